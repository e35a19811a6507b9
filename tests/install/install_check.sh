#!/usr/bin/env bash
# Installs the build tree into a fresh prefix and uses it as an engine would, from another folder
# and with LD_LIBRARY_PATH unset: the installed `moe-ep --version`; the consumer project of
# tests/consumer built once with find_package(moe_ep) and once by hand with pkg-config, each
# program running a 2-rank dispatch + combine it checks itself; with MPI, consumer_mpi on 2 MPI
# processes (moe_ep::mpi and moe_ep_mpi.pc); with Python, `import moe_ep` and `import deep_ep`
# (the alias) from the prefix. Every
# installed program and library must resolve libmoe_ep from the prefix, not from the build tree.
# Usage: install_check.sh BUILD SOURCE VERSION CXX CMAKE PKG_CONFIG WITH_MPI WITH_PYTHON PYTHON [MPIEXEC [MPIEXEC_FLAGS...]]
# (WITH_MPI, WITH_PYTHON: ON or OFF; PYTHON: the interpreter, "none" without Python)
set -euo pipefail
build=$1 source=$2 version=$3 cxx=$4 cmake=$5 pkg_config=$6 with_mpi=$7 with_python=$8 python=$9
shift 9
mpiexec=()
(($#)) && mpiexec=("$@")

tmp=$(mktemp -d "${TMPDIR:-/tmp}/moe-ep-install.XXXXXX")
trap 'rm -rf "$tmp"' EXIT
prefix=$tmp/prefix
elsewhere=$tmp/elsewhere
mkdir -p "$elsewhere"
fail() { echo "install_check: $*" >&2; exit 1; }
step() { echo "== $*"; }
# Runs a program from another folder with LD_LIBRARY_PATH unset.
run_elsewhere() { (cd "$elsewhere" && env -u LD_LIBRARY_PATH "$@"); }
# The libmoe_ep* a program or library loads must come from the prefix.
check_resolves_into_prefix() {
  local file=$1 libs
  libs=$(cd "$elsewhere" && { env -u LD_LIBRARY_PATH ldd "$file" | grep 'libmoe_ep' || true; })
  [ -n "$libs" ] || fail "$file does not load libmoe_ep"
  if grep -v "=> $prefix/" <<<"$libs"; then
    fail "$file loads the libraries above from outside $prefix"
  fi
}

step "cmake --install $build --prefix $prefix"
"$cmake" --install "$build" --prefix "$prefix" >"$tmp/install.log" || { cat "$tmp/install.log"; fail "cmake --install failed"; }

config=$(find "$prefix" -name moe_epConfig.cmake)
[ -n "$config" ] || fail "no moe_epConfig.cmake under $prefix"
libdir=$(dirname "$(dirname "$(dirname "$config")")")
for f in "$libdir/libmoe_ep.so" "$libdir/libmoe_ep.so.${version%%.*}" "$libdir/libmoe_ep.so.$version" \
         "$libdir/cmake/moe_ep/moe_epConfigVersion.cmake" "$libdir/pkgconfig/moe_ep.pc" \
         "$prefix/include/moe_ep/version.hpp" "$prefix/bin/moe-ep"; do
  [ -e "$f" ] || fail "missing $f"
done
for h in "$source"/include/moe_ep/*.hpp; do
  [ -f "$prefix/include/moe_ep/$(basename "$h")" ] || fail "header $(basename "$h") not installed"
done
grep -q "MOE_EP_VERSION_STRING \"$version\"" "$prefix/include/moe_ep/version.hpp" || fail "installed version.hpp is not $version"
if [ "$with_mpi" = ON ]; then
  for f in "$libdir/libmoe_ep_mpi.so" "$libdir/libmoe_ep_mpi.so.${version%%.*}" "$libdir/pkgconfig/moe_ep_mpi.pc"; do
    [ -e "$f" ] || fail "missing $f"
  done
fi

step "installed moe-ep --version"
out=$(run_elsewhere "$prefix/bin/moe-ep" --version)
[ "$out" = "moe-ep $version" ] || fail "moe-ep --version printed '$out', expected 'moe-ep $version'"
check_resolves_into_prefix "$prefix/bin/moe-ep"

step "consumer built with find_package(moe_ep)"
mpi_flag=OFF
[ "$with_mpi" = ON ] && mpi_flag=ON
"$cmake" -S "$source/tests/consumer" -B "$tmp/cmake-build" -DCMAKE_BUILD_TYPE=Release -DCMAKE_CXX_COMPILER="$cxx" \
  -DCMAKE_PREFIX_PATH="$prefix" -DMOE_EP_EXPECTED_VERSION="$version" -DCONSUMER_WITH_MPI=$mpi_flag \
  >"$tmp/consumer-configure.log" || { cat "$tmp/consumer-configure.log"; fail "configuring the consumer failed"; }
grep "moe_ep $version from $libdir/cmake/moe_ep" "$tmp/consumer-configure.log" ||
  { cat "$tmp/consumer-configure.log"; fail "find_package did not find moe_ep $version in $prefix"; }
"$cmake" --build "$tmp/cmake-build" >"$tmp/consumer-build.log" 2>&1 || { cat "$tmp/consumer-build.log"; fail "building the consumer failed"; }
run_elsewhere "$tmp/cmake-build/consumer" "$version"
check_resolves_into_prefix "$tmp/cmake-build/consumer"

step "consumer built with c++ and pkg-config --cflags --libs moe_ep"
export PKG_CONFIG_PATH="$libdir/pkgconfig"
[ "$("$pkg_config" --modversion moe_ep)" = "$version" ] || fail "pkg-config --modversion moe_ep is not $version"
mkdir -p "$tmp/pc-build"
# shellcheck disable=SC2046  # pkg-config prints lists of flags
"$cxx" -std=c++20 -O1 "$source/tests/consumer/consumer.cc" -o "$tmp/pc-build/consumer" $("$pkg_config" --cflags --libs moe_ep)
run_elsewhere "$tmp/pc-build/consumer" "$version"
check_resolves_into_prefix "$tmp/pc-build/consumer"

if [ "$with_mpi" = ON ]; then
  step "consumer_mpi (moe_ep::mpi) on 2 MPI processes"
  run_elsewhere "${mpiexec[@]}" -np 2 "$tmp/cmake-build/consumer_mpi"
  check_resolves_into_prefix "$tmp/cmake-build/consumer_mpi"
  step "consumer_mpi built with c++ and pkg-config --cflags --libs moe_ep_mpi, on 2 MPI processes"
  # shellcheck disable=SC2046
  "$cxx" -std=c++20 -O1 "$source/tests/consumer/consumer_mpi.cc" -o "$tmp/pc-build/consumer_mpi" \
    $("$pkg_config" --cflags --libs moe_ep_mpi)
  run_elsewhere "${mpiexec[@]}" -np 2 "$tmp/pc-build/consumer_mpi"
  check_resolves_into_prefix "$tmp/pc-build/consumer_mpi"
fi

if [ "$with_python" = ON ]; then
  step "import moe_ep and the deep_ep alias from the prefix"
  ext=$(find "$prefix" -path '*/moe_ep/_C.*.so')
  [ -n "$ext" ] || fail "the Python extension moe_ep/_C is not installed"
  check_resolves_into_prefix "$ext"
  if [ "$with_mpi" = ON ]; then
    ext_mpi=$(find "$prefix" -path '*/moe_ep/_C_mpi.*.so')
    [ -n "$ext_mpi" ] || fail "the Python extension moe_ep/_C_mpi is not installed"
    check_resolves_into_prefix "$ext_mpi"
  fi
  pkgdir=$(dirname "$(dirname "$ext")")
  alias=$(find "$prefix" -type d -name deep_ep_alias)
  [ -n "$alias" ] || fail "the deep_ep alias folder is not installed"
  got=$(run_elsewhere env PYTHONPATH="$pkgdir:$alias" "$python" -c '
import moe_ep, moe_ep.deep_ep, deep_ep
from deep_ep import ElasticBuffer
assert deep_ep is moe_ep.deep_ep and ElasticBuffer is moe_ep.deep_ep.ElasticBuffer, "deep_ep is not moe_ep.deep_ep"
print(moe_ep.__version__, moe_ep.__file__)')
  [ "$got" = "$version $pkgdir/moe_ep/__init__.py" ] || fail "import moe_ep gave '$got', expected version $version from $pkgdir"
fi
echo "install_check: OK"
