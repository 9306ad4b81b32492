"""The serve scheduler in-process (ikjax.runtime.scheduler): continuous batching that gives each
request exactly `Engine.generate`'s greedy tokens, prompts fed one chunk per step beside the
others' decode, greedy streams several tokens per dispatch when nothing waits, cancellation at any point freeing the slot, the prompt cache's exact reuse, a
full queue refused, and a failed step failing only the requests on the slots (the loop goes on)."""
from __future__ import annotations

import dataclasses
import queue
import threading
import time

import numpy as np
import pytest

import ikjax
from ikjax.runtime.scheduler import STOP_CANCELLED, QueueFullError, Scheduler

CTX, UB = 256, 16


@pytest.fixture(scope="module")
def eng(tiny_model):
    return ikjax.load(tiny_model, ctx=CTX, ubatch=UB)


class Collect:
    """A request's events, waited on from the test's thread."""

    def __init__(self):
        self.tokens: list[int] = []
        self.end = queue.Queue()

    def __call__(self, kind, value):
        if kind == "token":
            self.tokens.append(value)
        else:
            self.end.put((kind, value))

    def wait(self, timeout: float = 120):
        return self.end.get(timeout=timeout)


def ids(eng, n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(2, eng.config.vocab_size, n)]


def submit(s: Scheduler, prompt, n, **kw) -> tuple:
    c = Collect()
    return s.submit(s.make_request(prompt, n, on_event=c, **kw)), c


@pytest.fixture
def sched(eng):
    s = Scheduler(eng, 3, max_queue=8).start()
    yield s
    s.stop()


def test_interleaved_requests_equal_generate(eng, sched):
    """Prompts of 3..70 tokens (one to five chunks) arriving while others decode, more requests than
    slots: every answer is generate's for that prompt alone."""
    prompts = [ids(eng, n, i) for i, n in enumerate((5, 70, 3, 33, 17, 48, 9))]
    runs = []
    for p in prompts:
        runs.append(submit(sched, p, 10))
        time.sleep(0.02)
    for (req, c), p in zip(runs, prompts):
        assert c.wait()[0] == "done"
        assert c.tokens == list(eng.generate(p, 10)), len(p)
        assert req.finish_reason in ("eos", "max_tokens")
    assert sched.slots_busy() == 0


def test_loop_length_follows_the_burst_budget(eng, monkeypatch):
    """A decode dispatch makes as many tokens as fit IKJAX_SERVE_BURST_MS at the last dispatch's
    pace: a roomy budget gives whole loops, one below a step's time one token a dispatch (single
    steps); the answers stay generate's either way, and a budget of 0 is refused."""
    from ikjax.runtime.scheduler import LOOP_STEPS
    made = []
    decode = eng.decode

    def spy(*a, **k):
        made.append(a[3])
        return decode(*a, **k)
    monkeypatch.setattr(eng, "decode", spy)
    for budget in ("1000", "0.001"):
        monkeypatch.setenv("IKJAX_SERVE_BURST_MS", budget)
        made.clear()
        s = Scheduler(eng, 2).start()
        try:
            a = ids(eng, 5, 21)
            _, c = submit(s, a, 30)
            assert c.wait()[0] == "done"
        finally:
            s.stop()
        ran = list(made)
        assert c.tokens == list(eng.generate(a, 30))
        if budget == "1000":  # whole loops (where the context and token limits let them)
            assert max(ran) == LOOP_STEPS, ran
        else:                 # one token a dispatch: single steps (the step after the prompt set the pace)
            assert ran == [] and s.stats.decode_steps >= 29, ran
    monkeypatch.setenv("IKJAX_SERVE_BURST_MS", "0")
    with pytest.raises(ikjax.OptionError):
        Scheduler(eng, 2)


def test_lone_stream_decodes_as_a_batch_of_one(eng, monkeypatch):
    """One stream decoding alone runs as a batch of one (IKJAX_SERVE_SOLO=1, its row out of the
    slots' cache); a second request puts it back and both decode in the slots' batch; answers are
    generate's, and the next turn on the lone stream's slot, which reuses the KV written alone
    (the row went back), answers as with IKJAX_SERVE_SOLO=0 (always the slots' batch) bit for bit."""
    batches = []
    step, decode = eng.step, eng.decode

    def spy_step(cache, toks, *a, **k):
        if np.shape(toks)[1] == 1:  # a decode step (a prompt's chunks go through step too)
            batches.append(len(toks))
        return step(cache, toks, *a, **k)

    def spy_decode(cache, toks, *a, **k):
        batches.append(len(toks))
        return decode(cache, toks, *a, **k)
    monkeypatch.setattr(eng, "step", spy_step)
    monkeypatch.setattr(eng, "decode", spy_decode)
    a, b, more = ids(eng, 9, 31), ids(eng, 7, 32), ids(eng, 5, 33)
    answers = {}
    for solo in ("1", "0"):
        monkeypatch.setenv("IKJAX_SERVE_SOLO", solo)
        batches.clear()
        s = Scheduler(eng, 3).start()
        try:
            ra, ca = submit(s, a, 40, ignore_eos=True)
            while len(ca.tokens) < 6:
                time.sleep(0.001)
            alone = list(batches)
            _, cb = submit(s, b, 12, ignore_eos=True)
            assert ca.wait()[0] == "done" and cb.wait()[0] == "done"
            assert ca.tokens == list(eng.generate(a, 40, ignore_eos=True))
            assert cb.tokens == list(eng.generate(b, 12, ignore_eos=True))
            assert alone and set(alone) == ({1} if solo == "1" else {3}), (solo, alone)
            assert 3 in batches                                # the two streams: the slots' batch
            turn = a + ca.tokens + more                         # the next turn on a's slot
            rt, ct = submit(s, turn, 8)
            assert ct.wait()[0] == "done" and rt.n_cached >= len(a) + len(ca.tokens) - 1, rt.n_cached
            answers[solo] = ct.tokens
        finally:
            s.stop()
    assert answers["1"] == answers["0"]


