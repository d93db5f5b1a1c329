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
#       has room, else /tmp) at the same time; then imports vLLM's engine and
#       the connector. If vLLM does not import, it says which module is missing
#       and runs tests/gpu/run_vllm_layouts.sh (the connector's GPU layouts,
#       without vLLM) instead. VLLM_GPU_DUMMY=1: config only (vLLM draws the
#       weights, load_format dummy).
#   tests/gpu/vllm_gpu.sh run [ARGS]   (there) tests/gpu/vllm_bench.py on that
#       model: TTFT at k = 0, 5, 10, 20, 50, throughput at 1 / 16 / 64 concurrent
#       requests at k = 50, the connector's share per step; vllm_bench.md,
#       vllm_bench.json, the log and the connector's events into $OUT. ARGS go
#       to vllm_bench.py (e.g. --eager, --layerwise, --reps 20).
#
# The device calls, one right after the other (the machine keeps /tmp for 30 s
# between calls, 30 min in all):
#   1. tests/gpu/vllm_gpu.sh stage    carry [".stage/vllmgpu.00"]
#   2. tests/gpu/vllm_gpu.sh stage    carry [".stage/vllmgpu.01"]
#   3. tests/gpu/vllm_gpu.sh setup    carry [".stage/vllmgpu.02"]
#   4. tests/gpu/vllm_gpu.sh run      carry []
# A call that finds a fresh machine (parts missing) says which; start again at 1.
# Give `run` the full 600 s (it stops itself at VLLM_GPU_TIMEOUT, 570 s).
# vLLM 0.23 imports flashinfer for its sampler unless VLLM_USE_FLASHINFER_SAMPLER=0, which
# `run` sets (flashinfer is not carried; seen on the H200: ModuleNotFoundError at engine start).
# Sizes at pack time: parts of 56, 56 and 55 MiB; installed, /tmp/vllm-site is
# 437 MB. Device time expected (an estimate until measured): machine start 1-2
# min, each stage call under a minute, setup 3-4 min (the library's nvcc build
# is the longest; pip and the model are written meanwhile), run 4-6 min (engine
# start with torch.compile and graph capture, then about two minutes of
# requests): about 12 minutes.
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

die() { echo "vllm_gpu.sh: $*" >&2; exit 1; }

model_dir() {  # /dev/shm when it has 24 GiB free (the model is 15 GiB), else /tmp
  local kb
  kb=$(df --output=avail -k /dev/shm 2>/dev/null | tail -1 || echo 0)
  if [ "${kb:-0}" -gt $((24 << 20)) ]; then echo /dev/shm/kvi-model; else echo /tmp/kvi-model; fi
}

pip_download() {  # pip_download DEST SPEC-OR-ARGS...: cp312 manylinux x86_64 wheels, no dependencies
  local dest=$1; shift
  nice python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$dest" "$@"
}

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
    python3 tests/gpu/vllm_model.py --tokenizer "$pkg/tokenizer" --out "$model" "${margs[@]}" >"$out/model.log" 2>&1 &
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
    [ $mrc -eq 0 ]
    ;;
  run)
    model=$(model_dir)
    [ -f "$site/vllm/__init__.py" ] || die "no vLLM in $site (run stage x2 and setup first, on this machine)"
    [ -f "$build/lib/libkvinject.so" ] || die "no $build/lib/libkvinject.so (setup builds it)"
    [ -f "$model/config.json" ] || die "no model in $model (setup writes it)"
    mkdir -p "$out"
    bargs=()
    compgen -G "$model/*.safetensors" >/dev/null || bargs=(--dummy)
    export PYTHONPATH=$site:$PWD/python KVINJECT_LIBRARY=$build/lib/libkvinject.so HF_HUB_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false PYTHONUNBUFFERED=1
    set +e
    timeout "${VLLM_GPU_TIMEOUT:-570}" python3 tests/gpu/vllm_bench.py --model "$model" --out "$out" "${bargs[@]}" "$@" \
      >"$out/vllm_bench.log" 2>&1
    rc=$?
    grep -E "^vllm_bench|Error|error|Traceback|CUDA graph|cudagraph|backend" "$out/vllm_bench.log" | grep -v "^\s*$" | tail -40
    [ -f "$out/vllm_bench.md" ] && cat "$out/vllm_bench.md" || tail -60 "$out/vllm_bench.log"
    echo "vllm_gpu.sh: vllm_bench.py rc=$rc"
    exit $rc
    ;;
  *)
    die "usage: vllm_gpu.sh pack | stage | setup | run [vllm_bench.py args]"
    ;;
esac
