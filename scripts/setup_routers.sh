#!/usr/bin/env bash
# Install the routers the multi-replica benchmark puts in front of Slipstream replicas,
# each into its own virtualenv (they are Rust binaries in Python wheels; keeping them out of
# the project's environment keeps their dependencies out of it too). Not run by CI.
#
#   scripts/setup_routers.sh [DIR]     # default ~/.cache/slipstream/routers
#
# Afterwards DIR/vllm-router/bin/vllm-router and DIR/sglang-router/bin/python -m
# sglang_router.launch_router exist; `benchmarks/router_bench.py --routers DIR` finds them.
set -euo pipefail

VLLM_ROUTER_SPEC="vllm-router==0.1.17"
SGLANG_ROUTER_SPEC="sglang-router==0.3.2"
PYTHON="${PYTHON:-python3}"
CACHE="${SLIPSTREAM_CACHE:-${XDG_CACHE_HOME:-$HOME/.cache}/slipstream}"
DIR="${1:-$CACHE/routers}"

install_one() {  # venv-name spec
    local venv="$DIR/$1"
    if [ ! -x "$venv/bin/python" ]; then
        "$PYTHON" -m venv "$venv"
    fi
    "$venv/bin/python" -m pip install --quiet --upgrade pip
    "$venv/bin/python" -m pip install --quiet "$2"
    echo "[setup_routers] $2 -> $venv"
}

mkdir -p "$DIR"
install_one vllm-router "$VLLM_ROUTER_SPEC"
install_one sglang-router "$SGLANG_ROUTER_SPEC"
echo "[setup_routers] done: $DIR"