def test_split_modes_serve_a_lone_stream_and_two(tiny4_model):
    """-sm layer and -sm graph (two fake CPU devices, a process of their own): a stream alone (the
    batch of one: its row taken out of a cache split over the devices) and then beside a second
    one give generate's answers; two sampled streams side by side (their draws in the decode loop,
    a key per row) give generate's tokens for their seeds."""
    import subprocess
    import sys
    from conftest import TEST_XLA_FLAGS
    code = (f"import os\nos.environ['XLA_FLAGS'] = '--xla_force_host_platform_device_count=2 {TEST_XLA_FLAGS}'\n"
            "import time, numpy as np, ikjax\nfrom ikjax.runtime.scheduler import Scheduler\n"
            "class C:\n    def __init__(s): s.tokens, s.end = [], None\n"
            "    def __call__(s, kind, v):\n        if kind == 'token': s.tokens.append(v)\n        else: s.end = kind\n"
            "for sm in ('layer', 'graph'):\n"
            f"    eng = ikjax.load({tiny4_model!r}, ctx=128, ubatch=16, split_mode=sm)\n"
            "    s = Scheduler(eng, 2).start()\n"
            "    a, b = list(range(3, 14)), list(range(20, 27))\n"
            "    ca, cb = C(), C()\n"
            "    s.submit(s.make_request(a, 24, on_event=ca, ignore_eos=True))\n"
            "    while len(ca.tokens) < 5: time.sleep(0.001)\n"
            "    s.submit(s.make_request(b, 8, on_event=cb, ignore_eos=True))\n"
            "    while ca.end is None or cb.end is None: time.sleep(0.01)\n"
            "    # sampled streams side by side: a key per row in the split modes' decode loop too\n"
            "    cs, ct = C(), C()\n"
            "    s.submit(s.make_request(a, 12, on_event=cs, ignore_eos=True, temperature=0.9, top_k=20, seed=3))\n"
            "    s.submit(s.make_request(b, 12, on_event=ct, ignore_eos=True, temperature=0.6, top_p=0.9, seed=5))\n"
            "    while cs.end is None or ct.end is None: time.sleep(0.01)\n"
            "    s.stop()\n"
            "    assert eng.row_sampling(), sm\n"
            "    assert ca.tokens == list(eng.generate(a, 24, ignore_eos=True)), (sm, 'a')\n"
            "    assert cb.tokens == list(eng.generate(b, 8, ignore_eos=True)), (sm, 'b')\n"
            "    assert cs.tokens == list(eng.generate(a, 12, ignore_eos=True, temperature=0.9, top_k=20, seed=3)), (sm, 's')\n"
            "    assert ct.tokens == list(eng.generate(b, 12, ignore_eos=True, temperature=0.6, top_p=0.9, seed=5)), (sm, 't')\n"
            "    print(sm, 'ok')\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "layer ok" in r.stdout and "graph ok" in r.stdout


def test_greedy_streams_decode_in_loops(eng):
    """Nothing waiting and every stream plain greedy: LOOP_STEPS tokens of every slot per dispatch
    (the engine's decode loop, compiled for the slots' batch). Answers stay generate's, each
    stream stops at its own max_tokens / EOS inside a dispatch, a cancel inside one stops the
    stream there, and a request arriving meanwhile joins at the next dispatch."""
    from ikjax.runtime.scheduler import LOOP_STEPS
    s = Scheduler(eng, 2).start()
    try:
        a, b = ids(eng, 5, 11), ids(eng, 9, 12)
        (ra, ca), (rb, cb) = submit(s, a, 21), submit(s, b, 13)
        assert ca.wait()[0] == "done" and cb.wait()[0] == "done"
        assert ca.tokens == list(eng.generate(a, 21)) and cb.tokens == list(eng.generate(b, 13))
        assert {ra.finish_reason, rb.finish_reason} <= {"eos", "max_tokens"}
        assert any(k[0] == 2 and k[3] is not None and k[3][0] == LOOP_STEPS for k in eng._executables)
        steps = s.stats.decode_steps
        long, lc = submit(s, a, 200)
        while len(lc.tokens) < 3:
            time.sleep(0.001)
        late = ids(eng, 7, 13)
        _, c2 = submit(s, late, 6)
        s.cancel(long)
        assert lc.wait() == ("done", STOP_CANCELLED) and len(lc.tokens) < 200
        assert lc.tokens == list(eng.generate(a, len(lc.tokens)))
        assert c2.wait()[0] == "done" and c2.tokens == list(eng.generate(late, 6))
        assert s.stats.decode_steps > steps
    finally:
        s.stop()


def test_streams_banning_the_same_ids_decode_in_loops(eng):
    """ignore_eos bans EOS: such greedy streams loop too (the loop compiled with that ban), their
    answers generate's with ignore_eos; streams banning different ids fall back to one step a
    token, with the same answers."""
    from ikjax.runtime.scheduler import LOOP_STEPS
    eos = eng.config.eos_token_id
    s = Scheduler(eng, 2).start()
    try:
        a, b = ids(eng, 5, 21), ids(eng, 9, 22)
        steps0 = s.stats.decode_steps
        (_, ca), (_, cb) = submit(s, a, 30, ignore_eos=True), submit(s, b, 25, ignore_eos=True)
        assert ca.wait()[0] == "done" and cb.wait()[0] == "done"
        assert ca.tokens == list(eng.generate(a, 30, ignore_eos=True))
        assert cb.tokens == list(eng.generate(b, 25, ignore_eos=True))
        banned_loops = [k for k in eng._executables if k[0] == 2 and k[3] is not None and k[3][0] == LOOP_STEPS
                        and dict(k[3][1]).get("ban") == (eos,)]
        assert banned_loops, "the EOS-banning loop ran"
        assert s.stats.decode_steps > steps0
        # different bans in one batch: one step a token, the same answers
        (_, cc), (_, cd) = submit(s, a, 12, ignore_eos=True), submit(s, b, 12)
        assert cc.wait()[0] == "done" and cd.wait()[0] == "done"
        assert cc.tokens == list(eng.generate(a, 12, ignore_eos=True)) and cd.tokens == list(eng.generate(b, 12))
        # a ban set of its own (logit_bias -100): one step a token, no loop compiled for it (a
        # compile per set stalled every stream), the id never drawn
        plain = list(eng.generate(a, 12, ignore_eos=True))
        req, ce = submit(s, a, 12, ignore_eos=True, logit_bias={plain[1]: -100.0})
        assert ce.wait()[0] == "done" and plain[1] not in ce.tokens and len(ce.tokens) == 12
        assert not [k for k in eng._executables if k[3] is not None and plain[1] in dict(k[3][1]).get("ban", ())]
    finally:
        s.stop()


def test_sampled_streams_draw_generates_tokens_in_loops_and_steps(eng):
    """Sampled streams (no penalty, bias or logprobs) draw on the device with a key from their own
    seed, as Engine.generate draws: the same tokens as generate's for that seed, whether they run
    in the decode loop (alone, or beside a stream of the same setting) or one step a token (beside a
    stream of another setting, or a greedy one)."""
    from ikjax.runtime.scheduler import LOOP_STEPS
    p, q = ids(eng, 6, 31), ids(eng, 8, 32)
    kw = dict(temperature=0.9, top_k=20, seed=3)
    want_p = list(eng.generate(p, 20, ignore_eos=True, **kw))
    want_q = list(eng.generate(q, 20, ignore_eos=True, temperature=0.7, top_p=0.9, seed=5))
    s = Scheduler(eng, 2).start()
    try:
        _, alone = submit(s, p, 20, ignore_eos=True, **kw)  # the loop
        assert alone.wait()[0] == "done" and alone.tokens == want_p
        assert any(k[3] is not None and k[3][0] == LOOP_STEPS and dict(k[3][1]).get("rows")
                   for k in eng._executables), "the sampled loop ran"
        (_, a), (_, b) = submit(s, p, 20, ignore_eos=True, **kw), submit(s, q, 20, ignore_eos=True, temperature=0.7,
                                                                          top_p=0.9, seed=5)
        assert a.wait()[0] == "done" and b.wait()[0] == "done"
        assert a.tokens == want_p and b.tokens == want_q  # two settings: one step a token
        (_, c), (_, d) = submit(s, p, 20, ignore_eos=True, **kw), submit(s, q, 20)
        assert c.wait()[0] == "done" and d.wait()[0] == "done"
        assert c.tokens == want_p and d.tokens == list(eng.generate(q, 20))
    finally:
        s.stop()


def test_prompt_fed_one_chunk_per_decode_step(eng, sched):
    """A 96-token prompt (6 chunks) arriving while a stream decodes: the stream gets a token after
    every chunk, not after the whole prompt."""
    stream, sc = submit(sched, ids(eng, 4, 1), 60, ignore_eos=True)
    while len(sc.tokens) < 3:
        time.sleep(0.001)
    steps0 = sched.stats.decode_steps
    long, lc = submit(sched, ids(eng, 96, 2), 1)
    lc.wait()
    sc.wait()
    # six chunk iterations, each with the stream's decode step beside it
    assert sched.stats.decode_steps - steps0 >= 6
    assert len(sc.tokens) == 60


def test_cancel_in_queue_in_prefill_and_in_decode(eng):
    s = Scheduler(eng, 1, max_queue=4).start()
    try:
        busy, bc = submit(s, ids(eng, 4, 3), 200, ignore_eos=True)
        queued, qc = submit(s, ids(eng, 5, 4), 5)
        s.cancel(queued)
        assert qc.wait() == ("done", STOP_CANCELLED) and qc.tokens == []
        s.cancel(busy)
        assert bc.wait() == ("done", STOP_CANCELLED) and 0 < len(bc.tokens) < 200
        # cancelled while its prompt is fed (the first chunk may already be in)
        long, lc = submit(s, ids(eng, 200, 5), 5)
        while s.slots[0].req is not long or long._pos == 0:
            time.sleep(0.001)
        s.cancel(long)
        assert lc.wait() == ("done", STOP_CANCELLED)
        assert s.slots_busy() == 0 and 0 < len(s.slots[0].tokens) < 200
        # the slot serves the next prompt exactly, from what the cancelled feed left (whole chunks)
        p = ids(eng, 200, 5)[:40] + [7, 8]
        nxt, nc = submit(s, p, 8)
        assert nc.wait()[0] == "done" and nc.tokens == list(eng.generate(p, 8))
        assert nxt.n_cached % UB == 0
    finally:
        s.stop()


def test_prompt_cache_exact_and_prefix(eng):
    """exact: whole chunks of an earlier prompt reused, the answer generate's; a generated token's
    KV is never reused. prefix: the whole common prefix (as llama-server)."""
    p = ids(eng, 50, 6)
    for mode, want in (("exact", 48), ("prefix", 50), ("off", 0)):
        s = Scheduler(eng, 2, prompt_cache=mode).start()
        try:
            first, fc = submit(s, p, 6, ignore_eos=True)
            fc.wait()
            follow = p + fc.tokens[:3] + [9, 10]
            second, c2 = submit(s, follow, 6)
            c2.wait()
            assert second.slot == first.slot or mode == "off"
            # exact: 48 (3 whole chunks of the prompt); prefix: the prompt and the 3 generated tokens
            # it repeats (5 of the 6 are in the cache: the last one was never fed)
            assert second.n_cached == (want + 3 if mode == "prefix" else want), mode
            if mode != "prefix":
                assert c2.tokens == list(eng.generate(follow, 6))
            # no cache_prompt: nothing reused
            third, c3 = submit(s, follow, 2, cache_prompt=False)
            c3.wait()
            assert third.n_cached == 0
        finally:
            s.stop()


def test_prompt_cache_auto(eng):
    """auto: the same prompt again reuses whole chunks only (the answer generate's, bit for bit); a
    next turn that goes on into the answer reuses the whole common prefix, as prefix does."""
    p = ids(eng, 50, 6)
    s = Scheduler(eng, 1).start()
    assert s.prompt_cache == "auto"
    try:
        first, fc = submit(s, p, 6, ignore_eos=True)
        fc.wait()
        again, ca = submit(s, p, 6, ignore_eos=True)
        ca.wait()
        assert again.n_cached == 48 and ca.tokens == fc.tokens == list(eng.generate(p, 6, ignore_eos=True))
        follow = p + ca.tokens[:3] + [9, 10]
        turn, ct = submit(s, follow, 4)
        ct.wait()
        assert turn.n_cached == 53  # the prompt and the 3 answer tokens it repeats
        # a prompt sharing only part of the last one (a system prompt): whole chunks again
        other = p[:40] + [11, 12, 13]
        third, c3 = submit(s, other, 4)
        c3.wait()
        assert third.n_cached == 32 and c3.tokens == list(eng.generate(other, 4))
    finally:
        s.stop()


def test_prompt_cache_auto_reads_an_r1_next_turn(eng):
    """R1's template ends a prompt with `<think>\n` and renders an earlier turn without it: the next
    turn shares all of the last prompt but that tail. auto takes it as the next turn (the whole
    common prefix, as llama-server) instead of whole -ub chunks (up to 511 tokens fed again a turn);
    the same prompt again, or a longer one that differs before the tail, keeps whole chunks."""
    from ikjax.runtime.text import encode_prompt
    t = eng.chat_template("deepseek-r1")
    turn1 = [{"role": "system", "content": "Answer briefly. " * 4}, {"role": "user", "content": "hi there"}]
    p1 = encode_prompt(eng, t.render(turn1))
    turn2 = turn1 + [{"role": "assistant", "content": "ok fine"}, {"role": "user", "content": "more"}]
    p2 = encode_prompt(eng, t.render(turn2))
    lcp = next(i for i, (a, b) in enumerate(zip(p1, p2)) if a != b)
    assert eng.tokenizer.decode(p1[lcp:]).strip() == "<think>" and lcp % UB != 0
    s = Scheduler(eng, 1).start()
    try:
        _, c1 = submit(s, p1, 4)
        c1.wait()
        second, c2 = submit(s, p2, 4)
        c2.wait()
        assert second.n_cached == lcp
        # a longer prompt that differs before the tail (an edited message): whole chunks
        _, c1 = submit(s, p1, 4)
        c1.wait()
        edited = p1[:lcp - 20] + [7] * 30
        third, c3 = submit(s, edited, 4)
        c3.wait()
        assert third.n_cached == (lcp - 20) // UB * UB
    finally:
        s.stop()


def test_queue_full(eng):
    s = Scheduler(eng, 1, max_queue=1)  # not started: nothing leaves the queue
    submit(s, [5, 6], 1)  # would take the free slot
    submit(s, [5, 6], 1)  # waits
    with pytest.raises(QueueFullError):
        submit(s, [5, 6], 1)


def test_checks_before_queueing(eng, sched):
    with pytest.raises(ikjax.OptionError, match="do not fit a slot"):
        sched.make_request([5] * CTX, 1, on_event=print)
    with pytest.raises(ikjax.OptionError, match="temperature"):
        sched.make_request([5], 1, on_event=print, temperature=-1)
    with pytest.raises(ikjax.OptionError, match="vocabulary"):
        sched.make_request([10 ** 6], 1, on_event=print)


def test_requests_for_a_slot_run_there(eng, sched):
    """llama-server's id_slot: a request for slot k runs on slot k, waiting while it is busy (two
    requests for slot 2 run one after the other there), without holding back a request for any
    slot; its answer is generate's. A slot that does not exist is refused before queueing."""
    p = ids(eng, 9, 3)
    runs = [submit(sched, p, 6, slot=2), submit(sched, p, 6, slot=2), submit(sched, ids(eng, 5, 4), 6),
            submit(sched, p, 6, slot=0)]
    for req, c in runs:
        assert c.wait()[0] == "done"
    assert [req.slot for req, _ in runs[:2]] == [2, 2] and runs[3][0].slot == 0
    assert runs[0][1].tokens == runs[1][1].tokens == runs[3][1].tokens == list(eng.generate(p, 6))
    for bad in (3, -1, True, "1"):
        with pytest.raises(ikjax.OptionError, match="slot"):
            sched.make_request([5], 1, on_event=print, slot=bad)


def test_a_repeated_prompt_goes_back_to_its_slot(eng, sched):
    """A short prompt sent again (nothing of it reusable under `auto`: fewer tokens than -ub) runs
    on the slot that holds it, as llama-server's slot choice by prompt similarity, not on the least
    recently used one, whose cache holds another conversation; a prompt like none runs there."""
    a, b, c = ids(eng, 9, 11), ids(eng, 9, 12), ids(eng, 9, 13)
    first = [submit(sched, p, 3) for p in (a, b)]
    for req, col in first:
        assert col.wait()[0] == "done"
    slot_a, slot_b = first[0][0].slot, first[1][0].slot
    again, col = submit(sched, a, 3)
    assert col.wait()[0] == "done" and again.slot == slot_a and again.n_cached == 0
    other, col = submit(sched, c, 3)
    assert col.wait()[0] == "done" and other.slot not in (slot_a, slot_b)  # the free slot, not a held one


def test_failed_step_fails_the_slots_and_the_loop_goes_on(eng, monkeypatch):
    s = Scheduler(eng, 2).start()
    try:
        real_step, real_decode = eng.step, eng.decode
        calls = {"n": 0}

        def flaky(real):  # the third dispatch fails, a single step or the decode loop
            def run(*a, **k):
                calls["n"] += 1
                if calls["n"] == 3:
                    raise RuntimeError("device lost")
                return real(*a, **k)
            return run
        monkeypatch.setattr(eng, "step", flaky(real_step))
        monkeypatch.setattr(eng, "decode", flaky(real_decode))
        req, c = submit(s, ids(eng, 4, 7), 50, ignore_eos=True)
        kind, msg = c.wait()
        assert kind == "error" and "device lost" in msg and req.finish_reason == "error"
        monkeypatch.setattr(eng, "step", real_step)
        monkeypatch.setattr(eng, "decode", real_decode)
        p = ids(eng, 6, 8)
        _, c2 = submit(s, p, 5)
        assert c2.wait()[0] == "done" and c2.tokens == list(eng.generate(p, 5))
    finally:
        s.stop()


def test_a_callback_that_raises_ends_only_its_request(eng):
    """The caller's callback raising (the server's hand-over to a closed event loop) cancels that
    request alone: before, the step's exception failed every slot's request through _reset, and a
    callback raising again there ended the scheduler's thread (later requests queued for ever)."""
    s = Scheduler(eng, 2).start()
    try:
        class Raising(Collect):
            def __init__(self, on_done: bool):
                super().__init__()
                self.on_done = on_done

            def __call__(self, kind, value):
                super().__call__(kind, value)
                if kind == "token" and len(self.tokens) == 3 or kind != "token" and self.on_done:
                    raise RuntimeError("Event loop is closed")
        p, q = ids(eng, 5, 21), ids(eng, 9, 22)
        good = Collect()
        req_good = s.submit(s.make_request(p, 12, on_event=good, ignore_eos=True))
        for on_done in (False, True):
            bad = Raising(on_done)
            req_bad = s.submit(s.make_request(q, 12, on_event=bad, ignore_eos=True))
            deadline = time.time() + 60
            while req_bad.finish_reason is None and time.time() < deadline:
                time.sleep(0.01)
            assert req_bad.finish_reason == "cancelled" and len(bad.tokens) == 3
        assert good.wait() == ("done", "max_tokens") and good.tokens == list(eng.generate(p, 12, ignore_eos=True))
        assert req_good.finish_reason == "max_tokens" and s._thread.is_alive()
        _, c = submit(s, q, 4)  # the loop still serves
        assert c.wait()[0] == "done" and c.tokens == list(eng.generate(q, 4))
        assert s.slots_busy() == 0
    finally:
        s.stop()


def test_an_erase_answered_during_an_admission_is_never_skipped(eng, monkeypatch):
    """erase_slot answered while the loop was taking that slot for a request (between its dequeue and
    the slot's taking) was then skipped: the request reused the tokens the caller had just erased.
    Now an erase is either applied before the reuse is reckoned or refused (the slot busy)."""
    import threading
    s = Scheduler(eng, 1).start()
    try:
        p = ids(eng, 20, 31)
        _, c = submit(s, p, 2)
        assert c.wait()[0] == "done" and s.slot_info()[0]["n_cached"] > 0
        outcome = {}
        real = Scheduler._reuse

        def reuse(self, slot, prompt, cache_prompt):  # an erase arriving mid-admission, waited for a while
            if not outcome:
                def erase():
                    try:
                        outcome["erased"] = s.erase_slot(0)
                    except ikjax.OptionError as e:
                        outcome["refused"] = str(e)
                t = threading.Thread(target=erase)
                outcome["thread"] = t
                t.start()
                t.join(0.3)
            return real(self, slot, prompt, cache_prompt)
        monkeypatch.setattr(Scheduler, "_reuse", reuse)
        req, c = submit(s, p + [5], 2)
        assert c.wait()[0] == "done"
        outcome["thread"].join(10)
        assert ("erased" in outcome) != ("refused" in outcome), outcome
        if "erased" in outcome:
            assert req.n_cached == 0, (outcome, req.n_cached)
        else:
            assert "processing" in outcome["refused"]
    finally:
        s.stop()


def test_top_k_past_the_vocabulary_is_off(eng, sched):
    """A top_k at or past the vocabulary keeps every id: it is off (0), so it draws top_k 0's tokens,
    compiles no loop of its own, and one of 3e9 (past int32) no longer fails the whole batch: a
    greedy stream beside it finishes with generate's answer."""
    from ikjax.runtime.sampling import check_sampling
    V = eng.config.vocab_size
    assert check_sampling(top_k=3_000_000_000)["top_k"] == 0 and check_sampling(top_k=10**20, vocab=V)["top_k"] == 0
    assert check_sampling(top_k=V, vocab=V)["top_k"] == 0 and check_sampling(top_k=V - 1, vocab=V)["top_k"] == V - 1
    p, q = ids(eng, 6, 10), ids(eng, 5, 11)
    want = list(eng.generate(p, 10, temperature=0.7, top_k=0, seed=4, ignore_eos=True))
    n = eng.compile_count
    for k in (V, 4 * V + 1, 3_000_000_000):
        assert list(eng.generate(p, 10, temperature=0.7, top_k=k, seed=4, ignore_eos=True)) == want, k
    assert eng.compile_count == n  # the top_k 0 loop serves them all
    (_, cg), (_, cs) = submit(sched, q, 16, ignore_eos=True), submit(sched, p, 10, temperature=0.7, top_k=3_000_000_000,
                                                                      seed=4, ignore_eos=True)
    assert cs.wait()[0] == "done" and cs.tokens == want
    assert cg.wait()[0] == "done" and cg.tokens == list(eng.generate(q, 16, ignore_eos=True))


def test_sampling_seeded_and_ignore_eos(eng, sched):
    p = ids(eng, 6, 9)
    a = submit(sched, p, 12, temperature=0.9, top_k=20, seed=3)[1]
    b = submit(sched, p, 12, temperature=0.9, top_k=20, seed=3)[1]
    a.wait(), b.wait()
    assert a.tokens == b.tokens
    eos = eng.config.eos_token_id
    r, c = submit(sched, p, 30, ignore_eos=True)
    c.wait()
    assert len(c.tokens) == 30 and eos not in c.tokens and r.finish_reason == "max_tokens"


def test_stop_ends_waiting_requests(eng):
    s = Scheduler(eng, 1).start()
    _, c1 = submit(s, [5, 6], 1000 if CTX > 1000 else CTX - 3, ignore_eos=True)
    _, c2 = submit(s, [5, 7], 4)
    t = threading.Thread(target=s.stop)
    t.start()
    t.join(60)
    assert not t.is_alive()
    assert c1.wait(5)[1] in (STOP_CANCELLED, "max_tokens") and c2.wait(5)[1] in (STOP_CANCELLED, "max_tokens", "eos")


def test_failed_prompt_fails_only_its_request(eng, monkeypatch):
    """A prompt step that fails (fed in its own copy of the slot's row) ends that request; a stream
    decoding beside it goes on to the same tokens as alone."""
    s = Scheduler(eng, 2).start()
    try:
        p = ids(eng, 5, 10)
        stream, sc = submit(s, p, 40, ignore_eos=True)
        while len(sc.tokens) < 2:
            time.sleep(0.001)
        real = eng.prefill

        def failing(cache, chunk, start=0, all_logits=False):
            if len(chunk) == 7:
                raise RuntimeError("out of memory")
            return real(cache, chunk, start, all_logits)
        monkeypatch.setattr(eng, "prefill", failing)
        bad, bc = submit(s, ids(eng, 7, 11), 5)
        kind, msg = bc.wait()
        assert kind == "error" and "out of memory" in msg
        assert sc.wait() == ("done", "max_tokens")
        monkeypatch.setattr(eng, "prefill", real)
        assert sc.tokens == list(eng.generate(p, 40, ignore_eos=True))
        assert s.slots_busy() == 0
    finally:
        s.stop()


def test_device_argmax_bans_ids_and_checks_finite_before():
    """Greedy rows with banned ids (--ignore-eos) take their argmax on the device: a banned id is
    never picked even where it holds the maximum, padding ids past the vocabulary are dropped, and
    the finiteness flag reads the logits before the ban."""
    from ikjax.runtime.scheduler import _argmax_rows
    V = 11
    logits = np.zeros((3, V), np.float32)
    logits[0, 4], logits[0, 7] = 5.0, 3.0
    logits[1, 2] = 1.0
    logits[2, 9], logits[2, 1] = 2.0, np.nan
    banned = np.array([[4, V], [V, V], [9, 3]], np.int32)
    top, finite = (np.asarray(a) for a in _argmax_rows(logits, banned))
    assert top[0] == 7 and top[1] == 2
    assert finite.tolist() == [True, True, False]
    assert int(np.asarray(_argmax_rows(logits[:2])[0])[0]) == 4  # no ban: the plain argmax


def test_gpu_token_buckets_are_a_few_fixed_sizes(eng, monkeypatch):
    """With the GPU kernels a prompt step is one of a few fixed sizes, the short chunk times powers
    of 4 below ubatch and ubatch itself (a server never compiles a new step for a prompt's length);
    on the CPU the powers of two up to ubatch."""
    assert eng.prompt_step_sizes() == (1, 2, 4, 8, 16) and eng.token_bucket(5) == 8
    monkeypatch.setattr(eng, "backend", "pallas")
    for ub, sizes in ((16, (16,)), (64, (64,)), (100, (64, 100)), (512, (64, 256, 512)),
                      (2048, (64, 256, 1024, 2048))):
        monkeypatch.setattr(eng, "options", dataclasses.replace(eng.options, ubatch=ub))
        assert eng.prompt_step_sizes() == sizes, ub
        got = [eng.token_bucket(n) for n in range(1, ub + 1)]
        assert set(got) == set(sizes) and all(b >= n and (b == sizes[0] or n > max(t for t in sizes if t < b))
                                              for n, b in enumerate(got, 1)), ub
        assert eng.token_bucket(ub + 3) == ub + 3


def test_warmup_side_by_side_compiles_every_step_it_uses(tiny_model, monkeypatch):
    """On an accelerator the warm-up compiles its steps on threads (compile_side_by_side), forced
    here on CPU: each step once, and requests then compile nothing more and answer as generate.
    They lower in the order given: the prompt steps first, the most tokens first, then the decode
    loops, then the one-token steps (the longest XLA compiles start first, RESULTS §22al)."""
    from ikjax.runtime import scheduler as sched
    families, real = [], sched.compile_side_by_side

    def recorded(work, *a, **k):
        families.extend(f for f, _ in work)
        return real(work, *a, **k)
    monkeypatch.setattr(sched, "compile_side_by_side", recorded)
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=UB)
    eng.compile_in_parallel = lambda: True
    s = Scheduler(eng, 2)
    n = s.warmup()
    assert n > 2 and eng.compile_count == n == len(eng._executables)
    kinds = [0 if name == "precompile" and T > 1 else 1 if name == "precompile_decode" else 2 for name, T, _ in families]
    assert kinds == sorted(kinds) and set(kinds) == {0, 1, 2}, families
    prompt_tokens = [T for (name, T, _), k in zip(families, kinds) if k == 0]
    assert prompt_tokens == sorted(prompt_tokens, reverse=True) and len(set(prompt_tokens)) > 1, families
    s.start()
    try:
        runs = [(p, submit(s, p, 6)) for p in (ids(eng, 40, 1), ids(eng, 5, 2))]
        assert [c.wait()[0] for _, (_, c) in runs] == ["done", "done"]
    finally:
        s.stop()
    assert eng.compile_count == n  # (generate's own batch-1 steps compile below)
    for p, (_, c) in runs:
        assert c.tokens == list(eng.generate(p, 6))


