#!/usr/bin/env bash
# The peer comparison of README's "How fast" and docs/performance.md, measured in one run on this
# machine: this crate's fused QKV from Python (and the same call from Rust) against torch's
# F.linear, Modular MAX's CPU fused_qkv_ragged_matmul and ggml's matmul (llama.cpp), for
# Llama-3-8B and Qwen2.5-0.5B shapes, M = 1, 8, 64, 512, one thread and all cores.
#
#   tools/peers.sh [PYTHON] [-- extra arguments for python -m paged_qkv.bench]
#
# PYTHON: an interpreter with paged_qkv installed (pip install ./python), and, optionally, torch
# and max (pip install torch max); a peer that is not installed is skipped with a note.
# LLAMA_CPP=/path/to/llama.cpp (a source checkout) adds ggml: this script builds ggml there
# (cmake, into a temporary directory) and the driver tools/ggml_matmul.c against it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${1:-python3}
shift || true
[ "${1:-}" = "--" ] && shift
args=("$@")
if [ -n "${LLAMA_CPP:-}" ]; then
  build=$(mktemp -d)
  echo "building ggml from $LLAMA_CPP in $build"
  { cmake -S "$LLAMA_CPP" -B "$build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF \
      -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
      -DLLAMA_BUILD_TOOLS=OFF && cmake --build "$build" --target ggml -j; } >"$build/build.log" 2>&1 \
    || { tail -20 "$build/build.log"; echo "ggml did not build (log: $build/build.log)"; exit 1; }
  libs=$(find "$build/ggml/src" -name 'libggml*.a' | sort -r | tr '\n' ' ')
  # shellcheck disable=SC2086 # the static libraries, in link order (ggml before its backends)
  cc -O2 tools/ggml_matmul.c -I"$LLAMA_CPP/ggml/include" -Wl,--start-group $libs -Wl,--end-group \
    -lstdc++ -lm -lpthread -fopenmp -o "$build/ggml_matmul"
  args+=(--ggml "$build/ggml_matmul")
fi
"$PY" -m paged_qkv.bench --models llama3-8b,qwen2.5-0.5b --formats bf16,f32,nvfp4,mxfp8 --m 1,8,64,512 \
  "${args[@]}"
