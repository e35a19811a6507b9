#!/usr/bin/env python3
"""Checks a `moe-ep run --dump DIR` directory with numpy alone (docs/dump-format.md).

Recomputes, from each rank's inputs and the expert parameters, what every rank must receive
(order, payload, wire casts, scales and their storage, ids, weights, metadata), what its experts
must return, and the combined output of every token with the reduction order of the API
(docs/semantics.md, docs/legacy.md, docs/dispatcher.md), then compares bit for bit. Expectations
are derived from the inputs only, never from the outputs under test.

config.json's "api" selects the checks (tools/dump_check/, one module per API): "v2"
(ElasticBuffer), "v1" (Buffer, normal mode), "v1_low_latency" (Buffer, low-latency mode, BF16 /
FP8 / NVFP4 dispatch, BF16 or LogFMT combine) or "dispatcher" (every batch of a `moe-ep run
--dispatcher` sequence, per its output format).
Exit status 0 when everything matches, 1 on a mismatch, 2 when the dump cannot be checked.
"""
import json
import sys

import dump_check  # noqa: F401  (first: it chooses numpy's CPU features before numpy is imported)
from dump_check.compare import MAX_ERRORS, Errors, Mismatches
from dump_check.dispatcher import check_dispatcher
from dump_check.low_latency import check_low_latency
from dump_check.v1 import check_v1
from dump_check.v2 import check_v2


def main(directory):
    try:
        cfg = json.load(open(f"{directory}/config.json"))
    except (OSError, ValueError) as e:
        print(f"check_dump: {directory}: no readable config.json ({e})")
        return 2
    api = cfg.get("api", "v2")
    checks = {"v2": check_v2, "v1": check_v1, "v1_low_latency": check_low_latency, "dispatcher": check_dispatcher}
    if api not in checks:
        print(f"check_dump: {directory}: unknown api '{api}'")
        return 2
    err = Errors()
    try:
        what = checks[api](directory, cfg, err)
    except Mismatches:
        what = None
    except (OSError, ValueError, KeyError) as e:
        print(f"check_dump: {directory}: cannot check this dump: {type(e).__name__}: {e}")
        return 2
    if err.items:
        print(f"check_dump: {directory} (api {api}): MISMATCH\n  " + "\n  ".join(err.items[:MAX_ERRORS]))
        return 1
    print(f"check_dump: {directory}: {what} match (numpy recomputation)")
    return 0


if __name__ == "__main__":
    if len(sys.argv) != 2:
        print("usage: check_dump.py DUMP_DIR")
        sys.exit(2)
    sys.exit(main(sys.argv[1]))
