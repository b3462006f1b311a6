"""Engine counters: what a metrics endpoint or a benchmark reads."""
from __future__ import annotations

import time
from dataclasses import dataclass


@dataclass
class EngineStats:
    steps: int = 0
    prompt_tokens: int = 0  # prompt tokens computed (prefill work actually done)
    generation_tokens: int = 0
    num_finished: int = 0
    spec_drafted: int = 0
    spec_accepted: int = 0
    busy_seconds: float = 0.0
    batched_tokens_total: int = 0
    batched_seqs_total: int = 0

    def record_step(self, sched, seconds: float) -> None:
        self.steps += 1
        self.busy_seconds += seconds
        self.batched_tokens_total += sched.num_tokens
        self.batched_seqs_total += len(sched.scheduled)
        step_start = time.monotonic() - seconds  # recorded after the step ran
        for item in sched.scheduled:
            req = item.request
            if req.first_scheduled_time is None:  # the end of its queue time
                req.first_scheduled_time = step_start
            prompt_left = max(req.num_prompt_tokens - (req.num_computed_tokens - item.num_new_tokens), 0)
            self.prompt_tokens += min(prompt_left, item.num_new_tokens)

    def record_finish(self, req) -> None:
        self.num_finished += 1

    def record_speculation(self, drafted: int, accepted: int) -> None:
        self.spec_drafted += drafted
        self.spec_accepted += accepted

    def snapshot(self, scheduler, block_manager) -> dict:
        pc = block_manager.stats
        return {
            "num_running": len(scheduler.running),
            "num_waiting": len(scheduler.waiting),
            "kv_blocks_used": block_manager.num_used_blocks,
            "kv_blocks_total": block_manager.num_usable_blocks,
            "prefix_cache_queries": pc.queries,
            "prefix_cache_hits": pc.hits,
            "prefix_cache_hit_rate": pc.hit_rate,
            "prompt_tokens_total": self.prompt_tokens,
            "generation_tokens_total": self.generation_tokens,
            "preemptions_total": scheduler.num_preemptions,
            "num_finished": self.num_finished,
            "steps": self.steps,
            "busy_seconds": self.busy_seconds,
            "spec_draft_tokens": self.spec_drafted,
            "spec_accepted_tokens": self.spec_accepted,
            "spec_acceptance_rate": self.spec_accepted / self.spec_drafted if self.spec_drafted else 0.0,
        }
