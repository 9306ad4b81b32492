"""llama-server's context shift (`ikjax serve --context-shift`, Scheduler(context_shift=True)): the
cache's rows moved down with their roped keys turned back (model.cache.shift_row), a prompt longer
than a slot cut as ik_llama.cpp cuts it, a generation that fills its slot going on.

The oracle for the move: a layer-0 cache entry depends on its token and its position only (the
token's embedding, normed, times the layer's projections, its key part roped at its position), so
after a shift the first layer's rows must be what a fresh prompt of the kept tokens writes."""
from __future__ import annotations

import numpy as np
import pytest

import ikjax
from ikjax.errors import OptionError
from ikjax.model import cache as kvcache
from ikjax.runtime.scheduler import Scheduler
from test_scheduler import Collect

CTX = 64


def ids(eng, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, eng.config.vocab_size, n)]


def filled(eng, tokens):
    cache = eng.new_cache(1)
    _, cache = eng.step(cache, np.array([tokens], np.int32), np.zeros(1, np.int32))
    return cache


def rows(cache, name: str, group: int = 0, layer: int = 0, n: int | None = None) -> np.ndarray:
    leaf = cache[name][group]
    if isinstance(leaf, dict):  # q8_0
        width = {"latent": None}.get(name)
        x = kvcache.dequantize_q8_0({k: v[layer, 0] for k, v in leaf.items()}, width or leaf["q"].shape[-2] * 32,
                                    np.float32)
    else:
        x = leaf[layer, 0]
    x = np.asarray(x, np.float32)
    return x if n is None else x[:n]


@pytest.mark.parametrize("mla,ctk", [(3, "f16"), (3, "q8_0"), (0, "f32")])
def test_shift_row_moves_entries_and_turns_their_keys_back(tiny_model, mla, ctk):
    """Layer 0 after shift_row(keep 3, discard 10) of a 40-token cache is what a fresh prompt of the 30
    kept tokens writes (keys at their new positions: the rotation's direction and frequencies); every
    layer's position-free part (the latent c, V) moved bit for bit, the first `keep` rows untouched."""
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=16, mla=mla, ctk=ctk)
    cfg = eng.config
    toks = ids(eng, 40, 1)
    keep, d = 3, 10
    before = filled(eng, toks)
    want = filled(eng, toks[:keep] + toks[keep + d:])
    snap = {name: [np.asarray(rows(before, name, g, i), np.float32) for g in range(len(before[name]))
                   for i in range(np.asarray(before[name][g]["q"] if ctk == "q8_0" else before[name][g]).shape[0])]
            for name in before}
    got = kvcache.shift_row(before, cfg, 0, keep, d)
    n = 40 - d
    for name in got:
        a, b = rows(got, name, n=n), rows(want, name, n=n)
        tol = 2e-2 if ctk != "f32" else 2e-5
        assert np.abs(a - b).max() <= tol * max(1.0, np.abs(b).max()), (name, np.abs(a - b).max())
        spans = kvcache.rope_columns(name, cfg)
        free = np.ones(a.shape[-1], bool)
        for lo, hi in spans:
            free[lo:hi] = False
        k = 0
        for g in range(len(got[name])):
            leaf = got[name][g]
            for i in range(np.asarray(leaf["q"] if ctk == "q8_0" else leaf).shape[0]):
                new, old = rows(got, name, g, i), snap[name][k]
                k += 1
                assert np.array_equal(new[:keep], old[:keep]), (name, g, i)
                assert np.array_equal(new[keep:n][:, free], old[keep + d:40][:, free]), (name, g, i)
                if spans:  # the roped part turned, its length (pair by pair) kept
                    lo, hi = spans[0]
                    pn = np.linalg.norm(new[keep:n, lo:hi].reshape(n - keep, -1, 2), axis=-1)
                    po = np.linalg.norm(old[keep + d:40, lo:hi].reshape(n - keep, -1, 2), axis=-1)
                    # (q8_0: the turned values quantized again, a step of amax / 127 a block)
                    atol = 2e-2 * np.abs(po).max() if ctk == "q8_0" else 1e-3
                    assert np.allclose(pn, po, rtol=2e-2 if ctk != "f32" else 1e-5, atol=atol), (name, g, i)


def run(s: Scheduler, prompt, n, **kw):
    c = Collect()
    req = s.submit(s.make_request(prompt, n, on_event=c, **kw))
    return req, c.tokens, c.wait(300)


def test_a_generation_that_fills_its_slot_goes_on(tiny_model):
    """With the context shift, 100 tokens after a 20-token prompt in a 64-token slot: every one made
    (shifts of half the tokens past n_keep), the answer generate's up to the first shift, the request
    marked truncated; without it the answer ends at the slot's end ("context") as before. A shift's
    helpers are compiled at warm-up."""
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=16)
    p = ids(eng, 20, 2)
    plain = Scheduler(eng, 2).start()
    try:
        _, toks, end = run(plain, p, 100, ignore_eos=True)
    finally:
        plain.stop()
    assert end == ("done", "context") and len(toks) == CTX - len(p)
    s = Scheduler(eng, 2, context_shift=True)
    s.warmup(prompts=False)
    s.start()
    try:
        req, got, end = run(s, p, 100, ignore_eos=True)
        assert end == ("done", "max_tokens") and len(got) == 100
        assert got[:CTX - len(p)] == toks  # the same tokens until the slot was full
        assert req.truncated and req.shifted >= 100 - (CTX - len(p)) and req.timings()["n_past"] < CTX
        # n_keep -1 keeps the whole prompt: shifts drop generated tokens only; a fixed n_discard
        req2, got2, end2 = run(s, p, 90, ignore_eos=True, n_keep=-1, n_discard=8)
        assert end2 == ("done", "max_tokens") and len(got2) == 90 and got2[:CTX - len(p)] == toks
        assert req2.shifted % 8 == 0 and req2.shifted >= 90 - (CTX - len(p))
        # the slot's tokens after a shift: the prompt, then what was kept (n_keep -1)
        slot = s.slots[req2.slot]
        assert slot.tokens[:len(p)] == p and len(slot.tokens) < CTX
    finally:
        s.stop()


