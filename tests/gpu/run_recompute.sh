#!/usr/bin/env bash
# Selective recompute on the GPU machine: the CUDA deviation kernel against the
# CPU (gpu-recompute), the transformers correctness checks on the model
# (python/tests/vllm/test_recompute.py --device cuda), then the accuracy and
# TTFT table of kvinject_bench.recompute_eval (re-prefill, injection,
# injection + recompute configurations). Needs an already-built CUDA
# libkvinject (tests/gpu/run_device.sh builds one), python3 with torch,
# transformers and pytest, and a Llama-family model directory with its tokenizer
# (SmolLM2-135M-Instruct: .ci/install-vllm converts it; tests/gpu/stage.sh
# carries it).
#
#   tests/gpu/run_recompute.sh MODEL_DIR [BUILD_DIR]   # BUILD_DIR default $KVINJECT_BUILD, else /tmp/kvi-build
#
# Output: $OUT (default /tmp/kvi-out)/recompute.md. RECOMPUTE_ARGS: extra
# arguments for recompute_eval (default: --facts 20 --cases 30
# --ttft-reps 10 --dtype bfloat16). PYTHON picks the interpreter.
set -uo pipefail
cd "$(dirname "$0")/../.."
model=${1:?usage: run_recompute.sh MODEL_DIR [BUILD_DIR]}
build=${2:-${KVINJECT_BUILD:-/tmp/kvi-build}}
out=${OUT:-/tmp/kvi-out}
py=${PYTHON:-python3}
mkdir -p "$out"
lib=$build/lib/libkvinject.so
[ -e "$lib" ] || { echo "run_recompute.sh: no library at $lib" >&2; exit 2; }
export KVINJECT_LIBRARY=$lib PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export PYTHONPATH=$PWD/python${PYTHONPATH:+:$PYTHONPATH}
rc=0
if [ -x "$build/tests/gpu/test_gpu_recompute" ]; then
  "$build/tests/gpu/test_gpu_recompute" || rc=1
fi
KVI_VLLM_MODEL=$model timeout 300 "$py" python/tests/vllm/launch.py --pytest-here python/tests/vllm/test_recompute.py \
  --device cuda || rc=1
# shellcheck disable=SC2086  # the extra arguments are words
timeout 500 "$py" -m kvinject_bench.recompute_eval "$model" --device cuda \
  ${RECOMPUTE_ARGS:---facts 20 --cases 30 --ttft-reps 10 --dtype bfloat16} 2>&1 | tee "$out/recompute.md"
[ "${PIPESTATUS[0]}" -eq 0 ] || rc=1
echo "run_recompute.sh: rc=$rc; table in $out/recompute.md"
exit $rc
