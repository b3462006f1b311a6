"""Engine counters, and the snapshot of them that metrics endpoints and benchmarks read."""

from __future__ import annotations

import time
from dataclasses import dataclass, fields

from slipstream.core.block_manager import BlockManager
from slipstream.core.scheduler_output import SchedulerOutput


@dataclass(frozen=True)
class StatsSnapshot:
    """The engine's state and counters at one moment (``LLMEngine.get_stats``)."""

    num_running: int = 0
    num_waiting: int = 0
    kv_blocks_used: int = 0
    kv_blocks_total: int = 0
    prefix_cache_queries: int = 0  # prompt tokens looked up in the prefix cache
    prefix_cache_hits: int = 0  # of those, tokens found cached
    prompt_tokens_total: int = 0  # prompt tokens computed (prefill work actually done)
    generation_tokens_total: int = 0
    preemptions_total: int = 0
    num_finished: int = 0
    steps: int = 0
    busy_seconds: float = 0.0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    max_loras: int = 0  # 0: LoRA off
    running_lora_adapters: tuple[str, ...] = ()  # adapter names in use by running requests
    waiting_lora_adapters: tuple[str, ...] = ()

    @property
    def kv_cache_usage(self) -> float:
        return self.kv_blocks_used / self.kv_blocks_total if self.kv_blocks_total else 0.0

    @property
    def prefix_cache_hit_rate(self) -> float:
        return (
            self.prefix_cache_hits / self.prefix_cache_queries if self.prefix_cache_queries else 0.0
        )

    @property
    def spec_acceptance_rate(self) -> float:
        return self.spec_accepted_tokens / self.spec_draft_tokens if self.spec_draft_tokens else 0.0


@dataclass
class EngineStats:
    """The engine's running counters; those a ``StatsSnapshot`` shows bear its names."""

    steps: int = 0
    prompt_tokens_total: int = 0  # prompt tokens computed (prefill work actually done)
    generation_tokens_total: int = 0
    num_finished: int = 0
    spec_draft_tokens: int = 0
    spec_accepted_tokens: int = 0
    busy_seconds: float = 0.0
    batched_tokens_total: int = 0
    batched_seqs_total: int = 0

    def record_step(self, sched: SchedulerOutput, seconds: float) -> None:
        self.steps += 1
        self.busy_seconds += seconds
        self.batched_tokens_total += sched.num_tokens
        self.batched_seqs_total += len(sched.scheduled)
        step_start = time.monotonic() - seconds  # recorded after the step ran
        for item in sched.scheduled:
            req = item.request
            if req.first_scheduled_time is None:  # the end of its queue time
                req.first_scheduled_time = step_start
            prompt_left = max(req.num_prompt_tokens - item.num_computed_before, 0)
            self.prompt_tokens_total += min(prompt_left, item.num_new_tokens)

    def record_speculation(self, drafted: int, accepted: int) -> None:
        self.spec_draft_tokens += drafted
        self.spec_accepted_tokens += accepted

    def snapshot(self, block_manager: BlockManager) -> StatsSnapshot:
        """The counters and the KV cache's state; the scheduler's queues are the caller's to
        add (``dataclasses.replace``)."""
        pc = block_manager.stats
        return StatsSnapshot(
            kv_blocks_used=block_manager.num_used_blocks,
            kv_blocks_total=block_manager.num_usable_blocks,
            prefix_cache_queries=pc.queries,
            prefix_cache_hits=pc.hits,
            **{name: getattr(self, name) for name in _SHOWN},
        )


# The counters a snapshot shows as they are (named alike in both).
_SHOWN = tuple(
    f.name for f in fields(EngineStats) if f.name in {g.name for g in fields(StatsSnapshot)}
)
