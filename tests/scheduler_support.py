"""Model-free scheduling harness: a real scheduler and block manager, no model, no torch.

``sample`` answers a ``SchedulerOutput`` as the runner and sampler would (one token per
request that reaches its sequence's end, one per draft row plus one when drafts were
verified); ``check_step`` checks a step against the scheduler's invariants; ``FakeClock``
replaces the clock the scheduler and requests read, so time-based policies (aging, delay
windows) are measured in steps, not in the machine's speed.
"""

from __future__ import annotations

import sys
import types

import pytest

from slipstream.core.batch_scheduler import BatchScheduler
from slipstream.core.block_manager import BlockManager
from slipstream.core.config import EngineConfig
from slipstream.core.request import Request, RequestStatus
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler import Scheduler, SchedulerBase
from slipstream.core.scheduler_output import ModelRunnerOutput, SchedulerOutput
from slipstream.core.swap_space import SwapSpace

EOS = 2


def make_scheduler(
    num_blocks: int = 64, block_size: int = 4, swap_blocks: int = 0, **overrides
) -> Scheduler:
    settings = dict(
        max_num_batched_tokens=32,
        max_num_seqs=8,
        max_model_len=256,
        block_size=block_size,
        enable_prefix_caching=True,
    )
    settings.update(overrides)
    config = EngineConfig(**settings)
    bm = BlockManager(num_blocks, block_size, config.enable_prefix_caching)
    swap = SwapSpace(config, bm, swap_blocks) if config.preemption_mode != "recompute" else None
    cls = BatchScheduler if config.batching != "continuous" else Scheduler
    return cls(config, bm, swap)


def make_request(
    rid: str,
    prompt_len: int,
    max_tokens: int,
    *,
    first_token: int = 100,
    priority: int = 0,
    **params,
) -> Request:
    prompt = [first_token + i for i in range(prompt_len)]
    return Request(
        rid, prompt, SamplingParams(max_tokens=max_tokens, ignore_eos=True, **params), EOS, priority
    )


def sample(sched: SchedulerOutput, token: int = 7, agree_with_drafts: int = 0) -> ModelRunnerOutput:
    """What the worker returns: a request samples once its step reaches the end of its
    tokens; with drafts, the first ``agree_with_drafts`` draft rows agree with the target."""
    out = ModelRunnerOutput.empty(0)
    for item in sched.scheduled:
        reaches_end = item.num_computed_before + item.num_new_tokens == (
            item.num_tokens_before + len(item.spec_token_ids)
        )
        if not reaches_end:
            tokens = []
        else:
            drafts = item.spec_token_ids
            tokens = [d for d in drafts[:agree_with_drafts]]
            tokens += [token] * (1 + len(drafts) - len(tokens))
        out.token_ids.append(tokens)
        out.logprobs.append([-0.5] * len(tokens))
    return out


def no_stop_strings(req: Request):
    return None


def check_step(s: SchedulerBase, sched: SchedulerOutput, every: list[Request]) -> None:
    config = s.config
    assert sched.num_tokens <= config.max_num_batched_tokens
    assert len(sched.scheduled) <= config.max_num_seqs
    assert len(s.running) <= config.max_num_seqs
    ids = [item.request.request_id for item in sched.scheduled]
    assert len(ids) == len(set(ids)), "a request scheduled twice in one step"
    s.bm.check_invariants()
    assert s.bm.num_used_blocks + s.bm.num_free_blocks == s.bm.num_usable_blocks
    for req in every:
        assert 0 <= req.num_computed_tokens <= req.num_tokens, req
        if req.is_finished:
            assert req.block_table == [], f"finished {req} holds blocks"
        elif req.status is RequestStatus.RUNNING:
            assert len(req.block_table) * s.bm.block_size >= req.num_computed_tokens


def run_to_completion(s: SchedulerBase, reqs: list[Request], max_steps: int = 2000) -> int:
    for req in reqs:
        s.add(req)
    steps = 0
    while s.has_work():
        sched = s.schedule()
        s.update_from_output(sched, sample(sched), no_stop_strings)
        check_step(s, sched, reqs)
        steps += 1
        assert steps < max_steps, "the workload never finished"
    return steps


class FakeClock:
    """``time.monotonic`` for the scheduler's and the requests' modules; tests advance it."""

    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def monotonic(self) -> float:
        return self.now

    def install(self, monkeypatch: pytest.MonkeyPatch) -> FakeClock:
        fake_time = types.SimpleNamespace(monotonic=self.monotonic)
        for cls in (Scheduler, Request):  # by class, wherever the modules live
            monkeypatch.setattr(sys.modules[cls.__module__], "time", fake_time)
        return self
