#!/usr/bin/env bash
# The engine recipes of docs/integration.md ("Recipes, tested"), run as written. For each engine,
# the blocks marked `<!-- recipe: ENGINE/FILE -->` (conftest.py, test_recipe.py, run.sh) are written
# into a fresh temporary folder outside the source tree and ENGINE/run.sh runs there with bash, with
# `python` on PATH meaning the interpreter given. The recipes' install line (`pip install ...`) is
# not run: the interpreter's environment must already hold moe-ep (scripts/wheel-test.sh installs
# the wheel, then calls this script) and the engines. The switch (MOE_EP_DEEP_EP) and the
# compatibility layer's variable are cleared first, so each recipe runs with what its run.sh sets.
# Usage: tests/engines/recipes.sh PYTHON   Prints one line per engine with its time; exits non-zero,
# naming the engine and the block, when a marked block is missing or a recipe fails (its folder and
# output are kept then).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
doc=$root/docs/integration.md
engines=(megatron sglang vllm)
files=(conftest.py test_recipe.py run.sh)
timeout_s=300  # per recipe

if [ $# -ne 1 ]; then
  echo "usage: $0 PYTHON (the interpreter of an environment where moe-ep and the engines are installed)" >&2
  exit 2
fi
python=$1
if ! [ -x "$python" ]; then
  echo "recipes: $python is not an executable interpreter" >&2
  exit 2
fi
case $python in /*) ;; *) python=$(cd "$(dirname "$python")" && pwd)/$(basename "$python") ;; esac

# extract NAME: the fenced block that follows the line `<!-- recipe: NAME -->`, on stdout. Exit 2:
# no such marker (or more than one); 3: the marker is not followed by a fenced block.
extract() {
  awk -v marker="<!-- recipe: $1 -->" '
    $0 == marker { found++; state = 1; next }
    state == 1 { if ($0 ~ /^```/) { state = 2; next } bad = 1; state = 0; next }
    state == 2 { if ($0 ~ /^```[[:space:]]*$/) { state = 0; done++; next } print }
    END { if (bad) exit 3; if (found != 1 || done != 1) exit 2 }' "$doc"
}

# Every block of every engine first, so that a missing one fails before anything runs.
declare -A folder
cleanup() { for d in "${folder[@]}"; do [ -z "$d" ] || rm -rf "$d"; done; }
trap cleanup EXIT
for engine in "${engines[@]}"; do
  dir=$(mktemp -d "${TMPDIR:-/tmp}/moe-ep-recipe-$engine.XXXXXX")
  folder[$engine]=$dir
  for f in "${files[@]}"; do
    status=0
    extract "$engine/$f" >"$dir/$f" || status=$?
    if [ "$status" -ne 0 ]; then
      case $status in
        2) why="no block (or more than one) is marked <!-- recipe: $engine/$f -->" ;;
        3) why="the line <!-- recipe: $engine/$f --> is not followed by a fenced block" ;;
        *) why="extracting it failed (status $status)" ;;
      esac
      echo "recipes: $engine: block $engine/$f of docs/integration.md: $why" >&2
      exit 1
    fi
  done
  # `python` is the given interpreter: a wrapper, not a symbolic link, so that a virtual
  # environment's interpreter still finds its pyvenv.cfg (it looks beside the path it was run as).
  mkdir "$dir/bin"
  printf '#!/usr/bin/env bash\nexec %q "$@"\n' "$python" >"$dir/bin/python"
  chmod +x "$dir/bin/python"
done

total_start=$SECONDS
for engine in "${engines[@]}"; do
  dir=${folder[$engine]}
  start=$SECONDS
  status=0
  (cd "$dir" && env -u MOE_EP_DEEP_EP -u MOE_EP_CPU_COMPAT PATH="$dir/bin:$PATH" \
     timeout "$timeout_s" bash -euo pipefail run.sh) >"$dir/output.log" 2>&1 || status=$?
  if [ "$status" -ne 0 ]; then
    cat "$dir/output.log" >&2
    folder[$engine]=""  # kept for inspection
    if [ "$status" -eq 124 ]; then
      echo "recipes: $engine: block $engine/run.sh did not finish within $timeout_s s (kept in $dir)" >&2
    else
      echo "recipes: $engine: block $engine/run.sh failed with status $status after $((SECONDS - start)) s (kept in $dir)" >&2
    fi
    exit 1
  fi
  echo "recipes: $engine: passed in $((SECONDS - start)) s ($(tail -1 "$dir/output.log"))"
done
echo "recipes: ${#engines[@]} engines passed in $((SECONDS - total_start)) s"
