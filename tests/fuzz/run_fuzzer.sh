#!/bin/sh
# Runs a libFuzzer target over its committed seed corpus for a bounded number of runs, as a
# test: exit status 0 when nothing was found. New inputs go to a temporary directory (the seed
# corpus is only read); an input that crashes, leaks or trips a sanitizer is kept in
# fuzz-artifacts/ of the working directory (the build tree) and fails the test.
# Usage: run_fuzzer.sh FUZZER CORPUS_DIR [RUNS] [SECONDS]
set -eu
fuzzer=$1
corpus=$2
runs=${3:-20000}
seconds=${4:-60}
work=$(mktemp -d "${TMPDIR:-/tmp}/moe-ep-fuzz.XXXXXX")
trap 'rm -rf "$work"' EXIT INT TERM
artifacts="$(pwd)/fuzz-artifacts"
mkdir -p "$artifacts"
"$fuzzer" -runs="$runs" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 \
  -artifact_prefix="$artifacts/$(basename "$fuzzer")-" "$work" "$corpus"
