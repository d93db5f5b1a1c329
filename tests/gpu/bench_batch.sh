#!/usr/bin/env bash
# The batched injection ABI on the GPU machine, in one command from the
# repository root: builds the library and the injection benchmarks for
# Hopper (no test suites: no cmocka needed), then prints
#   - bench_host: the CPU backend's host cost per request of kvi_inject
#     against kvi_inject_batched;
#   - tests/bench/py_inject.py, which runs bench_inject (kvi_inject,
#     kvi_inject_batched from host arrays and with device fact ids, the
#     device-to-device copy of the same bytes) and times the Python binding's
#     calls in the same run (Injector.inject with InjectRequest lists,
#     Injector.inject_batch with CPU and with CUDA tensors) side by side,
#     then the search -> inject_batch chain with device ids.
# Needs torch with CUDA for the Python part. Logs and tables land in $OUT
# (default /tmp/kvi-out).
set -euo pipefail
out=${OUT:-/tmp/kvi-out}
build=${KVI_BENCH_BUILD:-/tmp/kvi-bench-build}
mkdir -p "$out"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
if [ ! -f "$build/build.ninja" ]; then
  meson setup "$build" -Dcuda=enabled -Dcublaslt=enabled -Dnccl=disabled -Dtests=disabled -Dexamples=false \
    -Dcuda-arch=sm_90 --buildtype=release >"$out/bench-setup.log" 2>&1 || { tail -40 "$out/bench-setup.log"; exit 1; }
fi
ninja -C "$build" tests/bench/bench_inject tests/bench/bench_host >"$out/bench-build.log" 2>&1 ||
  { tail -40 "$out/bench-build.log"; exit 1; }
lib=$build/lib/libkvinject.so
echo "== bench_host (CPU backend, host cost per request)"
"$build"/tests/bench/bench_host | tee "$out/bench_host.txt"
echo "== bench_inject + Python binding, one run"
KVINJECT_LIBRARY=$lib PYTHONPATH=$PWD/python python3 tests/bench/py_inject.py "$build"/tests/bench/bench_inject \
  2>&1 | tee "$out/py_inject.txt"
exit "${PIPESTATUS[0]}"
