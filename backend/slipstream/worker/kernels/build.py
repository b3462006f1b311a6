"""The compiled CPU kernels (``csrc/``): built with ``torch.utils.cpp_extension`` and loaded
into ``torch.ops.slipstream_cpu``.

Each source is compiled with the flags of its class (``SOURCE_CLASSES``, the one table of
per-file flags); a class is one shared library, built by cpp_extension's ninja build (sources
in parallel), under its file lock (two processes starting at once build once), into
``<cache>/kernels/<key>/<class>/``. The key covers the sources, torch, the compiler, the
flags and the CPU's flags (``-march=native``), so a cache on a volume shared by different
machines or images never hands one the other's build. A library already built is loaded
directly, without ninja or a compiler: an image built with ``slipstream build-kernels``
(``docker build``) or a cache kept on a volume starts without compiling.

``load()`` returns False, with the reason logged once, where building fails (no compiler,
no headers): the engine then runs the torch path. ``SLIPSTREAM_CPU_KERNELS=0`` turns the
kernels off.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
import shutil
import threading
from pathlib import Path
from typing import Optional

import torch

from slipstream.cache_dir import cache_root
from slipstream.startup_log import Phase, phase
from slipstream.worker.kernels.cpu_features import cpu_flags

log = logging.getLogger("slipstream")

ENV_VAR = "SLIPSTREAM_CPU_KERNELS"
CSRC = Path(__file__).with_name("csrc")


class FlagClass(str, enum.Enum):
    """How a source's floating point may be compiled."""

    # -ffast-math (reassociation lets the dot products and exp vectorize)
    FAST = "fast"
    # Rounds exactly as torch's separate operators do: no reassociation and no fused
    # multiply-add (a product and a sum each round once, as torch's mul and add do).
    EXACT = "exact"
    # Results that must not depend on how the compiler regroups a sum (a prompt row's
    # attention must not depend on the tile around it; NaN checks must survive: the
    # sampler's NaN guard reads logit_stats' log-sum-exp, and silu_mul keeps a NaN a NaN when
    # it rounds to bf16): no reassociation, multiply-adds fused.
    ORDERED = "ordered"


# Every source and its class: the one table of per-file flags.
SOURCE_CLASSES: dict[str, FlagClass] = {
    "cpu_paged_attention.cpp": FlagClass.FAST,
    "cpu_prefill_attention.cpp": FlagClass.ORDERED,
    "cpu_small_gemm.cpp": FlagClass.FAST,
    "cpu_weight_gemm.cpp": FlagClass.FAST,
    "cpu_q8_gemm.cpp": FlagClass.FAST,
    "cpu_q4_gemm.cpp": FlagClass.FAST,
    "cpu_bf16_gemm.cpp": FlagClass.FAST,
    "cpu_rms_norm.cpp": FlagClass.FAST,
    "cpu_rotary.cpp": FlagClass.EXACT,
    "cpu_packed_rows.cpp": FlagClass.EXACT,
    "cpu_sampling.cpp": FlagClass.FAST,
    "cpu_silu_mul.cpp": FlagClass.ORDERED,
    "cpu_logit_stats.cpp": FlagClass.ORDERED,
    "cpu_decode_stack.cpp": FlagClass.FAST,
    "cpu_machine_probe.cpp": FlagClass.FAST,
}
CLASS_FLAGS: dict[FlagClass, tuple[str, ...]] = {
    FlagClass.FAST: ("-ffast-math",),
    FlagClass.EXACT: ("-fno-fast-math", "-ffp-contract=off"),
    FlagClass.ORDERED: ("-fno-fast-math", "-ffp-contract=fast"),
}
# Every class: cpp_extension adds -fPIC, -std=c++17 and torch's ABI flag. No -fopenmp at the
# link: the OpenMP calls resolve to the runtime torch already loaded (a second runtime would
# bring a second thread pool).
COMMON_FLAGS = ("-O3", "-march=native", "-fopenmp", "-DNDEBUG", "-w")
LIBRARY = "slipstream_cpu"

_lock = threading.Lock()
_loaded: Optional[bool] = None
_error: Optional[str] = None


def sources(flag_class: FlagClass) -> list[Path]:
    return [CSRC / name for name, c in SOURCE_CLASSES.items() if c is flag_class]


def headers() -> list[Path]:
    return sorted(CSRC.glob("*.h"))


def compile_flags(flag_class: FlagClass) -> list[str]:
    return [*COMMON_FLAGS, *CLASS_FLAGS[flag_class]]


def compiler() -> Optional[str]:
    return os.environ.get("CXX") or shutil.which("g++") or shutil.which("c++")


def build_key(cxx: str) -> str:
    h = hashlib.sha256()
    for path in sorted(CSRC.iterdir()):
        h.update(path.name.encode())
        h.update(path.read_bytes())
    for part in (torch.__version__, cxx, repr(sorted(SOURCE_CLASSES.items())), cpu_flags()):
        h.update(part.encode())
    h.update(repr((COMMON_FLAGS, sorted(CLASS_FLAGS.items()))).encode())
    return h.hexdigest()[:16]


def build_dir(cxx: str) -> Path:
    return cache_root() / "kernels" / build_key(cxx)


def _library_path(root: Path, flag_class: FlagClass) -> Path:
    return root / flag_class.value / f"{LIBRARY}_{flag_class.value}.so"


def built(cxx: Optional[str] = None) -> bool:
    """Every class's library is in the cache for this machine, torch and these sources."""
    cxx = cxx or compiler()
    root = build_dir(cxx) if cxx else None
    return root is not None and all(_library_path(root, c).exists() for c in FlagClass)


def _build_or_load(root: Path, flag_class: FlagClass, cxx: str) -> None:
    library = _library_path(root, flag_class)
    if library.exists():
        torch.ops.load_library(str(library))
        return
    from torch.utils import cpp_extension

    library.parent.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("CXX", cxx)
    cpp_extension.load(
        name=library.stem,
        sources=[str(s) for s in sources(flag_class)],
        extra_cflags=compile_flags(flag_class),
        extra_include_paths=[str(CSRC)],
        build_directory=str(library.parent),
        is_python_module=False,
        verbose=False,
    )


def load() -> bool:
    """Build (once per machine, torch and sources) and load the kernels; False if unavailable."""
    global _loaded
    with _lock:
        if _loaded is None:
            _loaded = _load()
        return _loaded


def _load() -> bool:
    if os.environ.get(ENV_VAR, "1").strip().lower() in ("0", "false", "off", "no"):
        return _unavailable(f"{ENV_VAR}=0", quiet=True)
    cxx = compiler()
    if cxx is None:
        return _unavailable("no C++ compiler (g++) found")
    root = build_dir(cxx)
    try:
        if built(cxx):
            for flag_class in FlagClass:
                _build_or_load(root, flag_class, cxx)
            return True
        # once per machine, torch and sources: a phase of the start-up, reported as such
        with phase(Phase.KERNEL_BUILD, total=len(FlagClass), directory=str(root)) as progress:
            for done, flag_class in enumerate(FlagClass, 1):
                _build_or_load(root, flag_class, cxx)
                progress.step(done)
        return True
    except Exception as exc:  # a broken toolchain or library must not stop the engine
        return _unavailable(f"{type(exc).__name__}: {str(exc)[-2000:]}")


def _unavailable(reason: str, quiet: bool = False) -> bool:
    global _error
    _error = reason
    if not quiet:
        log.warning("CPU kernels unavailable, using the torch path: %s", reason)
    return False


def unavailable_reason() -> Optional[str]:
    return _error