def test_a_prompt_longer_than_a_slot_is_cut(tiny_model):
    """A 150-token prompt in a 64-token slot: a 400-type error without the context shift; with it, cut
    as ik cuts it (its first n_keep tokens and BOS kept, then half a slot at a time dropped), and the
    answer is generate's for the cut prompt."""
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=16)
    p = ids(eng, 150, 3)
    plain = Scheduler(eng, 1)
    with pytest.raises(OptionError, match="do not fit"):
        plain.make_request(p, 5, on_event=lambda *a: None)
    s = Scheduler(eng, 1, context_shift=True).start()
    try:
        for n_keep in (0, 5):
            keep = n_keep + int(p[0] == eng.config.bos_token_id)
            step = (CTX - keep) // 2
            cut = step * -(-(len(p) - CTX + 1) // step)
            want_prompt = p[:keep] + p[keep + cut:]
            assert len(want_prompt) < CTX
            req, got, end = run(s, p, 6, n_keep=n_keep)
            assert req.truncated and list(req.prompt) == want_prompt
            # generate's answer up to the slot's end (the scheduler then shifts and goes on)
            room = CTX - len(want_prompt)
            assert got[:room] == list(eng.generate(want_prompt, 6))[:room] and len(got) == 6 and end[0] == "done"
        with pytest.raises(OptionError, match="n_keep"):
            s.make_request(p, 5, on_event=lambda *a: None, n_keep=CTX)
        with pytest.raises(OptionError, match="n_discard"):
            s.make_request(p[:10], 5, on_event=lambda *a: None, n_discard=-2)
    finally:
        s.stop()


def test_serve_context_shift_over_http(tiny_model):
    """`ikjax serve --context-shift on --keep 4` (a server process): a prompt of 300 token ids in a
    128-token slot answered (200) and marked truncated, 200 tokens generated past the slot's end; a
    request's n_keep / n_discard checked (400) and echoed in generation_settings; a value that is
    no switch refused in one line before any load."""
    import subprocess
    import sys

    from test_serve import Proc, call
    s = Proc(tiny_model, "-c", "128", "-np", "1", "-ub", "16", "--temp", "0", "--context-shift", "on", "--keep", "4")
    try:
        prompt = [int(t) for t in np.random.default_rng(5).integers(2, 500, 300)]
        st, body = call(s, "POST", "/completion", {"prompt": prompt, "n_predict": 200, "ignore_eos": True})
        assert st == 200, body
        assert body["truncated"] is True and body["tokens_predicted"] == 200 and body["tokens_evaluated"] < 128
        assert body["generation_settings"]["n_keep"] == 4 and body["generation_settings"]["n_discard"] == 0
        st, body = call(s, "POST", "/completion", {"prompt": prompt[:10], "n_predict": 3, "n_keep": -1,
                                                   "n_discard": 16})
        assert st == 200 and body["truncated"] is False and body["generation_settings"]["n_discard"] == 16, body
        for bad in ({"n_keep": -2}, {"n_discard": -1}, {"n_discard": "x"}):
            st, body = call(s, "POST", "/completion", {"prompt": prompt[:10], "n_predict": 3, **bad})
            assert st == 400 and next(iter(bad)) in body["error"]["message"], (bad, body)
    finally:
        s.stop()
    r = subprocess.run([sys.executable, "-m", "ikjax.cli", "serve", "-m", tiny_model, "--context-shift", "maybe"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and "--context-shift: expected on, off" in r.stderr and "Traceback" not in r.stderr


def test_a_shifted_slot_is_reused_only_in_its_kept_part(tiny_model):
    """After a context shift the rows past the kept part were computed in a context since dropped: a
    later prompt that goes on from the slot's tokens (a "next turn" for --prompt-cache auto) reuses at
    most the kept part, so its answer is a fresh run's (the same prompt alternated between two answers
    before); a cut that would leave nothing keeps the prompt's last token (a 500 before)."""
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=16)
    bos = eng.config.bos_token_id
    p = [bos] + ids(eng, 19, 6)
    s = Scheduler(eng, 1, context_shift=True).start()
    try:
        req, got, end = run(s, p, 80, ignore_eos=True)
        slot = s.slots[req.slot]
        assert req.shifted and slot.moved == 1 and end == ("done", "max_tokens")
        follow = slot.tokens + [int(got[-1]), 7]  # the slot's tokens and more: auto's next turn
        assert s._reuse(slot, np.asarray(follow), True) <= 1
        room = CTX - len(follow)
        req2, got2, _ = run(s, follow, room, ignore_eos=True)
        assert req2.n_cached <= 1 and got2 == list(eng.generate(follow, room, ignore_eos=True))
        assert slot.moved is None  # (its rows fed afresh)
        for keep in (0, 3):  # n_discard past the prompt's end
            long = ids(eng, 150, 7)
            req3, got3, end3 = run(s, long, 4, n_keep=keep, n_discard=10**9)
            assert end3[0] == "done" and list(req3.prompt) == long[:keep] + ([long[-1]] if keep == 0 else [])
            assert got3 == list(eng.generate(list(req3.prompt), 4))[:len(got3)]
    finally:
        s.stop()
