"""The GPU check's profile: where a decode step's time goes (``torch.profiler``).

A few decode steps run under the profiler; the device's busy time is the union of its kernel
intervals, against the steps' wall time (the rest is the device waiting on the host: Python,
launches, the copy back). The kernels with the most device time are listed with their share.
On CPU (``--smoke``) only host operators are recorded.
"""

from __future__ import annotations

import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field

import torch


@dataclass
class StepProfile:
    steps: int
    wall_ms: float  # per step
    device_busy_ms: float  # per step: the union of kernel intervals
    busy_share: float
    top: list = field(default_factory=list)  # (kernel, ms per step, calls per step, share)

    def row(self) -> dict:
        return asdict(self)


def _union(intervals: list[tuple[float, float]]) -> float:
    total, end = 0.0, float("-inf")
    for a, b in sorted(intervals):
        if b <= end:
            continue
        total += b - max(a, end)
        end = b
    return total


def profile_decode_steps(
    engine, device: torch.device, steps: int = 3, top: int = 10
) -> StepProfile:
    """Profile ``steps`` engine steps (the engine must have decoding requests in flight)."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if device.type == "cuda":
        activities.append(ProfilerActivity.CUDA)
    engine.step()  # warm
    with profile(activities=activities) as prof:
        start = time.perf_counter()
        for _ in range(steps):
            engine.step()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        wall = time.perf_counter() - start
    kernels = [e for e in prof.events() if e.device_type.name == "CUDA"]
    if not kernels:  # CPU: the host's own operators stand in
        kernels = [
            e for e in prof.events() if e.device_type.name == "CPU" and e.name.startswith("aten::")
        ]
    busy = _union([(e.time_range.start, e.time_range.end) for e in kernels]) / 1e3  # ms
    by_name: dict = defaultdict(lambda: [0.0, 0])
    for e in kernels:
        entry = by_name[e.name[:80]]
        entry[0] += (e.time_range.end - e.time_range.start) / 1e3
        entry[1] += 1
    ranked = sorted(by_name.items(), key=lambda kv: -kv[1][0])[:top]
    total = sum(v[0] for v in by_name.values()) or 1.0
    return StepProfile(
        steps,
        wall / steps * 1e3,
        busy / steps,
        busy / (wall * 1e3),
        [(name, ms / steps, calls / steps, ms / total) for name, (ms, calls) in ranked],
    )
