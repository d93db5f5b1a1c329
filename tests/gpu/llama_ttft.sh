#!/usr/bin/env bash
# Time to first token with llama.cpp (CUDA) on the GPU machine: re-prefill
# against libkvinject injection of k facts into a llama.cpp sequence state
# (tests/gpu/llama_ttft.c). Run from the repository root with .llama/ carried
# (tests/gpu/llama_carry.sh packs llama.cpp's sources into it).
#
#   tests/gpu/llama_ttft.sh build   llama.cpp (CUDA sm_90, shared) and libkvinject
#                                   (CUDA sm_90) built in parallel, the program,
#                                   the random-weight Llama-3.2-1B-shaped F16 GGUF
#   tests/gpu/llama_ttft.sh run     the benchmark (REPS, default 10), its table
#                                   in $OUT/llama_ttft.txt
#   tests/gpu/llama_ttft.sh all     both (default)
#
# Everything is kept under /tmp/kvi-llama-* while the machine is held: a build
# cut short by the time limit resumes where it stopped when run again.
set -euo pipefail
phase=${1:-all}
out=${OUT:-/tmp/kvi-out}
mkdir -p "$out"
jobs=$(nproc)
src=/tmp/kvi-llama-src
lbuild=/tmp/kvi-llama-build
lprefix=/tmp/kvi-llama-cuda
kbuild=/tmp/kvi-llama-kvi
model=/tmp/kvi-llama-1b-f16.gguf
prog=/tmp/kvi-llama-ttft
export PATH=/usr/local/cuda/bin:$PATH

build() {
  [ -s .llama/llama-src.tar.gz ] || { echo "llama_ttft: .llama/llama-src.tar.gz was not carried" >&2; exit 1; }
  if [ ! -f "$src/CMakeLists.txt" ]; then
    mkdir -p "$src"
    tar -xzf .llama/llama-src.tar.gz -C "$src"
  fi
  local t0=$SECONDS
  (
    if [ ! -f "$lprefix/.complete" ]; then
      gen=()
      command -v ninja >/dev/null && gen=(-G Ninja)
      cmake -S "$src" -B "$lbuild" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON \
        -DCMAKE_INSTALL_PREFIX="$lprefix" -DCMAKE_INSTALL_LIBDIR=lib -DLLAMA_BUILD_COMMON=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        -DLLAMA_BUILD_APP=OFF -DLLAMA_OPENSSL=OFF -DGGML_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES=90 \
        >"$out/llama_configure.log" 2>&1
      cmake --build "$lbuild" -j "$jobs" >"$out/llama_build.log" 2>&1
      cmake --install "$lbuild" >/dev/null
      touch "$lprefix/.complete"
    fi
  ) &
  local lpid=$!
  (
    [ -d "$kbuild" ] || meson setup "$kbuild" -Dcuda=enabled -Dcuda-arch=sm_90 -Dtests=disabled -Dexamples=false \
      --buildtype=release >"$out/kvi_setup.log" 2>&1
    ninja -C "$kbuild" >"$out/kvi_build.log" 2>&1
  ) &
  local kpid=$!
  if [ ! -s "$model" ]; then
    PYTHONPATH=$src/gguf-py python3 tests/gpu/make_llama_gguf.py "$model.part" >"$out/gguf.log" 2>&1 &&
      mv "$model.part" "$model" || { echo "llama_ttft: generating the GGUF failed" >&2; tail -20 "$out/gguf.log" >&2; }
  fi
  local st=0
  wait "$lpid" || { st=1; tail -30 "$out/llama_build.log" "$out/llama_configure.log" 2>/dev/null; }
  wait "$kpid" || { st=1; tail -30 "$out/kvi_build.log" "$out/kvi_setup.log" 2>/dev/null; }
  [ $st -eq 0 ] || exit 1
  gcc -std=c11 -O2 -Wall -Wextra -o "$prog" tests/gpu/llama_ttft.c -Iinclude -I"$kbuild/include" \
    -I"$lprefix/include" -I/usr/local/cuda/include -L"$kbuild/lib" -lkvinject -L"$lprefix/lib" -lllama -lggml \
    -lggml-base -L/usr/local/cuda/lib64 -lcudart -lm \
    -Wl,--disable-new-dtags,-rpath,"$lprefix/lib:$kbuild/lib:/usr/local/cuda/lib64"
  echo "llama_ttft: built in $((SECONDS - t0)) s; model $(du -h "$model" | cut -f1)"
}

run() {
  [ -x "$prog" ] && [ -s "$model" ] || { echo "llama_ttft: run 'build' first" >&2; exit 1; }
  nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$out/gpu.txt"
  "$prog" "$model" "${REPS:-10}" | tee "$out/llama_ttft.txt"
}

case "$phase" in
build) build ;;
run) run ;;
all) build && run ;;
*) echo "usage: $0 [build|run|all]" >&2; exit 2 ;;
esac
