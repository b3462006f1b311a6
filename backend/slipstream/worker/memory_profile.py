"""The CUDA half of memory sizing (``memory_plan`` holds the arithmetic): device-memory
checkpoints, and profiling steps run on a scratch cache to measure the activations' peak.

The profiling steps are what the engine's worst steps will be: ``max_num_batched_tokens``
prompt tokens (in sequences no longer than ``max_model_len``), and a decode step of the
largest batch, sampled with top-p (the device sampler's sort is its largest working set).
Their requests are dummies whose block tables point into a scratch cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from slipstream.core.request import Request
from slipstream.core.sampling_params import SamplingParams
from slipstream.core.scheduler_output import ScheduledRequest, SchedulerOutput


@dataclass(frozen=True)
class MemoryCheckpoint:
    free: int
    total: int
    allocated: int  # by torch's caching allocator, in tensors
    reserved: int  # by torch's caching allocator, in all

    @classmethod
    def take(cls, device: torch.device) -> "MemoryCheckpoint":
        torch.cuda.synchronize(device)
        free, total = torch.cuda.mem_get_info(device)
        return cls(
            free,
            total,
            torch.cuda.memory_allocated(device),
            torch.cuda.memory_reserved(device),
        )


def peak_above_now(run: Callable[[], object], device: torch.device) -> int:
    """How far above what is allocated now the allocator's peak goes while ``run`` runs."""
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    base = torch.cuda.memory_allocated(device)
    run()
    torch.cuda.synchronize(device)
    return max(torch.cuda.max_memory_allocated(device) - base, 0)


@dataclass
class ProfilingStep:
    """A scheduled step over dummy requests, and the scratch blocks it needs."""

    sched: SchedulerOutput
    num_blocks: int  # of the scratch cache (block 0 left to padding rows)

    @property
    def requests(self) -> list[Request]:
        return [item.request for item in self.sched.scheduled]


def _step(lengths: list[int], params: SamplingParams, block_size: int) -> ProfilingStep:
    """Prompts of ``lengths`` tokens, each scheduled whole, their block tables one after
    another from block 1."""
    scheduled, next_block = [], 1
    for i, length in enumerate(lengths):
        req = Request(f"memory-profile-{i}", [0] * length, params)
        blocks = -(-length // block_size)
        req.block_table = list(range(next_block, next_block + blocks))
        next_block += blocks
        scheduled.append(ScheduledRequest(req, length))
    return ProfilingStep(SchedulerOutput(scheduled), next_block)


def prefill_step(num_tokens: int, max_model_len: int, block_size: int) -> ProfilingStep:
    """``num_tokens`` prompt tokens in sequences of at most ``max_model_len``, greedy."""
    lengths = [max_model_len] * (num_tokens // max_model_len)
    if num_tokens % max_model_len:
        lengths.append(num_tokens % max_model_len)
    return _step(lengths, SamplingParams(max_tokens=1, temperature=0.0), block_size)


def decode_step(batch: int, block_size: int) -> ProfilingStep:
    """``batch`` one-token rows sampled with top-p (the device sampler's sort)."""
    nucleus = SamplingParams(max_tokens=1, temperature=0.8, top_p=0.95)
    return _step([1] * batch, nucleus, block_size)
