"""A Triton model repository as ``slipstream serve`` prepares it: rendered (copied with config
parameters replaced, so engine settings change at launch without editing ``config.pbtxt``),
and its Slipstream models found and checked before Triton starts.

A model is Slipstream's when its config.pbtxt names the ``slipstream`` backend (or one of its
aliases, e.g. ``vllm`` when ``slipstream serve --vllm-alias`` installs it under that name), or
when it is a ``python`` model whose ``1/model.py`` re-exports the Slipstream adapter (the
layout of ``model_repository/slipstream``). Other models (ensembles, plain Python models) are
Triton's business and are left alone.
"""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Optional, Sequence

from slipstream.server.launch.config_pbtxt import parse, read_parameters, set_name, set_parameters
from slipstream.server.launch.triton_install import BACKEND_NAME, REPO_ROOT
from slipstream.server.stub.engine_args import aliases_in
from slipstream.server.stub.model_config import ModelSettings, load_settings

DEFAULT_MODEL_REPOSITORY = REPO_ROOT / "model_repository"
DEFAULT_MODEL_NAME = "slipstream"
LINK_FROM_BYTES = 1 << 20  # files this large or larger are linked, not copied
# The adapter's module, and where it lived before the server's rooms (older model.py files).
_ADAPTERS = ("slipstream.server.stub.triton_model", "slipstream.server.triton_model")


@dataclass
class RepositoryModel:
    name: str
    backend: str
    directory: Path


def find_models(repo: Path, aliases: Sequence[str] = ()) -> list:
    """The repository's Slipstream models, by name."""
    names = {BACKEND_NAME, *aliases}
    found = []
    for config in sorted(Path(repo).glob("*/config.pbtxt")):
        backend = parse(config.read_text(), str(config)).backend
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


# --------------------------------------------------------------------------- rendering
def render_model_repository(
    src,
    dst,
    overrides: Optional[Mapping[str, object]] = None,
    models: Optional[Sequence[str]] = None,
) -> Path:
    """Mirror model repository ``src`` at ``dst`` with config ``parameters`` replaced.

    Files below ``LINK_FROM_BYTES`` (configs, ``model.py``, ``model.json``) are copied, so a
    rendering is a private copy its caller may edit (tests write their own ``model.py``);
    larger files are symbolic links to their source, so weights in the repository cost no
    space where it is rendered (a container's /tmp is small). ``overrides`` apply to every
    model of the repository (or only to ``models``). A ``model`` override that names an existing
    directory is made absolute.
    """
    src, dst = Path(src).resolve(), Path(dst)
    if not src.is_dir():
        raise FileNotFoundError(f"model repository {src} does not exist")
    overrides = dict(overrides or {})
    model = overrides.get("model")
    if (
        isinstance(model, (str, Path))
        and str(model) not in ("", "default")
        and Path(model).is_dir()
    ):
        overrides["model"] = str(Path(model).resolve())
    if dst.exists():
        shutil.rmtree(dst)
    _mirror(src, dst)
    for config in sorted(dst.glob("*/config.pbtxt")):
        if models is not None and config.parent.name not in models:
            continue
        if overrides:
            text = override_parameters(config.read_text(), overrides, src / config.parent.name)
            config.write_text(text)
    return dst


def _mirror(src: Path, dst: Path) -> None:
    """Directories recreated, small files copied, large ones linked."""
    for here, dirs, files in os.walk(src, followlinks=True):
        dirs[:] = [d for d in dirs if d != "__pycache__"]
        rel = Path(here).relative_to(src)
        (dst / rel).mkdir(parents=True, exist_ok=True)
        for name in files:
            if name.endswith(".pyc"):
                continue
            source = Path(here) / name
            if source.stat().st_size < LINK_FROM_BYTES:
                shutil.copyfile(source, dst / rel / name)
            else:
                (dst / rel / name).symlink_to(source.resolve())


def override_parameters(text: str, overrides: Mapping[str, object], source: Path) -> str:
    """A config.pbtxt with ``overrides`` set. A setting overridden under one of its names (vLLM's
    ``enforce_eager``, Slipstream's ``enable_cuda_graphs``) replaces the config's parameter under
    the other, so that the two never contradict each other."""
    present = read_parameters(text)
    replaced = sorted({alias for key in overrides for alias in aliases_in(present, key)})
    replaced = [name for name in replaced if name not in overrides]
    header = f"Rendered from {source / 'config.pbtxt'}; parameters set: {', '.join(overrides)}"
    if replaced:
        header += f"; replaced: {', '.join(replaced)}"
    return set_parameters(text, overrides, header=header, remove=replaced)


def rename_model(repo: Path, old: str, new: str) -> None:
    """Rename model ``old`` of a (rendered) repository to ``new``: its directory and the name
    its config.pbtxt gives."""
    if not new or "/" in new or new.startswith(".") or (Path(repo) / new).exists():
        raise ValueError(f"{new!r} cannot name a model directory of {repo}")
    target = Path(repo) / new
    (Path(repo) / old).rename(target)
    config = target / "config.pbtxt"
    config.write_text(set_name(config.read_text(), new))
