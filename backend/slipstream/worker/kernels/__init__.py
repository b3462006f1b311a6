"""The compiled CPU kernels: ``build`` compiles ``csrc/`` into ``torch.ops.slipstream_cpu``;
``cpu_features`` says what the CPU runs."""

from slipstream.worker.kernels.build import load, unavailable_reason

__all__ = ["load", "unavailable_reason"]
