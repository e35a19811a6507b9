#!/usr/bin/env bash
# Builds moe-ep (installing missing packages) and runs the whole test suite with CTest, three ways:
#  1. the Release build (build/): every test but the engines' (label engines), which run in
#     1b. the installed wheel (scripts/wheel-test.sh): sdist, wheel, auditwheel, a fresh
#     environment, and there the installation, engine and compatibility-layer tests;
#  2. AddressSanitizer + UndefinedBehaviorSanitizer, built with clang (build-asan/): every test,
#     the MPI ones included, plus the libFuzzer targets (label fuzz) for a bounded number of runs;
#  3. ThreadSanitizer, built with clang (build-tsan/): the suites where ranks are threads that
#     synchronise: the in-process transport, the buffers (V2, V1), the dispatcher and the CUDA
#     provider's algorithm on host threads; of the randomized cases, the first seeds (below).
# Any sanitizer finding stops its program and fails its test. Exits non-zero if anything failed.
# Env: JOBS (parallel builds and tests); MOE_EP_SANITIZERS=0 runs only the Release suite and the wheel pass;
# MOE_EP_QUICK=1 runs the quick form instead: the C++ suites, the tool and the examples of a
# Release build without Python, MPI, CUDA or benchmarks (build-quick/), in-process and host
# transport, without the full DeepSeek-V3-shaped runs (minutes, against half an hour).
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
jobs=${JOBS:-$(nproc)}
failed=()
big='^tool\.run_(default|v1|v1_low_latency|fp8_expand_align128|dispatcher_v2_low_latency)$'

# suite NAME BUILD_DIR [ctest arguments...]: runs CTest there with the variables in suite_env.
suite_env=()
suite() {
  local name=$1 dir=$2 start=$SECONDS
  shift 2
  echo "== $name: ctest in $dir"
  if env "${suite_env[@]}" ctest --test-dir "$dir" --output-on-failure -j "$jobs" --timeout 300 "$@"; then
    echo "== $name: passed in $((SECONDS - start)) s"
  else
    echo "== $name: FAILED after $((SECONDS - start)) s"
    failed+=("$name")
    # its logs, before the next suite in the same build folder replaces them
    local kept
    kept=$(mktemp -d)
    cp "$dir"/Testing/Temporary/LastTest*.log "$kept"/ 2>/dev/null || true
    recap+=("$name" "$kept")
  fi
}

