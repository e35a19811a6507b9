#!/usr/bin/env bash
# What the multi-host tests leave behind in /dev/shm, and of Open MPI's session directories in the
# temporary directory. Only names the tests could create count, so the check holds while other
# tests (or other build trees' pretend hosts) write there beside them: the names that hold a set
# name of this build tree (`moeep-ID-`), such as Open MPI's segments named after a pretend host
# (`vader_segment.moeep-ID-2-h0.*`), the sets' job folders (`moeep-ID-2`) and session
# directories (`ompi.moeep-ID-2-h0.0`).
#   shm_check.sh before LIST ID   writes those names into LIST (run before the first hosts test)
#   shm_check.sh after LIST ID    fails naming each of them that was not in LIST (run after the last,
#                                 after the sets were taken down)
set -uo pipefail
. "$(dirname "$0")/common.sh"
step=${1:-} list=${2:-} id=${3:-}
[ -n "$list" ] && [ -n "$id" ] || { echo "usage: shm_check.sh before|after LIST ID"; exit 2; }
tmp=${TMPDIR:-/tmp}
own_names() {
  {
    ls -A /dev/shm 2>/dev/null | grep -F "moeep-$id-" | sed 's|^|/dev/shm/|'
    ls -A "$tmp" 2>/dev/null | grep -F "ompi.moeep-$id-" | sed "s|^|$tmp/|"
  } | sort
}
case "$step" in
  before)
    own_names >"$list"
    echo "before the hosts tests: $(wc -l <"$list") name(s) of this build tree's sets (moeep-$id-*)" ;;
  after)
    if ! reason=$("$pretend_hosts" check); then
      echo "SKIPPED: $reason"
      exit "$skip_code"
    fi
    [ -e "$list" ] || { echo "FAIL: no listing from before the hosts tests ($list)"; exit 1; }
    left=$(comm -13 "$list" <(own_names))
    rm -f "$list"
    if [ -n "$left" ]; then
      echo "FAIL: the hosts tests left behind:"
      echo "$left" | sed 's/^/  /'
      exit 1
    fi
    echo "PASS: nothing of this build tree's sets (moeep-$id-*) left in /dev/shm or $tmp" ;;
  *) echo "usage: shm_check.sh before|after LIST ID"; exit 2 ;;
esac
