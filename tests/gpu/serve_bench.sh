#!/usr/bin/env bash
# Memory requests under load on the GPU machine: tests/gpu/serve_bench.py
# (its docstring is the manual) against `vllm serve` with the connector and the
# gateway on 127.0.0.1, on the model and vLLM that tests/gpu/vllm_gpu.sh
# stages (a Llama-3.1-8B-shaped model, dummy weights). Run from the
# repository root.
#
#   tests/gpu/serve_bench.sh pack   (here) .stage/servebench.NN: the gateway's
#       embedder (all-MiniLM-L6-v2 from KVI_EMBEDDER, default the vllm suite's
#       copy, its weights stored in fp16 to fit one part; the gateway computes
#       in fp32) and the wheels `vllm serve` needs beyond vllm_gpu.sh's
#       (tests/gpu/serve_bench.requirements) through tests/gpu/stage.sh; one
#       part of about 46 MiB.
#   tests/gpu/serve_bench.sh run [ARGS]   (there, after vllm_gpu.sh setup)
#       takes the carried part (the first call), opens it into /tmp/kvi-embedder,
#       installs its wheels --no-deps into vllm_gpu.sh's /tmp/vllm-site and
#       imports vLLM's server modules and the gateway's (tests/gpu/vllm_deps.py
#       --import-check serve: every missing module named at once), then runs serve_bench.py
#       --device gpu on the staged
#       model with ARGS (--targets, --k, --rates, ...), stopping itself before
#       SERVE_BENCH_TIMEOUT (default 540 s; the script gets --time-budget 60 s
#       less and starts no point it cannot finish). The points accumulate in
#       /tmp/kvi-serve-bench/serve_bench.json (kept while the machine is held);
#       a fresh machine starts from .serve-bench/serve_bench.json when that is
#       carried (copy the last call's file there). Every call copies the JSON,
#       the table, the logs into $OUT. Exit 3: points left for the next call
#       (run the same command again).
#
# The device calls, one right after the other (the machine keeps /tmp while
# held, 30 min in all), and the device time each is expected to take (an
# estimate until measured):
#   1. tests/gpu/vllm_gpu.sh stage                     carry [".stage/vllmgpu.00"]   1-2 min start + < 1 min
#   2. tests/gpu/vllm_gpu.sh stage                     carry [".stage/vllmgpu.01"]   < 1 min
#   3. tests/gpu/vllm_gpu.sh setup                     carry [".stage/vllmgpu.02"]   76-96 s on an H100
#      (VLLM_GPU_DUMMY=1: the 8B as a config only, vLLM drawing its weights)
#   4. tests/gpu/serve_bench.sh run --targets reprefill,inject --k 5,10,20,50
#                                                      carry [".stage/servebench.00"]   9 min
#      engine start 2-3 min (torch.compile, CUDA graphs; 99 s on an H100, 51f5c64), captures seconds
#      (1,632 facts in 1.2 s), then about a minute per
#      (target, k) at the default rates 4..64 req/s (8 s of arrivals, 50 requests at least; less where
#      a target saturates); exit 3 with points left
#   5. the same command, carry []: 4-9 min (the engine starts in about a minute from vLLM's compile
#      cache), again while it exits 3
#   6. tests/gpu/serve_bench.sh run --targets gateway --k 5,10,20,50    carry []   6-9 min
#   7. (optional) tests/gpu/serve_bench.sh run --targets plain --k 5,10,20,50    carry []   6-9 min
# The shortest sweep that gives every figure once: step 4 as
#   tests/gpu/serve_bench.sh run --targets reprefill,inject,gateway --k 50
# (one replica and gateway start for the three targets, about 6-8 min with its repeat).
# About 30-35 min in all, more than one machine's 30 min: go on with a fresh
# machine from step 1, with the last serve_bench.json in .serve-bench/ carried
# in step 4 (carry [".stage/servebench.00", ".serve-bench"]). Then here:
#   /tmp/mpl/venv/bin/python tests/gpu/serve_bench.py --plot DIR     (DIR holding serve_bench.json)
set -euo pipefail
cd "$(dirname "$0")/../.."

embedder_src=${KVI_EMBEDDER:-/var/cache/kvinject/vllm/model/all-MiniLM-L6-v2}
venv_py=${KVI_VLLM_CACHE:-/var/cache/kvinject/vllm}/venv/bin/python
site=/tmp/vllm-site
build=/tmp/kvi-build
embedder=/tmp/kvi-embedder/embedder
results=/tmp/kvi-serve-bench
out=${OUT:-/tmp/kvi-out}

die() { echo "serve_bench.sh: $*" >&2; exit 1; }
# pip_download DEST SPEC-OR-ARGS...
. tests/gpu/pip_download.sh

