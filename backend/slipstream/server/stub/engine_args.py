"""``1/model.json`` of a Triton vLLM-backend model: vLLM's engine arguments as Slipstream settings.

Triton's vLLM backend feeds ``model.json`` to vLLM's ``AsyncEngineArgs``; an unknown key fails
the load there, and so it does here. Every key is one of:

* mapped onto an ``EngineConfig`` setting (``max_num_seqs`` ...), possibly converted
  (``enforce_eager`` -> ``enable_cuda_graphs``, ``swap_space`` GiB -> bytes ...);
* a server option (``disable_log_stats`` turns the custom metrics off, ``max_logprobs``);
* accepted only at the value that means "nothing to do" here (``tensor_parallel_size: 1``,
  ``quantization: null`` ...): any other value is refused, since this
  engine could not honour it;
* without effect on serving and accepted as such (``served_model_name``, log switches).

Pure Python: the tests and ``slipstream serve`` check a repository without starting Triton.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Optional

from slipstream.core.block_hash import HASH_ALGOS
from slipstream.core.boolean_text import JSON_FLAG, parse_bool

MODEL_JSON = "model.json"
log = logging.getLogger("slipstream")
# Keys vLLM once accepted and has since removed; old model.json files (vllm_backend's own
# multi-LoRA CI model among them) still carry them. Accepted with a warning: no effect here.
REMOVED_IN_VLLM = {
    "lora_extra_vocab_size": "LoRA adapters here never add vocabulary (vLLM dropped the "
    "argument as well)",
}


@dataclass
class EngineArgs:
    """What one model.json asks of Slipstream."""

    engine: dict = field(default_factory=dict)  # EngineConfig settings (name -> value)
    disable_log_stats: bool = False
    max_logprobs: Optional[int] = None
    kv_events_config: Any = None  # vLLM's KVEventsConfig fields (a JSON object or its text)


def _same(name: str) -> Callable[[Any], dict]:
    return lambda value: {name: value}


def _dtype(value: Any) -> dict:
    names = {
        "auto": "auto",
        "float32": "float32",
        "float": "float32",
        "float16": "float16",
        "half": "float16",
        "bfloat16": "bfloat16",
    }
    if str(value) not in names:
        raise ValueError(f"dtype must be one of {sorted(names)}, got {value!r}")
    return {"dtype": names[str(value)]}


SHIPPED_SCHEMES = ("gguf", "awq", "gptq")  # 4-bit checkpoints served as they ship (CPU)


def _quantization(value: Any) -> dict:
    """vLLM's ``quantization`` names a checkpoint's scheme: ``gguf``, ``awq`` and ``gptq``
    (4 bits) are served as they ship; ``int8`` (weights and activations in blocks of 32,
    made at load) is Slipstream's own; null / "" none."""
    if value in (None, "", "none"):
        return {"quantization": None}
    if value != "int8" and value not in SHIPPED_SCHEMES:
        raise ValueError(
            f"quantization={value!r} is not supported (weights load unquantized, with "
            f"'int8' quantized at load, or a 4-bit checkpoint as it ships: "
            f"{', '.join(SHIPPED_SCHEMES)}; CPU)"
        )
    return {"quantization": str(value)}


def _kv_cache_dtype(value: Any) -> dict:
    names = {"auto": "auto", "float32": "float32", "bfloat16": "bfloat16"}
    if str(value) not in names:
        raise ValueError(
            f"kv_cache_dtype={value!r} is not supported (the KV cache uses the "
            f"model's dtype, or one of {sorted(names)})"
        )
    return {"kv_cache_dtype": names[str(value)]}


def _flag(value: Any, name: str) -> bool:
    parsed = parse_bool(str(value), JSON_FLAG)
    if parsed is None:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return parsed


def _scheduling_policy(value: Any) -> dict:
    policies = {"fcfs": "fifo", "priority": "priority"}
    if value not in policies:
        raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {value!r}")
    return {"policy": policies[value]}


