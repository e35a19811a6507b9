#!/usr/bin/env bash
# The numpy checker must notice a corrupted dump: runs `moe-ep run --dump`, checks that the dump
# passes, flips one byte of one file and expects the checker to report a mismatch (exit status 1).
# Usage: dump_corrupt_check.sh MOE_EP CHECKER FILE BYTE [run options...]
# FILE is a dump file name (e.g. rank0_recv_x.npy); BYTE the offset into its data (negative: from
# the end), so that the flipped byte is one the checker compares.
set -euo pipefail
moe_ep=$1 checker=$2 file=$3 byte=$4
shift 4
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
python=/usr/bin/python3
[ -x "$python" ] || python=python3
"$moe_ep" run "$@" --dump "$dir" >/dev/null
"$python" "$checker" "$dir" >/dev/null || { echo "the intact dump does not pass"; exit 1; }
"$python" - "$dir/$file" "$byte" <<'PY'
import sys
import numpy as np
path, offset = sys.argv[1], int(sys.argv[2])
a = np.load(path)
raw = bytearray(open(path, "rb").read())
start = len(raw) - a.nbytes  # the data follow the header
raw[start + offset % a.nbytes] ^= 0x01
open(path, "wb").write(bytes(raw))
print(f"flipped bit 0 of data byte {offset % a.nbytes} of {path}")
PY
set +e
"$python" "$checker" "$dir"
status=$?
set -e
[ "$status" -eq 1 ] || { echo "check_dump exited with $status on the corrupted dump, expected 1"; exit 1; }
echo "check_dump reports the corruption"