cmd=${1:-}
[ $# -gt 0 ] && shift
case "$cmd" in
  pack)
    [ -f "$embedder_src/modules.json" ] || die "no embedder in $embedder_src (set KVI_EMBEDDER)"
    rm -rf .servebench && mkdir -p .servebench
    cp -r "$embedder_src" .servebench/embedder
    rm -f .servebench/embedder/*.safetensors .servebench/embedder/.kvi-*
    # the weights in fp16 (the gateway loads them as fp32)
    nice "$venv_py" - "$embedder_src" .servebench/embedder <<'EOF'
import os, sys, torch
from safetensors.torch import load_file, save_file
src, dst = sys.argv[1:3]
for f in os.listdir(src):
    if f.endswith(".safetensors"):
        t = load_file(os.path.join(src, f))
        save_file({k: (v.half() if v.is_floating_point() else v).contiguous() for k, v in t.items()},
                  os.path.join(dst, f), metadata={"format": "pt"})
EOF
    du -sh .servebench/embedder
    mkdir -p .servebench/wheels
    pip_download .servebench/wheels -r tests/gpu/serve_bench.requirements
    du -sh .servebench/wheels
    (cd .servebench && ../tests/gpu/stage.sh pack servebench embedder wheels >/dev/null)
    mkdir -p .stage && rm -rf .stage/servebench.[0-9][0-9]
    mv .servebench/.stage/servebench.* .stage/
    rm -rf .servebench
    ls -d .stage/servebench.*
    du -sh .stage/servebench.*
    ;;
  run)
    model=""
    for d in /dev/shm/kvi-model /tmp/kvi-model; do [ -f "$d/config.json" ] && model=$d && break; done
    [ -n "$model" ] || die "no model in /dev/shm/kvi-model or /tmp/kvi-model (tests/gpu/vllm_gpu.sh setup writes it)"
    [ -f "$site/vllm/__init__.py" ] || die "no vLLM in $site (tests/gpu/vllm_gpu.sh stage x2 and setup first)"
    [ -f "$build/lib/libkvinject.so" ] || die "no $build/lib/libkvinject.so (tests/gpu/vllm_gpu.sh setup builds it)"
    if [ ! -f "$embedder/modules.json" ]; then
      tests/gpu/stage.sh take
      tests/gpu/stage.sh open servebench /tmp/kvi-embedder \
        || die "the embedder's part has not arrived (carry .stage/servebench.00)"
    fi
    if [ ! -f "$site/.kvi-serve-wheels" ]; then
      python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
        /tmp/kvi-embedder/wheels/*.whl 2>&1 | grep -v "^WARNING: Target directory" || true
      PYTHONPATH=$site:$PWD/python python3 tests/gpu/vllm_deps.py --import-check serve \
        || die "vLLM's server does not import (above: the missing modules; add their wheels to tests/gpu/serve_bench.requirements)"
      touch "$site/.kvi-serve-wheels"
    fi
    mkdir -p "$out" "$results" /tmp/kvi-bin
    if [ ! -f "$results/serve_bench.json" ] && [ -f .serve-bench/serve_bench.json ]; then
      cp .serve-bench/serve_bench.json "$results/"
      echo "serve_bench.sh: going on from the carried .serve-bench/serve_bench.json"
    fi
    # `vllm serve` for servers.py: vLLM is installed with --target, no console script next to python3
    printf '#!/bin/sh\nexec python3 -m vllm.entrypoints.cli.main "$@"\n' > /tmp/kvi-bin/vllm
    chmod +x /tmp/kvi-bin/vllm
    export PYTHONPATH=$site:$PWD/python KVINJECT_LIBRARY=$build/lib/libkvinject.so HF_HUB_OFFLINE=1 \
      VLLM_NO_USAGE_STATS=1 DO_NOT_TRACK=1 VLLM_USE_FLASHINFER_SAMPLER=0 TOKENIZERS_PARALLELISM=false \
      PYTHONUNBUFFERED=1 KVI_EMBEDDER=$embedder KVI_VLLM_EXECUTABLE=/tmp/kvi-bin/vllm
    limit=${SERVE_BENCH_TIMEOUT:-540}
    set +e
    timeout -k 30 "$limit" python3 tests/gpu/serve_bench.py --device gpu --model "$model" --out "$results" \
      --time-budget $((limit - 60)) "$@" >"$results/serve_bench.log" 2>&1
    rc=$?
    set -e
    grep -E "^serve_bench|Error|Traceback" "$results/serve_bench.log" | tail -40
    cp "$results"/serve_bench.json "$results"/serve_bench.md "$results"/*.log "$out/" 2>/dev/null || true
    [ -f "$results/serve_bench.md" ] && cat "$results/serve_bench.md"
    [ $rc -eq 0 ] || [ $rc -eq 3 ] || tail -40 "$results/replica.log" 2>/dev/null || true
    echo "serve_bench.sh: serve_bench.py rc=$rc"
    exit $rc
    ;;
  *)
    die "usage: serve_bench.sh pack | run [serve_bench.py args]"
    ;;
esac
