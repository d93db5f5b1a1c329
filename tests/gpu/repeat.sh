#!/usr/bin/env bash
# Runs one gpu-suite binary many times under parallel load, to catch
# intermittent failures (an ordering bug between streams shows only when the
# device is busy). Run from the repository root on the GPU machine, after
# `tests/gpu/run_device.sh build` (or `tests`) left a build in /tmp/kvi-build.
#
#   tests/gpu/repeat.sh [binary] [runs] [parallel]
#
# defaults: test_gpu_store, 60 runs, 4 at a time (as `meson test
# --num-processes 4` runs the suites), with test_gpu_transfer looping beside
# them as load. Each run's log is kept in $OUT (default /tmp/kvi-out) only
# when it fails. Exits 1 if any run failed, printing the first failure.
set -uo pipefail
bin=${1:-test_gpu_store} runs=${2:-60} par=${3:-4}
build=${KVI_BUILD:-/tmp/kvi-build}
out=${OUT:-/tmp/kvi-out}
mkdir -p "$out"
sysroot=/tmp/sysroot # run_device.sh unpacks cmocka there
export LD_LIBRARY_PATH=$sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
exe=$build/tests/gpu/$bin
[ -x "$exe" ] || { echo "repeat: no $exe (run tests/gpu/run_device.sh build first)"; exit 2; }
load=$build/tests/gpu/test_gpu_transfer
tmp=$(mktemp -d)
stop=$tmp/stop
bg=0 # background jobs that are not runs: the load loop
if [ -x "$load" ] && [ "$bin" != test_gpu_transfer ]; then
  (while [ ! -e "$stop" ]; do "$load" >/dev/null 2>&1; done) &
  loader=$! bg=1
fi
run_one() { # $1: index
  if "$exe" >"$tmp/run-$1.log" 2>&1; then rm -f "$tmp/run-$1.log"; else echo "$1" >>"$tmp/failed"; fi
}
started=$SECONDS
for i in $(seq 1 "$runs"); do
  run_one "$i" &
  while [ "$(jobs -rp | wc -l)" -ge "$((par + bg))" ]; do sleep 0.2; done
done
while [ "$(jobs -rp | wc -l)" -gt "$bg" ]; do sleep 0.2; done # the runs, not the load loop
touch "$stop"
[ "$bg" -eq 1 ] && wait "$loader"
nfail=0
[ -e "$tmp/failed" ] && nfail=$(wc -l <"$tmp/failed")
echo "repeat: $bin: $runs runs, $par at a time beside test_gpu_transfer: $nfail failed ($((SECONDS - started)) s)"
if [ "$nfail" -gt 0 ]; then
  first=$(sort -n "$tmp/failed" | head -1)
  for f in $(sort -n "$tmp/failed" | head -3); do cp "$tmp/run-$f.log" "$out/repeat-$bin-$f.log"; done
  echo "repeat: first failure (run $first):"
  grep -E "FAILED|ERROR|LINE|differ" "$tmp/run-$first.log" | head -20
fi
rm -rf "$tmp"
[ "$nfail" -eq 0 ]