def test_warmup_compiles_the_loops_of_ignore_eos_and_the_default_sampling(tiny_model):
    """The warm-up (side by side, forced here on CPU) also compiles the loop that bans EOS and,
    given the server's default sampling, the sampled loop of that setting: streams asking
    ignore_eos, or sampling with the defaults, then loop without compiling anything."""
    from ikjax.runtime.sampling import check_sampling, top_k_bucket
    from ikjax.runtime.scheduler import LOOP_STEPS
    eng = ikjax.load(tiny_model, ctx=CTX, ubatch=UB)
    eng.compile_in_parallel = lambda: True
    d = check_sampling(0.8, 40, 0.95, 0.05)
    s = Scheduler(eng, 2)
    n = s.warmup(sampling=d)
    loops = [dict(k[3][1]) for k in eng._executables if k[3] is not None and k[3][0] == LOOP_STEPS]
    assert any(not f.get("rows") and not f.get("ban") for f in loops)  # greedy
    assert any(f.get("ban") == (eng.config.eos_token_id,) for f in loops)  # ignore_eos
    # the defaults' loop: only their top_k bucket is compiled in (the values are step arguments)
    assert any(f.get("rows") and f.get("bucket") == top_k_bucket(40) and "temperature" not in f for f in loops)
    s.start()
    try:
        p, q = ids(eng, 9, 41), ids(eng, 7, 42)
        (_, a), (_, b) = submit(s, p, 20, ignore_eos=True), submit(s, q, 20, ignore_eos=True)
        assert a.wait()[0] == "done" and b.wait()[0] == "done"
        (_, c), (_, e) = (submit(s, p, 20, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7),
                          submit(s, q, 20, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=8))
        assert c.wait()[0] == "done" and e.wait()[0] == "done"
        # other values, top_k in the same bucket: the same loop and one-step sampler, nothing compiled
        # (each new temperature or top_k compiled a loop before: seconds a value, an outside probe)
        other = dict(temperature=1.3, top_k=25, top_p=0.9, min_p=0.0)
        (_, f), (_, g) = submit(s, p, 20, seed=9, **other), submit(s, q, 20, seed=10, temperature=0.5, top_k=64)
        assert f.wait()[0] == "done" and g.wait()[0] == "done"
    finally:
        s.stop()
    assert eng.compile_count == n
    assert a.tokens == list(eng.generate(p, 20, ignore_eos=True))
    assert c.tokens == list(eng.generate(p, 20, temperature=0.8, top_k=40, top_p=0.95, min_p=0.05, seed=7))
    assert f.tokens == list(eng.generate(p, 20, seed=9, **other))
    assert g.tokens == list(eng.generate(q, 20, seed=10, temperature=0.5, top_k=64))


