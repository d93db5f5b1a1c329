#!/usr/bin/env bash
# Kernel times of the injection and retrieval benchmarks under Nsight Compute
# (GPU machine; run from the repository root after `run_device.sh build`):
# one metric (duration) for every library kernel of a short run
# (KVI_BENCH_ITERS timed calls per case), then the detailed sections for a
# few launches named by KVI_PROFILE_XFER / KVI_PROFILE_SEARCH (ncu
# --launch-skip values over the filtered kernels). Results in $OUT.
set -uo pipefail
out=${OUT:-/tmp/kvi-out}
build=/tmp/kvi-build
mkdir -p "$out"
export KVI_BENCH_ITERS=${KVI_BENCH_ITERS:-3}
ncu="ncu --clock-control none"
durations() { # name, kernel regex, program...
  local name=$1 re=$2
  shift 2
  timeout 400 $ncu --metrics gpu__time_duration.sum --csv -k "regex:$re" "$@" >"$out/ncu-$name.csv" 2>"$out/ncu-$name.err"
  echo "ncu $name: rc=$? $(grep -c gpu__time_duration "$out/ncu-$name.csv") kernels"
}
durations inject 'xfer_kernel' "$build"/tests/bench/bench_inject
durations search 'prep_kernel|scan_kernel|select_kernel|emit_kernel|nvjet|gemm|xmma|cutlass|splitK' \
  "$build"/tests/bench/bench_search
sections="--section SpeedOfLight --section Occupancy --section LaunchStats --section MemoryWorkloadAnalysis --section WarpStateStats --section SchedulerStats"
for skip in ${KVI_PROFILE_XFER:-}; do
  timeout 200 $ncu $sections -k regex:xfer_kernel --launch-skip "$skip" --launch-count 1 \
    "$build"/tests/bench/bench_inject >"$out/ncu-xfer-$skip.txt" 2>&1
  echo "ncu xfer launch $skip: rc=$?"
done
for skip in ${KVI_PROFILE_SEARCH:-}; do
  timeout 300 $ncu $sections -k 'regex:prep_kernel|scan_kernel|select_kernel|emit_kernel|nvjet|gemm|xmma|cutlass' \
    --launch-skip "$skip" --launch-count 1 "$build"/tests/bench/bench_search >"$out/ncu-search-$skip.txt" 2>&1
  echo "ncu search launch $skip: rc=$?"
done
