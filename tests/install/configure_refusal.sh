#!/usr/bin/env bash
# configure_refusal.sh BUILD_DIR EXPECTED [VAR=VALUE ...] -- CMAKE_ARGS...: configures the project in
# BUILD_DIR (removed first) with the environment variables and CMake arguments given, and passes
# when the configure fails with a message containing EXPECTED (CMake's line breaks and indentation
# read as one space). What `pip install .` prints on a machine without the compiler or a library.
set -uo pipefail
build=$1 expected=$2
shift 2
envs=()
while [ $# -gt 0 ] && [ "$1" != -- ]; do envs+=("$1"); shift; done
shift
rm -rf "$build"
out=$(env "${envs[@]}" cmake -B "$build" "$@" 2>&1)
status=$?
rm -rf "$build"
flat=$(tr -s ' \n' '  ' <<<"$out")
if [ $status -eq 0 ]; then
  echo "configure_refusal: the configure succeeded; expected it to fail with: $expected"
  exit 1
fi
if ! grep -qF -- "$expected" <<<"$flat"; then
  echo "$out"
  echo "configure_refusal: the configure failed, but without: $expected"
  exit 1
fi
echo "configure_refusal: refused with: $expected"
