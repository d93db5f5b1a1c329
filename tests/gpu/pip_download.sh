# shellcheck shell=bash
# Sourced by tests/gpu/vllm_gpu.sh and tests/gpu/serve_bench.sh (here, to pack what
# the GPU machine installs with --no-index --no-deps):
#   pip_download DEST SPEC-OR-ARGS...   the CPython 3.12 manylinux x86_64 (or pure
#       Python) wheels of SPEC into DEST, without their dependencies.
pip_download() {
  local dest=$1; shift
  nice python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_26_x86_64 \
    --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_31_x86_64 --platform manylinux_2_34_x86_64 --platform manylinux_2_5_x86_64 \
    --platform manylinux1_x86_64 --platform any -d "$dest" "$@"
}
