"""Finding and loading a model and its tokenizer: the embedded default (``gguf``), any local
Hugging Face directory, or, served as they ship on CPU, a GGUF file (``gguf_checkpoint``) or an
AWQ / GPTQ directory (``int4_checkpoint``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from slipstream.worker.model import gguf_checkpoint, int4_checkpoint, llama
from slipstream.worker.model.gguf import default_gguf_path, default_model_dir

# quantization values whose checkpoints are served as they ship (4-bit blocks, CPU)
SHIPPED_QUANTIZATIONS = ("gguf", "awq", "gptq")


def resolve_model_path(model: str, quantization: Optional[str] = None) -> Path:
    """The checkpoint to load: a directory, or with ``quantization=gguf`` a GGUF file (the
    embedded model's own, for ``default``)."""
    default = model in ("default", "", None)
    if quantization == "gguf":
        return default_gguf_path() if default else _gguf_file(Path(model).expanduser())
    if default:
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model must be 'default' or a local Hugging Face model directory: {model!r}"
        )
    return path


def _gguf_file(path: Path) -> Path:
    """``path`` itself, or the one GGUF file in the directory ``path``."""
    if gguf_checkpoint.is_gguf(path):
        return path
    found = sorted(path.glob("*" + gguf_checkpoint.SUFFIX)) if path.is_dir() else []
    if len(found) != 1:
        raise ValueError(
            f"quantization=gguf needs model to be 'default', a .gguf file or a directory "
            f"holding exactly one: {str(path)!r}"
        )
    return found[0]


def checkpoint_quantization(model: str) -> Optional[str]:
    """The scheme a checkpoint ships its weights in, where it is one served as it ships
    (vLLM reads ``quantization`` from the checkpoint when it is not set): ``gguf`` for a
    GGUF file, ``awq`` / ``gptq`` from ``config.json``'s ``quantization_config``."""
    if model in ("default", "", None):
        return None
    path = Path(model).expanduser()
    if gguf_checkpoint.is_gguf(path):
        return "gguf"
    return int4_checkpoint.scheme(path) if path.is_dir() else None


def load_model(
    path: Path,
    dtype: torch.dtype,
    device: torch.device,
    lean: bool = False,
    quantization: Optional[str] = None,
) -> torch.nn.Module:
    """The checkpoint at ``path``; ``lean``: a CPU model the lean forward will run, built
    without transformers' model code where ``llama`` covers it (~150 MB less
    resident). ``quantization`` gguf / awq / gptq: its 4-bit blocks as they ship (CPU)."""
    if quantization in SHIPPED_QUANTIZATIONS:
        if device.type != "cpu":
            raise ValueError(f"quantization={quantization} is CPU only")
        if quantization == "gguf":
            return gguf_checkpoint.load(path)
        return int4_checkpoint.load(path, quantization)
    if lean and device.type == "cpu":
        shape = llama.read_shape(path)
        if shape is not None:
            return llama.load(path, shape, dtype)
    from transformers import AutoModelForCausalLM

    model: torch.nn.Module = AutoModelForCausalLM.from_pretrained(str(path), dtype=dtype)
    return model.to(device).eval()


# tokenizer_config.json classes that are the tokenizers library's file and nothing more
PLAIN_TOKENIZER_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")


def load_tokenizer(path: Optional[Path], tokenizer: Optional[str] = None):
    """``AutoTokenizer``'s tokenizer. Where the tokenizer's own config names the plain fast
    class, that class is built directly: the one AutoTokenizer resolves to, without the
    model config it loads first (transformers' config classes cost ~60 MB resident)."""
    if tokenizer is None and path is not None and gguf_checkpoint.is_gguf(path):
        path = gguf_checkpoint.tokenizer_dir(path)
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