def _hash_algo(value: Any) -> dict:
    # vLLM's sha256 (pickle) and xxhash digests depend on its own pickling: not reproduced.
    if value not in HASH_ALGOS:
        raise ValueError(
            f"prefix_caching_hash_algo={value!r} is not supported, only "
            f"{' and '.join(HASH_ALGOS)} are"
        )
    return {"prefix_caching_hash_algo": value}


def _speculative_config(value: Any) -> dict:
    if isinstance(value, str):
        value = json.loads(value)
    if not isinstance(value, dict):
        raise ValueError("speculative_config must be an object")
    known = {
        "method",
        "model",
        "num_speculative_tokens",
        "prompt_lookup_max",
        "prompt_lookup_min",
        "disable_by_batch_size",
    }
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
    renames = {
        "model": "speculative_model",
        "num_speculative_tokens": "num_speculative_tokens",
        "prompt_lookup_max": "ngram_prompt_lookup_max",
        "prompt_lookup_min": "ngram_prompt_lookup_min",
        "disable_by_batch_size": "speculative_disable_by_batch_size",
    }
    out.update({renames[k]: v for k, v in value.items() if k in renames})
    return out


# model.json key -> converter returning EngineConfig settings
MAPPED: dict = {
    "model": _same("model"),
    "tokenizer": _same("tokenizer"),
    "dtype": _dtype,
    "quantization": _quantization,
    "kv_cache_dtype": _kv_cache_dtype,
    "seed": _same("seed"),
    "device": _same("device"),
    "block_size": _same("block_size"),
    "max_model_len": _same("max_model_len"),
    "max_num_seqs": _same("max_num_seqs"),
    "max_num_batched_tokens": _same("max_num_batched_tokens"),
    "prefix_caching_hash_algo": _hash_algo,
    "enable_prefix_caching": lambda v: {"enable_prefix_caching": _flag(v, "enable_prefix_caching")},
    "enable_chunked_prefill": lambda v: {
        "enable_chunked_prefill": _flag(v, "enable_chunked_prefill")
    },
    "enforce_eager": lambda v: {"enable_cuda_graphs": not _flag(v, "enforce_eager")},
    "gpu_memory_utilization": _same("gpu_memory_utilization"),
    "kv_cache_memory_bytes": _same("kv_cache_memory_bytes"),
    "num_gpu_blocks_override": _same("num_gpu_blocks_override"),
    "swap_space": lambda v: {"swap_space_bytes": int(float(v) * 2**30)},  # GiB in vLLM
    "preemption_mode": _same("preemption_mode"),
    "scheduling_policy": _scheduling_policy,
    "speculative_config": _speculative_config,
    # the adapters themselves come from 1/multi_lora.json (server/stub/multi_lora.py)
    "enable_lora": lambda v: {"enable_lora": _flag(v, "enable_lora")},
    "max_loras": _same("max_loras"),
    "max_lora_rank": _same("max_lora_rank"),
}
# Accepted only at these values: anything else asks for something this engine cannot do.
FIXED: dict = {
    "tensor_parallel_size": 1,
    "pipeline_parallel_size": 1,
    "data_parallel_size": 1,
    "trust_remote_code": False,
    "tokenizer_mode": "auto",
    "load_format": "auto",
    "skip_tokenizer_init": False,
    "enable_expert_parallel": False,
}
WHY_FIXED = {
    "tensor_parallel_size": "one device per model",
    "pipeline_parallel_size": "one device per model",
    "data_parallel_size": "one engine per model instance",
    "trust_remote_code": "only architectures built into transformers load",
    "tokenizer_mode": "the model's Hugging Face tokenizer is used",
    "load_format": "weights load with transformers' from_pretrained",
    "skip_tokenizer_init": "requests are text and need the tokenizer",
    "enable_expert_parallel": "one device per model",
}
# No effect on what a Triton model serves: accepted (listed in the README).
NO_EFFECT = {
    "served_model_name",
    "disable_log_requests",
    "enable_log_requests",
    "distributed_executor_backend",
    "disable_custom_all_reduce",
    "max_seq_len_to_capture",
    "max_cpu_loras",
}
SERVER_OPTIONS = {"disable_log_stats", "max_logprobs", "kv_events_config"}


