"""Load on a running `ikjax serve` (or llama-server): throughput, time to first token, inter-token
latency at several concurrencies, and the issue-23 scenarios.

    python bench/serve_load.py --url http://127.0.0.1:8080 [--concurrency 1,4,16] [--requests 32]
           [--prompt-tokens 128] [--max-tokens 128] [--mode load|interference|multiturn] [--json out.json]

Requests go to llama-server's `/completion` with random token-id prompts, `ignore_eos` and a fixed
`n_predict`, streamed, so every request generates exactly `--max-tokens` tokens whatever the
model says, and the same command measures llama-server (`-np 8 -cb`) and ikjax alike. Each request
has its own prompt (nothing shared for the prompt cache to reuse).

Modes:
  load          for each concurrency C, `--requests` requests by C clients at once: aggregate
                generated tokens/s (all tokens / wall time), per-stream tokens/s, TTFT and
                inter-token latency (ITL) percentiles.
  interference  C streams decode; once they run, a `--long-prompt` token prompt arrives: the
                streams' largest gap between tokens while it is fed, against their median ITL
                (the issue's target: delayed by at most one prompt chunk's time).
  multiturn     a `--history`-token conversation answered, then the same history plus a short turn
                (the prompt cache: only the new part is fed), against a 64-token prompt: TTFT of
                the second turn / TTFT of the short prompt (target <= 1.2).
Only the standard library and aiohttp.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time

import aiohttp


def pct(xs: list[float], p: float) -> float:
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(p / 100 * (len(xs) - 1))))]


class Client:
    def __init__(self, session: aiohttp.ClientSession, url: str, key: str | None, vocab: int, seed: int,
                 temperature: float = 0.0):
        self.s, self.url, self.vocab = session, url.rstrip("/"), vocab
        self.temperature = temperature  # > 0: sampled, with the server's default filters (--top-k --top-p --min-p)
        self.headers = {"Authorization": f"Bearer {key}"} if key else {}
        self.rng = random.Random(seed)
        self.live: list[list[float]] = []  # token times of the streams under way

    def prompt(self, n: int) -> list[int]:
        return [self.rng.randrange(100, self.vocab) for _ in range(n)]

    async def stream(self, ids: list[int], n_predict: int) -> dict:
        """One streamed request: arrival-relative times of every token event."""
        body = {"prompt": ids, "n_predict": n_predict, "stream": True, "ignore_eos": True,
                "temperature": self.temperature, "cache_prompt": True, "return_tokens": True}
        t0 = time.perf_counter()
        times: list[float] = []
        absolute: list[float] = []
        self.live.append(absolute)
        n_tokens = 0
        timings: dict = {}
        out_ids: list[int] = []
        async with self.s.post(self.url + "/completion", json=body, headers=self.headers) as r:
            if r.status != 200:
                raise RuntimeError(f"HTTP {r.status}: {(await r.text())[:200]}")
            async for line in r.content:
                if not line.startswith(b"data: "):
                    continue
                ev = json.loads(line[6:])
                if ev.get("stop"):
                    n_tokens = ev.get("tokens_predicted", n_tokens)
                    timings = ev.get("timings", {})
                    break
                toks = ev.get("tokens") or []
                out_ids.extend(toks)
                # a data event is one token unless it lists several (ikjax's decode loop sends a
                # dispatch's tokens together): llama-server sends one event a token and, for a token
                # whose text is an incomplete UTF-8 sequence, empty content and no token list, which
                # counted as nothing left its multi-turn rows without a first token (RESULTS §23i)
                k = len(toks) or 1
                if k:
                    now = time.perf_counter()
                    times.extend([now - t0] * k)
                    absolute.extend([now] * k)
        self.live.remove(absolute)
        return {"t": times, "abs": absolute, "t0": t0, "n": n_tokens or len(times), "end": time.perf_counter() - t0,
                "timings": timings, "ids": out_ids}


async def vocab_size(session, url: str, headers: dict) -> int:
    async with session.get(url.rstrip("/") + "/v1/models", headers=headers) as r:
        meta = (await r.json())["data"][0].get("meta", {})
    return int(meta.get("n_vocab", 32000))


def itls(times: list[float]) -> list[float]:
    return [b - a for a, b in zip(times, times[1:]) if b > a]


async def run_load(cl: Client, concurrency: int, n_requests: int, prompt_tokens: int, max_tokens: int) -> dict:
    queue = list(range(n_requests))
    results: list[dict] = []

    async def worker():
        while queue:
            queue.pop()
            results.append(await cl.stream(cl.prompt(prompt_tokens), max_tokens))
    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - t0
    gen = sum(r["n"] for r in results)
    ttft = [r["t"][0] for r in results if r["t"]]
    gaps = [g for r in results for g in itls(r["t"])]
    per_stream = [(len(r["t"]) - 1) / (r["t"][-1] - r["t"][0]) for r in results if len(r["t"]) > 1 and
                  r["t"][-1] > r["t"][0]]
    return {"concurrency": concurrency, "requests": len(results), "wall_s": wall, "tokens": gen,
            "agg_tok_s": gen / wall, "stream_tok_s": statistics.median(per_stream) if per_stream else float("nan"),
            "ttft_p50_ms": pct(ttft, 50) * 1e3, "ttft_p90_ms": pct(ttft, 90) * 1e3,
            "itl_p50_ms": pct(gaps, 50) * 1e3, "itl_p90_ms": pct(gaps, 90) * 1e3, "itl_max_ms": max(gaps) * 1e3
            if gaps else float("nan")}


async def run_interference(cl: Client, streams: int, long_prompt: int, stream_tokens: int, ubatch: int) -> dict:
    """`streams` streams decode; once they run, a `long_prompt`-token prompt arrives: the streams'
    largest gap between two tokens while it is fed, against their time a token before it and one
    prompt chunk's time (the prompt's time / its ubatch chunks). The time a token: each stream's
    span from its 8th token to its last before the prompt over the tokens in it (the median over
    the streams), not the median gap: where the server runs its decode loop (greedy streams,
    nothing waiting) a dispatch's tokens arrive together, most gaps are ~0, and the median gap
    would count a whole token's time as delay."""
    await cl.stream(cl.prompt(long_prompt), 1)  # its steps compiled before the measured run
    tasks = [asyncio.create_task(cl.stream(cl.prompt(32), stream_tokens)) for _ in range(streams)]
    while sum(len(r) for r in cl.live) < 24 * streams:  # every stream decoding for a while
        await asyncio.sleep(0.05)
    long = await cl.stream(cl.prompt(long_prompt), 1)
    done = await asyncio.gather(*tasks)
    lo, hi = long["t0"], long["t0"] + (long["t"][0] if long["t"] else long["end"])
    during = [b - a for r in done for a, b in zip(r["abs"], r["abs"][1:]) if b > lo and a < hi]
    steady = [b - a for r in done for a, b in zip(r["abs"], r["abs"][1:]) if b <= lo]
    per_token = []
    for r in done:
        before = [t for t in r["abs"] if t <= lo][8:]
        if len(before) > 1:
            per_token.append((before[-1] - before[0]) / (len(before) - 1))
    token_s = statistics.median(per_token) if per_token else pct(steady, 50)
    prompt_ms = long["timings"].get("prompt_ms", float("nan"))
    chunk_ms = prompt_ms / -(-long_prompt // ubatch)
    if max(r["abs"][-1] for r in done) < hi:
        raise RuntimeError("the streams ended before the long prompt was fed: raise --stream-tokens")
    # where the worst gaps lie: (start, end) in ms from the long prompt's arrival, for the trace
    worst = sorted(((b - a, a - lo, b - lo) for r in done for a, b in zip(r["abs"], r["abs"][1:])
                    if b > lo and a < hi), reverse=True)[:5]
    return {"streams": streams, "long_prompt": long_prompt, "prompt_ms": prompt_ms, "chunk_ms": chunk_ms,
            "_window_ms": (hi - lo) * 1e3, "_worst_gaps_at_ms": [[round(x * 1e3, 1) for x in g[1:]] for g in worst],
            "itl_p50_ms": pct(steady, 50) * 1e3, "token_ms": token_s * 1e3,
            "worst_gap_during_ms": max(during, default=0.0) * 1e3,
            "delay_in_chunks": (max(during, default=0.0) - token_s) * 1e3 / chunk_ms}


async def run_multiturn(cl: Client, history: int, turn: int, answer: int) -> dict:
    """TTFT of a second turn that repeats a `history`-token conversation, against a 64-token prompt."""
    short = [await cl.stream(cl.prompt(64), 4) for _ in range(3)]
    for _ in range(2):  # a rehearsal (its steps compiled), then the measured conversation
        hist = cl.prompt(history)
        first = await cl.stream(hist, answer)
        second = await cl.stream(hist + first["ids"] + cl.prompt(turn), answer)  # the history, the answer, a turn
    t_short = statistics.median(r["t"][0] for r in short)
    return {"history": history, "ttft_first_turn_ms": first["t"][0] * 1e3, "ttft_second_turn_ms": second["t"][0] * 1e3,
            "ttft_64_prompt_ms": t_short * 1e3, "ratio_second_vs_64": second["t"][0] / t_short,
            "cached_second": second["timings"].get("cache_n")}


def table(rows: list[dict]) -> str:
    cols = [k for k in rows[0] if not k.startswith("_")]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rows:
        out.append("| " + " | ".join(f"{r[c]:.1f}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    return "\n".join(out)


async def main_async(a) -> list[dict]:
    timeout = aiohttp.ClientTimeout(total=None, sock_read=600)
    # a new connection per request: llama-server dropped reused keep-alive connections after a
    # streamed answer (ServerDisconnected on the next request, nothing in its log; RESULTS §23e), and
    # a localhost connect costs ~0.1 ms of a request's time to first token for either server
    async with aiohttp.ClientSession(timeout=timeout, connector=aiohttp.TCPConnector(force_close=True)) as s:
        headers = {"Authorization": f"Bearer {a.api_key}"} if a.api_key else {}
        cl = Client(s, a.url, a.api_key, await vocab_size(s, a.url, headers), a.seed, a.temperature)
        await cl.stream(cl.prompt(8), 2)  # warm: the first request may compile
        if a.mode == "load":
            rows = []
            for c in [int(x) for x in a.concurrency.split(",")]:
                await run_load(cl, c, c, a.prompt_tokens, min(a.max_tokens, 8))  # this level's shapes compiled
                rows.append(await run_load(cl, c, max(a.requests, c), a.prompt_tokens, a.max_tokens))
            return rows
        if a.mode == "interference":
            return [await run_interference(cl, int(a.concurrency.split(",")[-1]), a.long_prompt, a.stream_tokens,
                                           a.ubatch)]
        return [await run_multiturn(cl, a.history, 32, 16)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--api-key")
    ap.add_argument("--mode", choices=("load", "interference", "multiturn"), default="load")
    ap.add_argument("--concurrency", default="1,4,16", help="comma list (interference: the last = streams)")
    ap.add_argument("--requests", type=int, default=16, help="requests per concurrency level (at least C)")
    ap.add_argument("--prompt-tokens", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--long-prompt", type=int, default=2048)
    ap.add_argument("--stream-tokens", type=int, default=1024, help="interference: tokens each stream generates")
    ap.add_argument("--ubatch", type=int, default=512, help="interference: the server's -ub (a prompt chunk)")
    ap.add_argument("--history", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--temperature", type=float, default=0.0, help="> 0: sampled streams (default greedy)")
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args()
    rows = asyncio.run(main_async(a))
    print(table(rows))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
