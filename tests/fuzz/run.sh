#!/usr/bin/env bash
# Builds the store-file loader's libFuzzer target (clang, ASan + UBSan) in
# build-fuzz/, writes its seed corpus and fuzzes for a bounded time.
# Usage: tests/fuzz/run.sh [SECONDS]   (default 60). Exits non-zero when the
# fuzzer finds a crash, a leak, undefined behaviour or a violated property;
# the input that did it is left in build-fuzz/fuzz-artifacts/.
set -euo pipefail
cd "$(dirname "$0")/../.."
secs=${1:-60}
build=${KVI_FUZZ_BUILD:-build-fuzz}
if [ -d "$build" ]; then
  meson setup --reconfigure "$build" -Dfuzz=enabled -Dcuda=disabled -Dtests=disabled -Dexamples=false >/dev/null
else
  CC=clang meson setup "$build" -Dfuzz=enabled -Dcuda=disabled -Dtests=disabled -Dexamples=false >/dev/null
fi
meson compile -C "$build" fuzz_load fuzz_seeds >/dev/null
corpus=$build/fuzz-corpus
artifacts=$build/fuzz-artifacts
rm -rf "$corpus" "$artifacts"
mkdir -p "$corpus" "$artifacts"
"$build"/tests/fuzz/fuzz_seeds "$corpus"
"$build"/tests/fuzz/fuzz_load -max_total_time="$secs" -timeout=10 -rss_limit_mb=2048 -max_len=16384 \
  -print_final_stats=1 -artifact_prefix="$artifacts/" "$corpus" >"$build/fuzz.log" 2>&1 || {
  tail -60 "$build/fuzz.log"
  echo "fuzz: FAILED (input in $artifacts/)" >&2
  exit 1
}
grep -E '^(stat::|Done )|INITED|DONE' "$build/fuzz.log" || true
echo "fuzz: $(grep -E '^Done ' "$build/fuzz.log" | tail -1); corpus $(ls "$corpus" | wc -l) inputs"
