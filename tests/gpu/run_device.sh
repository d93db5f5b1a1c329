#!/usr/bin/env bash
# Builds libkvinject for Hopper on the GPU machine and runs every test suite
# there (the gpu suite for real), then the benchmarks. Run from the
# repository root. cmocka is not installed there: its Debian packages travel
# in .debs/ (see README.md, "GPU machine") and are unpacked into a sysroot.
# Argument: all (default), tests (build, suites, sanitizers), build (only
# that), bench (the benchmarks, on the build a `tests` or `build` run left
# in /tmp/kvi-build, or $KVI_DEVICE_BUILD) or perf (build, the transfer and retrieval GPU suites,
# their benchmarks and an Nsight Compute report of two injection launches:
# a short loop for kernel work, few files in $OUT), or ab PATCH... (a
# same-run comparison: the tree as it is and the tree with each patch
# applied, e.g. `git diff main some-branch > .debs/x.patch`, each built in
# its own directory; the tests AB_TEST names (default test_gpu_transfer; a
# space-separated list) run on each, then AB_ROUNDS (default 2) interleaved
# rounds of each benchmark AB_BENCH names (default bench_inject; a list too),
# so that drift of the machine hits every variant alike; AB_NCU=REGEX then
# times each launch of the kernels REGEX names in one pass of each variant's
# first benchmark under Nsight Compute (KVI_BENCH_ITERS=1) and prints those
# over AB_NCU_MIN_US (default 200) µs: tests/gpu/ncu_launches.py),
# or repeat [BIN [RUNS [PARALLEL]]] (build, then tests/gpu/repeat.sh: one gpu
# test binary many times under parallel load, default test_gpu_store 60 x 4).
set -euo pipefail
phase=${1:-all}
out=${OUT:-/tmp/kvi-out}
mkdir -p "$out"
sysroot=/tmp/sysroot
mkdir -p "$sysroot"
for f in .debs/*.deb; do dpkg -x "$f" "$sysroot"; done
pcdir=$sysroot/usr/lib/x86_64-linux-gnu/pkgconfig
# the packaged .pc names absolute /usr paths: point them into the sysroot
sed -i "s| -L/usr| -L$sysroot/usr|; s| -I/usr| -I$sysroot/usr|" "$pcdir"/cmocka.pc
export PKG_CONFIG_PATH=$pcdir
export LD_LIBRARY_PATH=$sysroot/usr/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
# pytest for the python suite: python3-pytest and its dependencies travel in
# .debs/ too, for a python3 (the one with torch) that has no pytest of its own
if ! python3 -c 'import pytest' 2>/dev/null; then
  export PYTHONPATH=$sysroot/usr/lib/python3/dist-packages${PYTHONPATH:+:$PYTHONPATH}
fi

nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
build=${KVI_DEVICE_BUILD:-/tmp/kvi-build}
if [ "$phase" = bench ]; then
  meson test -C "$build" --benchmark --verbose 2>&1 | tee "$out/bench.log" | grep -E '^\||^\(|device:|MiB moved counts|torch'
  exit "${PIPESTATUS[0]}"
fi
setup_args=(-Dcuda=enabled -Dcublaslt=enabled -Dnccl=enabled -Dtests=enabled -Dcuda-arch=sm_90 --buildtype=release)
if [ "$phase" = ab ]; then
  shift
  variants=(base "$@")
  read -ra benches <<<"${AB_BENCH:-bench_inject}"
  read -ra tests <<<"${AB_TEST-test_gpu_transfer}"
  targets=("${benches[@]/#/tests/bench/}" "${tests[@]/#/tests/gpu/}")
  # the variants build side by side: each build waits mostly on its few large .cu files
  for i in "${!variants[@]}"; do
    v=${variants[$i]} t=/tmp/kvi-ab-$i
    rm -rf "$t" && mkdir -p "$t"
    tar -C . --exclude=./.git --exclude=./.debs --exclude='./build*' -cf - . | tar -C "$t" -xf -
    if [ "$v" != base ]; then (cd "$t" && patch -s -p1 <"$OLDPWD/$v") || { echo "ab: $v does not apply"; exit 1; }; fi
    (cd "$t" && meson setup b "${setup_args[@]}" >/dev/null && ninja -C b "${targets[@]}") >"$out/ab-build-$i.log" 2>&1 &
  done
  wait
  for i in "${!variants[@]}"; do
    for bench in "${benches[@]}"; do
      [ -x /tmp/kvi-ab-$i/b/tests/bench/$bench ] ||
        { echo "ab: variant $i (${variants[$i]}) does not build"; tail -30 "$out/ab-build-$i.log"; exit 1; }
    done
    echo "ab: variant $i = ${variants[$i]}"
  done
  set +e
  for i in "${!variants[@]}"; do
    for test in "${tests[@]}"; do
      timeout 300 /tmp/kvi-ab-$i/b/tests/gpu/$test >"$out/ab-test-$i-$test.log" 2>&1
      echo "ab: variant $i $test rc=$? $(grep -E 'PASSED|FAILED' "$out/ab-test-$i-$test.log" | tr '\n' ' ')"
    done
  done
  for bench in "${benches[@]}"; do
    for r in $(seq 1 "${AB_ROUNDS:-2}"); do
      for i in "${!variants[@]}"; do
        args=()
        [ "$bench" = bench_search ] && [ "$r" = 1 ] && args=(tests/bench/torch_search.py)
        timeout 300 /tmp/kvi-ab-$i/b/tests/bench/$bench "${args[@]}" >"$out/ab-$bench-$i-$r.log" 2>&1
        echo "ab: $bench round $r variant $i rc=$?"
        grep -E '^\|' "$out/ab-$bench-$i-$r.log" | sed "s/^/v$i /"
      done
    done
  done
  if [ -n "${AB_NCU:-}" ]; then
    for i in "${!variants[@]}"; do
      KVI_BENCH_ITERS=1 timeout 300 ncu --clock-control none --csv --metrics gpu__time_duration.sum \
        -k "regex:$AB_NCU" /tmp/kvi-ab-$i/b/tests/bench/${benches[0]} >"$out/ab-ncu-$i.csv" 2>"$out/ab-ncu-$i.err"
      echo "ab: ncu variant $i rc=$?"
      python3 tests/gpu/ncu_launches.py "$out/ab-ncu-$i.csv" "${AB_NCU_MIN_US:-200}" | sed "s/^/v$i /"
    done
  fi
  exit 0
fi
rm -rf "$build"
meson setup "$build" "${setup_args[@]}" >"$out/setup.log" 2>&1 || { tail -40 "$out/setup.log"; exit 1; }
grep -A8 '^libkvinject' "$out/setup.log" || true
ninja -C "$build" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
[ "$phase" = build ] && exit 0
[ "$phase" = repeat ] && exec tests/gpu/repeat.sh "${@:2}" # BIN RUNS PARALLEL: see repeat.sh
if [ "$phase" = perf ]; then
  set +e
  for t in test_gpu_transfer test_gpu_search; do
    timeout 300 "$build"/tests/gpu/$t >>"$out/gpu-tests.log" 2>&1
    echo "$t: rc=$?" | tee -a "$out/gpu-tests.log"
  done
  grep -E "FAILED|PASSED" "$out/gpu-tests.log" | tail -6
  for b in bench_inject bench_search; do
    args=()
    [ $b = bench_search ] && args=(tests/bench/torch_search.py)
    timeout 400 "$build"/tests/bench/$b "${args[@]}" >>"$out/bench.log" 2>&1
    echo "$b: rc=$?"
  done
  grep -E '^\|' "$out/bench.log"
  KVI_BENCH_ITERS=3 timeout 200 ncu --clock-control none --section SpeedOfLight --section Occupancy \
    --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis -k regex:xfer_kernel \
    --launch-skip 13 --launch-count 1 "$build"/tests/bench/bench_inject >"$out/ncu-xfer.txt" 2>&1
  echo "ncu: rc=$?"
  exit 0
fi
set +e
meson test -C "$build" --print-errorlogs --num-processes 4 2>&1 | tee "$out/test.log"
rc=${PIPESTATUS[0]}
# the gpu suite's own per-test lines
"$build"/tests/gpu/test_gpu_store 2>&1 | tee "$out/gpu-suite.log"
grc=${PIPESTATUS[0]}
"$build"/tests/gpu/test_gpu_transfer 2>&1 | tee "$out/gpu-transfer.log"
trc=${PIPESTATUS[0]}
"$build"/tests/gpu/test_gpu_search 2>&1 | tee "$out/gpu-search.log"
qrc=${PIPESTATUS[0]}
"$build"/tests/gpu/test_gpu_tp 2>&1 | tee "$out/gpu-tp.log"
tprc=${PIPESTATUS[0]}
"$build"/tests/gpu/test_gpu_retrieve 2>&1 | tee "$out/gpu-retrieve.log"
rrc=${PIPESTATUS[0]}
"$build"/tests/gpu/test_gpu_disk 2>&1 | tee "$out/gpu-disk.log"
drc=${PIPESTATUS[0]}
# the Python binding with torch on the device: skips become failures here
KVINJECT_REQUIRE_CUDA=1 meson test -C "$build" --suite python --no-rebuild --verbose 2>&1 | tee "$out/python.log" |
  grep -E ' passed| failed| skipped| error|^FAILED|^SKIPPED|^ERROR|libkvinject:python'
prc=${PIPESTATUS[0]}
# memcheck: no out-of-bounds or misaligned device accesses in the kernels
src=0
if command -v compute-sanitizer >/dev/null; then
  for t in test_gpu_transfer test_gpu_store test_gpu_search test_gpu_retrieve test_gpu_disk; do
    [ $t = test_gpu_search ] && export KVI_TEST_QUICK=1 || unset KVI_TEST_QUICK
    timeout 300 compute-sanitizer --tool memcheck --error-exitcode 9 "$build"/tests/gpu/$t >"$out/memcheck-$t.log" 2>&1
    r=$?; echo "memcheck $t: rc=$r"; tail -3 "$out/memcheck-$t.log"; [ $r -eq 0 ] || src=1
  done
  unset KVI_TEST_QUICK
  # NCCL probes kernels of other architectures at init (cudaFuncGetAttributes fails by design): API errors off
  timeout 300 compute-sanitizer --tool memcheck --report-api-errors no --target-processes all --error-exitcode 9 \
    "$build"/tests/gpu/test_gpu_tp \
    >"$out/memcheck-test_gpu_tp.log" 2>&1
  r=$?; echo "memcheck test_gpu_tp: rc=$r"; tail -3 "$out/memcheck-test_gpu_tp.log"; [ $r -eq 0 ] || src=1
  # the search kernels' shared-memory protocol (selection) and barriers, on smaller sizes
  for tool in racecheck synccheck; do
    KVI_TEST_QUICK=1 timeout 600 compute-sanitizer --tool $tool --error-exitcode 9 "$build"/tests/gpu/test_gpu_search \
      >"$out/$tool-test_gpu_search.log" 2>&1
    r=$?; echo "$tool test_gpu_search: rc=$r"; tail -3 "$out/$tool-test_gpu_search.log"; [ $r -eq 0 ] || src=1
  done
fi
[ "$phase" = all ] && meson test -C "$build" --benchmark --verbose 2>&1 | tee "$out/bench.log" |
  grep -E '^\||^\(|device:|MiB moved counts|torch'
echo "meson test rc=$rc, gpu suite rc=$grc, gpu-transfer rc=$trc, gpu-search rc=$qrc, gpu-tp rc=$tprc, gpu-retrieve rc=$rrc, gpu-disk rc=$drc, python rc=$prc, memcheck rc=$src"
[ "$rc" -eq 0 ] && [ "$grc" -eq 0 ] && [ "$trc" -eq 0 ] && [ "$qrc" -eq 0 ] && [ "$tprc" -eq 0 ] && [ "$rrc" -eq 0 ] && [ "$drc" -eq 0 ] &&
  [ "$prc" -eq 0 ] && [ "$src" -eq 0 ]