def read_model_json(version_dir: Path) -> Optional[dict]:
    """The engine arguments of ``<version_dir>/model.json``, or None if there is none."""
    path = Path(version_dir) / MODEL_JSON
    if not path.is_file():
        return None
    try:
        args = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(args, dict):
        raise ValueError(f"{path}: must hold a JSON object of vLLM engine arguments")
    return args


def translate(args: Mapping[str, Any]) -> EngineArgs:
    """vLLM engine arguments -> ``EngineArgs``; ``ValueError`` names every key it refuses."""
    result = EngineArgs()
    problems = []
    for key, value in args.items():
        try:
            _apply(result, key, value)
        except (TypeError, ValueError) as e:
            problems.append(str(e))
    if problems:
        raise ValueError("model.json: " + "; ".join(problems))
    return result


def _apply(result: EngineArgs, key: str, value: Any) -> None:
    if key in MAPPED:
        if value is not None:
            result.engine.update(MAPPED[key](value))
    elif key in FIXED:
        if not _equal(value, FIXED[key]):
            raise ValueError(
                f"{key}={value!r} is not supported ({WHY_FIXED[key]}), only "
                f"{json.dumps(FIXED[key])} is"
            )
    elif key == "disable_log_stats":
        result.disable_log_stats = _flag(value, key)
    elif key == "max_logprobs":
        result.max_logprobs = int(value)
    elif key in REMOVED_IN_VLLM:
        log.warning(
            "model.json: %s=%r is accepted and has no effect: %s", key, value, REMOVED_IN_VLLM[key]
        )
    elif key == "kv_events_config":
        result.kv_events_config = value
    elif key not in NO_EFFECT:
        supported = sorted(set(MAPPED) | set(FIXED) | NO_EFFECT | SERVER_OPTIONS)
        raise ValueError(
            f"unknown or unsupported engine argument {key!r} (supported: {', '.join(supported)})"
        )


def _equal(value: Any, fixed: Any) -> bool:
    if fixed is None:
        return value in (None, "", "none", "None")
    if isinstance(fixed, bool):
        return str(value).strip().lower() == str(fixed).lower()
    if isinstance(fixed, int):
        try:
            return int(value) == fixed
        except (TypeError, ValueError):
            return False
    return str(value) == str(fixed)


def resolve_model(name: str, search_dirs: list) -> str:
    """Where a ``model`` / ``tokenizer`` value points: ``default``; an absolute directory; a
    directory relative to one of ``search_dirs`` (the model's directory, its version
    directory, the working directory, which is what vLLM resolves against); or a Hugging Face
    id already in the local cache. Nothing is downloaded: anything else is a load error
    naming what was tried."""
    if name in ("", "default"):
        return name
    path = Path(name).expanduser()
    candidates = [path] if path.is_absolute() else [Path(d) / path for d in search_dirs]
    for candidate in candidates:
        if candidate.is_dir():
            return str(candidate.resolve())
    cached = _hub_cache(name)
    if cached is not None:
        return cached
    tried = ", ".join(str(c) for c in candidates)
    raise ValueError(
        f"model {name!r} not found: not a directory ({tried}) nor a Hugging Face "
        "model in the local cache; this backend does not download models"
    )


def _hub_cache(repo_id: str) -> Optional[str]:
    if repo_id.count("/") != 1:
        return None
    try:
        from huggingface_hub import snapshot_download

        return snapshot_download(repo_id, local_files_only=True)
    except Exception:  # not cached, not a valid id, or no huggingface_hub
        return None
