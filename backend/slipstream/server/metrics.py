"""Custom Triton metrics of the slipstream model, built on ``pb_utils.MetricFamily``.

``pb_utils`` (``triton_python_backend_utils``) is passed in, so the package never imports
Triton. Gauges and counters are refreshed from ``EngineLoop.stats()``; the latency histograms
are observed per request by the sender thread. Where the Python backend has no HISTOGRAM
kind (before Triton 24.10), each histogram falls back to ``<name>_count`` / ``<name>_sum``
counters (a Prometheus summary without quantiles).
"""
from __future__ import annotations

from typing import Mapping, Optional

from slipstream.core.stats import StatsSnapshot

PREFIX = "slipstream_"
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

GAUGES = {  # metric suffix -> (description, StatsSnapshot attribute)
    "requests_running": ("Requests being decoded or prefilled", "num_running"),
    "requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
    "kv_blocks_used": ("KV cache blocks in use", "kv_blocks_used"),
    "kv_blocks_total": ("KV cache blocks in the pool", "kv_blocks_total"),
    "kv_cache_usage_ratio": ("Fraction of KV cache blocks in use", "kv_cache_usage"),
    "prefix_cache_hit_rate": ("Prompt tokens served from the prefix cache / tokens looked up",
                              "prefix_cache_hit_rate"),
    "spec_acceptance_rate": ("Speculative decoding: accepted / proposed draft tokens",
                             "spec_acceptance_rate"),
}
COUNTERS = {
    "prompt_tokens_total": ("Prompt tokens processed", "prompt_tokens_total"),
    "generation_tokens_total": ("Tokens generated", "generation_tokens_total"),
    "preemptions_total": ("Requests preempted to free KV blocks", "preemptions_total"),
    "requests_finished_total": ("Requests finished (any reason)", "num_finished"),
    "engine_steps_total": ("Engine steps run", "steps"),
    "spec_draft_tokens_total": ("Speculative decoding: draft tokens proposed", "spec_draft_tokens"),
    "spec_accepted_tokens_total": ("Speculative decoding: draft tokens accepted",
                                   "spec_accepted_tokens"),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token",
                                    TTFT_BUCKETS),
    "time_per_output_token_seconds": ("Mean time between output tokens of a request",
                                      TPOT_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the last response", E2E_BUCKETS),
}


class _SummaryFallback:
    def __init__(self, count, total) -> None:
        self.count, self.total = count, total

    def observe(self, value: float) -> None:
        self.count.increment(1)
        self.total.increment(float(value))


class SlipstreamMetrics:
    def __init__(self, pb_utils, labels: Mapping[str, str]) -> None:
        self._families = []  # keep families alive as long as their metrics
        self.labels = dict(labels)
        mf = pb_utils.MetricFamily
        self.gauges = {k: self._metric(mf, k, d, mf.GAUGE) for k, (d, _) in GAUGES.items()}
        self.counters = {k: self._metric(mf, k, d, mf.COUNTER) for k, (d, _) in COUNTERS.items()}
        self._last = {k: 0.0 for k in COUNTERS}
        self._gauge_values: dict = {}
        self.histograms = {}
        kind = getattr(mf, "HISTOGRAM", None)
        for name, (desc, buckets) in HISTOGRAMS.items():
            if kind is not None:
                self.histograms[name] = self._metric(mf, name, desc, kind, buckets=buckets)
            else:
                self.histograms[name] = _SummaryFallback(
                    self._metric(mf, name + "_count", desc + " (count)", mf.COUNTER),
                    self._metric(mf, name + "_sum", desc + " (sum)", mf.COUNTER))

    def _metric(self, mf, name: str, desc: str, kind, buckets: Optional[list] = None):
        family = mf(name=PREFIX + name, description=desc, kind=kind)
        self._families.append(family)
        if buckets is not None:
            return family.Metric(labels=self.labels, buckets=buckets)
        return family.Metric(labels=self.labels)

    def update(self, stats: StatsSnapshot) -> None:
        for name, (_, attr) in GAUGES.items():
            self._set(name, float(getattr(stats, attr)))
        for name, (_, attr) in COUNTERS.items():
            value = float(getattr(stats, attr))
            delta = value - self._last[name]
            if delta > 0:
                self.counters[name].increment(delta)
                self._last[name] = value

    def _set(self, name: str, value: float) -> None:
        # Each set is a round trip to the Triton process: skip the ones that change nothing.
        if self._gauge_values.get(name) != value:
            self.gauges[name].set(value)
            self._gauge_values[name] = value

    def observe_request(self, ttft: Optional[float], tpot: Optional[float], e2e: float) -> None:
        if ttft is not None:
            self.histograms["time_to_first_token_seconds"].observe(ttft)
        if tpot is not None:
            self.histograms["time_per_output_token_seconds"].observe(tpot)
        self.histograms["e2e_request_latency_seconds"].observe(e2e)
