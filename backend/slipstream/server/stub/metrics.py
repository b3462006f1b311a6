"""Custom Triton metrics of a Slipstream model, built on ``pb_utils.MetricFamily``.

Sets of families, chosen per model (``metric_families``; a set another layer defines, e.g.
``trtllm``: TensorRT-LLM's ``nv_trt_llm_*`` families in ``trtllm/metrics.py``, is handed in as
a ``FamilyBuilder``):

* ``slipstream_*``: engine gauges and counters refreshed from ``EngineLoop.stats()`` (a
  ``StatsSnapshot``), and
  per-request latency histograms;
* ``vllm:*``: Triton vLLM backend's families with its names, labels and buckets, plus the ones
  vLLM's Grafana dashboard and the Kubernetes Gateway API Inference Extension read
  (``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``, ``vllm:request_success_total``,
  queue / prefill / decode times ...), so those work unchanged. As in vLLM, prompt tokens count
  whole prompts (prefix-cache hits included) and ``time_per_output_token`` is observed once per
  generated token after the first.

``pb_utils`` (``triton_python_backend_utils``) is passed in, so the package never imports
Triton. Every metric call is a round trip to the Triton process: they run on one recorder
thread, off the thread that sends responses; counters are summed locally and flushed at each
refresh and when a request finishes. Where the Python backend has no HISTOGRAM kind (before
Triton 24.10), each histogram becomes ``<name>_count`` / ``<name>_sum`` counters.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping, Optional, Protocol, Sequence

from slipstream.core.stats import StatsSnapshot

# ---------------------------------------------------------------------------- the families
PREFIX = "slipstream_"
TTFT_BUCKETS = [0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0]
TPOT_BUCKETS = [0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5]
E2E_BUCKETS = [0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0]

GAUGES = {  # metric suffix -> (description, StatsSnapshot attribute)
    "requests_running": ("Requests being decoded or prefilled", "num_running"),
    "requests_waiting": ("Requests waiting to be scheduled", "num_waiting"),
    "kv_blocks_used": ("KV cache blocks in use", "kv_blocks_used"),
    "kv_blocks_capacity": ("KV cache blocks in the pool", "kv_blocks_total"),
    "kv_cache_usage_ratio": ("Fraction of KV cache blocks in use", "kv_cache_usage"),
    "prefix_cache_hit_rate": (
        "Prompt tokens served from the prefix cache / tokens looked up",
        "prefix_cache_hit_rate",
    ),
    "spec_acceptance_rate": (
        "Speculative decoding: accepted / proposed draft tokens",
        "spec_acceptance_rate",
    ),
}
COUNTERS = {
    "prompt_tokens_total": ("Prompt tokens processed", "prompt_tokens_total"),
    "generation_tokens_total": ("Tokens generated", "generation_tokens_total"),
    "preemptions_total": ("Requests preempted to free KV blocks", "preemptions_total"),
    "requests_finished_total": ("Requests finished (any reason)", "num_finished"),
    "engine_steps_total": ("Engine steps run", "steps"),
    "spec_draft_tokens_total": ("Speculative decoding: draft tokens proposed", "spec_draft_tokens"),
    "spec_accepted_tokens_total": (
        "Speculative decoding: draft tokens accepted",
        "spec_accepted_tokens",
    ),
}
HISTOGRAMS = {
    "time_to_first_token_seconds": ("Time from arrival to the first generated token", TTFT_BUCKETS),
    "time_per_output_token_seconds": ("Mean time between output tokens of a request", TPOT_BUCKETS),
    "e2e_request_latency_seconds": ("Time from arrival to the last response", E2E_BUCKETS),
}

# vLLM's bucket boundaries, in rows (one per line, the formatter's layout, would make three
# long columns that repeat one another's tails).
# fmt: off
VLLM_TTFT_BUCKETS = [
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75,
    1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
]
VLLM_TPOT_BUCKETS = [
    0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
    0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0, 40.0, 80.0,
]
VLLM_REQUEST_TIME_BUCKETS = [
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0,
    30.0, 40.0, 50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0,
]
# fmt: on
VLLM_N_BUCKETS = [1, 2, 5, 10, 20]
FINISHED_REASONS = ("stop", "length", "abort")


def one_two_five_buckets(limit: int) -> list[int]:
    """1, 2, 5, 10, 20, 50 ... up to ``limit`` (vLLM's token-count buckets)."""
    out: list[int] = []
    scale = 1
    while True:
        for m in (1, 2, 5):
            if m * scale > limit:
                return out
            out.append(m * scale)
        scale *= 10


# vLLM name -> (description, kind, buckets or None); kinds are MetricFamily attribute names.
# vLLM's counters and gauges: name -> (help, kind, buckets).
_VLLM_SCALAR_FAMILIES = {
    "vllm:prompt_tokens_total": ("Number of prefill tokens processed.", "COUNTER", None),
    "vllm:generation_tokens_total": ("Number of generation tokens processed.", "COUNTER", None),
    "vllm:num_preemptions_total": (
        "Cumulative number of preemption from the engine.",
        "COUNTER",
        None,
    ),
    "vllm:prefix_cache_queries_total": (
        "Prefix cache queries, in terms of number of queried tokens.",
        "COUNTER",
        None,
    ),
    "vllm:prefix_cache_hits_total": (
        "Prefix cache hits, in terms of number of cached tokens.",
        "COUNTER",
        None,
    ),
    "vllm:num_requests_running": ("Number of requests in model execution batches.", "GAUGE", None),
    "vllm:num_requests_waiting": ("Number of requests waiting to be processed.", "GAUGE", None),
    "vllm:kv_cache_usage_perc": ("KV-cache usage. 1 means 100 percent usage.", "GAUGE", None),
    "vllm:gpu_cache_usage_perc": (
        "KV-cache usage. 1 means 100 percent usage (the name before vLLM 0.10).",
        "GAUGE",
        None,
    ),
}


# vLLM's histograms that share their buckets: name -> help.
_VLLM_TPOT_HISTOGRAMS = {  # VLLM_TPOT_BUCKETS
    "vllm:time_per_output_token_seconds": "Histogram of time per output token in seconds.",
    "vllm:inter_token_latency_seconds": "Histogram of inter-token latency in seconds.",
    "vllm:request_time_per_output_token_seconds": (
        "Histogram of time_per_output_token_seconds per request."
    ),
}
_VLLM_TIME_HISTOGRAMS = {  # VLLM_REQUEST_TIME_BUCKETS
    "vllm:e2e_request_latency_seconds": "Histogram of end to end request latency in seconds.",
    "vllm:request_queue_time_seconds": "Histogram of time spent in WAITING phase for request.",
    "vllm:request_inference_time_seconds": "Histogram of time spent in RUNNING phase for request.",
    "vllm:request_prefill_time_seconds": "Histogram of time spent in PREFILL phase for request.",
    "vllm:request_decode_time_seconds": "Histogram of time spent in DECODE phase for request.",
}


def vllm_families(max_model_len: int) -> dict:
    """Every vLLM family: name -> (help, kind, buckets), in vLLM's order."""
    tokens = one_two_five_buckets(max_model_len)
    histograms = {
        "vllm:time_to_first_token_seconds": (
            "Histogram of time to first token in seconds.",
            VLLM_TTFT_BUCKETS,
        ),
        **{name: (desc, VLLM_TPOT_BUCKETS) for name, desc in _VLLM_TPOT_HISTOGRAMS.items()},
        **{name: (desc, VLLM_REQUEST_TIME_BUCKETS) for name, desc in _VLLM_TIME_HISTOGRAMS.items()},
        "vllm:request_prompt_tokens": ("Number of prefill tokens processed.", tokens),
        "vllm:request_generation_tokens": ("Number of generation tokens processed.", tokens),
        "vllm:request_params_n": ("Histogram of the n request parameter.", VLLM_N_BUCKETS),
        "vllm:request_max_num_generation_tokens": (
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        ),
        "vllm:request_params_max_tokens": (
            "Histogram of the max_tokens request parameter.",
            tokens,
        ),
    }
    return {
        **_VLLM_SCALAR_FAMILIES,
        **{name: (desc, "HISTOGRAM", buckets) for name, (desc, buckets) in histograms.items()},
    }


# ---------------------------------------------------------------------------- data
@dataclass
class RequestTrack:
    """What the metrics need to remember about one request between its outputs."""

    arrival: float
    max_tokens: int
    n: int = 1
    first_token: Optional[float] = None
    last_token: Optional[float] = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    # sequence index -> tokens generated (n > 1: the longest is vLLM's max_num_generation_tokens)
    tokens_by_sequence: dict[int, int] = field(default_factory=dict)


@dataclass(frozen=True)
class FamilyLimits:
    """The engine's sizes some families report as constants."""

    max_model_len: Optional[int] = 2048  # None: not set (the vllm families need it)
    block_size: int = 16
    num_blocks: int = 0
    max_num_seqs: int = 0
    max_loras: int = 0


class MetricFamilies(Protocol):
    """One set of families: refreshed from the engine's counters, told of each request's end."""

    def update(self, stats: StatsSnapshot) -> None: ...

    def on_finish(self, track: RequestTrack, out, now: float) -> None: ...


# A set of families another layer defines: (its factory, the recorder's post, the limits).
FamilyBuilder = Callable[["MetricFactory", Callable, FamilyLimits], MetricFamilies]


class _SummaryFallback:
    def __init__(self, count, total) -> None:
        self.count, self.total = count, total

    def observe(self, value: float) -> None:
        self.count.increment(1)
        self.total.increment(float(value))


class _Recorder:
    """One thread that performs the metric calls (each a round trip to Triton) in order."""

    def __init__(self) -> None:
        self._queue: "queue.Queue" = queue.Queue()
        self._thread = threading.Thread(target=self._run, name="slipstream-metrics", daemon=True)
        self._thread.start()

    def post(self, call: Callable, *args) -> None:
        self._queue.put((call, args))

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            call, args = item
            try:
                call(*args)
            except Exception:  # a metric must never take the model down
                pass

    def stop(self, timeout: float = 5.0) -> None:
        self._queue.put(None)
        self._thread.join(timeout)


class MetricFactory:
    """Creates metrics of one label set, keeping their families alive."""

    def __init__(self, pb_utils, labels: Mapping[str, str]) -> None:
        self.mf = pb_utils.MetricFamily
        self.labels = dict(labels)
        self._families: list = []

    def metric(
        self,
        name: str,
        desc: str,
        kind: str,
        buckets: Optional[Sequence] = None,
        labels: Optional[Mapping[str, str]] = None,
    ):
        labels = {**self.labels, **(labels or {})}
        if kind == "HISTOGRAM" and getattr(self.mf, "HISTOGRAM", None) is None:
            return _SummaryFallback(
                self.metric(name + "_count", desc + " (count)", "COUNTER", labels=labels),
                self.metric(name + "_sum", desc + " (sum)", "COUNTER", labels=labels),
            )
        family = self._family(name, desc, getattr(self.mf, kind))
        if buckets is not None:
            return family.Metric(labels=labels, buckets=list(buckets))
        return family.Metric(labels=labels)

    def _family(self, name: str, desc: str, kind):
        for existing_name, family in self._families:  # one family, several label sets
            if existing_name == name:
                return family
        family = self.mf(name=name, description=desc, kind=kind)
        self._families.append((name, family))
        return family


# ---------------------------------------------------------------------------- slipstream_*
class SlipstreamFamilies:
    def __init__(self, factory: MetricFactory, post: Callable) -> None:
        self._post = post
        self.gauges = {k: factory.metric(PREFIX + k, d, "GAUGE") for k, (d, _) in GAUGES.items()}
        self.counters = {
            k: factory.metric(PREFIX + k, d, "COUNTER") for k, (d, _) in COUNTERS.items()
        }
        self.histograms = {
            k: factory.metric(PREFIX + k, d, "HISTOGRAM", buckets=b)
            for k, (d, b) in HISTOGRAMS.items()
        }
        self._last = {k: 0.0 for k in COUNTERS}
        self._gauge_values: dict = {}

    def update(self, stats: StatsSnapshot) -> None:
        for name, (_, attr) in GAUGES.items():
            self._set(name, float(getattr(stats, attr)))
        for name, (_, attr) in COUNTERS.items():
            value = float(getattr(stats, attr))
            delta = value - self._last[name]
            if delta > 0:
                self._post(self.counters[name].increment, delta)
                self._last[name] = value

    def _set(self, name: str, value: float) -> None:
        if self._gauge_values.get(name) != value:  # skip round trips that change nothing
            self._post(self.gauges[name].set, value)
            self._gauge_values[name] = value

    def on_finish(self, track: RequestTrack, out, now: float) -> None:
        if out.finish_reason not in ("stop", "length"):
            return
        if track.first_token is not None:
            self._post(
                self.histograms["time_to_first_token_seconds"].observe,
                track.first_token - track.arrival,
            )
            if track.num_output_tokens > 1:
                self._post(
                    self.histograms["time_per_output_token_seconds"].observe,
                    (now - track.first_token) / (track.num_output_tokens - 1),
                )
        self._post(self.histograms["e2e_request_latency_seconds"].observe, now - track.arrival)


# ---------------------------------------------------------------------------- vllm:*
class VllmFamilies:
    def __init__(
        self,
        factory: MetricFactory,
        post: Callable,
        *,
        max_model_len: int,
        block_size: int,
        num_blocks: int,
        max_loras: int = 0,
    ) -> None:
        self._post = post
        self.m = {
            name: factory.metric(name, desc, kind, buckets)
            for name, (desc, kind, buckets) in vllm_families(max_model_len).items()
        }
        self.success = {
            reason: factory.metric(
                "vllm:request_success_total",
                "Count of successfully processed requests.",
                "COUNTER",
                labels={"finished_reason": reason},
            )
            for reason in FINISHED_REASONS
        }
        # Read by endpoint pickers: block size for prefix-aware routing, and LoRA state.
        post(
            factory.metric(
                "vllm:cache_config_info",
                "Information of the LLMEngine CacheConfig",
                "GAUGE",
                labels={"block_size": str(block_size), "num_gpu_blocks": str(num_blocks)},
            ).set,
            1,
        )
        self._factory = factory
        self._lora_series: dict = {}  # label values -> vllm:lora_requests_info series
        self._lora_current: Optional[tuple] = None
        self._update_lora(StatsSnapshot(max_loras=max_loras))
        self._pending = {"vllm:prompt_tokens_total": 0, "vllm:generation_tokens_total": 0}
        self._last = {
            "preemptions_total": 0.0,
            "prefix_cache_queries": 0.0,
            "prefix_cache_hits": 0.0,
        }
        self._gauge_values: dict = {}

    def update(self, stats: StatsSnapshot) -> None:
        usage = stats.kv_cache_usage
        for name, value in (
            ("vllm:num_requests_running", stats.num_running),
            ("vllm:num_requests_waiting", stats.num_waiting),
            ("vllm:kv_cache_usage_perc", usage),
            ("vllm:gpu_cache_usage_perc", usage),
        ):
            if self._gauge_values.get(name) != float(value):
                self._post(self.m[name].set, float(value))
                self._gauge_values[name] = float(value)
        for key, name in (
            ("preemptions_total", "vllm:num_preemptions_total"),
            ("prefix_cache_queries", "vllm:prefix_cache_queries_total"),
            ("prefix_cache_hits", "vllm:prefix_cache_hits_total"),
        ):
            value = float(getattr(stats, key))
            if value > self._last[key]:
                self._post(self.m[name].increment, value - self._last[key])
                self._last[key] = value
        self._update_lora(stats)
        self.flush()

    def _update_lora(self, stats: StatsSnapshot) -> None:
        """vLLM's info gauge: the adapters in use as labels, the time they were last current as
        value; as in vLLM, each label set is its own series and readers take the newest (a
        Triton metric family keeps every series it made, so each is made once and reused)."""
        labels = {
            "max_lora": str(stats.max_loras),
            "running_lora_adapters": ",".join(stats.running_lora_adapters),
            "waiting_lora_adapters": ",".join(stats.waiting_lora_adapters),
        }
        key = tuple(labels.values())
        if key == self._lora_current:
            return
        self._lora_current = key
        if key not in self._lora_series:
            self._lora_series[key] = self._factory.metric(
                "vllm:lora_requests_info", "Running stats on lora requests.", "GAUGE", labels=labels
            )
        self._post(self._lora_series[key].set, time.time())

    def flush(self) -> None:
        for name, count in self._pending.items():
            if count:
                self._post(self.m[name].increment, count)
                self._pending[name] = 0

    def on_tokens(self, track: RequestTrack, out, num_tokens: int, now: float, first: bool) -> None:
        self._pending["vllm:generation_tokens_total"] += num_tokens
        if first:
            self._pending["vllm:prompt_tokens_total"] += out.num_prompt_tokens
            self._post(self.m["vllm:time_to_first_token_seconds"].observe, now - track.arrival)
            num_tokens -= 1  # the first token has no time per output token
            if num_tokens <= 0:
                return
            since = track.first_token
        else:
            since = track.last_token
        assert since is not None, "on_outputs sets first_token, then last_token, before this"
        # vLLM's inter-token latency: one observation per output read (between consecutive
        # streamed outputs); time per output token: the outputs read together share the time
        # since the last one, token by token.
        self._post(self.m["vllm:inter_token_latency_seconds"].observe, now - since)
        interval = (now - since) / num_tokens
        for _ in range(num_tokens):
            self._post(self.m["vllm:time_per_output_token_seconds"].observe, interval)

    def on_finish(self, track: RequestTrack, out, now: float) -> None:
        reason = out.finish_reason if out.finish_reason in FINISHED_REASONS else "abort"
        self._post(self.success[reason].increment, 1)
        self.flush()
        if reason == "abort":
            return
        observe = {
            "vllm:e2e_request_latency_seconds": now - track.arrival,
            "vllm:request_prompt_tokens": track.num_prompt_tokens,
            "vllm:request_generation_tokens": track.num_output_tokens,
            "vllm:request_params_n": track.n,
            "vllm:request_params_max_tokens": track.max_tokens,
            "vllm:request_max_num_generation_tokens": max(
                track.tokens_by_sequence.values(), default=track.num_output_tokens
            ),
            "vllm:request_time_per_output_token_seconds": (
                (now - track.first_token) / (track.num_output_tokens - 1)
                if track.first_token is not None and track.num_output_tokens > 1
                else 0.0
            ),
        }
        timing = getattr(out, "timing", None)
        if timing is not None and timing.first_scheduled is not None:
            observe["vllm:request_queue_time_seconds"] = timing.first_scheduled - timing.arrival
            observe["vllm:request_inference_time_seconds"] = (
                timing.finished - timing.first_scheduled
            )
            if timing.first_token is not None:
                observe["vllm:request_prefill_time_seconds"] = (
                    timing.first_token - timing.first_scheduled
                )
                observe["vllm:request_decode_time_seconds"] = timing.finished - timing.first_token
        for name, value in observe.items():
            self._post(self.m[name].observe, max(float(value), 0.0))


# ---------------------------------------------------------------------------- the facade
class ModelMetrics:
    """The metrics of one model instance, as the Triton adapter drives them."""

    def __init__(
        self,
        pb_utils,
        labels: Mapping[str, str],
        families: Sequence[str] = ("slipstream",),
        limits: FamilyLimits = FamilyLimits(),
        builders: Optional[Mapping[str, FamilyBuilder]] = None,
    ) -> None:
        """``builders``: the sets other layers define, by their ``metric_families`` name."""
        self._recorder = _Recorder()
        self._factory = factory = MetricFactory(pb_utils, labels)  # its families must stay alive
        self.families: list[MetricFamilies] = []
        try:
            if "slipstream" in families:
                self.families.append(SlipstreamFamilies(factory, self._recorder.post))
            if "vllm" in families:
                if limits.max_model_len is None:
                    raise ValueError("the vllm metric families need max_model_len set")
                # vLLM's own label (dashboards and endpoint pickers filter on it) beside
                # Triton vLLM backend's model / version
                self._vllm_factory = MetricFactory(
                    pb_utils, {**labels, "model_name": labels.get("model", "")}
                )
                self.families.append(
                    VllmFamilies(
                        self._vllm_factory,
                        self._recorder.post,
                        max_model_len=limits.max_model_len,
                        block_size=limits.block_size,
                        num_blocks=limits.num_blocks,
                        max_loras=limits.max_loras,
                    )
                )
            for name, build in (builders or {}).items():
                if name in families:
                    self.families.append(build(factory, self._recorder.post, limits))
        except BaseException:
            self._recorder.stop()
            raise

    def track(self, arrival: float, params) -> RequestTrack:
        return RequestTrack(arrival=arrival, max_tokens=params.max_tokens, n=params.n)

    def on_outputs(self, track: RequestTrack, outs: Sequence, now: float) -> None:
        """The engine outputs of one request read at ``now`` (usually one)."""
        num_tokens = sum(len(o.token_ids) for o in outs)
        if not num_tokens:
            return
        first = track.first_token is None
        if first:
            track.first_token = now
            track.num_prompt_tokens = outs[0].num_prompt_tokens
        track.num_output_tokens += num_tokens
        for o in outs:
            index = getattr(o, "index", 0)
            track.tokens_by_sequence[index] = track.tokens_by_sequence.get(index, 0) + len(
                o.token_ids
            )
        for family in self.families:
            if isinstance(family, VllmFamilies):
                family.on_tokens(track, outs[0], num_tokens, now, first)
        track.last_token = now

    def on_finish(self, track: RequestTrack, out, now: float) -> None:
        for family in self.families:
            family.on_finish(track, out, now)

    def update(self, stats: StatsSnapshot) -> None:
        for family in self.families:
            family.update(stats)

    def stop(self) -> None:
        self._recorder.stop()


class NoMetrics:
    """REPORT_CUSTOM_METRICS off, or the server started with ``--allow-metrics=false``."""

    families: list[MetricFamilies] = []

    def track(self, arrival: float, params) -> RequestTrack:
        return RequestTrack(arrival=arrival, max_tokens=params.max_tokens, n=params.n)

    def on_outputs(self, track: RequestTrack, outs: Sequence, now: float) -> None:
        track.num_output_tokens += sum(len(o.token_ids) for o in outs)

    def on_finish(self, track: RequestTrack, out, now: float) -> None:
        pass

    def update(self, stats: StatsSnapshot) -> None:
        pass

    def stop(self) -> None:
        pass