def test_logit_bias(eng, sched):
    """A bias is added to its id's logit before sampling (the host path), a bias of -100 or less
    bans the id (the device argmax honours bans); bad biases are refused before queueing."""
    p = ids(eng, 12, 5)
    plain = list(eng.generate(p, 6))
    t = next(x for x in range(3, 100) if x not in plain and x != eng.config.eos_token_id)
    _, c = submit(sched, p, 6, logit_bias={t: 100.0})
    assert c.wait()[0] == "done" and c.tokens == [t] * 6
    _, c = submit(sched, p, 6, logit_bias=[[plain[0], False]])
    assert c.wait()[0] == "done" and c.tokens[0] != plain[0]
    req, c = submit(sched, p, 3, logit_bias={str(plain[0]): -100.0, str(t): 0.5})
    assert c.wait()[0] == "done" and plain[0] in req.ban and req.logit_bias == ((t, 0.5),)
    # sampled with a ban alone: drawn on the host (a device draw compiles its ban set into its
    # setting: a loop per set), the id never drawn; ignore_eos's EOS ban keeps the device's draw
    req, c = submit(sched, p, 8, logit_bias={plain[0]: -100.0}, temperature=1.5, seed=4, ignore_eos=True)
    assert c.wait()[0] == "done" and plain[0] not in c.tokens and req._setting is None
    req, c = submit(sched, p, 4, temperature=1.5, seed=4, ignore_eos=True)
    assert c.wait()[0] == "done" and (req._setting is not None) == sched._row_keys
    # 1e308: finite, but a repeat penalty below 1 made its logit Inf and the request ended blaming the model
    for bad in ({eng.config.vocab_size: 1.0}, {"a": 1.0}, {1: "x"}, {1: float("nan")}, [[1]], 5, {1: 1e308},
                {1: -1e31}):
        with pytest.raises(ikjax.OptionError, match="logit_bias"):
            sched.make_request(p, 2, on_event=Collect(), logit_bias=bad)
    # every token banned (it drew banned ids): refused; every token but one: that one, every time
    V, eos = eng.config.vocab_size, eng.config.eos_token_id
    with pytest.raises(ikjax.OptionError, match="bans every token"):
        sched.make_request(p, 2, on_event=Collect(), logit_bias={i: -100.0 for i in range(V)})
    with pytest.raises(ikjax.OptionError, match="bans every token .* with ignore_eos"):
        sched.make_request(p, 2, on_event=Collect(), logit_bias={i: False for i in range(V) if i != eos},
                           ignore_eos=True)
    _, c = submit(sched, p, 3, logit_bias={i: -100.0 for i in range(V) if i != t}, temperature=1.0, seed=1)
    assert c.wait()[0] == "done" and c.tokens == [t] * 3


