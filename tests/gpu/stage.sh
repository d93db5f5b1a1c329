#!/usr/bin/env bash
# Moves files larger than one device command may carry (64 MiB in all) onto the
# GPU machine in parts, over consecutive commands while the machine is held.
#
#   tests/gpu/stage.sh pack NAME PATH...  (here) tar PATHs (relative to the
#       current directory) into .stage/NAME.00, .stage/NAME.01, ... each one
#       part of at most STAGE_PART_MIB (default 56) MiB plus NAME.manifest
#       (part count and SHA-256 of the whole archive). Prints the part folders.
#   tests/gpu/stage.sh take               (there) moves every carried part under
#       .stage/ into /tmp/kvi-stage/NAME/ (kept while the machine is held).
#   tests/gpu/stage.sh open NAME DEST     (there) once every part of NAME has
#       arrived: joins them, checks the SHA-256 and extracts into DEST. Exit 3,
#       naming the missing parts, when some have not; exit 1 on a bad checksum.
#
# One command carries one part folder (carry: [".stage/NAME.NN"]) and starts
# with `tests/gpu/stage.sh take`; the last also runs `open`. /.stage/ is ignored.
set -euo pipefail

STAGE_DIR=/tmp/kvi-stage

die() { echo "stage.sh: $*" >&2; exit 1; }

cmd=${1:-}
case "$cmd" in
  pack)
    [ $# -ge 3 ] || die "usage: stage.sh pack NAME PATH..."
    name=$2; shift 2
    [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "NAME must be letters, digits, _ or -"
    mib=${STAGE_PART_MIB:-56}
    rm -rf .stage/"$name".[0-9][0-9]
    mkdir -p .stage
    tmp=$(mktemp -d)
    tar -cf "$tmp/all.tar" "$@"
    sum=$(sha256sum "$tmp/all.tar" | cut -d' ' -f1)
    split -b "${mib}M" -d -a 2 "$tmp/all.tar" "$tmp/part."
    n=$(ls "$tmp"/part.* | wc -l)
    for p in "$tmp"/part.*; do
      i=${p##*.}
      mkdir -p .stage/"$name.$i"
      mv "$p" .stage/"$name.$i/part"
      printf '%s %s\n' "$n" "$sum" > .stage/"$name.$i/$name.manifest"
      echo ".stage/$name.$i"
    done
    rm -rf "$tmp"
    ;;
  take)
    [ -d .stage ] || exit 0
    for d in .stage/*.[0-9][0-9]; do
      [ -f "$d/part" ] || continue
      base=${d##*/}; name=${base%.*}; i=${base##*.}
      mkdir -p "$STAGE_DIR/$name"
      cp "$d/$name.manifest" "$STAGE_DIR/$name/manifest"
      mv "$d/part" "$STAGE_DIR/$name/part.$i"
      echo "stage.sh: took $name part $i ($(du -h "$STAGE_DIR/$name/part.$i" | cut -f1))"
    done
    ;;
  open)
    [ $# -eq 3 ] || die "usage: stage.sh open NAME DEST"
    name=$2; dest=$3; dir=$STAGE_DIR/$name
    [ -f "$dir/manifest" ] || { echo "stage.sh: no part of $name has arrived" >&2; exit 3; }
    read -r n sum < "$dir/manifest"
    missing=""
    for ((i = 0; i < n; i++)); do
      f=$(printf '%s/part.%02d' "$dir" "$i")
      [ -f "$f" ] || missing="$missing $(printf '%02d' "$i")"
    done
    [ -z "$missing" ] || { echo "stage.sh: $name lacks parts:$missing" >&2; exit 3; }
    got=$(cat "$dir"/part.* | sha256sum | cut -d' ' -f1)
    [ "$got" = "$sum" ] || die "$name: checksum $got, expected $sum"
    mkdir -p "$dest"
    cat "$dir"/part.* | tar -xf - -C "$dest"
    echo "stage.sh: $name opened into $dest"
    ;;
  *)
    die "usage: stage.sh pack NAME PATH... | take | open NAME DEST"
    ;;
esac
