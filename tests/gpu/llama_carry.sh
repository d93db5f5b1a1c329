#!/usr/bin/env bash
# Packs what tests/gpu/llama_ttft.sh needs from the llama-cpp-python sdist
# into .llama/llama-src.tar.gz (an ignored folder that travels to the GPU
# machine): llama.cpp's library sources (CMake files, include, src, ggml with
# its CPU and CUDA backends, the vendored hash code and the header-only
# vendor stubs) and gguf-py (the GGUF writer for the random-weight model).
# Run here, from the repository root, after .ci/install-llama (which caches
# the sdist).
set -euo pipefail
cache=${KVI_LLAMA_CACHE:-/var/cache/kvinject/llama}
sdist=$cache/llama_cpp_python-0.3.36.tar.gz
[ -s "$sdist" ] || { echo "llama_carry: $sdist missing: run .ci/install-llama first" >&2; exit 1; }
top=llama_cpp_python-0.3.36/vendor/llama.cpp
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
tar -xzf "$sdist" -C "$work" "$top/CMakeLists.txt" "$top/LICENSE" "$top/cmake" "$top/include" "$top/src" \
  "$top/vendor/CMakeLists.txt" "$top/vendor/hash" "$top/vendor/miniaudio/CMakeLists.txt" \
  "$top/vendor/nlohmann/CMakeLists.txt" "$top/vendor/sheredom/CMakeLists.txt" "$top/vendor/stb/CMakeLists.txt" \
  "$top/ggml/CMakeLists.txt" "$top/ggml/cmake" "$top/ggml/include" "$top/ggml/src" "$top/gguf-py/gguf"
# ggml's other backends are not built: leave their sources out
find "$work/$top/ggml/src" -mindepth 1 -maxdepth 1 -type d ! -name ggml-cpu ! -name ggml-cuda -exec rm -rf {} +
mkdir -p .llama
tar -czf .llama/llama-src.tar.gz -C "$work/$top" .
ls -l .llama/llama-src.tar.gz
