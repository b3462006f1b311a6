"""What this machine can do, measured as the kernels use it (``cpu_machine_probe.cpp``): the
rate its threads stream memory (a decode step's floor: every weight read once) and the peak
rate of the dot-product instructions (a prompt chunk's ceiling), with the CPU's description
recorded beside every figure (the machines vary from session to session)."""

from __future__ import annotations

import functools
import platform
import subprocess
from dataclasses import dataclass

import torch

# A buffer well past the caches (a 32 MB L3 here): every pass reads from memory.
BUFFER_BYTES = 1 << 30
PASSES = 3
# Multiply-adds per instruction and the instruction each weight format's products run on.
PEAK_KINDS = {"float32": "fp32_fma", "bfloat16": "bf16_dot", "int8": "int8_dot", "int4": "int8_dot"}


@dataclass(frozen=True)
class CpuDescription:
    model: str
    flags: str  # the reduced-precision flags that choose the kernels' paths
    threads: int  # torch's intra-op threads (what the engine uses)
    mhz: float  # /proc/cpuinfo's current clock of core 0 (a VM may report the nominal one)

    def line(self) -> str:
        return f"{self.model}, {self.threads} threads, {self.mhz:.0f} MHz, flags: {self.flags}"


_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_int8", "avx_vnni")


@functools.lru_cache(maxsize=1)
def describe_cpu() -> CpuDescription:
    from slipstream.worker.kernels.cpu_features import cpu_flags

    model, mhz = platform.processor() or "unknown", 0.0
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                model = line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in open("/proc/cpuinfo"):
            if line.startswith("cpu MHz"):
                mhz = float(line.split(":")[1])
                break
    except OSError:
        pass
    present = set(cpu_flags().split())
    flags = " ".join(f for f in _FLAGS if f in present)
    return CpuDescription(model, flags, torch.get_num_threads(), mhz)


class Bandwidth:
    """Streaming reads of a buffer larger than the caches, on torch's threads."""

    def __init__(self, nbytes: int = BUFFER_BYTES) -> None:
        from slipstream.worker import kernels

        if not kernels.load():
            raise RuntimeError(f"the probe needs the CPU kernels: {kernels.unavailable_reason()}")
        self.buffer = torch.ones(nbytes + 64, dtype=torch.uint8)
        offset = (-self.buffer.data_ptr()) % 64  # 64-byte aligned view
        self.view = self.buffer[offset : offset + nbytes]

    def measure(self, passes: int = PASSES) -> float:
        """Bytes per second, the fastest of ``passes`` reads."""
        seconds = torch.ops.slipstream_cpu.stream_read_seconds(self.view, passes)
        return self.view.numel() / seconds


def peak_macs_per_second(weight_format: str, iterations: int = 2_000_000) -> float:
    """Multiply-adds per second of the instruction ``weight_format``'s products run on, on
    every intra-op thread (0 where the CPU lacks it)."""
    from slipstream.worker import kernels

    if not kernels.load():
        return 0.0
    return float(torch.ops.slipstream_cpu.peak_rate(PEAK_KINDS[weight_format], iterations))
