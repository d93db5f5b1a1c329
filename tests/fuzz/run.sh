#!/usr/bin/env bash
# Builds a libFuzzer target (clang, ASan + UBSan) in build-fuzz/ and fuzzes it
# for a bounded time from its seed corpus.
# Usage: tests/fuzz/run.sh [SECONDS] [TARGET]   (default 60 s, target load)
#   load: the store-file loader (fuzz_load.c; seeds written by fuzz_seeds.c)
#   api:  sequences of API calls against a shadow model (fuzz_api.c; seeds
#         committed in tests/fuzz/api-seeds/)
#   llama: llama.cpp sequence states (fuzz_llama.c; seeds committed in
#         tests/fuzz/llama-seeds/)
# Exits non-zero when the fuzzer finds a crash, a leak, undefined behaviour or
# a violated property; the input that did it is left in
# build-fuzz/fuzz-artifacts-TARGET/.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
target=${2:-load}
build=${KVI_FUZZ_BUILD:-build-fuzz}
case "$target" in load | api | llama) ;; *) echo "run.sh: unknown target $target (load, api, llama)" >&2; exit 2 ;; esac
if [ -d "$build" ]; then
  meson setup --reconfigure "$build" -Dfuzz=enabled -Dcuda=disabled -Dtests=disabled -Dexamples=false >/dev/null
else
  CC=clang meson setup "$build" -Dfuzz=enabled -Dcuda=disabled -Dtests=disabled -Dexamples=false >/dev/null
fi
meson compile -C "$build" "fuzz_$target" fuzz_seeds >/dev/null
corpus=$build/fuzz-corpus-$target
artifacts=$build/fuzz-artifacts-$target
log=$build/fuzz-$target.log
rm -rf "$corpus" "$artifacts"
mkdir -p "$corpus" "$artifacts"
if [ "$target" = load ]; then
  "$build"/tests/fuzz/fuzz_seeds "$corpus"
  max_len=16384
elif [ "$target" = api ]; then
  cp tests/fuzz/api-seeds/* "$corpus"/
  max_len=1024
else
  cp tests/fuzz/llama-seeds/* "$corpus"/
  max_len=4096
fi
"$build/tests/fuzz/fuzz_$target" -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=$max_len \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" >"$log" 2>&1 || {
  tail -60 "$log"
  echo "fuzz ($target): FAILED (input in $artifacts/)" >&2
  exit 1
}
grep -E '^(stat::|Done )|INITED|DONE' "$log" || true
echo "fuzz ($target): $(grep -E '^Done ' "$log" | tail -1); corpus $(ls "$corpus" | wc -l) inputs"
