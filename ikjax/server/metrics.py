"""`GET /metrics`: the scheduler's counters in Prometheus' text format (prometheus-client).

A collector reads the scheduler's `Stats` at scrape time (nothing is updated per token on the
serving path), in a registry of this server's own (tests start several servers in one process's
children; the library's global registry would mix them). The names mirror llama-server's
`llamacpp:*` metrics under an `ikjax_` prefix: token counters, average throughputs, the queue and
the busy slots, requests by how they ended, and the time to first token.
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


class _SchedulerCollector:
    def __init__(self, scheduler):
        self.s = scheduler

    def collect(self):
        s, st = self.s, self.s.stats
        yield CounterMetricFamily("ikjax_prompt_tokens", "prompt tokens computed", value=st.prompt_tokens)
        yield CounterMetricFamily("ikjax_prompt_tokens_cached", "prompt tokens taken from a slot's cache",
                                  value=st.cached_tokens)
        yield CounterMetricFamily("ikjax_tokens_predicted", "tokens generated", value=st.generated_tokens)
        yield CounterMetricFamily("ikjax_prompt_seconds", "seconds spent feeding prompts", value=st.prompt_seconds)
        yield CounterMetricFamily("ikjax_decode_seconds", "seconds spent in decode steps", value=st.decode_seconds)
        yield CounterMetricFamily("ikjax_decode_steps", "decode steps run (all slots at once)", value=st.decode_steps)
        yield GaugeMetricFamily("ikjax_prompt_tokens_seconds", "average prompt throughput in tokens/s",
                                value=st.prompt_tokens / st.prompt_seconds if st.prompt_seconds else 0.0)
        yield GaugeMetricFamily("ikjax_predicted_tokens_seconds", "average generation throughput in tokens/s "
                                "(all slots together)",
                                value=st.generated_tokens / st.decode_seconds if st.decode_seconds else 0.0)
        yield GaugeMetricFamily("ikjax_requests_deferred", "requests waiting for a slot", value=s.queue_length())
        yield GaugeMetricFamily("ikjax_requests_processing", "slots busy", value=s.slots_busy())
        yield GaugeMetricFamily("ikjax_slots", "slots (-np)", value=s.n_slots)
        finished = CounterMetricFamily("ikjax_requests", "requests finished, by how they ended", labels=["reason"])
        for reason, n in sorted(st.requests.items()):
            finished.add_metric([reason], n)
        yield finished


class Metrics:
    """This server's registry: the scheduler's counters and the time-to-first-token histogram."""

    def __init__(self, scheduler):
        self.registry = CollectorRegistry()
        self.registry.register(_SchedulerCollector(scheduler))
        self.ttft = Histogram("ikjax_time_to_first_token_seconds", "from a request's arrival to its first token",
                              buckets=(0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120), registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)
