"""Issue 22's deep first row: the command line as it started before 7dc38ef / the cache-program
commit, in this tree, for an A/B on one lease (`lease_x4.sh STAGE=73`).

    python3 bench/early_start_ab.py old|new sweep-bench -m F ...   # = ikjax sweep-bench -m F ...

old: JAX's backend thread started once `ikjax.cli` and every command module are imported (as
     `ikjax.cli` did), and the first KV cache made by eager zeros (a program per shape, compiled
     at the first `new_cache`);
new: the default (the thread from `ikjax/__init__` once JAX is imported; the cache's one program
     compiled beside the first steps).
"""
import sys

variant, args = sys.argv[1], sys.argv[2:]
if variant not in ("old", "new"):
    raise SystemExit("usage: early_start_ab.py old|new COMMAND ...")
sys.argv = (["bench-old"] if variant == "old" else ["/usr/bin/ikjax"]) + args  # argv[0]: is_cli or not
import ikjax  # noqa: E402  (new: the thread starts here)
import ikjax.cli  # noqa: E402
from ikjax import early_backend  # noqa: E402

if variant == "old":
    from ikjax.model import cache as kvcache
    from ikjax.runtime import executors

    early_backend.start(args)
    executors.SingleDevice.prepare_cache = lambda self, layout: None
    executors.SingleDevice.new_cache = lambda self, layout: kvcache.init_cache(layout)
ikjax.cli.main()
