"""`-sm layer`: the step as a pipeline of stages, one per run of consecutive layers on one device.

The placement (`ikjax.placement.splits.layer_split`) gives each layer a device; each stage is one
jitted function over its device's weights and cache, run in turn with the activation moved from
one device to the next (`jax.device_put`), as llama.cpp's pipeline does: one jit over weights
committed to different devices is refused by JAX ("incompatible devices"), and a per-device stage
keeps every kernel (C++ CPU custom calls, Pallas) usable unchanged.
"""
from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import SingleDeviceSharding

from ikjax import env, ops
from ikjax.model import cache as kvcache
from ikjax.model.deepseek2 import embed, output_head, run_layers, trims_last_layer
from ikjax.placement.devices import jax_devices
from ikjax.placement.host import is_host_resident
from ikjax.runtime import compile_cache
from ikjax.runtime.sampling import row_params_shapes, sample_device, sample_rows


def _stage(weights, cache, x, start, last, *, cfg, plan, embed_in: bool, head_out: bool):
    """One device's part of a step: [embedding] + its layers + [output head]."""
    with ops.kernel_context(plan.backend, plan.threads, seq_tokens=x.shape[1]):  # x: tokens [B,T] or [B,T,d]
        if embed_in:
            x = embed(weights["token_embd"], x)
        # the head's stage holds the model's last layer: trimmed as one device trims it
        # (deepseek2.trims_last_layer), so -sm layer gives one device's bits
        trim = head_out and bool(weights["groups"]) and trims_last_layer(plan, x.shape[1])
        x, cache = run_layers(weights["groups"], cache, x, start, cfg=cfg, plan=plan, last=last, trim_last=trim)
        if head_out:
            x = output_head(weights, x, jnp.zeros_like(last) if trim else last, cfg=cfg, plan=plan)
    return x, cache


def _decode_stage(weights, cache, x, start, key, out, i, *, cfg, plan, embed_in: bool, head_out: bool,
                  sampling: tuple):
    """One device's part of one decode step of the -sm layer decode loop: x is the token ids [B]
    (a first stage) or the activation [B,1,d]; the last stage picks the next token on its device
    (`sample_device`, the draw keyed by the position as `generation.decode_steps` keys it) and
    writes it into column i of the chunk's tokens `out` [B, chunk] (donated: one buffer for the
    chunk, whatever n is), so what leaves the stage is ids [B], never logits. Returns
    (x, cache, start + 1, out, i + 1): the next token's positions and column stay on the device
    (no host-to-device copy per token); `key`, `out` and `i` are None on the other stages.
    sampling's ("rows", True): `key` holds a key per row and, where it draws, the rows' settings
    ((keys [B], sampling.row_params)), drawn as `generation.decode_steps` draws them: the values
    are step arguments, so another temperature or top_k in the bucket compiles nothing."""
    B = x.shape[0]
    zeros = jnp.zeros((B,), jnp.int32)
    with ops.kernel_context(plan.backend, plan.threads, seq_tokens=1):
        if embed_in:
            x = embed(weights["token_embd"], x[:, None])
        x, cache = run_layers(weights["groups"], cache, x, start, cfg=cfg, plan=plan, last=zeros)
        if head_out:
            logits = output_head(weights, x, zeros, cfg=cfg, plan=plan)
            filters = {k: v for k, v in sampling if k != "rows"}
            if dict(sampling).get("rows"):
                if "bucket" in filters:
                    key, params = key
                    filters = dict(filters, params=params)
                x = sample_rows(logits, key, start, **filters)
            else:
                x = sample_device(logits, jax.random.fold_in(key, start[0]), **filters)
            out = jax.lax.dynamic_update_slice(out, x[:, None], (0, i))
            i = i + 1
    return x, cache, start + 1, out, i


# prompt micro-batches (IKJAX_PIPELINE_MB=auto): tokens each at least, and how many at most
MICRO_MIN, MICRO_MAX = 256, 4
# ... and routed picks per expert each at least (tokens x n_expert_used / n_expert): every
# micro-batch reads all of a layer's experts, so R1's 256 experts in 4 micro-batches of 512 tokens
# (16 picks an expert) spent the step re-reading weights: 2 micro-batches (32 picks) ran 1.39x the
# prompt rate of 4 and 1.07x that of 1 on 2 x H200 (RESULTS §25f); V2-Lite keeps 4 (48 picks)
MICRO_MIN_PICKS = 32

_jitted_stage = None
_jitted_decode_stage = None


