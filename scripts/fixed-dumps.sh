#!/usr/bin/env bash
# Fixed runs of `moe-ep run --dump`, for checking that a change of the code leaves every output
# byte the same: V2 compact, expanded, FP8, across logical nodes (hybrid and direct), V1 normal
# and low-latency (BF16, FP8, LogFMT), the dispatcher's sequence on V1 and V2 and its V2 normal
# layouts (expanded, hybrid_ep, hybrid_ep across nodes). Compare two trees with
# scripts/compare-dumps.py.
# Usage: scripts/fixed-dumps.sh MOE_EP_BINARY OUT_DIR
set -euo pipefail
if [ $# -ne 2 ]; then sed -n '2,7p' "$0" >&2; exit 2; fi
bin=$1
out=$2
rm -rf "$out"
mkdir -p "$out"
common=(--ranks 4 --tokens 64 --hidden 256 --experts 16 --topk 4 --iters 1 --quiet)
w=(--workers 2)
status=0
run() {
  local name=$1
  shift
  if ! "$@" --dump "$out/$name" >"$out/$name.log" 2>&1; then
    echo "fixed-dumps: $name failed:" >&2
    cat "$out/$name.log" >&2
    status=1
  fi
}
run v2_compact "$bin" run "${common[@]}" "${w[@]}"
run v2_expanded "$bin" run "${common[@]}" "${w[@]}" --expand --alignment 4
run v2_fp8 "$bin" run "${common[@]}" "${w[@]}" --fp8
run v2_hybrid_nodes "$bin" run "${common[@]}" "${w[@]}" --nodes 2
run v2_direct_nodes_expanded "$bin" run "${common[@]}" "${w[@]}" --nodes 2 --no-hybrid --expand
run v1_normal "$bin" run "${common[@]}" "${w[@]}" --api v1
run v1_low_latency "$bin" run "${common[@]}" --api v1 --low-latency
run v1_low_latency_fp8 "$bin" run "${common[@]}" --api v1 --low-latency --fp8
run v1_low_latency_logfmt "$bin" run "${common[@]}" --api v1 --low-latency --logfmt
run dispatcher_v1 "$bin" run "${common[@]}" --dispatcher --mode auto
MOE_EP_USE_V2=1 run dispatcher_v2 "$bin" run "${common[@]}" --dispatcher --mode auto
MOE_EP_USE_V2=1 MOE_EP_V2_NORMAL_LAYOUT=expanded run dispatcher_v2_expanded "$bin" run "${common[@]}" --dispatcher --mode normal
MOE_EP_USE_V2=1 MOE_EP_V2_NORMAL_LAYOUT=hybrid_ep run dispatcher_v2_hybrid_ep "$bin" run "${common[@]}" --dispatcher --mode normal
MOE_EP_USE_V2=1 MOE_EP_V2_NORMAL_LAYOUT=hybrid_ep run dispatcher_v2_hybrid_ep_nodes "$bin" run "${common[@]}" --dispatcher --mode normal --nodes 2
echo "fixed-dumps: $(find "$out" -name '*.npy' | wc -l) arrays in $out"
exit $status
