"""TensorRT-LLM backend's metric families (``metric_families`` includes ``trtllm``), with its
names, label keys and values, and kinds (its ``custom_metrics_reporter`` and the
``ci/L0_backend_trtllm`` metrics tests), filled from the engine's own counters
(``StatsSnapshot``), so dashboards built for TRT-LLM read Slipstream unchanged.

Only the label values the engine can fill truthfully are exported: no ``request_type=context``
(the engine does not count requests by phase), no disaggregated-serving families.
``kv_cache_block_type=reused`` is the prefix cache's hit tokens in whole blocks.
``nv_trt_llm_runtime_memory_metrics`` is the serving process's own memory, in bytes
(``worker/memory_usage.py``): resident CPU memory, GPU memory torch allocated, pinned host
memory.
"""

from __future__ import annotations

import time
from typing import Callable, Dict, Tuple

from slipstream.core.stats import StatsSnapshot
from slipstream.server.stub.metrics import FamilyLimits, MetricFactory
from slipstream.worker.memory_usage import MemoryUsage, process_memory

TOKEN_LEN_BUCKETS = [10.0, 50.0, 100.0, 500.0, 1000.0]  # TRT-LLM's token-length buckets


# family -> (description, label key, {label value: how to read it from a StatsSnapshot})
def gauge_families(max_num_seqs: int, block_size: int) -> Dict[str, Tuple[str, str, dict]]:
    return {
        "nv_trt_llm_request_metrics": (
            "TRT LLM request metrics",
            "request_type",
            {
                "active": lambda s: s.num_running + s.num_waiting,
                "max": lambda s: max_num_seqs,
                "scheduled": lambda s: s.num_running,
                "waiting": lambda s: s.num_waiting,
            },
        ),
        "nv_trt_llm_kv_cache_block_metrics": (
            "TRT LLM KV cache block metrics",
            "kv_cache_block_type",
            {
                "max": lambda s: s.kv_blocks_total,
                "free": lambda s: s.kv_blocks_total - s.kv_blocks_used,
                "used": lambda s: s.kv_blocks_used,
                "tokens_per": lambda s: block_size,
                "reused": lambda s: s.prefix_cache_hits // max(block_size, 1),
                "fraction": lambda s: s.kv_cache_usage,
            },
        ),
        "nv_trt_llm_inflight_batcher_metrics": (
            "TRT LLM inflight_batcher-specific metrics",
            "inflight_batcher_specific_metric",
            {
                "total_context_tokens": lambda s: s.prompt_tokens_total,
                "generation_requests": lambda s: s.num_running,
                "micro_batch_id": lambda s: 0,  # no pipeline parallelism: one micro-batch
            },
        ),
        "nv_trt_llm_general_metrics": (
            "General TRT LLM metrics",
            "general_type",
            {
                "iteration_counter": lambda s: s.steps,
                "timestamp": lambda s: int(time.time() * 1e6),  # microseconds, as TRT-LLM's
            },
        ),
    }


# TensorRT-LLM's runtime memory family: label value -> how to read it from a MemoryUsage
MEMORY_FAMILY = "nv_trt_llm_runtime_memory_metrics"
MEMORY_READERS: Dict[str, Callable[[MemoryUsage], int]] = {
    "cpu": lambda m: m.cpu_bytes,
    "gpu": lambda m: m.gpu_bytes,
    "pinned": lambda m: m.pinned_bytes,
}


def _token_len(factory: MetricFactory, family: str, metric_type: str):
    """One of TensorRT-LLM's response histograms of token counts."""
    labels = {"response_metric_type": metric_type}
    return factory.metric(
        family, "TRT LLM response metrics", "HISTOGRAM", TOKEN_LEN_BUCKETS, labels=labels
    )


class TrtllmFamilies:
    def __init__(
        self, factory: MetricFactory, post: Callable, *, max_num_seqs: int, block_size: int
    ) -> None:
        self._post = post
        self._gauges = []  # (metric, reader)
        for family, (desc, key, readers) in gauge_families(max_num_seqs, block_size).items():
            for value, read in readers.items():
                self._gauges.append(
                    (factory.metric(family, desc, "GAUGE", labels={key: value}), read)
                )
        self._input_len = _token_len(factory, "nv_llm_input_token_len", "total_input_tokens")
        self._output_len = _token_len(factory, "nv_llm_output_token_len", "total_output_tokens")
        self._memory = [
            (
                factory.metric(
                    MEMORY_FAMILY,
                    "TRT LLM runtime memory metrics",
                    "GAUGE",
                    labels={"memory_type": kind},
                ),
                read,
            )
            for kind, read in MEMORY_READERS.items()
        ]
        self._values: dict = {}

    def update(self, stats: StatsSnapshot) -> None:
        for i, (metric, read) in enumerate(self._gauges):
            self._set(("engine", i), metric, float(read(stats)))
        memory = process_memory()
        for kind, (metric, read_memory) in zip(MEMORY_READERS, self._memory):
            self._set(("memory", kind), metric, float(read_memory(memory)))

    def _set(self, key: tuple, metric, value: float) -> None:
        if self._values.get(key) != value:  # skip round trips that change nothing
            self._post(metric.set, value)
            self._values[key] = value

    def on_finish(self, track, out, now: float) -> None:
        if out.finish_reason not in ("stop", "length"):
            return
        self._post(self._input_len.observe, float(out.num_prompt_tokens or track.num_prompt_tokens))
        self._post(self._output_len.observe, float(track.num_output_tokens))


def trtllm_families(factory: MetricFactory, post: Callable, limits: FamilyLimits) -> TrtllmFamilies:
    """The ``trtllm`` set (``metric_families``), as the stub's ``ModelMetrics`` builds it."""
    return TrtllmFamilies(
        factory, post, max_num_seqs=limits.max_num_seqs, block_size=limits.block_size
    )
