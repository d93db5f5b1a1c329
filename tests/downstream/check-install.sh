#!/usr/bin/env bash
# Downstream check: install the just-built project into a temporary DESTDIR,
# check the installed tree, then build a C and a C++ program against it using
# nothing but `pkg-config --cflags --libs kvinject`, and run them.
#
# Meson runs it (tests/downstream/meson.build) as:
#   check-install.sh BUILD_ROOT SOURCE_ROOT MESON PREFIX LIBDIR INCLUDEDIR \
#                    VERSION SOVERSION CUDA CUBLASLT NCCL
# LIBDIR and INCLUDEDIR are absolute (prefix joined); CUDA, CUBLASLT and NCCL
# are true/false as the build configured them.
#
# Exit 77 (skipped) only when pkg-config is missing.
#
# SPDX-License-Identifier: Apache-2.0
set -euo pipefail
unset LD_LIBRARY_PATH # meson points it at the build tree; the programs must find the installed library

if [ $# -ne 11 ]; then
  echo "usage: $0 BUILD_ROOT SOURCE_ROOT MESON PREFIX LIBDIR INCLUDEDIR VERSION SOVERSION CUDA CUBLASLT NCCL" >&2
  exit 2
fi
build=$1 srcroot=$2 meson=$3 prefix=$4 libdir=$5 includedir=$6
version=$7 soversion=$8 want_cuda=$9 want_cublaslt=${10} want_nccl=${11}
here=$srcroot/tests/downstream

fail() {
  echo "FAIL: $*" >&2
  exit 1
}
step() { echo "--- $*"; }

if ! command -v pkg-config >/dev/null 2>&1; then
  echo "SKIP: pkg-config not found"
  exit 77
fi
command -v cc >/dev/null 2>&1 || fail "no C compiler 'cc' in PATH"

tmp=$(mktemp -d "${TMPDIR:-/tmp}/kvinject-downstream.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
dest=$tmp/destdir
D_prefix=$dest$prefix
D_libdir=$dest$libdir
D_includedir=$dest$includedir

# ------------------------------------------------------------------ install
step "meson install --destdir $dest"
"$meson" install -C "$build" --destdir "$dest" --no-rebuild --quiet ||
  fail "meson install into $dest failed"

# ------------------------------------------------------------ installed tree
step "installed tree"
for h in kvinject.h kvinject/common.h kvinject/model.h kvinject/store.h kvinject/version.h; do
  [ -f "$D_includedir/$h" ] || fail "header not installed: $includedir/$h"
done
for h in "$srcroot"/include/kvinject/*.h; do
  [ -f "$D_includedir/kvinject/${h##*/}" ] || fail "public header ${h##*/} is in include/kvinject but not installed"
done
if grep -n '@[A-Z_]*@' "$D_includedir/kvinject/version.h"; then
  fail "installed version.h has unsubstituted @VARIABLES@"
fi

real=$D_libdir/libkvinject.so.$version
soname_link=$D_libdir/libkvinject.so.$soversion
dev_link=$D_libdir/libkvinject.so
[ -f "$real" ] && [ ! -L "$real" ] || fail "library not installed as a file: $libdir/libkvinject.so.$version"
[ -L "$soname_link" ] || fail "soname symlink missing: $libdir/libkvinject.so.$soversion"
[ -L "$dev_link" ] || fail "development symlink missing: $libdir/libkvinject.so"
for l in "$soname_link" "$dev_link"; do
  [ "$(readlink -f "$l")" = "$(readlink -f "$real")" ] || fail "${l##*/} does not resolve to libkvinject.so.$version"
done
if command -v readelf >/dev/null 2>&1; then
  dyn=$(LC_ALL=C readelf -d "$real")
  echo "$dyn" | grep -q "Library soname: \[libkvinject.so.$soversion\]" ||
    fail "installed library's soname is not libkvinject.so.$soversion"
  if echo "$dyn" | grep -E '\((RPATH|RUNPATH)\)' | grep -qF "$build"; then
    fail "installed library keeps a run path into the build directory"
  fi
fi

pc_file=$D_libdir/pkgconfig/kvinject.pc
[ -f "$pc_file" ] || fail "pkg-config file not installed: $libdir/pkgconfig/kvinject.pc"
# --define-variable=prefix relocates the .pc only if prefix= comes first and
# the other paths are written in terms of ${prefix}.
first=$(head -n 1 "$pc_file")
[ "$first" = "prefix=$prefix" ] || fail "first line of kvinject.pc is '$first', expected 'prefix=$prefix'"

# ---------------------------------------------------------------- pkg-config
step "pkg-config (PKG_CONFIG_PATH=$D_libdir/pkgconfig, prefix=$D_prefix)"
export PKG_CONFIG_PATH=$D_libdir/pkgconfig
export PKG_CONFIG_LIBDIR=$D_libdir/pkgconfig # nothing else: never a system-installed kvinject.pc
unset PKG_CONFIG_SYSROOT_DIR PKG_CONFIG_ALLOW_SYSTEM_CFLAGS PKG_CONFIG_ALLOW_SYSTEM_LIBS
pc() { pkg-config --define-variable=prefix="$D_prefix" "$@" kvinject; }

pc --exists || fail "pkg-config does not find kvinject in $PKG_CONFIG_PATH"
[ "$(pc --modversion)" = "$version" ] || fail "pkg-config --modversion is '$(pc --modversion)', expected $version"
for var in libdir includedir; do
  val=$(pc --variable=$var)
  case "$val" in
    "$dest"/*) ;;
    *) fail "kvinject.pc: $var resolves to '$val' with prefix=$D_prefix; it should be written as \${prefix}/... (line: $(grep "^$var=" "$pc_file"))" ;;
  esac
done
[ "$(pc --variable=libdir)" = "$D_libdir" ] || fail "libdir from pkg-config is $(pc --variable=libdir), expected $D_libdir"
[ "$(pc --variable=includedir)" = "$D_includedir" ] ||
  fail "includedir from pkg-config is $(pc --variable=includedir), expected $D_includedir"

check_var() {
  local got
  got=$(pc --variable="$1")
  [ "$got" = "$2" ] || fail "pkg-config --variable=$1 kvinject is '$got', this build has $1=$2"
  echo "    $1=$got"
}
check_var cuda "$want_cuda"
check_var cublaslt "$want_cublaslt"
check_var nccl "$want_nccl"
archs=$(pc --variable=cuda_archs)
if [ "$want_cuda" = true ]; then
  [ -n "$archs" ] || fail "cuda=true but cuda_archs is empty"
else
  [ -z "$archs" ] || fail "cuda=false but cuda_archs is '$archs'"
fi

read -r -a cflags <<<"$(pc --cflags)"
read -r -a libs <<<"$(pc --libs)"
echo "    cflags: ${cflags[*]-}"
echo "    libs:   ${libs[*]}"

run_consumer() { # name binary
  local ldd_out
  if command -v ldd >/dev/null 2>&1; then
    ldd_out=$(LD_LIBRARY_PATH=$D_libdir ldd "$2" | grep libkvinject || true)
    case "$ldd_out" in
      *"=> $D_libdir/libkvinject.so.$soversion"*) ;;
      *) fail "$1 does not load the installed library: $ldd_out" ;;
    esac
  fi
  LD_LIBRARY_PATH=$D_libdir "$2" || fail "$1 failed (exit $?)"
}

# ------------------------------------------------------------------------ C
step "C program: cc \$(pkg-config --cflags --libs kvinject)"
cc -std=c99 -pedantic -Wall -Wextra -Werror "-DEXPECTED_VERSION=\"$version\"" \
  ${cflags[@]+"${cflags[@]}"} "$here/consumer.c" -o "$tmp/consumer-c" "${libs[@]}" ||
  fail "the C program does not build against the installed package"
run_consumer "the C program" "$tmp/consumer-c"

# ---------------------------------------------------------------------- C++
if command -v c++ >/dev/null 2>&1; then
  step "C++ program: c++ \$(pkg-config --cflags --libs kvinject)"
  c++ -std=c++11 -pedantic -Wall -Wextra -Werror "-DEXPECTED_VERSION=\"$version\"" \
    ${cflags[@]+"${cflags[@]}"} "$here/consumer.cpp" -o "$tmp/consumer-cxx" "${libs[@]}" ||
    fail "the C++ program does not build against the installed package"
  run_consumer "the C++ program" "$tmp/consumer-cxx"
else
  echo "--- C++ program: skipped, no 'c++' compiler in PATH"
fi

echo "downstream: OK"