def _decode_stage_jit():
    global _jitted_decode_stage
    if _jitted_decode_stage is None:
        _jitted_decode_stage = jax.jit(_decode_stage, static_argnames=("cfg", "plan", "embed_in", "head_out",
                                                                       "sampling"), donate_argnums=(1, 5))
    return _jitted_decode_stage


def _stage_jit():
    global _jitted_stage
    if _jitted_stage is None:
        _jitted_stage = jax.jit(_stage, static_argnames=("cfg", "plan", "embed_in", "head_out"),
                                donate_argnums=(1,))
    return _jitted_stage


class Pipeline:
    """-sm layer: the step as stages, one per run of consecutive layers on one device, in order
    (stage = (device index, first layer, layer count, embeds?, computes the head?)). The embedding
    and the output head join the first / last stage where they share its device, else they are a
    stage of their own. Each stage's weights and cache live on its device; the activation [B,T,d]
    moves to the next device between stages."""

    def __init__(self, placement, weights, cfg):
        self.cfg = cfg
        self.devices = jax_devices(placement)
        n_layer = cfg.n_layer
        groups: list[list[int]] = []  # [device, first, count]
        for i, d in enumerate(placement.layer_device[:n_layer]):
            if groups and groups[-1][0] == d:
                groups[-1][2] += 1
            else:
                groups.append([d, i, 1])
        if not groups or groups[0][0] != placement.embed_device:
            groups.insert(0, [placement.embed_device, 0, 0])
        if groups[-1][0] != placement.output_device:
            groups.append([placement.output_device, n_layer, 0])
        self.stages = tuple((d, first, count, k == 0, k == len(groups) - 1)
                            for k, (d, first, count) in enumerate(groups))
        # each stage's layer groups (a group never spans two devices: the device is part of what
        # makes layers identical, ikjax.model.groups), by index into the whole list
        layer_groups = weights["groups"]
        self.stage_groups = [[g for g, grp in enumerate(layer_groups) if first <= grp.first < first + count]
                             for _, first, count, _, _ in self.stages]
        self.counts = tuple(grp.count for grp in layer_groups)
        self.stage_weights = []
        for (d, first, count, embed_in, head_out), idx in zip(self.stages, self.stage_groups):
            w: dict[str, Any] = {"groups": [layer_groups[g] for g in idx]}
            if embed_in:
                w["token_embd"] = weights["token_embd"]
            if head_out:  # the output head on the last stage's device
                w["output_norm"] = jax.device_put(weights["output_norm"], self.devices[d])
                w["output"] = jax.device_put(weights["output"], self.devices[d])
            self.stage_weights.append(w)

    @property
    def host_experts(self) -> bool:
        """Whether a stage reads experts from host RAM (-ot exps=CPU). Its prompt steps then run
        whole, not as micro-batches: each micro-batch would move a layer's experts over the link
        again (the link is what a host-expert prompt step waits for), and one of 512 tokens falls
        under the streaming threshold (runs_on: 512 x 8 picks < 32 x 256 experts), so R1's
        experts were computed on the host CPU: 372 t/s against 3838 on one GPU (RESULTS §25e)."""
        return any(is_host_resident(t) for w in self.stage_weights
                   for t in jax.tree.leaves(w, is_leaf=is_host_resident))

    def describe(self) -> str:
        parts = []
        for d, first, count, embed_in, head_out in self.stages:
            what = (["embedding"] if embed_in else []) + ([f"layers {first}-{first + count - 1}"] if count else []) \
                + (["output"] if head_out else [])
            parts.append(f"device {d}: {', '.join(what)}")
        return "; ".join(parts)

    def new_cache(self, layout) -> dict:
        """The KV cache: each layer's entries on the device of its stage."""
        out: dict[str, list] = {name: [] for name, _ in layout.widths}
        for (d, first, count, _, _), idx in zip(self.stages, self.stage_groups):
            if not count:
                continue
            with jax.default_device(self.devices[d]):
                part = kvcache.init_cache(dataclasses.replace(layout, n_layer=count,
                                                              groups=tuple(self.counts[g] for g in idx)))
            for name in out:
                out[name] += part[name]
        return out

    def _split_cache(self, cache) -> list[dict]:
        return [{name: [entries[g] for g in idx] for name, entries in cache.items()} for idx in self.stage_groups]

    def micro_batches(self, T: int) -> int:
        """How many micro-batches a step of T tokens runs as (IKJAX_PIPELINE_MB; auto: on GPUs,
        as many as keep each at MICRO_MIN tokens and MICRO_MIN_PICKS picks an expert or more, at
        most MICRO_MAX; one where the stages cannot overlap (one stage with layers, or T not a
        multiple of them) or where a stage's experts live in host RAM (`host_experts`))."""
        with_layers = sum(1 for _, _, count, _, _ in self.stages if count)
        choice = env.choice("IKJAX_PIPELINE_MB")
        if choice == "auto":
            if not any(d.platform == "gpu" for d in self.devices) or with_layers < 2 or self.host_experts:
                return 1
            n_exp, used = self.cfg.n_expert, self.cfg.n_expert_used
            m = 1
            while m * 2 <= MICRO_MAX and T // (m * 2) >= MICRO_MIN and T % (m * 2) == 0 and \
                    (not n_exp or T // (m * 2) * used >= MICRO_MIN_PICKS * n_exp):
                m *= 2
            return m
        m = int(choice)
        return m if T % m == 0 and T >= m else 1

    def compile(self, cache_shapes, B: int, T: int, plan, options=None) -> "CompiledPipeline":
        """Compile every stage for this shape (`cache_shapes`: the whole cache's ShapeDtypeStructs),
        each for one micro-batch of T / `micro_batches(T)` tokens; `options`: XLA's compile options
        of each stage (ikjax.runtime.executables.gpu_options)."""
        m = self.micro_batches(T)
        T //= m
        exes = []
        for (d, first, count, embed_in, head_out), w, c in zip(self.stages, self.stage_weights,
                                                              self._split_cache(cache_shapes)):
            sh = SingleDeviceSharding(self.devices[d])
            c = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), c)
            x = jax.ShapeDtypeStruct((B, T), jnp.int32, sharding=sh) if embed_in else \
                jax.ShapeDtypeStruct((B, T, self.cfg.d_model), jnp.float32, sharding=sh)
            i32 = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh)
            exes.append(compile_cache.lower(_stage_jit(), w, c, x, i32, i32, cfg=self.cfg, plan=plan,
                                            embed_in=embed_in, head_out=head_out).compile(options))
        return CompiledPipeline(self, exes, m)

    def compile_decode(self, cache_shapes, B: int, plan, chunk: int, sampling: tuple, options=None) -> "DecodePipeline":
        """Compile every stage's decode step (`_decode_stage`) for batch B: the -sm layer decode
        loop (`DecodePipeline`). `options`: XLA compile options of each stage (on a GPU the
        decode loop's command buffers, so each stage's kernels launch as one graph)."""
        exes = []
        key = jax.eval_shape(lambda: jax.random.key(0))
        for (d, first, count, embed_in, head_out), w, c in zip(self.stages, self.stage_weights,
                                                              self._split_cache(cache_shapes)):
            sh = SingleDeviceSharding(self.devices[d])
            c = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s.shape, s.dtype, sharding=sh), c)
            x = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh) if embed_in else \
                jax.ShapeDtypeStruct((B, 1, self.cfg.d_model), jnp.float32, sharding=sh)
            i32 = jax.ShapeDtypeStruct((B,), jnp.int32, sharding=sh)
            k = None
            if head_out:
                rows = dict(sampling).get("rows", False)
                k = jax.ShapeDtypeStruct((B,) if rows else key.shape, key.dtype, sharding=sh)
                if rows and "bucket" in dict(sampling):  # (keys, each row's setting: sampling.row_params)
                    k = (k, row_params_shapes(B, sh))
            out = jax.ShapeDtypeStruct((B, chunk), jnp.int32, sharding=sh) if head_out else None
            i = jax.ShapeDtypeStruct((), jnp.int32, sharding=sh) if head_out else None
            lowered = compile_cache.lower(_decode_stage_jit(), w, c, x, i32, k, out, i, cfg=self.cfg, plan=plan,
                                          embed_in=embed_in, head_out=head_out, sampling=sampling)
            exes.append(lowered.compile(options))
        return DecodePipeline(self, exes, chunk)


