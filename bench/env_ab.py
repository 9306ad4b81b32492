"""A/B of environment settings on one `ikjax` command (issue 22's cold start): FORM names a set of
variables in AB_FORMS, set before anything imports JAX, then the command runs in this process.

    AB_FORMS='base=;nogemm=XLA_FLAGS=--xla_gpu_enable_triton_gemm=false' \
        python bench/env_ab.py nogemm sweep-bench -m F -mla 3 -fa 1 -c 16384 -ub 2048 -n 128

AB_FORMS: `name=VAR=value,VAR2=value2;name2=...` (an empty list: the environment as it is). A value
added to XLA_FLAGS is appended to what XLA_FLAGS holds already.
"""
from __future__ import annotations

import os
import sys


def forms(text: str) -> dict[str, dict[str, str]]:
    out: dict[str, dict[str, str]] = {}
    for part in filter(None, (p.strip() for p in text.split(";"))):
        name, _, rest = part.partition("=")
        out[name] = dict(kv.split("=", 1) for kv in filter(None, rest.split(",")))
    return out


def main() -> None:
    table = forms(os.environ.get("AB_FORMS", ""))
    form, argv = sys.argv[1], sys.argv[2:]
    if form not in table:
        raise SystemExit(f"form {form!r} is not in AB_FORMS ({', '.join(table) or 'empty'})")
    for k, v in table[form].items():
        os.environ[k] = (os.environ.get(k, "") + " " + v).strip() if k == "XLA_FLAGS" else v
    import ikjax.cli
    sys.argv = ["ikjax", *argv]
    ikjax.cli.main()


if __name__ == "__main__":
    main()
