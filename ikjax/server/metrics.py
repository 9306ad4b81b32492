"""`GET /metrics`: the scheduler's counters in Prometheus' text format (prometheus-client).

A collector reads the scheduler's `Stats` at scrape time (nothing is updated per token on the
serving path), in a registry of this server's own (tests start several servers in one process's
children; the library's global registry would mix them). The names mirror llama-server's
`llamacpp:*` metrics under an `ikjax_` prefix: token counters, average throughputs, the queue and
the busy slots, requests by how they ended, and the time to first token; the figures llama-server
reports are also given under its own `llamacpp:` names. Its two throughput gauges are, as
llama-server's, over the work done since the previous scrape (it resets their bucket at each
one: a dashboard sees the current rate); the `ikjax_` ones average the server's lifetime.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.s = scheduler
        self._mark = (0, 0.0, 0, 0.0)  # (prompt tokens, seconds, generated tokens, seconds) at the last scrape
        self._recent = (0.0, 0.0)  # llama-server's prompt / generation t/s since the scrape before

    def roll(self) -> None:
        """A scrape: the rates over what was done since the previous one, and a new bucket."""
        st = self.s.stats
        now = (st.prompt_tokens, st.prompt_seconds, st.generated_tokens, st.decode_seconds)
        dp, dps, dg, dgs = (a - b for a, b in zip(now, self._mark))
        self._recent = (dp / dps if dp and dps > 0 else 0.0, dg / dgs if dg and dgs > 0 else 0.0)
        self._mark = now

    def collect(self):
        s, st = self.s, self.s.stats
        cached = sum(slot["n_cached"] for slot in s.slot_info())
        # (ikjax name, llama-server's name or None, counter?, help, value): the figures llama-server has
        # are given under its `llamacpp:` names too, so a dashboard made for it reads this server
        rows = (
            ("prompt_tokens", "prompt_tokens", True, "prompt tokens computed", st.prompt_tokens),
            ("prompt_tokens_cached", None, True, "prompt tokens taken from a slot's cache", st.cached_tokens),
            ("tokens_predicted", "tokens_predicted", True, "tokens the decode steps generated (a stream's few "
             "past its stop string too: the work done; usage counts the answer's)", st.generated_tokens),
            ("prompt_seconds", "prompt_seconds", True, "seconds spent feeding prompts", st.prompt_seconds),
            ("decode_seconds", "tokens_predicted_seconds", True, "seconds spent in decode steps", st.decode_seconds),
            ("decode_steps", "n_decode", True, "decode steps run (all slots at once)", st.decode_steps),
            ("prompt_tokens_seconds", None, False, "average prompt throughput in tokens/s",
             st.prompt_tokens / st.prompt_seconds if st.prompt_seconds else 0.0),
            ("predicted_tokens_seconds", None, False,
             "average generation throughput in tokens/s (all slots together)",
             st.generated_tokens / st.decode_seconds if st.decode_seconds else 0.0),
            ("requests_deferred", "requests_deferred", False, "requests waiting for a slot", s.queue_length()),
            ("requests_processing", "requests_processing", False, "slots busy", s.slots_busy()),
            ("slots", None, False, "slots (-np)", s.n_slots),
            ("kv_cache_tokens", "kv_cache_tokens", False, "tokens held in the slots' KV caches", cached),
            ("kv_cache_usage_ratio", "kv_cache_usage_ratio", False, "the slots' KV caches' use (0..1)",
             cached / (s.n_slots * s.ctx) if s.n_slots * s.ctx else 0.0),
        )
        for name, theirs, counter, what, value in rows:
            family = CounterMetricFamily if counter else GaugeMetricFamily
            yield family(f"ikjax_{name}", what, value=value)
            if theirs is not None:
                yield family(f"llamacpp:{theirs}", what, value=value)
        for theirs, what, value in (
                ("prompt_tokens_seconds", "prompt throughput in tokens/s since the previous scrape", self._recent[0]),
                ("predicted_tokens_seconds", "generation throughput in tokens/s since the previous scrape (all "
                 "slots together)", self._recent[1])):
            yield GaugeMetricFamily(f"llamacpp:{theirs}", what, value=value)
        finished = CounterMetricFamily("ikjax_requests", "requests finished, by how they ended", labels=["reason"])
        for reason, n in sorted(st.requests.items()):
            finished.add_metric([reason], n)
        yield finished


class Metrics:
    """This server's registry: the scheduler's counters and the time-to-first-token histogram."""

    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.collector = _SchedulerCollector(scheduler)
        self.registry.register(self.collector)
        self.ttft = Histogram("ikjax_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)

    def render(self) -> bytes:
        self.collector.roll()
        return generate_latest(self.registry)
