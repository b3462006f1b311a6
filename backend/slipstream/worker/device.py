"""Where and in which formats a model runs: the device, the activations' dtype, how a CPU
model holds its weights, the KV cache's dtype, resolved from the engine's config."""

from __future__ import annotations

import logging
import sys
from dataclasses import dataclass
from typing import Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.worker.model.loader import SHIPPED_QUANTIZATIONS, checkpoint_quantization

log = logging.getLogger("slipstream")


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_quantization(config: EngineConfig, device: torch.device) -> Optional[str]:
    """The quantization a model is served with: ``quantization`` where set, else on CPU the
    scheme its checkpoint ships (a GGUF file, an AWQ / GPTQ directory: served as it ships, as
    vLLM reads it from the checkpoint), else None."""
    if config.quantization is not None or device.type != "cpu":
        return config.quantization
    return checkpoint_quantization(config.model)


def resolve_weight_format(config: EngineConfig, device: torch.device) -> str:
    """How a CPU model's linear weights are held: ``float32``, ``bfloat16``, ``int8`` or
    ``int4`` (a 4-bit checkpoint's own blocks; ``worker/layers/reduced_linear``; the
    activations stay float32). On CUDA ``dtype`` is the whole model's dtype and this is
    always ``float32`` (nothing converted after load)."""
    if device.type != "cpu":
        if config.quantization is not None:
            raise ValueError(f"quantization={config.quantization} is CPU only")
        return "float32"
    quantization = resolve_quantization(config, device)
    if quantization == "int8":
        return "int8"
    if quantization in SHIPPED_QUANTIZATIONS:
        return "int4"
    return "bfloat16" if config.dtype in ("bfloat16", "float16") else "float32"


def resolve_compute_dtype(config: EngineConfig, device: torch.device) -> torch.dtype:
    """The activations' dtype: on CPU always float32 (reduced weights are converted after
    load), elsewhere ``dtype``."""
    if device.type == "cpu":
        if config.dtype == "float16":
            log.warning(
                "dtype=float16 on CPU: weights held as bfloat16 (the CPU's native "
                "reduced format), activations float32"
            )
        return torch.float32
    return resolve_dtype(config.dtype, device)


def resolve_kv_cache_dtype(
    config: EngineConfig, compute: torch.dtype, weight_format: str = "float32"
) -> torch.dtype:
    """``auto`` follows the model's ``dtype``, as vLLM's does: bf16 for a CPU model with bf16
    or int8 weights (the attention kernels widen it as they read it; a decode step's cache
    reads halve), else the activations' dtype."""
    if config.kv_cache_dtype == "auto":
        return torch.bfloat16 if weight_format in ("bfloat16", "int8", "int4") else compute
    return getattr(torch, config.kv_cache_dtype)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def keep_gpu_compiler_out(device: torch.device) -> bool:
    """In a serving process on a machine without CUDA, keep OpenAI Triton from loading: torch
    imports it (where it is installed) as soon as transformers' model code imports
    ``torch._dynamo``, only to learn whether it could compile for a GPU, and its library then
    holds 66 MB resident that a CPU engine never uses. Only where no GPU engine can start in
    this process and Triton is not loaded yet; returns whether it was kept out (``import
    triton`` raises ImportError from then on)."""
    if device.type != "cpu" or torch.cuda.is_available() or "triton" in sys.modules:
        return False
    sys.modules["triton"] = None  # type: ignore[assignment]  # Python's "not importable" mark
    return True


@dataclass(frozen=True)
class DeviceSettings:
    """Where and in which formats the models run, resolved once from the config."""

    device: torch.device
    dtype: torch.dtype  # the activations'
    weight_format: str  # how a CPU model holds its linear weights
    kv_dtype: torch.dtype
    quantization: Optional[str] = None  # the checkpoint's scheme, resolved (resolve_quantization)

    @classmethod
    def resolve(cls, config: EngineConfig) -> "DeviceSettings":
        device = resolve_device(config.device)
        dtype = resolve_compute_dtype(config, device)
        weight_format = resolve_weight_format(config, device)
        return cls(
            device,
            dtype,
            weight_format,
            resolve_kv_cache_dtype(config, dtype, weight_format),
            resolve_quantization(config, device),
        )
