#!/usr/bin/env bash
# Every shell script of the project parses (bash -n): those under tests/ and
# examples/ (*.sh) and CI's (.ci/). Most run only on the GPU machine or in CI,
# where a syntax error costs a whole call. Argument: the source root.
set -u
root=${1:?usage: check_scripts.sh SOURCE_ROOT}
n=0 bad=0
while IFS= read -r -d '' f; do
  n=$((n + 1))
  if ! out=$(bash -n "$f" 2>&1); then
    echo "$f does not parse:"; echo "$out"; bad=$((bad + 1))
  fi
done < <(find "$root/tests" "$root/examples" -name '*.sh' -type f -print0; find "$root/.ci" -type f ! -name '*.*' -print0)
echo "$n scripts, $bad that do not parse"
[ "$n" -gt 0 ] && [ "$bad" -eq 0 ]
