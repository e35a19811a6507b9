#!/usr/bin/env bash
# Runs `moe-ep run` with the log settings of CASE and checks what it logs (docs/logging.md).
# Usage: log_check.sh MOE_EP VERSION CASE
#   info      MOE_EP_DEBUG=INFO: the version line first, the group (topology, transport) of each
#             rank, the buffer size, path and worker count, every line with the host:pid:tid [rank] prefix
#   hybrid    the same on two logical nodes: the hybrid path
#   version   MOE_EP_DEBUG=VERSION: exactly one line, the version line
#   no_init   MOE_EP_DEBUG_SUBSYS=^INIT: no INIT line, the ENV lines stay
#   file      MOE_EP_DEBUG_FILE=DIR/log.%h.%p: the file named with host and pid holds the log, stderr nothing
#   warn_efa  FI_PROVIDER=efa caps the 129 queue pairs of a hybrid-capable V2 buffer: a WARN at level WARN
#   warn_provider  an unloadable provider before the built-in one: the dispatcher skips it with a WARN
#   bad_level MOE_EP_DEBUG=maybe: one warning naming the value and the accepted ones; logging off
set -euo pipefail
moe_ep=$1 version=$2 case=$3
dir=$(mktemp -d)
trap 'rm -rf "$dir"' EXIT
host=$(uname -n)  # gethostname()
shape=(--ranks 2 --tokens 16 --hidden 256 --experts 8 --topk 2 --iters 1)

fail() {
  echo "log_check $case: $*" >&2
  echo "--- stderr of the run:" >&2
  cat "$dir/err" >&2 || true
  exit 1
}
# Runs moe-ep in the background to learn its pid; stderr to $dir/err.
run() {
  "$moe_ep" run "$@" >"$dir/out" 2>"$dir/err" &
  pid=$!
  wait "$pid" || fail "moe-ep run failed"
}
has() { grep -Eq -- "$1" "${2:-$dir/err}" || fail "no line matches: $1"; }
hasnt() { ! grep -Eq -- "$1" "${2:-$dir/err}" || fail "a line matches: $1"; }
who() { echo "^${host}:${pid}:[0-9]+ \\[$1\\] moe-ep"; }  # the prefix, for rank $1

version_line() { echo "$(who '([0-9]+|-)') version ${version//./\\.}\$"; }

case $case in
  info)
    MOE_EP_DEBUG=INFO run "${shape[@]}"
    head -1 "$dir/err" | grep -Eq "$(version_line)" || fail "the first line is not the version line"
    # Every log line carries the prefix; the version line is the only one of its kind.
    [ "$(grep -c ' moe-ep ' "$dir/err")" -eq "$(grep -Ec "$(who '([0-9]+|-)') (version|INFO|WARN) " "$dir/err")" ] ||
      fail "a log line lacks the host:pid:tid [rank] prefix"
    [ "$(grep -Ec "$(version_line)" "$dir/err")" -eq 1 ] || fail "the version line is not there exactly once"
    for r in 0 1; do
      has "$(who $r) INFO INIT group: rank $r of 2, 1 logical node\\(s\\) x 2 ranks per node; transport local \\(ranks as threads of process $pid\\)\$"
      # One node: no record crosses a node, the buffer is the minimum of one 2 MiB unit (docs/sizing.md).
      has "$(who $r) INFO INIT ElasticBuffer #[0-9]+: 2097152 bytes of symmetric memory per rank; 2 ranks, 1 node\\(s\\) x 2 ranks per node \\(logical 1 x 2\\), direct \\(scale-up only\\) path; "
      has "$(who $r) INFO INIT ElasticBuffer #[0-9]+: [1-9][0-9]* worker thread\\(s\\) per rank for the copies"
    done
    has "$(who '[01]') INFO ENV MOE_EP_DEBUG set by environment to \"info\"\$"
    hasnt " TRACE "
    ;;
  hybrid)
    MOE_EP_DEBUG=info run --ranks 4 --nodes 2 --tokens 16 --hidden 256 --experts 8 --topk 2 --iters 1
    for r in 0 1 2 3; do
      has "$(who $r) INFO INIT group: rank $r of 4, 2 logical node\\(s\\) x 2 ranks per node; transport local "
      has "$(who $r) INFO INIT ElasticBuffer #[0-9]+: [0-9]+ bytes of symmetric memory per rank; 4 ranks, 2 node\\(s\\) x 2 ranks per node \\(logical 2 x 2\\), hybrid path; "
    done
    ;;
  version)
    MOE_EP_DEBUG=VERSION run "${shape[@]}"
    [ "$(wc -l <"$dir/err")" -eq 1 ] || fail "VERSION printed $(wc -l <"$dir/err") lines, expected 1"
    has "$(version_line)"
    ;;
  no_init)
    MOE_EP_DEBUG=INFO MOE_EP_DEBUG_SUBSYS=^INIT run "${shape[@]}"
    has "$(version_line)"
    hasnt " moe-ep [A-Z]+ INIT "
    has "$(who '([0-9]+|-)') INFO ENV MOE_EP_DEBUG_SUBSYS set by environment to \"\\^INIT\"\$"
    ;;
  file)
    MOE_EP_DEBUG=INFO MOE_EP_DEBUG_FILE="$dir/log.%h.%p" run "${shape[@]}"
    log="$dir/log.$host.$pid"
    [ -f "$log" ] || fail "no file $log (files: $(ls "$dir"))"
    head -1 "$log" | grep -Eq "$(version_line)" || fail "the file does not open with the version line"
    has "$(who 0) INFO INIT group: rank 0 of 2" "$log"
    has "$(who 1) INFO INIT ElasticBuffer #[0-9]+: 2097152 bytes of symmetric memory per rank" "$log"
    hasnt " moe-ep " "$dir/err"
    ;;
  warn_efa)
    MOE_EP_DEBUG=WARN FI_PROVIDER=efa run "${shape[@]}"
    has "$(version_line)"
    for r in 0 1; do
      has "$(who $r) WARN NET fabric: EFA allows 128 in-flight requests per peer: 129 queue pairs requested, 128 used\$"
    done
    hasnt " INFO "
    ;;
  warn_provider)
    MOE_EP_DEBUG=WARN MOE_EP_PROVIDER_PATH="$dir/no-such-provider.so:cpu" run --dispatcher --ranks 2 --tokens 16 \
      --hidden 256 --experts 8 --topk 2 --sequence PD --decode-tokens 8
    has "$(who '([0-9]+|-)') WARN INIT dispatcher: provider $dir/no-such-provider.so skipped: $dir/no-such-provider.so: cannot load library"
    ;;
  bad_level)
    MOE_EP_DEBUG=maybe run "${shape[@]}"
    [ "$(wc -l <"$dir/err")" -eq 1 ] || fail "expected one line on stderr"
    has "$(who '([0-9]+|-)') WARN ENV environment variable MOE_EP_DEBUG=\"maybe\" is invalid: accepted values are version \\| warn \\| info \\| trace \\| 0 \\| 1 \\| \\(empty\\); logging is off\$"
    ;;
  *)
    echo "log_check: unknown case $case" >&2
    exit 2
    ;;
esac
