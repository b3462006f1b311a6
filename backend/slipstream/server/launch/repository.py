"""The Slipstream models of a Triton model repository, found and checked before Triton starts.

A model is Slipstream's when its config.pbtxt names the ``slipstream`` backend (or one of its
aliases, e.g. ``vllm`` when ``slipstream serve --vllm-alias`` installs it under that name), or
when it is a ``python`` model whose ``1/model.py`` re-exports the Slipstream adapter (the
layout of ``model_repository/slipstream``). Other models (ensembles, plain Python models) are
Triton's business and are left alone.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from slipstream.server.launch.launcher import BACKEND_NAME, read_parameters
from slipstream.server.stub.model_config import ModelSettings, load_settings

_BACKEND_RE = re.compile(r'^\s*backend\s*:\s*"([^"]+)"', re.M)
# The adapter's module, and where it lived before the server's rooms (older model.py files).
_ADAPTERS = ("slipstream.server.stub.triton_model", "slipstream.server.triton_model")


@dataclass
class RepositoryModel:
    name: str
    backend: str
    directory: Path


def backend_of(config_pbtxt: str) -> str:
    match = _BACKEND_RE.search(config_pbtxt)
    return match.group(1) if match else ""


def find_models(repo: Path, aliases: Sequence[str] = ()) -> list:
    """The repository's Slipstream models, by name."""
    names = {BACKEND_NAME, *aliases}
    found = []
    for config in sorted(Path(repo).glob("*/config.pbtxt")):
        backend = backend_of(config.read_text())
        directory = config.parent
        ours = backend in names or (
            backend == "python"
            and any(
                adapter in p.read_text()
                for p in directory.glob("*/model.py")
                for adapter in _ADAPTERS
            )
        )
        if ours:
            found.append(RepositoryModel(directory.name, backend, directory))
    return found


def check_models(models: Sequence[RepositoryModel]) -> dict:
    """name -> ``ModelSettings`` (engine settings validated); ``ValueError`` names the model."""
    from slipstream import EngineConfig

    checked = {}
    for m in models:
        try:
            settings: ModelSettings = load_settings(
                read_parameters((m.directory / "config.pbtxt").read_text()), m.backend, m.directory
            )
            EngineConfig.from_dict(settings.engine)
        except ValueError as e:
            raise ValueError(f"model {m.name!r}: {e}") from None
        checked[m.name] = settings
    return checked
