#!/usr/bin/env bash
# Parity and speed against Hugging Face transformers on the GPU machine
# (python/kvinject_bench): hf_parity (exit 1 when a parity criterion fails),
# then hf_speed (TTFT and throughput tables for BENCHMARKS.md). Needs an
# already-built CUDA libkvinject (tests/gpu/run_device.sh builds one) and
# python3 with torch and transformers; no network.
#
#   tests/gpu/run_hf.sh [BUILD_DIR]        # default $KVINJECT_BUILD, else /tmp/kvi-build
#
# Output: $OUT (default /tmp/kvi-out)/hf-parity.md and hf-speed.md. Extra
# arguments for the benchmarks: HF_PARITY_ARGS, HF_SPEED_ARGS (e.g. --quick).
# PYTHON picks the interpreter (default python3); HF_DEVICE=cpu runs both on
# the CPU (a smoke test of the script itself). Run from anywhere.
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-${KVINJECT_BUILD:-/tmp/kvi-build}}
out=${OUT:-/tmp/kvi-out}
py=${PYTHON:-python3}
dev=${HF_DEVICE:-cuda}
mkdir -p "$out"
lib=$build/lib/libkvinject.so
if [ ! -e "$lib" ]; then
  echo "run_hf.sh: no library at $lib (build first, or pass the build directory)" >&2
  exit 2
fi
export KVINJECT_LIBRARY=$lib
export PYTHONDONTWRITEBYTECODE=1
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
if ! "$py" -c "import sys, torch, transformers; sys.exit(0 if '$dev' == 'cpu' or torch.cuda.is_available() else 'no CUDA device')" 2>"$out/hf-import.log"; then
  echo "run_hf.sh: $py lacks torch/transformers or a CUDA device:" >&2
  cat "$out/hf-import.log" >&2
  exit 2
fi

start=$SECONDS
# shellcheck disable=SC2086  # the extra arguments are words
timeout 300 "$py" -m kvinject_bench.hf_parity --device "$dev" ${HF_PARITY_ARGS:-} 2>&1 | tee "$out/hf-parity.md"
prc=${PIPESTATUS[0]}
echo "hf_parity rc=$prc ($((SECONDS - start)) s)"
start=$SECONDS
# shellcheck disable=SC2086
timeout 400 "$py" -m kvinject_bench.hf_speed --device "$dev" ${HF_SPEED_ARGS:-} 2>&1 | tee "$out/hf-speed.md"
src=${PIPESTATUS[0]}
echo "hf_speed rc=$src ($((SECONDS - start)) s)"
echo "run_hf.sh: parity rc=$prc, speed rc=$src; output in $out/hf-parity.md and $out/hf-speed.md"
[ "$prc" -eq 0 ] && [ "$src" -eq 0 ]