def test_reasoning_budget_state_machine():
    """ik's reasoning budget (common/reasoning-budget.cpp) token by token: counting from the opening
    tag, a natural end, the end forced when the budget runs out (after a whole UTF-8 character),
    a fresh budget for a later opening, and the free steps that bound the scheduler's loop."""
    from ikjax.runtime.reasoning_budget import COUNTING, DONE, FORCING, IDLE, WAITING_UTF8, ReasoningBudget, utf8_complete
    b = ReasoningBudget(2, [5, 9], [6], [7, 6])
    assert b.state == IDLE and b.free_steps() == 4 and b.forced() is None
    for t in (5, 1, 5, 9):  # a broken opening, then the whole one
        b.accept(t)
    assert b.state == COUNTING and b.free_steps() == 2
    b.accept(1)
    b.accept(2)
    assert b.state == FORCING and b.free_steps() == 0 and b.forced() == 7
    b.accept(7)
    assert b.forced() == 6
    b.accept(6)
    assert b.state == DONE and b.forced() is None
    b.accept(5)
    b.accept(9)
    assert b.state == COUNTING and b.remaining == 2  # a fresh budget
    b.accept(6)
    assert b.state == DONE  # the natural end: nothing forced
    w = ReasoningBudget(1, [5], [6], [6])
    w.accept(5)
    w.accept(3, complete=False)  # half a character: the end waits for the rest of it
    assert w.state == WAITING_UTF8 and w.forced() is None and w.free_steps() == 0
    w.accept(4, complete=True)
    assert w.state == FORCING and w.forced() == 6
    z = ReasoningBudget(0, [5], [6], [6])
    z.accept(5, prompt=True)
    z.accept(201, prompt=True)  # the prompt's newline after the tag: not a forced token
    assert z.forced() == 6  # 0: the end at once
    assert utf8_complete(b"a") and utf8_complete("é".encode()) and utf8_complete("€".encode())
    assert not utf8_complete("é".encode()[:1]) and not utf8_complete("€".encode()[:2])
    assert utf8_complete("€".encode()[2:]) is False  # continuation bytes alone: the lead came before


