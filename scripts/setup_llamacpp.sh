#!/usr/bin/env bash
# Build llama.cpp's llama-server for the benchmark's llama.cpp peer (modes llamacpp_q8_0 and
# llamacpp_q4_1 of `slipstream bench`), and make the default model's GGUF files for it.
#
#   scripts/setup_llamacpp.sh [DIR]        # DIR defaults to ~/.cache/slipstream/peers
#
# Takes ~6 minutes on 2 cores (cmake + ninja, Release, CPU only, two targets): run it by hand,
# never in CI.
# The source is the llama.cpp vendored in the llama-cpp-python sdist (fetched with pip from the
# package index, pinned below), so no git host is needed. Writes:
#   DIR/llamacpp/bin/llama-server, DIR/llamacpp/bin/llama-quantize
#   DIR/llamacpp/SmolLM2-135M-Instruct.Q4_1.gguf   (the embedded model's own file, copied)
#   DIR/llamacpp/SmolLM2-135M-Instruct.{Q8_0,BF16,F32}.gguf  (requantized from it: Q8_0 the
#                                                   same weights at 8 bits a weight; BF16 and F32
#                                                   the values Slipstream serves as bf16 / fp32)
#   DIR/llamacpp/llamacpp.json                     (what the benchmark reads)
# Idempotent: a finished build is kept (delete DIR/llamacpp to redo it).
set -euo pipefail

LLAMA_CPP_PYTHON_VERSION="0.3.36"
ROOT="$(cd "$(dirname "$0")/.." && pwd)"
PY="${PYTHON:-$ROOT/.venv/bin/python}"
DIR="${1:-${SLIPSTREAM_CACHE:-$HOME/.cache/slipstream}/peers}"
OUT="$DIR/llamacpp"
JOBS="$(nproc)"
mkdir -p "$OUT/bin"

if [ ! -x "$OUT/bin/llama-server" ] || [ ! -x "$OUT/bin/llama-quantize" ]; then
  work="$(mktemp -d)"
  trap 'rm -rf "$work"' EXIT
  "$PY" -m pip download --no-deps --no-binary :all: --dest "$work" \
    "llama-cpp-python==$LLAMA_CPP_PYTHON_VERSION"
  tar -xzf "$work"/llama_cpp_python-*.tar.gz -C "$work"
  src="$(echo "$work"/llama_cpp_python-*/vendor/llama.cpp)"
  generator=()
  if command -v ninja >/dev/null 2>&1; then generator=(-G Ninja); fi
  cmake -S "$src" -B "$work/build" "${generator[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=OFF \
    -DGGML_NATIVE=ON -DLLAMA_CURL=OFF -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_UI=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_BUILD_TOOLS=ON -DLLAMA_BUILD_SERVER=ON
  cmake --build "$work/build" -j "$JOBS" --target llama-server llama-quantize
  cp "$work/build/bin/llama-server" "$work/build/bin/llama-quantize" "$OUT/bin/"
fi

Q41="$OUT/SmolLM2-135M-Instruct.Q4_1.gguf"
if [ ! -f "$Q41" ]; then
  cp "$("$PY" -c 'from slipstream.worker.model.gguf import default_gguf_path as p; print(p())')" "$Q41"
fi
for type in Q8_0 BF16 F32; do
  target="$OUT/SmolLM2-135M-Instruct.$type.gguf"
  if [ ! -f "$target" ]; then
    "$OUT/bin/llama-quantize" --allow-requantize "$Q41" "$target" "$type"
  fi
done

cat > "$OUT/llamacpp.json" <<EOF
{
 "server": "$OUT/bin/llama-server",
 "source": "llama-cpp-python $LLAMA_CPP_PYTHON_VERSION (vendored llama.cpp)",
 "gguf": {"q4_1": "$Q41", "q8_0": "$OUT/SmolLM2-135M-Instruct.Q8_0.gguf",
          "bf16": "$OUT/SmolLM2-135M-Instruct.BF16.gguf",
          "f32": "$OUT/SmolLM2-135M-Instruct.F32.gguf"},
 "cpu_flags": "$(grep -m1 '^flags' /proc/cpuinfo | cut -d: -f2 | xargs)"
}
EOF
echo "llama.cpp peer ready: $OUT/llamacpp.json"
