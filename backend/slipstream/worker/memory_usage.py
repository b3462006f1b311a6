"""How much memory the serving process holds, in the three kinds TensorRT-LLM's backend
reports for its runtime (``nv_trt_llm_runtime_memory_metrics``): resident CPU memory, GPU
memory torch has allocated, and page-locked (pinned) host memory torch's CUDA host allocator
holds. A CPU-only process holds no GPU or pinned memory."""

from __future__ import annotations

import os
import resource
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class MemoryUsage:
    cpu_bytes: int = 0
    gpu_bytes: int = 0
    pinned_bytes: int = 0


def process_memory() -> MemoryUsage:
    return MemoryUsage(_resident_bytes(), _gpu_bytes(), _pinned_bytes())


def _resident_bytes() -> int:
    """Resident set size now (``/proc/self/statm``); elsewhere the peak, which is all
    ``getrusage`` knows."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _cuda_in_use() -> bool:
    """CUDA initialized by this process (asking never initializes it)."""
    return torch.cuda.is_available() and torch.cuda.is_initialized()


def _gpu_bytes() -> int:
    if not _cuda_in_use():
        return 0
    return sum(torch.cuda.memory_allocated(d) for d in range(torch.cuda.device_count()))


def _pinned_bytes() -> int:
    stats = getattr(torch.cuda, "host_memory_stats", None)  # torch 2.5 and later
    if stats is None or not _cuda_in_use():
        return 0
    return int(stats().get("allocated_bytes.current", 0))
