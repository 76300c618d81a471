#!/usr/bin/env bash
# The test run's `g++` (tests/conftest.py writes it, its two paths filled in, to a dir it puts first
# on PATH): the real g++ under ccache, so a C++ kernel that several of the suite's builds compile
# is compiled by g++ once. Test runs
# only: the product never sees this, and Inductor still writes, links and loads every .so itself.
# Inductor compiles and links a kernel in one call, which ccache does not cache: such a call is
# split into a cached compile (-c) and a link. Each unit compiles under its own dir (a kernel's
# file name is its code's hash), so the compile runs in the source's dir, which is then ccache's
# base dir: the kernel's own bytes and flags are its identity, not where a build put it.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
path=":$PATH:"
path="${path//:$here:/:}"
path="${path#:}"
real="$(PATH="${path%:}" command -v g++)"
ccache="@CCACHE@"
export CCACHE_DIR="@CCACHE_DIR@"
export CCACHE_NOHASHDIR=1 CCACHE_COMPILERCHECK=content CCACHE_MAXSIZE=20G
export CCACHE_SLOPPINESS=include_file_mtime,include_file_ctime,time_macros,file_macro,locale
sources=() out="" next_out=0 compile_only=0 linked=0 flags=()
for arg in "$@"; do
  if [ $next_out = 1 ]; then out="$arg"; next_out=0; continue; fi
  case "$arg" in
    -o) next_out=1 ;;
    -c) compile_only=1 ;;
    -E|-S|-M|-MM|-MD|-MMD|-v|--version|-dump*) linked=-1 ;;
    -shared) linked=1 ;;
    /*.cpp|/*.cc|/*.cxx) sources+=("$arg") ;;
    -l*|-L*|-Wl,*) ;;
    *) flags+=("$arg") ;;
  esac
done
# One absolute source and an absolute output, compiled (-c) or compiled and linked (-shared).
if [ $linked = -1 ] || [ ${#sources[@]} != 1 ] || [[ "$out" != /* ]] || { [ $compile_only = 0 ] && [ $linked = 0 ]; }; then
  exec "$real" "$@"
fi
source="${sources[0]}"
# The suite's two workers build the same kernels at the same time (e.g. `built` beside
# `packaged_build` at the start): both missed and ran g++. One compile per kernel at a time, so
# the second waits for the first's object and hits. Inductor names each file by its code's and
# command line's hash: its name is the lock's. Held until this compile ends (ccache inherits it).
mkdir -p "$CCACHE_DIR/locks"
exec 9>"$CCACHE_DIR/locks/$(basename "$source").lock"
if command -v flock >/dev/null; then flock 9; fi
cd "$(dirname "$source")"
export CCACHE_BASEDIR="$PWD"
# Most of a cold compile (2.5 of 2.9 CPU-s for Inductor's largest .main.cpp of the tiny model) is
# g++ parsing Inductor's prefix header (ATen's vectors, thousands of -pedantic warnings). The
# header is precompiled once per command line (from the second compile that asks, so that a
# command line used once costs no ~7 CPU-s precompile) and found by g++ before the header itself:
# an `-I` dir first on the line, which g++ skips if the PCH does not fit. The object is
# byte-identical (compared), so ccache leaves that dir out of its hash: a kernel compiled before
# and after the PCH existed is one entry. Inductor's own PCH stays off (the product's setting).
pch=()
header="$(sed -n -E '/^[[:space:]]*(\/\/.*)?$/d; s@^#include <(torch/csrc/inductor/[^>]+)>.*@\1@p; q' "$source")"
# A compile that brings its own (AOTInductor's `-include` of Inductor's PCH) can use no other.
for arg in "${flags[@]}"; do if [ "$arg" = -include ]; then header=""; fi; done
if [ -n "$header" ]; then
  mkdir -p "$CCACHE_DIR/pch"
  export CCACHE_IGNOREOPTIONS="-I$CCACHE_DIR/pch/*"
  pch_dir="$CCACHE_DIR/pch/$(printf '%s\n' "$real" "$header" "${flags[@]}" | md5sum | cut -c1-32)"
  if [ ! -e "$pch_dir.asked" ]; then
    : >"$pch_dir.asked"
  elif [ ! -e "$pch_dir/$header.gch" ] && [ ! -e "$pch_dir.failed" ]; then
    # One precompile per command line; a compile that finds it under way goes on without it.
    exec 8>"$pch_dir.lock"
    if flock -n 8 && [ ! -e "$pch_dir/$header.gch" ]; then
      found=""
      for arg in "${flags[@]}"; do
        if [[ "$arg" == -I/* ]] && [ -f "${arg#-I}/$header" ]; then found="${arg#-I}/$header"; break; fi
      done
      mkdir -p "$(dirname "$pch_dir/$header")"
      if [ -n "$found" ] && "$real" "${flags[@]}" -x c++-header "$found" -o "$pch_dir/$header.gch.tmp" 2>/dev/null; then
        mv "$pch_dir/$header.gch.tmp" "$pch_dir/$header.gch"
      else
        : >"$pch_dir.failed"
      fi
    fi
    exec 8>&-
  fi
  if [ -e "$pch_dir/$header.gch" ]; then pch=("-I$pch_dir"); fi
fi
if [ $compile_only = 1 ]; then
  exec "$ccache" "$real" "${pch[@]}" "${@/#"$source"/$(basename "$source")}" "-ffile-prefix-map=$PWD=."
fi
object="$out.ccache.o"
trap 'rm -f "$object"' EXIT
compile=() link=()
skip=0
for arg in "$@"; do
  if [ $skip = 1 ]; then skip=0; continue; fi
  case "$arg" in
    -o) skip=1 ;;
    -l*|-L*|-shared|-Wl,*) link+=("$arg") ;;
    "$source") compile+=("$(basename "$source")"); link+=("$object") ;;
    *) compile+=("$arg"); link+=("$arg") ;;
  esac
done
# The object must not name this dir either (its debug info would): the same bytes from any dir.
"$ccache" "$real" "${pch[@]}" -c "${compile[@]}" "-ffile-prefix-map=$PWD=." -o "$object"
# The link (~0.3 CPU-s, for every kernel of every build, ccache's hits included) is a function of
# the object's bytes and the link's arguments: ld writes no time or path of its own (the same .so
# from any dir, compared). Linked once per run, that .so copied after.
linked="$CCACHE_DIR/links/$({ printf '%s\n' "$real" "${link[@]/#"$object"/}"; cat "$object"; } | md5sum | cut -c1-32).so"
if [ -f "$linked" ]; then
  cp "$linked" "$out"
else
  "$real" "${link[@]}" -o "$out"
  # Not kept (e.g. a full disk): the next link of it runs ld again, this one stands.
  { mkdir -p "$CCACHE_DIR/links" && cp "$out" "$linked.$$" && mv "$linked.$$" "$linked"; } 2>/dev/null || rm -f "$linked.$$"
fi
