"""The values of vLLM's engine arguments turned into Slipstream's settings: each converter takes
an argument's value (JSON from model.json, text from a config parameter or a flag) and returns
the ``EngineConfig`` settings it decides, or raises ``ValueError`` saying what is accepted."""

from __future__ import annotations

import json
from typing import Any, Callable, Optional

from slipstream.core.block_hash import HASH_ALGOS
from slipstream.core.boolean_text import Spelling, parse_bool
from slipstream.core.config import DTYPES, KV_CACHE_DTYPES, QUANTIZATIONS, EngineConfig

GIB = 2**30
Converter = Callable[[Any, Spelling], dict]


def parse_flag(value: Any, name: str, spelling: Spelling) -> bool:
    if isinstance(value, bool):
        return value
    parsed = parse_bool(str(value), spelling)
    if parsed is None:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return parsed


def switch(name: str, setting: str, invert: bool = False) -> Converter:
    return lambda value, spelling: {setting: parse_flag(value, name, spelling) != invert}


def convert_dtype(value: Any, spelling: Spelling) -> dict:
    names = {"float": "float32", "half": "float16", **{d: d for d in DTYPES}}
    if str(value) not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {value!r}")
    return {"dtype": names[str(value)]}


def convert_quantization(value: Any, spelling: Spelling) -> dict:
    """vLLM's ``quantization`` names a checkpoint's scheme: ``gguf``, ``awq`` and ``gptq``
    (4 bits) are served as they ship; ``int8`` (weights and activations in blocks of 32, made
    at load) is Slipstream's own; null / "" none."""
    if value in (None, "", "none", "None"):
        return {"quantization": None}
    if value not in QUANTIZATIONS:
        raise ValueError(
            f"quantization={value!r} is not supported (weights load unquantized, with 'int8' "
            "quantized at load, or a 4-bit checkpoint as it ships: gguf, awq, gptq; CPU)"
        )
    return {"quantization": str(value)}


def convert_kv_cache_dtype(value: Any, spelling: Spelling) -> dict:
    if str(value) not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported (the KV cache uses the "
            f"model's dtype, or one of {sorted(KV_CACHE_DTYPES)})"
        )
    return {"kv_cache_dtype": str(value)}


POLICIES = {"fcfs": "fifo", "priority": "priority"}  # vLLM's scheduling_policy -> ours


def convert_scheduling_policy(value: Any, spelling: Spelling) -> dict:
    if value not in POLICIES:
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {value!r}")
    return {"policy": POLICIES[value]}


def convert_hash_algo(value: Any, spelling: Spelling) -> dict:
    # vLLM's sha256 (pickle) and xxhash digests depend on its own pickling: not reproduced.
    if value not in HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo={value!r} is not supported, only "
            f"{' and '.join(HASH_ALGOS)} are"
        )
    return {"prefix_caching_hash_algo": value}


def convert_swap_space(value: Any, spelling: Spelling) -> dict:
    return {"swap_space_bytes": int(float(value) * GIB)}  # GiB in vLLM


SPECULATIVE_KEYS = {  # speculative_config key -> EngineConfig setting
    "model": "speculative_model",
    "num_speculative_tokens": "num_speculative_tokens",
    "prompt_lookup_max": "ngram_prompt_lookup_max",
    "prompt_lookup_min": "ngram_prompt_lookup_min",
    "disable_by_batch_size": "speculative_disable_by_batch_size",
}


def convert_speculative_config(value: Any, spelling: Spelling) -> dict:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be an object")
    known = {"method", *SPECULATIVE_KEYS}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(
            f"speculative_config: unsupported keys {unknown} (supported: {sorted(known)})"
        )
    method = value.get("method") or ("draft" if value.get("model") else None)
    if method in ("ngram", "[ngram]"):
        method = "ngram"
    elif method in ("draft_model", "draft"):
        method = "draft"
    else:
        raise ValueError(
            f"speculative_config: method must be 'ngram' or a draft 'model', got "
            f"{value.get('method')!r}"
        )
    out = {"speculative_method": method}
    out.update({SPECULATIVE_KEYS[k]: v for k, v in value.items() if k in SPECULATIVE_KEYS})
    return out


def shown_speculative_config(config: EngineConfig) -> Optional[str]:
    if config.speculative_method is None:
        return None
    shown = {"method": config.speculative_method}
    shown.update({k: getattr(config, s) for k, s in SPECULATIVE_KEYS.items() if k != "model"})
    if config.speculative_model:
        shown["model"] = config.speculative_model
    return json.dumps(shown)


def convert_adapters(value: Any, spelling: Spelling) -> dict:
    """LoRA adapters (name -> PEFT directory): a JSON object or its text."""
    adapters = json.loads(value) if isinstance(value, str) and value.strip() else value
    return {"lora_modules": adapters or {}}