# recap: at the very end, the last lines of each failed test's output, then the failed tests'
# names (CTest printed all of it above, long before the end of the log).
recap=()
print_recap() {
  local i name dir test names=()
  for ((i = 0; i < ${#recap[@]}; i += 2)); do
    name=${recap[i]} dir=${recap[i + 1]}
    [ -f "$dir/LastTestsFailed.log" ] || continue
    while IFS= read -r test; do
      test=${test#*:}
      names+=("$name: $test")
      echo "== $name: the end of $test's output:"
      awk -v t="$test" '/^[0-9]+\/[0-9]+ Test: / { on = (substr($0, index($0, ": ") + 2) == t) }
                        on && /^<end of output>$/ { on = 0 }
                        on' "$dir/LastTest.log" | tail -n 25 || true
    done <"$dir/LastTestsFailed.log"
  done
  ((${#names[@]})) && printf '== failed test: %s\n' "${names[@]}"
  return 0
}

# exit_if_failed: ends the command, with the recap, if any suite failed.
exit_if_failed() {
  ((${#failed[@]})) || return 0
  print_recap
  echo "FAILED: ${failed[*]}"
  exit 1
}

if [ "${MOE_EP_QUICK:-0}" = 1 ]; then
  CMAKE_ARGS="-DMOE_EP_WITH_PYTHON=OFF -DMOE_EP_WITH_MPI=OFF -DMOE_EP_WITH_CUDA=OFF -DMOE_EP_BUILD_BENCH=OFF" \
    "$root/scripts/bootstrap.sh" "$root/build-quick"
  suite quick "$root/build-quick" -E "$big"
  exit_if_failed
  echo "the quick suite passed"
  exit 0
fi

"$root/scripts/packages.sh"
if ! "$root/scripts/python-env.sh" --check >/dev/null; then
  # The Python environment is made (minutes, mostly waiting on the network) while the Release
  # build's C++ compiles; then the same build adds the Python package on it.
  env_log=$(mktemp)
  "$root/scripts/python-env.sh" >"$env_log" 2>&1 &
  env_pid=$!
  CMAKE_ARGS="-DMOE_EP_WITH_PYTHON=OFF" "$root/scripts/bootstrap.sh" "$root/build"
  if ! wait "$env_pid"; then
    cat "$env_log" >&2
    echo "== the Python environment could not be set up (above)" >&2
    exit 1
  fi
  rm -f "$env_log"
fi
"$root/scripts/bootstrap.sh" "$root/build"
# The engines' own DeepEP code (label engines) runs from the installed wheel, in the next pass.
suite release "$root/build" -LE '^engines$'

# The Python package as users install it: the sdist, the wheel built from it, auditwheel, a fresh
# environment with the wheel installed, and there the installation tests, the engines' tests, the
# example and the engine recipes (scripts/wheel-test.sh).
echo "== wheel: scripts/wheel-test.sh"
wheel_start=$SECONDS
if "$root/scripts/wheel-test.sh" "$root/build/wheel"; then
  echo "== wheel: passed in $((SECONDS - wheel_start)) s"
else
  echo "== wheel: FAILED after $((SECONDS - wheel_start)) s"
  failed+=(wheel)
fi

if [ "${MOE_EP_SANITIZERS:-1}" != 0 ]; then
  common=(UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1
          "LSAN_OPTIONS=suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0")

  echo "== building with AddressSanitizer + UndefinedBehaviorSanitizer (clang)"
  CC=clang-14 CXX=clang++-14 BUILD_TYPE=Debug \
    CMAKE_ARGS="-DMOE_EP_SANITIZE=address,undefined -DMOE_EP_FUZZ=ON -DMOE_EP_BUILD_BENCH=OFF -DMOE_EP_WITH_PYTHON=OFF" \
    "$root/scripts/bootstrap.sh" "$root/build-asan"
  asan=ASAN_OPTIONS=detect_leaks=1:check_initialization_order=1:strict_string_checks=1
  # The five runs of the full DeepSeek-V3 shape (4096 tokens x 7168 per rank, $big) take minutes
  # each under the sanitizers; the same paths run there at smaller shapes, and at full size in
  # the Release suite above.
  suite_env=("${common[@]}" "$asan")
  suite asan+ubsan "$root/build-asan" -LE '^mpi$' -E "$big"
  # MPI's plugins are unloaded at exit: their leaks are recognized only from full stacks.
  suite_env=(UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 "$asan"
             "LSAN_OPTIONS=suppressions=$root/tests/sanitizers/lsan.supp:print_suppressions=0:fast_unwind_on_malloc=0:malloc_context_size=40")
  suite asan+ubsan-mpi "$root/build-asan" -L '^mpi$'

  echo "== building with ThreadSanitizer (clang): the in-process suites"
  CC=clang-14 CXX=clang++-14 BUILD_TYPE=Debug \
    CMAKE_ARGS="-DMOE_EP_SANITIZE=thread -DMOE_EP_WITH_MPI=OFF -DMOE_EP_BUILD_BENCH=OFF -DMOE_EP_WITH_PYTHON=OFF" \
    TARGETS="comm_test elastic_test legacy_test dispatcher_test cuda_host_test" "$root/scripts/bootstrap.sh" "$root/build-tsan"
  suite_env=("${common[@]}" "TSAN_OPTIONS=halt_on_error=1:second_deadlock_stack=1:suppressions=$root/tests/sanitizers/tsan.supp")
  # The randomized cases differ in shapes and routings, not in how threads meet: under TSan the
  # first 8 of V2's 30 seeds and 4 of V1's 12 (all of them run in the two suites above).
  later_seeds='^Seeds/(RandomCases\.MatchReference/([89]|[1-9][0-9])|LegacyRandom\.NormalModeMatchesReference/([4-9]|1[0-9]))$'
  suite tsan "$root/build-tsan" -L '^(comm|elastic|legacy|dispatcher|cuda)$' -E "$later_seeds"
fi

exit_if_failed
echo "all suites passed"