def test_reasoning_budget_forces_the_end_of_the_thinking(eng, sched):
    """A request on R1's template (its prompt opens <think>) with a budget of B: the answer is
    generate's greedy tokens while the budget lasts (the prompt's newline after <think> counts, as
    ik's prefill tokens do; a token cut mid-character runs on to the character's end), then exactly the message and </think> forced, then generate's greedy
    continuation of that; without a budget it is generate's answer; a bad budget is refused."""
    from ikjax.runtime.reasoning_budget import utf8_complete
    from ikjax.runtime.text import encode_prompt, render_chat
    tok = eng.tokenizer
    prompt = encode_prompt(eng, render_chat(eng, [{"role": "user", "content": "Why?"}], "deepseek-r1"))
    start = tok.encode("<think>", add_bos=False, parse_special=True)
    at = max(i for i in range(len(prompt)) if prompt[i:i + len(start)] == start)
    after = len(prompt) - at - len(start)  # prompt tokens after <think> (its newline): counted
    forced = tok.encode(" Enough.</think>", add_bos=False, parse_special=True)
    B, n = 6, 24
    r, c = submit(sched, prompt, n, reasoning_budget=B, reasoning_budget_message=" Enough.", ignore_eos=True)
    assert c.wait()[0] == "done"
    # greedy's tokens while the budget lasts: B less the prompt's, then on to a whole character
    plain = list(eng.generate(prompt, n, ignore_eos=True))
    free, left = 0, B - after
    while left > 0 or not utf8_complete(tok.piece(plain[free - 1])):
        free, left = free + 1, left - 1
    assert c.tokens[:free] == plain[:free]
    assert c.tokens[free:free + len(forced)] == forced
    head = prompt + c.tokens[:free + len(forced)]
    assert c.tokens[free + len(forced):] == list(eng.generate(head, n - free - len(forced), ignore_eos=True))
    _, c2 = submit(sched, prompt, n, ignore_eos=True)
    assert c2.wait()[0] == "done" and c2.tokens == list(eng.generate(prompt, n, ignore_eos=True))
    # 0: the end forced at once (R1's prompt ends "<think>\n": its newline is no forced token), each
    # token's log-probability recorded, forced ones too
    r, c = submit(sched, prompt, 20, reasoning_budget=0, ignore_eos=True, top_logprobs=0)
    assert c.wait()[0] == "done"
    close = tok.encode("</think>", add_bos=False, parse_special=True)
    assert c.tokens[:len(close)] == close
    assert len(r.token_logprobs) == len(c.tokens) == 20
    raw, _ = eng.prefill(eng.new_cache(1), np.array(prompt), 0)
    raw = np.asarray(raw, np.float64)
    want = raw[close[0]] - raw.max() - np.log(np.exp(raw - raw.max()).sum())
    assert abs(r.token_logprobs[0][0] - want) < 1e-3  # the forced token's own log-probability
    for bad in (-2, 1.5, True):
        with pytest.raises(ikjax.OptionError, match="reasoning budget"):
            sched.make_request(prompt, 4, on_event=lambda *a: None, reasoning_budget=bad)
