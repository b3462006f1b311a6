"""Finding and loading a model and its tokenizer: the embedded default (``gguf``) or any local
Hugging Face directory."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from slipstream.worker.model import llama
from slipstream.worker.model.gguf import default_model_dir


def resolve_model_path(model: str) -> Path:
    if model in ("default", "", None):
        return default_model_dir()
    path = Path(model).expanduser()
    if not path.is_dir():
        raise ValueError(
            f"model must be 'default' or a local Hugging Face model directory: {model!r}"
        )
    return path


def load_model(
    path: Path, dtype: torch.dtype, device: torch.device, lean: bool = False
) -> torch.nn.Module:
    """The checkpoint at ``path``; ``lean``: a CPU model the lean forward will run, built
    without transformers' model code where ``llama`` covers it (~150 MB less
    resident)."""
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
