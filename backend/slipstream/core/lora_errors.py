"""vLLM's (and Triton vllm_backend's) refusals of a request's ``lora_name``, word for word:
clients match these texts. Shared by the engine and the Triton adapter."""

from __future__ import annotations

from typing import Optional, Sequence

LORA_NOT_ENABLED = "LoRA feature is not enabled."


def unknown_lora_message(name: str, supported: Sequence[str]) -> str:
    return f"LoRA {name} is not supported, we currently support {list(supported)}"


def lora_name_error(name: Optional[str], supported: Optional[Sequence[str]]) -> Optional[str]:
    """Why ``name`` cannot be served (``supported`` None: LoRA is off), or None."""
    if name is None:
        return None
    if supported is None:
        return LORA_NOT_ENABLED
    return None if name in supported else unknown_lora_message(name, supported)
