#!/usr/bin/env bash
# vLLM's GPU cache layouts on the library's CUDA backend, through torch and
# without vLLM: python/tests/vllm/test_layouts.py --device cuda (for each of
# FlashAttention [2, NB, BS, H, D] and its HND view, FlashInfer / Triton
# [NB, 2, BS, H, D] and HND, packed K|V [NB, BS, H, 2D] / [NB, H, BS, 2D], and
# the CPU backend's container, in fp32 and bf16: kvinject.vllm.layout derives
# the layout from CUDA tensors, a fact is injected into them by a CUDA store,
# read back by indexing the tensors as the backend does against a float64
# rotation, the rest of the cache checked untouched, and captured back).
# Needs an already-built CUDA libkvinject (tests/gpu/run_device.sh builds one)
# and python3 with torch, pytest and a CUDA device; no vLLM, no network.
#
#   tests/gpu/run_vllm_layouts.sh [BUILD_DIR]   # default $KVINJECT_BUILD, else /tmp/kvi-build
#
# Exit 0 when every check passes (77: no device or not a CUDA build).
set -uo pipefail
cd "$(dirname "$0")/../.."
build=${1:-${KVINJECT_BUILD:-/tmp/kvi-build}}
lib=$build/lib/libkvinject.so
if [ ! -e "$lib" ]; then
  echo "run_vllm_layouts.sh: no library at $lib (build first, or pass the build directory)" >&2
  exit 2
fi
export KVINJECT_LIBRARY=$lib PYTHONPATH=$PWD/python PYTHONDONTWRITEBYTECODE=1
exec "${PYTHON:-python3}" python/tests/vllm/launch.py --pytest-here python/tests/vllm/test_layouts.py --device cuda
