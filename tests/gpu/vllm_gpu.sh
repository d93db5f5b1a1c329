#!/usr/bin/env bash
# vLLM 0.23.0 (CUDA 13, torch 2.11.0: the GPU machine's torch) on the GPU
# machine, which has no network, and the connector's TTFT / throughput
# benchmark inside it (tests/gpu/vllm_bench.py). Run from the repository root.
#
#   tests/gpu/vllm_gpu.sh pack    (here, with network) builds .stage/vllmgpu.NN:
#       vllm's wheel (274 MB) less what a Llama model on a Hopper GPU never
#       loads (FlashAttention 2, the MoE kernels, FlashMLA, the Rust frontend,
#       deep_gemm for other Pythons: 138 MB left; FlashAttention 3, vllm._C
#       and _C_stable_libtorch stay), the wheels of tests/gpu/vllm_gpu.requirements
#       (what the image lacks; 32 MB) and a small tokenizer (SmolLM2's, from
#       KVI_VLLM_TOKENIZER, default the vllm suite's model directory that
#       .ci/install-vllm makes): three parts of at most 56 MiB.
#       Downloads go to KVI_VLLM_GPU_CACHE (default /var/cache/kvinject/vllm-gpu).
#   tests/gpu/vllm_gpu.sh stage   (there) takes the carried part into /tmp/kvi-stage
#       (kept while the machine is held); the first also prints the machine's
#       versions of the packages vLLM leans on.
#   tests/gpu/vllm_gpu.sh setup   (there) takes the last part, opens the parts,
#       pip-installs vllm and the wheels --no-deps into /tmp/vllm-site, builds
#       libkvinject for sm_90 in /tmp/kvi-build and writes a random-weight
#       Llama-3.1-8B-shaped bf16 model (tests/gpu/vllm_model.py; /dev/shm when it
#       has room, else /tmp) at the same time, with the configs of the 32B
#       (bf16) and 70B (fp8) shapes in /tmp/kvi-model-32b and /tmp/kvi-model-70b
#       (vLLM draws their weights: load_format dummy); then imports vLLM's engine
#       and the connector. If vLLM does not import, it says which module is
#       missing and runs tests/gpu/run_vllm_layouts.sh (the connector's GPU
#       layouts, without vLLM) instead. VLLM_GPU_DUMMY=1: the 8B as a config only
#       too.
#   tests/gpu/vllm_gpu.sh run [ARGS]   (there) tests/gpu/vllm_bench.py on the
#       model VLLM_GPU_MODEL names (8b, the default; 32b; 70b): three engines,
#       one subprocess each: the connector (re-prefill and injected requests),
#       vLLM's prefix cache without the connector (apc: the floor) and neither
#       (plain); TTFT at each k (default 0, 5, 10, 20, 50; --shape paper: Mem0-
#       sized facts, k = 5, 10, 20, 50), throughput at 1 / 16 / 64 concurrent
#       requests at the largest k, the connector's share per step. Each engine
#       writes its part into /tmp/kvi-vllm-bench (kept while the machine is
#       held; a carried .vllm-bench/ is copied there first); an engine whose part
#       is there is not run again; no engine starts that would end past the
#       call's time (VLLM_GPU_TIMEOUT, 570 s, less 30): exit 3, run the same
#       command again. Every call copies vllm_bench.md / .json (merged from the
#       parts there), the parts, the log and the connector's events into $OUT.
#       ARGS go to vllm_bench.py (e.g. --shape paper, --eager, --reps 30, --rounds 3,
#       --engines apc,plain, --redo). --engines shared: the connector with
#       vLLM's prefix cache on, injected and APC requests in one engine.
#       --engines cold: the cold-user engine
#       (not among the defaults): the connector with a disk tier under
#       /tmp/kvi-vllm-bench and hybrid serving, 10 users per k captured until
#       their facts are only on disk, then each user's first request (the facts
#       prefilled as text, prefetched) against the re-prefill of its prompt
#       (target: within 5%) and its next request (injected from memory); with
#       the same other ARGS its table merges into the run's vllm_bench.md.
#   tests/gpu/vllm_gpu.sh profile [ARGS]   (there) the same with --profile: the
#       connector and apc engines, each with its engine core in-process, a few
#       injected / re-prefill / APC requests at the largest k under
#       torch.profiler (Python frames only with --profile-stack: they slow the
#       host several times); traces (.trace.json.gz), operator tables and
#       profile.md (top host-side functions per request kind, and the GPU's idle
#       gaps by what the host was doing; with --profile-timers N, the host µs per
#       request of vLLM's scheduler and model runner, the connector's hooks and the
#       binding, function by function, unprofiled) into $OUT/profile. Only the profile's
#       small files come back with it (the call's file count is limited): copy
#       a trace into $OUT in a call of its own right after.
#
# The device calls, one right after the other (the machine keeps /tmp while
# held, 30 min in all), and the device time each took on an H100 (2026-12-06;
# the same machine, one after the other): "machine N" is one held machine
# (30 min of device time)
#   machine 1 (the 8B, about 17 min):
#    1. tests/gpu/vllm_gpu.sh stage              carry [".stage/vllmgpu.00"]   1-2 min start + 0.3 s
#    2. tests/gpu/vllm_gpu.sh stage              carry [".stage/vllmgpu.01"]   0.2 s
#    3. tests/gpu/vllm_gpu.sh setup              carry [".stage/vllmgpu.02"]   97-101 s
#    4. tests/gpu/vllm_gpu.sh run                carry []   5 min: connector 2.5 min (engine start
#       1-1.5 min: torch.compile, CUDA graphs), apc and plain about 1 min each, in one call
#    5. tests/gpu/vllm_gpu.sh run --shape paper  carry []   2.5-3 min (vLLM's compile cache is warm)
#    6. tests/gpu/vllm_gpu.sh run --engines cold  carry []   about 3 min (an estimate; 40 users
#       captured, 5 requests each; up to 4 GiB of tenant files in /tmp, removed at the end)
#    7. tests/gpu/vllm_gpu.sh profile            carry []   1.6 min
#    8. tests/gpu/vllm_gpu.sh run --tput-users 64 --k 50 --concurrency 64   carry []   the throughput
#       with 64 users, each its own facts (and APC its own cached prefix): 64 more captures
#    9. tests/gpu/vllm_gpu.sh run --shape paper --k 0,5,10,20,50 --engines shared --concurrency 1
#       --rounds 2   carry []   2.7 min (H100, 2026-12-07; 1.9 min with --model-runner v1):
#       injected / APC in one engine, 40 pairs per k (their paired ratios' 95% intervals about
#       ±0.02; --reps 50 for 100 pairs). Add apc to --engines for the cross-engine spread (4.5 min).
#       (move /tmp/kvi-vllm-bench aside first if step 5 wrote there). The same with --no-events:
#       the engine without an event file, as in production (about the same time).
#   machine 2 (about 20 min): steps 1-3, then
#    4. VLLM_GPU_MODEL=32b tests/gpu/vllm_gpu.sh run             10-12 min (an estimate), in two or
#       three calls
#   machine 3 (about 20 min): steps 1-3 with VLLM_GPU_DUMMY=1 (the 8B is not used), then
#    4. VLLM_GPU_MODEL=70b tests/gpu/vllm_gpu.sh run --max-batched-tokens 8192     12-15 min, two or three
#       calls. 70B fp8: 65 GiB of weights; on an H100 (79.6 GiB) ~6 GiB of KV cache (~20k tokens: the 64
#       concurrent requests at k = 50 queue), on an H200 ~64 GiB; vllm_bench.py refuses a GPU it cannot fit.
# A call that finds a fresh machine (parts missing) says which; start again at 1;
# to go on with a run's engines on a fresh machine, put the last call's part-*.json
# into .vllm-bench/ and carry it with `run` (carry [".vllm-bench"]). Here, the
# parts of several calls merge into one table: python3 tests/gpu/vllm_bench.py --report DIR.
# Give `run` the full 600 s (it stops itself at VLLM_GPU_TIMEOUT, 570 s).
# vLLM 0.23 imports flashinfer for its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, which
# `run` sets (flashinfer is not carried; seen on the H200: ModuleNotFoundError at engine start).
# Sizes at pack time: parts of 56, 56 and 55 MiB; installed, /tmp/vllm-site is
# 437 MB.
set -euo pipefail
cd "$(dirname "$0")/../.."

