"""``1/multi_lora.json``: the LoRA adapters of a Triton vLLM-backend model (name -> PEFT
directory), read when model.json says ``enable_lora: true``, as vllm_backend reads it.

A relative path is looked up against the model's directory, its version directory and the
working directory (vllm_backend hands it to vLLM, which resolves it against the working
directory); adapters are never downloaded. Pure Python.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

MULTI_LORA_JSON = "multi_lora.json"


def read_multi_lora(version_dir: Path, search_dirs: Sequence[Path]) -> dict[str, str]:
    """name -> absolute adapter directory; ``ValueError`` names what is missing or malformed."""
    path = Path(version_dir) / MULTI_LORA_JSON
    if not path.is_file():
        raise ValueError(f"enable_lora is true but the backend cannot find {path}.")
    try:
        adapters = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not valid JSON: {e}") from None
    if not isinstance(adapters, dict) or not all(
        isinstance(k, str) and k and isinstance(v, str) and v for k, v in adapters.items()
    ):
        raise ValueError(f"{path}: must map LoRA names to adapter directories")
    return {name: _resolve(name, where, search_dirs, path) for name, where in adapters.items()}


def _resolve(name: str, where: str, search_dirs: Sequence[Path], source: Path) -> str:
    given = Path(where).expanduser()
    candidates = [given] if given.is_absolute() else [Path(d) / given for d in search_dirs]
    for candidate in candidates:
        if candidate.is_dir():
            return str(candidate.resolve())
    tried = ", ".join(str(c) for c in candidates)
    raise ValueError(f"{source}: LoRA {name!r} not found: no directory {tried}")
