"""Reading a LoRA adapter in PEFT format: ``adapter_config.json`` + ``adapter_model.safetensors``.

An adapter adds ``scale * B @ A`` to some of the model's linear weights (``A`` is
``[rank, in]``, ``B`` is ``[out, rank]``). What this engine applies is checked here, at load, so
that a request never meets an adapter it cannot run: the attention and MLP projections
(``TARGET_MODULES``) of the loaded model, with matching shapes, at most ``max_lora_rank``, and
none of the PEFT variants that change the arithmetic (DoRA, trained biases, extra saved modules).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

import torch

TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
_PEFT_PREFIX = "base_model.model."
_SUFFIXES = {".lora_A.weight": "A", ".lora_B.weight": "B"}


@dataclass
class LoraAdapter:
    name: str
    path: Path
    rank: int  # the largest rank among its modules
    # module name (as ``model.named_modules`` spells it) -> (A [r, in], scale * B [out, r])
    weights: dict[str, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)


def _read_config(path: Path) -> dict:
    file = path / CONFIG_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: no {CONFIG_FILE} (PEFT format expected)")
    config = json.loads(file.read_text())
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ValueError(f"LoRA adapter {path}: peft_type {config.get('peft_type')!r} is not LORA")
    refused = {
        "use_dora": config.get("use_dora"),
        "modules_to_save": config.get("modules_to_save"),
        "alpha_pattern": config.get("alpha_pattern"),
        "fan_in_fan_out": config.get("fan_in_fan_out"),
    }
    for key, value in refused.items():
        if value:
            raise ValueError(f"LoRA adapter {path}: {key}={value!r} is not supported")
    if config.get("bias", "none") != "none":
        raise ValueError(
            f"LoRA adapter {path}: bias={config['bias']!r} is not supported (only 'none')"
        )
    return config


def _read_tensors(path: Path) -> dict[str, dict[str, torch.Tensor]]:
    """module name -> {"A": tensor, "B": tensor} from the adapter's safetensors."""
    from safetensors.torch import load_file

    file = path / WEIGHTS_FILE
    if not file.is_file():
        raise ValueError(f"LoRA adapter {path}: no {WEIGHTS_FILE}")
    modules: dict[str, dict[str, torch.Tensor]] = {}
    for key, tensor in load_file(str(file)).items():
        suffix = next((s for s in _SUFFIXES if key.endswith(s)), None)
        if suffix is None or not key.startswith(_PEFT_PREFIX):
            raise ValueError(
                f"LoRA adapter {path}: unsupported weight {key!r} (only lora_A / "
                f"lora_B of {', '.join(TARGET_MODULES)})"
            )
        module = key[len(_PEFT_PREFIX) : -len(suffix)]
        modules.setdefault(module, {})[_SUFFIXES[suffix]] = tensor
    return modules


def _check_module(
    path: Path, model: torch.nn.Module, module: str, pair: dict, max_rank: int
) -> int:
    if module.rsplit(".", 1)[-1] not in TARGET_MODULES:
        raise ValueError(
            f"LoRA adapter {path}: target {module!r} is not supported (only "
            f"{', '.join(TARGET_MODULES)})"
        )
    try:
        linear = model.get_submodule(module)
    except AttributeError:
        raise ValueError(f"LoRA adapter {path}: the model has no module {module!r}") from None
    if set(pair) != {"A", "B"}:
        raise ValueError(f"LoRA adapter {path}: {module} lacks lora_A or lora_B")
    a, b = pair["A"], pair["B"]
    rank = a.shape[0]
    if (
        a.dim() != 2
        or b.dim() != 2
        or a.shape[1] != linear.in_features
        or b.shape != (linear.out_features, rank)
    ):
        raise ValueError(
            f"LoRA adapter {path}: {module} has lora_A {list(a.shape)} and lora_B "
            f"{list(b.shape)}, which do not fit the model's "
            f"[{linear.out_features}, {linear.in_features}] weight"
        )
    if rank > max_rank:
        raise ValueError(
            f"LoRA adapter {path}: rank {rank} is greater than max_lora_rank {max_rank}"
        )
    return rank


def load_adapter(
    name: str,
    path: Path,
    model: torch.nn.Module,
    max_rank: int,
    dtype: torch.dtype,
    device: torch.device,
) -> LoraAdapter:
    """Read and check one adapter; its scale is folded into B (``lora_alpha / r``, or
    ``/ sqrt(r)`` with rsLoRA, per module, as PEFT computes it)."""
    path = Path(path)
    config = _read_config(path)
    alpha = float(config.get("lora_alpha", 8))  # PEFT's default
    rslora = bool(config.get("use_rslora"))
    adapter = LoraAdapter(name, path, 0)
    for module, pair in _read_tensors(path).items():
        rank = _check_module(path, model, module, pair, max_rank)
        scale = alpha / (math.sqrt(rank) if rslora else rank)
        a = pair["A"].to(device=device, dtype=dtype).contiguous()
        b = (pair["B"].to(device=device, dtype=torch.float32) * scale).to(dtype).contiguous()
        adapter.weights[module] = (a, b)
        adapter.rank = max(adapter.rank, rank)
    if not adapter.weights:
        raise ValueError(f"LoRA adapter {path}: no LoRA weights")
    return adapter