cache=${KVI_VLLM_GPU_CACHE:-/var/cache/kvinject/vllm-gpu}
tokenizer=${KVI_VLLM_TOKENIZER:-/var/cache/kvinject/vllm/model/SmolLM2-135M-Instruct}
vllm_spec=vllm==0.23.0
# members of the wheel left out (read for each: nothing on the path of a dense
# bf16 Llama on sm_90 imports them unguarded; FA3 is vLLM's choice on Hopper)
drop=(
  'vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so'
  'vllm/_moe_C.abi3.so'
  'vllm/vllm-rs'
  'vllm/_flashmla_C.abi3.so'
  'vllm/_flashmla_extension_C.abi3.so'
  'vllm/third_party/deep_gemm/_C.cpython-310-x86_64-linux-gnu.so'
  'vllm/third_party/deep_gemm/_C.cpython-311-x86_64-linux-gnu.so'
  'vllm/third_party/deep_gemm/_C.cpython-313-x86_64-linux-gnu.so'
  'vllm/third_party/deep_gemm/_C.cpython-314-x86_64-linux-gnu.so'
)
site=/tmp/vllm-site
pkg=/tmp/vllm-pkg/.vllm-gpu/pkg
build=/tmp/kvi-build
out=${OUT:-/tmp/kvi-out}
results=/tmp/kvi-vllm-bench

