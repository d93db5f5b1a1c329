#!/usr/bin/env bash
# Background jobs on the GPU machine that outlive one device command (they run
# until the machine is given back), so that long runs go on while later
# commands stage files or collect results.
#
#   tests/gpu/bg.sh start NAME [--after OTHER]... -- CMD...
#       copies the repository (without build folders) to /tmp/kvi-bg/NAME.src,
#       and runs CMD there in a new session once every OTHER job has finished;
#       output in /tmp/kvi-bg/NAME.log, exit status in /tmp/kvi-bg/NAME.rc.
#   tests/gpu/bg.sh status          one line per job: running, waiting or its rc
#   tests/gpu/bg.sh wait NAME [S]   waits up to S seconds (default 540) for NAME;
#                                   exit 0 if it finished with 0, 1 if it failed,
#                                   124 if still running
#   tests/gpu/bg.sh collect NAME... copies each job's log into $OUT (tail shown)
#
# A job's working copy is its own: the next command's fresh copy of the tree
# does not change files under a running job.
set -uo pipefail
BG=/tmp/kvi-bg
mkdir -p "$BG"
die() { echo "bg.sh: $*" >&2; exit 2; }

case "${1:-}" in
  start)
    name=${2:-}; shift 2 || die "usage: bg.sh start NAME [--after OTHER]... -- CMD..."
    [[ "$name" =~ ^[A-Za-z0-9_-]+$ ]] || die "NAME must be letters, digits, _ or -"
    after=()
    while [ $# -gt 0 ] && [ "$1" != "--" ]; do
      [ "$1" = "--after" ] || die "unexpected $1"
      after+=("$2"); shift 2
    done
    [ "${1:-}" = "--" ] || die "missing -- before the command"
    shift
    [ $# -gt 0 ] || die "no command"
    [ ! -f "$BG/$name.pid" ] || ! kill -0 "$(cat "$BG/$name.pid")" 2>/dev/null || die "$name is running"
    rm -rf "$BG/$name.src" "$BG/$name.rc" "$BG/$name.log"
    mkdir -p "$BG/$name.src"
    tar --exclude='./build*' --exclude='./.stage' -cf - . | tar -xf - -C "$BG/$name.src"
    printf '%q ' "$@" > "$BG/$name.cmd"
    waits=""
    for a in "${after[@]}"; do waits="$waits while [ ! -f $BG/$a.rc ]; do sleep 2; done;"; done
    setsid bash -c "$waits cd $BG/$name.src && echo \"bg: \$(date +%T) start\" && bash $BG/$name.cmd; \
      rc=\$?; echo \"bg: \$(date +%T) exit \$rc\"; echo \$rc > $BG/$name.rc" \
      > "$BG/$name.log" 2>&1 < /dev/null &
    echo $! > "$BG/$name.pid"
    echo "bg.sh: started $name (pid $!)${after:+ after ${after[*]}}"
    ;;
  status)
    for p in "$BG"/*.pid; do
      [ -f "$p" ] || continue
      n=$(basename "$p" .pid)
      if [ -f "$BG/$n.rc" ]; then s="exit $(cat "$BG/$n.rc")"
      elif kill -0 "$(cat "$p")" 2>/dev/null; then s="running"
      else s="gone"; fi
      echo "$n: $s; $(tail -c 300 "$BG/$n.log" 2>/dev/null | tail -1)"
    done
    ;;
  wait)
    name=${2:-}; secs=${3:-540}
    [ -f "$BG/$name.pid" ] || die "no job $name"
    end=$((SECONDS + secs))
    while [ ! -f "$BG/$name.rc" ] && [ $SECONDS -lt $end ]; do sleep 2; done
    [ -f "$BG/$name.rc" ] || { echo "bg.sh: $name still running"; exit 124; }
    [ "$(cat "$BG/$name.rc")" = 0 ]
    ;;
  collect)
    shift
    out=${OUT:-/tmp/kvi-out}; mkdir -p "$out"
    for n in "$@"; do
      [ -f "$BG/$n.log" ] || { echo "bg.sh: no log of $n"; continue; }
      cp "$BG/$n.log" "$out/$n.log"
      echo "== $n ($( [ -f "$BG/$n.rc" ] && echo "exit $(cat "$BG/$n.rc")" || echo running))"
      tail -n 25 "$BG/$n.log"
    done
    ;;
  *)
    die "usage: bg.sh start|status|wait|collect ..."
    ;;
esac
