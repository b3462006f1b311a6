"""What the CPU can run, read once from ``/proc/cpuinfo``: the kernels' build key and the
reduced-precision paths' choices."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path


@functools.lru_cache(maxsize=1)
def cpu_flags() -> str:
    """The ``flags`` line of ``/proc/cpuinfo`` ('' where there is none)."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return line
    except OSError:
        pass
    return ""


@dataclass(frozen=True)
class CpuFeatures:
    """What the reduced paths need from the CPU."""

    avx512_bf16: bool
    amx_bf16: bool
    avx512_vnni: bool

    @classmethod
    def detect(cls) -> "CpuFeatures":
        flags = set(cpu_flags().split())
        return cls("avx512_bf16" in flags, "amx_bf16" in flags, "avx512_vnni" in flags)