class CompiledPipeline:
    """A compiled -sm layer step: called like the one-device executable, (weights, cache, tokens,
    start, last) -> (logits, cache); `weights` is ignored (each stage holds its own part).

    With `micro` > 1 the step's T tokens run as `micro` micro-batches of consecutive tokens, one
    after the other through the stages, as chunks of a prompt do (each attends to the cache
    entries the ones before it wrote, on each stage's device): dispatched micro-batch by
    micro-batch without waiting, stage k works on micro-batch j while stage k+1 works on j-1, so
    every device works on a long prompt chunk instead of waiting for the stage before it."""

    def __init__(self, pipeline: Pipeline, exes: list, micro: int = 1):
        self.pipeline, self.exes, self.micro = pipeline, exes, micro

    def __call__(self, weights, cache, tokens, start, last):
        p = self.pipeline
        caches = p._split_cache(cache)
        devs = [p.devices[d] for d, *_ in p.stages]
        tokens, start, last = np.asarray(tokens), np.asarray(start, np.int32), np.asarray(last, np.int32)
        Tm = tokens.shape[1] // self.micro
        outs = []
        for j in range(self.micro):
            x = tokens[:, j * Tm:(j + 1) * Tm]
            # `last` inside this micro-batch: -1 before it (no real token here is the last one; its
            # rows all count as real), Tm - 1 past it
            lj = np.clip(last - j * Tm, -1, Tm - 1).astype(np.int32)
            sj = start + np.int32(j * Tm)
            for s, (w, exe, dev) in enumerate(zip(p.stage_weights, self.exes, devs)):
                x, caches[s] = exe(w, caches[s], jax.device_put(x, dev), jax.device_put(sj, dev),
                                   jax.device_put(lj, dev))
            outs.append(x)
        out_cache: dict[str, list] = {name: [] for name in cache}
        for c in caches:
            for name in out_cache:
                out_cache[name] += c[name]
        if self.micro == 1:
            return outs[0], out_cache
        if outs[0].ndim == 3:  # every token's logits [B, Tm, V]: in token order
            return _concat_tokens(tuple(outs)), out_cache
        return _pick_micro(tuple(outs), jax.device_put(last // Tm, outs[0].devices().pop())), out_cache

    def memory_analysis(self):
        """XLA's buffers of all stages together (each stage's on its own device)."""
        total = SimpleNamespace(temp_size_in_bytes=0, output_size_in_bytes=0, alias_size_in_bytes=0)
        for exe in self.exes:
            ma = exe.memory_analysis()
            for k in vars(total):
                setattr(total, k, getattr(total, k) + getattr(ma, k))
        return total


class DecodePipeline(CompiledPipeline):
    """The -sm layer decode loop, called like the one-device decode executable: (weights, cache,
    tokens [B], start [B], n, key) -> (tokens [B, chunk] on the last stage's device, the first n
    produced; cache); `weights` is ignored.

    Each token runs the stages in turn, the activation handed to the next device and the picked
    token back to the first with `jax.device_put`, all dispatched without the host waiting for
    any of it (JAX dispatch and device-to-device copies are asynchronous): the host queues the n
    tokens' stages ahead of the devices and reads nothing until the caller reads the tokens, once
    a chunk. Why not one executable: one jit cannot hold weights committed to different devices
    (module docstring), and a mesh program would need every stage's weights in the same shapes."""

    def __init__(self, pipeline: Pipeline, exes: list, chunk: int):
        super().__init__(pipeline, exes)
        self.chunk = chunk

    def __call__(self, weights, cache, tokens, start, n, key):
        p = self.pipeline
        n = int(n)
        start = np.asarray(start, np.int32)
        caches = p._split_cache(cache)
        devs = [p.devices[d] for d, *_ in p.stages]
        last = len(devs) - 1  # the head's stage (the pipeline ends with it)
        key = jax.device_put(key, devs[last])
        out = jax.device_put(np.zeros((len(start), self.chunk), np.int32), devs[last])
        col = jax.device_put(np.int32(0), devs[last])
        pos = [jax.device_put(start, dev) for dev in devs]  # each stage's positions, advanced by the stage
        tok = tokens
        for _ in range(n):
            x = tok
            for s, (w, exe, dev) in enumerate(zip(p.stage_weights, self.exes, devs)):
                head = (key, out, col) if s == last else (None, None, None)
                x, caches[s], pos[s], o, c = exe(w, caches[s], jax.device_put(x, dev), pos[s], *head)
                if s == last:
                    out, col = o, c
            tok = x
        new_cache: dict[str, list] = {name: [] for name in cache}
        for c in caches:
            for name in new_cache:
                new_cache[name] += c[name]
        return out, new_cache


@jax.jit
def _concat_tokens(outs: tuple):
    return jnp.concatenate(outs, axis=1)


@jax.jit
def _pick_micro(outs: tuple, which):
    """Each row's logits [B, V] from the micro-batch that holds its `last` token (`which` [B])."""
    every = jnp.stack(outs)  # [m, B, V]
    return jnp.take_along_axis(every, which[None, :, None], axis=0)[0]
