"""`ikjax info`: what a GGUF file holds and what it would need, from its header alone.

Architecture, hyper-parameters, tensor types and sizes, the MLA tensor layout, and the memory plan
for the options that size it (-c, -ub, -mla, -fa, -ctk, -ot, ...). It takes every run option the
other commands take (an ik command line pasted after `ikjax info` is accepted as it is; those that
size nothing change nothing here). It reads no tensor data, so it is instant on any file size.
"""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from ikjax import env
from ikjax.errors import OptionError
from ikjax.cli.common import app, fmt_bytes, handle, resolve_model
from ikjax.cli.parser import ExactCommand
from ikjax.cli.run_options import RunArgs, check_options, takes_run_options


def _mla_layout(names: set[str], n_layer: int) -> str:
    has = lambda t: any(f"blk.{i}.{t}.weight" in names for i in range(n_layer))  # noqa: E731
    kvb, kb, vb = has("attn_kv_b"), has("attn_k_b"), has("attn_v_b")
    if kvb and kb and vb:
        return "all three: attn_kv_b + attn_k_b + attn_v_b (ik_llama.cpp converter)"
    if kvb and not (kb or vb):
        return "attn_kv_b only (older converters; attn_k_b/attn_v_b derived from it in the graph)"
    if kb and vb and not kvb:
        return "attn_k_b + attn_v_b only (mainline llama.cpp; attn_kv_b derived from them in the graph)"
    return f"incomplete: attn_kv_b={'yes' if kvb else 'no'} attn_k_b={'yes' if kb else 'no'} attn_v_b={'yes' if vb else 'no'}"


