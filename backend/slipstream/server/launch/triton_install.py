"""Where ``tritonserver`` and its backends are, and the environment it runs in.

Two installations are supported:

* a Triton container (``tritonserver`` on ``PATH``, backends in ``/opt/tritonserver/backends``):
  the binary is used as it is;
* the ``nvidia-pytriton`` wheel, which ships ``tritonserver``, the Python backend and a backend
  stub for each Python version. The backend directory Triton wants (``python/`` holding
  ``libtriton_python.so``, ``triton_python_backend_utils.py`` and the stub built for the running
  Python) is assembled once in a cache directory, and the process gets the wheel's shared
  libraries and this interpreter's ``libpython`` on ``LD_LIBRARY_PATH`` and this environment's
  ``bin/`` first on ``PATH`` (so the stub's embedded Python sees the same site-packages).

Either way the backend directory holds the Python-based backend ``slipstream/model.py``
(``triton_backends/slipstream`` of this repository), so ``backend: "slipstream"`` models load; a
container that lacks it gets a cache directory linking its own backends plus this one. Aliases
(``vllm``) install the same backend under another name, for repositories written for Triton's
vLLM backend and for tools that look at a model's backend name.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import sysconfig
import tempfile
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Optional, Sequence

from slipstream.cache_dir import cache_root

REPO_ROOT = Path(__file__).resolve().parents[4]
BACKEND_NAME = "slipstream"
BACKEND_SOURCE = REPO_ROOT / "triton_backends" / BACKEND_NAME / "model.py"
# What triton_backends/slipstream/model.py says, for installs without the repository's files.
BACKEND_MODEL_PY = "from slipstream.server.triton_model import TritonPythonModel  # noqa: F401\n"


class TritonServerError(RuntimeError):
    """tritonserver could not be found, did not start, or did not become ready."""


@dataclass
class TritonInstall:
    binary: Path
    backend_dir: Optional[Path]  # None: the binary's built-in default (a Triton container)
    lib_dirs: list = field(default_factory=list)
    source: str = "path"  # "path" (container / system install) or "pytriton" (the wheel)


def _python_tag() -> str:
    return f"{sys.version_info.major}.{sys.version_info.minor}"


def _pytriton_root() -> Optional[Path]:
    import importlib.util

    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        return None
    root = Path(list(spec.submodule_search_locations)[0]) / "tritonserver"
    return root if (root / "bin" / "tritonserver").exists() else None


def find_tritonserver(prefer: str = "auto", backend_aliases: Sequence[str] = ()) -> TritonInstall:
    """``prefer``: ``auto`` (PATH first, then the nvidia-pytriton wheel), ``path`` or ``pytriton``.

    ``SLIPSTREAM_TRITONSERVER=/path/to/tritonserver`` forces a binary (a container layout is
    assumed: its backends next to it in ``../backends``). ``backend_aliases``: other names the
    slipstream backend is installed under (``vllm``).
    """
    forced = os.environ.get("SLIPSTREAM_TRITONSERVER")
    found = forced or (shutil.which("tritonserver") if prefer in ("auto", "path") else None)
    if forced and not Path(forced).exists():
        raise TritonServerError(f"SLIPSTREAM_TRITONSERVER={forced} does not exist")
    if found:
        backends = Path(found).resolve().parent.parent / "backends"
        return TritonInstall(
            Path(found),
            overlay_backend_dir(backends if backends.is_dir() else None, backend_aliases),
            [],
            "path",
        )
    if prefer in ("auto", "path"):
        if prefer == "path":
            raise TritonServerError("tritonserver is not on PATH")
    root = _pytriton_root()
    if root is None:
        raise TritonServerError(
            "tritonserver not found: run inside a Triton container (tritonserver on PATH) or "
            "install the nvidia-pytriton wheel (pip install -e '.[server]')"
        )
    libs = root.parent.parent / "nvidia_pytriton.libs"
    libdir = sysconfig.get_config_var("LIBDIR")
    lib_dirs = [str(p) for p in (libs, libdir) if p and Path(p).is_dir()]
    return TritonInstall(
        root / "bin" / "tritonserver",
        prepare_backend_dir(root, backend_aliases),
        lib_dirs,
        "pytriton",
    )


def backend_model_py() -> str:
    """The slipstream backend's ``model.py``: the repository's, else its one line."""
    return BACKEND_SOURCE.read_text() if BACKEND_SOURCE.is_file() else BACKEND_MODEL_PY


def prepare_backend_dir(pytriton_root: Path, aliases: Sequence[str] = ()) -> Path:
    """Assemble ``<cache>/triton_backends/<key>/`` for the running Python (once): ``python/``
    from the wheel, ``slipstream/model.py`` and one copy per alias."""
    stub = pytriton_root / "python_backend_stubs" / _python_tag() / "triton_python_backend_stub"
    if not stub.exists():
        raise TritonServerError(
            f"nvidia-pytriton ships no Python backend stub for Python "
            f"{_python_tag()} (looked for {stub})"
        )
    src = pytriton_root / "backends" / "python"
    files = {
        "libtriton_python.so": src / "libtriton_python.so",
        "triton_python_backend_utils.py": src / "triton_python_backend_utils.py",
        "triton_python_backend_stub": stub,
    }
    model_py = backend_model_py()
    names = [BACKEND_NAME, *sorted(set(aliases) - {BACKEND_NAME})]
    stamp = json.dumps(
        {
            "files": {
                n: [str(p), p.stat().st_size, int(p.stat().st_mtime)]
                for n, p in sorted(files.items())
            },
            "backends": names,
            "model.py": model_py,
        },
        sort_keys=True,
    )
    key = f"py{_python_tag()}-{uuid.uuid5(uuid.NAMESPACE_URL, stamp).hex[:12]}"

    def fill(tmp: Path) -> None:
        (tmp / "python").mkdir()
        for name, path in files.items():
            shutil.copy2(path, tmp / "python" / name)
        os.chmod(tmp / "python" / "triton_python_backend_stub", 0o755)
        for name in names:
            (tmp / name).mkdir(exist_ok=True)
            (tmp / name / "model.py").write_text(model_py)

    return _cached_dir(key, stamp, fill)


def overlay_backend_dir(backends: Optional[Path], aliases: Sequence[str] = ()) -> Optional[Path]:
    """A container's backend directory as it is when it already holds ``slipstream`` (and no
    alias is asked for); otherwise a cache directory linking its backends, plus ours."""
    names = [BACKEND_NAME, *sorted(set(aliases) - {BACKEND_NAME})]
    if backends is None:  # no backends next to the binary: it knows where its own are
        return None
    if (backends / BACKEND_NAME).is_dir() and names == [BACKEND_NAME]:
        return backends
    model_py = backend_model_py()
    entries = sorted(p.name for p in backends.iterdir())
    stamp = json.dumps(
        {"source": str(backends), "entries": entries, "backends": names, "model.py": model_py},
        sort_keys=True,
    )
    key = f"overlay-{uuid.uuid5(uuid.NAMESPACE_URL, stamp).hex[:12]}"

    def fill(tmp: Path) -> None:
        for entry in entries:
            if entry not in names:
                os.symlink(backends / entry, tmp / entry)
        for name in names:
            (tmp / name).mkdir()
            (tmp / name / "model.py").write_text(model_py)

    return _cached_dir(key, stamp, fill)


def _cached_dir(key: str, stamp: str, fill) -> Path:
    """``<cache>/triton_backends/<key>``, built once by ``fill(tmp)`` and renamed into place."""
    target = cache_root() / "triton_backends" / key
    if (target / ".complete").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=key + ".tmp", dir=target.parent))
    fill(tmp)
    (tmp / ".complete").write_text(stamp)
    try:
        os.rename(tmp, target)
    except OSError:  # another process won the race
        shutil.rmtree(tmp, ignore_errors=True)
        if not (target / ".complete").exists():
            raise
    return target


def server_env(install: TritonInstall, base: Optional[Mapping[str, str]] = None) -> dict:
    env = dict(os.environ if base is None else base)
    if install.lib_dirs:
        old = env.get("LD_LIBRARY_PATH", "")
        env["LD_LIBRARY_PATH"] = os.pathsep.join(install.lib_dirs + ([old] if old else []))
    # This interpreter's bin/ first: the stub's embedded Python then resolves this environment.
    bindir = os.path.dirname(sys.executable)
    env["PATH"] = os.pathsep.join(
        [bindir] + [p for p in env.get("PATH", "").split(os.pathsep) if p and p != bindir]
    )
    if sys.prefix != sys.base_prefix:
        env.setdefault("VIRTUAL_ENV", sys.prefix)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def gpu_present(dev: Path = Path("/dev")) -> bool:
    """An NVIDIA GPU is visible (the device plugin and ``docker --gpus`` mount /dev/nvidiaN)."""
    return any(dev.glob("nvidia[0-9]*"))