die() { echo "vllm_gpu.sh: $*" >&2; exit 1; }

model_dir() {  # /dev/shm when it has 24 GiB free (the model is 15 GiB), else /tmp
  local kb
  kb=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1 || echo 0)
  if [ "${kb:-0}" -gt $((24 << 20)) ]; then echo /dev/shm/kvi-model; else echo /tmp/kvi-model; fi
}

# pip_download DEST SPEC-OR-ARGS...
. tests/gpu/pip_download.sh

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  pack)
    command -v zip >/dev/null || die "pack needs zip"
    [ -f "$tokenizer/tokenizer.json" ] || die "no tokenizer.json in $tokenizer (.ci/install-vllm makes it; or set KVI_VLLM_TOKENIZER)"
    mkdir -p "$cache"
    whl=$(ls "$cache"/vllm-0.23.0-*.whl 2>/dev/null | head -1 || true)
    if [ -z "$whl" ]; then
      pip_download "$cache" "$vllm_spec"
      whl=$(ls "$cache"/vllm-0.23.0-*.whl | head -1)
    fi
    rm -rf "$cache/deps.new" && mkdir -p "$cache/deps.new"
    pip_download "$cache/deps.new" -r tests/gpu/vllm_gpu.requirements
    rm -rf "$cache/deps" && mv "$cache/deps.new" "$cache/deps"
    rm -rf .vllm-gpu && mkdir -p .vllm-gpu/pkg/deps .vllm-gpu/pkg/tokenizer
    cp "$whl" .vllm-gpu/pkg/
    (cd .vllm-gpu/pkg && zip -q -d "${whl##*/}" "${drop[@]}")
    cp "$cache"/deps/*.whl .vllm-gpu/pkg/deps/
    for f in tokenizer.json tokenizer_config.json special_tokens_map.json chat_template.jinja; do
      [ -f "$tokenizer/$f" ] && cp "$tokenizer/$f" .vllm-gpu/pkg/tokenizer/
    done
    # every Requires-Dist of the carried wheels is on the image or carried
    python3 tests/gpu/vllm_deps.py .vllm-gpu/pkg/*.whl .vllm-gpu/pkg/deps/*.whl
    du -sh .vllm-gpu/pkg/*.whl .vllm-gpu/pkg/deps .vllm-gpu/pkg/tokenizer
    tests/gpu/stage.sh pack vllmgpu .vllm-gpu/pkg
    rm -rf .vllm-gpu
    du -sh .stage/vllmgpu.*
    ;;
  stage)
    tests/gpu/stage.sh take
    have=$(ls /tmp/kvi-stage/vllmgpu/ 2>/dev/null | grep -c '^part' || true)
    echo "vllm_gpu.sh: vllmgpu parts on this machine: $have ($(ls /tmp/kvi-stage/vllmgpu/ 2>/dev/null | tr '\n' ' '))"
    if [ -f /tmp/kvi-stage/vllmgpu/part.00 ] && [ "$have" = 1 ]; then
      nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader || true
      python3 tests/gpu/vllm_deps.py --versions
      df -h /tmp /dev/shm 2>/dev/null | cat
      free -g | head -2
    fi
    ;;
  setup)
    t0=$SECONDS
    mkdir -p "$out"
    tests/gpu/stage.sh take
    tests/gpu/stage.sh open vllmgpu /tmp/vllm-pkg
    model=$(model_dir)
    rm -rf "$build" "$site" "$model"
    (meson setup "$build" -Dcuda=enabled -Dcublaslt=disabled -Dnccl=disabled -Dtests=disabled -Dexamples=false \
       -Dcuda-arch=sm_90 --buildtype=release && ninja -C "$build") >"$out/kvi-build.log" 2>&1 &
    bpid=$!
    margs=()
    [ "${VLLM_GPU_DUMMY:-0}" = 1 ] && margs=(--config-only)
    (python3 tests/gpu/vllm_model.py --tokenizer "$pkg/tokenizer" --out "$model" "${margs[@]}" &&
       for shape in 32b 70b; do
         rm -rf /tmp/kvi-model-$shape
         python3 tests/gpu/vllm_model.py --tokenizer "$pkg/tokenizer" --out /tmp/kvi-model-$shape --shape $shape
       done) >"$out/model.log" 2>&1 &
    mpid=$!
    python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target "$site" \
      "$pkg"/*.whl "$pkg"/deps/*.whl >"$out/pip.log" 2>&1 || { cat "$out/pip.log"; die "pip install failed"; }
    echo "vllm_gpu.sh: $site $(du -sh "$site" | cut -f1) at $((SECONDS - t0)) s"
    set +e
    PYTHONPATH=$site python3 tests/gpu/vllm_deps.py --import-check 2>&1 | tee "$out/import-check.log"
    irc=${PIPESTATUS[0]}
    wait $mpid; mrc=$?
    cat "$out/model.log"
    wait $bpid; brc=$?
    grep -E "^ninja|error|FAILED" "$out/kvi-build.log" | tail -5
    echo "vllm_gpu.sh: import check rc=$irc, model rc=$mrc, library build rc=$brc at $((SECONDS - t0)) s"
    [ $brc -eq 0 ] || { tail -30 "$out/kvi-build.log"; exit 1; }
    if [ $irc -ne 0 ]; then
      echo "vllm_gpu.sh: vLLM does not import here; the connector's GPU layouts without vLLM instead:"
      tests/gpu/run_vllm_layouts.sh "$build"
      exit 1
    fi
    KVINJECT_LIBRARY=$build/lib/libkvinject.so PYTHONPATH=$site:$PWD/python python3 -c \
      "import kvinject.vllm.connector as c; print('vllm_gpu.sh: connector imports:', c.KVInjectConnector)" 2>&1 | tail -2
    PYTHONPATH=$site python3 -c "import vllm.model_executor.layers.quantization.fp8 as m; print('vllm_gpu.sh: fp8 \
(the 70B shape) imports:', m.Fp8Config)" 2>&1 | tail -2 || true
    [ $mrc -eq 0 ]
    ;;
  run|profile)
    model=$(model_dir)
    case "${VLLM_GPU_MODEL:-8b}" in
      8b) ;;
      32b|70b) model=/tmp/kvi-model-$VLLM_GPU_MODEL ;;
      *) die "VLLM_GPU_MODEL=$VLLM_GPU_MODEL: 8b, 32b or 70b" ;;
    esac
    [ -f "$site/vllm/__init__.py" ] || die "no vLLM in $site (run stage x2 and setup first, on this machine)"
    [ -f "$build/lib/libkvinject.so" ] || die "no $build/lib/libkvinject.so (setup builds it)"
    [ -f "$model/config.json" ] || die "no model in $model (setup writes it)"
    mkdir -p "$out" "$results"
    if compgen -G ".vllm-bench/part-*.json" >/dev/null; then
      cp -n .vllm-bench/part-*.json "$results/" && echo "vllm_gpu.sh: the carried parts: $(ls .vllm-bench)"
    fi
    bargs=(--model "$model" --out "$results")
    compgen -G "$model/*.safetensors" >/dev/null || bargs+=(--dummy)
    [ "$cmd" = profile ] && bargs+=(--profile "$results/profile")
    limit=${VLLM_GPU_TIMEOUT:-570}
    export PYTHONPATH=$site:$PWD/python KVINJECT_LIBRARY=$build/lib/libkvinject.so HF_HUB_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    set +e
    timeout -k 15 "$limit" python3 tests/gpu/vllm_bench.py "${bargs[@]}" --time-budget $((limit - 30)) "$@" \
      >"$out/vllm_bench.log" 2>&1
    rc=$?
    set -e
    grep -E "^vllm_bench|Error|error|Traceback|CUDA graph|cudagraph|backend" "$out/vllm_bench.log" | grep -v "^\s*$" | tail -60
    cp "$results"/vllm_bench.md "$results"/vllm_bench.json "$results"/part-*.json "$results"/events-* "$out/" 2>/dev/null || true
    if [ "$cmd" = profile ]; then
      mkdir -p "$out/profile" && cp -r "$results"/profile/. "$out/profile/" 2>/dev/null || true
      [ -f "$out/profile/profile.md" ] && head -120 "$out/profile/profile.md"
    else
      [ -f "$out/vllm_bench.md" ] && cat "$out/vllm_bench.md" || tail -60 "$out/vllm_bench.log"
    fi
    [ $rc -eq 3 ] && echo "vllm_gpu.sh: engines left: run the same command again"
    echo "vllm_gpu.sh: vllm_bench.py rc=$rc"
    exit $rc
    ;;
  *)
    die "usage: vllm_gpu.sh pack | stage | setup | run [vllm_bench.py args] | profile [vllm_bench.py args]"
    ;;
esac