@app.command("info", cls=ExactCommand)
@handle
@takes_run_options(after={"tensors": "kv_block"})
def info(
    run: RunArgs,
    file: Annotated[Optional[str], typer.Argument(help="GGUF file (any shard of a split model)")] = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="also list every tensor")] = False,
) -> None:
    """Architecture, hyper-parameters, tensor types and sizes, MLA layout, and the memory plan for the given
    options (-c, -ctk, -mla, -ub, -fa, -ot) — from the header only, instant on any file size."""
    from ikjax import ops  # the runtime only when the command runs: `--help` stays light
    from ikjax.gguf_io.config import ModelConfig, load_notes
    from ikjax.gguf_io.reader import GGUFModelFile
    from ikjax.runtime.memory_plan import plan_memory
    _, opts = check_options(run, "info")
    env.check_all()  # what the report says of the C++ kernels is what runs: a bad knob is an error
    if file is not None and run.model is not None and file != run.model:
        raise OptionError(f"info: two models given ({file!r} and -m {run.model!r}); give one")
    path = file if file is not None else run.model
    if path is None or path.startswith("synthetic:") or not path.strip():
        path = resolve_model(path)
    f = GGUFModelFile(path)
    md = f.metadata
    emb = f.tensors.get("token_embd.weight")
    cfg = ModelConfig.from_metadata(md, source=path, vocab_from_tensor=emb.shape[0] if emb else None,
                                    file_tensors=f.tensors)
    opts = opts.with_model(cfg.n_expert_used, cfg.n_expert > 0, ops.auto_dtype())
    out = typer.echo
    n_params = sum(_prod(t.shape) for t in f.tensors.values())
    size = sum(t.nbytes for t in f.tensors.values())
    out(f"file           {path}" + (f" ({len(f.shards)} shards)" if len(f.shards) > 1 else ""))
    out(f"architecture   {f.architecture}   name: {md.get('general.name', '?')}   "
        f"size label: {md.get('general.size_label', '?')}")
    out(f"parameters     {n_params / 1e9:.3f} B   tensor data {fmt_bytes(size)} "
        f"({size * 8 / max(n_params, 1):.2f} bits/weight)")
    out("")
    out("hyper-parameters")
    q = f"q_lora_rank {cfg.q_lora_rank}" if cfg.q_lora_rank else "no q_lora (direct attn_q, V2-Lite style)"
    rows = [
        ("layers", f"{cfg.n_layer} ({min(cfg.n_dense_lead, cfg.n_layer)} dense leading)"),
        ("d_model", cfg.d_model), ("heads", cfg.n_head), ("q", q),
        ("kv_lora_rank r", cfg.kv_lora_rank), ("rope / nope / v", f"{cfg.rope_dim} / {cfg.nope_dim} / {cfg.v_dim}"),
        ("latent entry", f"{cfg.latent_dim} values (r + rope)"),
        ("vocab", cfg.vocab_size), ("dense ffn", cfg.ffn_dim),
        ("experts", f"{cfg.n_expert} routed, top-{cfg.n_expert_used}, {cfg.n_expert_shared} shared, ffn {cfg.expert_ffn_dim}"
         if cfg.n_expert else "none (dense)"),
        ("routing", (f"{'sigmoid' if cfg.gating == 2 else 'softmax'}"
                     + (f", {cfg.n_expert_group} groups top-{cfg.n_expert_group_used}" if cfg.n_expert_group > 1 else "")
                     + (", exp_probs_b" if any(n.endswith("exp_probs_b.bias") for n in f.tensors) else "")
                     + (", norm" if cfg.expert_weights_norm else "") + f", scale {cfg.expert_weights_scale:g}")
         if cfg.n_expert else "-"),
        ("rope", f"base {cfg.rope_base:g}" + (f", YaRN factor {cfg.yarn.factor:g} orig ctx {cfg.yarn.original_context} "
                                             f"log-mul {cfg.yarn.log_multiplier:g} (mscale {cfg.yarn.mscale:.4f})"
                                             if cfg.yarn else "")),
        ("softmax scale", f"{cfg.softmax_scale:.6f}"), ("rms eps", f"{cfg.rms_eps:g}"),
        ("context length", cfg.context_length),
        ("tokenizer", f"{md.get('tokenizer.ggml.model', '-')} / {md.get('tokenizer.ggml.pre', '-')}, "
                      f"bos {cfg.bos_token_id} eos {cfg.eos_token_id}"),
    ]
    for k, v in rows:
        out(f"  {k:<16} {v}")
    out("")
    out(f"MLA layout     {_mla_layout(set(f.tensors), cfg.n_layer)}")
    for note in load_notes(cfg, f.tensors, md):  # what the loader will say it passes over (MTP, indexer)
        out(f"note           {note}")
    out("")
    from ikjax import ops
    out(f"cpu kernels    {ops.cpu_kernel_report()}")
    out("")
    by_type: dict[str, list[int]] = {}
    for t in f.tensors.values():
        e = by_type.setdefault(t.type_name, [0, 0, 0])
        e[0] += 1
        e[1] += t.nbytes
        e[2] += _prod(t.shape)
    out(f"{'tensor type':<12} {'count':>6} {'size':>12} {'weights':>14}")
    for name, (cnt, nb, ne) in sorted(by_type.items(), key=lambda kv: -kv[1][1]):
        out(f"{name:<12} {cnt:>6} {fmt_bytes(nb):>12} {ne:>14,}")
    out(f"{'total':<12} {len(f.tensors):>6} {fmt_bytes(size):>12} {n_params:>14,}")
    if tensors:
        out("")
        for t in f.tensors.values():
            out(f"  {t.name:<40} {t.type_name:<8} {str(list(t.shape)):<24} {fmt_bytes(t.nbytes)}")
    out("")
    # the load's own placement (the tensors' shapes and types: -sm graph splits by them), and its notes
    from ikjax.placement.rules import plan_placement
    placement = plan_placement(cfg, f.tensors.values(), opts)
    for note in placement.notes:
        out(f"note           {note}")
    if opts.gpu_experts:  # checked as a load checks it (host experts, the statistics file, its layers)
        from ikjax.placement import hot as hot_experts
        n = "0" if opts.gpu_experts == "auto" else opts.gpu_experts  # auto needs the device: checks only
        hot, line, _ = hot_experts.plan(placement, cfg.n_expert, f.tensors, n, opts.expert_counts, None)
        if opts.gpu_experts == "auto":
            line = ("--gpu-experts auto: the most used host experts of each layer (by the statistics) are "
                    "copied into the device memory the plan leaves, decided at load")
        else:
            placement = hot
        out(f"note           {line}")
    plan = plan_memory(cfg, opts, placement=placement)
    out(f"memory plan (-c {opts.ctx} -ub {opts.ubatch} -mla {opts.mla} -fa {int(opts.fa)} -ctk {opts.ctk}"
        + (f" -amb {opts.amb}" if opts.amb else "") + ")")
    for line in plan.lines():
        out("  " + line)
    total = plan.weights_bytes + plan.kv_bytes + plan.attention_buffer_bytes
    out(f"  total            {total / (1 << 20):10.2f} MiB")
    # the report reads the header alone; what a load would refuse (a tensor type ikjax cannot
    # dequantize, a missing tensor) ends it with that error and status 1, not a clean exit (a probe)
    from ikjax.gguf_io.tensors import validate
    validate(f.tensors, cfg, path)


def _prod(shape) -> int:
    n = 1
    for s in shape:
        n *= int(s)
    return n
