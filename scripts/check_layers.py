#!/usr/bin/python3
"""The layer order of the library, checked on every #include "..." of src/ and include/moe_ep/,
and the public-API rule of the library's clients, checked on every #include "..." of python/src/
(with python/src/mpi/) and tools/.

Layers, bottom to top (docs/architecture.md):

    core -> comm -> routing -> engine -> elastic | legacy -> dispatcher -> cuda

cuda is the CUDA provider (src/cuda/, built only when nvcc is found): it implements the provider
interface of the dispatcher layer, so it sits above it and nothing in the library includes it.

A file may include headers of its own layer and of any layer below it; elastic and legacy are
two buffer generations on one level and may not include each other. Public headers belong to
the layer listed in PUBLIC_HEADERS and never include internal (src/) headers, because they are
installed without them. Every file of src/ and every public header must map to a layer.

The clients (CLIENTS: the Python extension in python/src/, the moe-ep tool in tools/) sit on top
of the public headers: a file there may include public headers (moe_ep/*.hpp), headers of its own
folder, and the headers its client's allow-list names, each with the reason it is needed. The
Python extension's list is empty; the tool's names the internals a command-line tool measures or
writes with. An allow-list entry that no file of its client includes is reported too, so each list
holds exactly what its client needs.

Exits 0 when every include respects these rules; otherwise prints one line per violation
(file:line, the include, the two layers or the rule) and exits 1. Only the standard library is
used, so Debian's /usr/bin/python3 runs it.
"""

import argparse
import pathlib
import re
import sys

# Rank of each layer: a file may include a layer of lower rank, or its own layer.
LAYERS = {"core": 0, "comm": 1, "routing": 2, "engine": 3, "elastic": 4, "legacy": 4, "dispatcher": 5, "cuda": 6}

# src/<folder>/ -> layer (src/comm/host and src/comm/mpi are part of comm).
SOURCE_FOLDERS = {name: name for name in LAYERS}

# include/moe_ep/<header> -> layer: the lowest layer whose code the header describes.
PUBLIC_HEADERS = {
    "error.hpp": "core",
    "limits.hpp": "core",
    "dtype.hpp": "core",
    "convert.hpp": "core",
    "tensor.hpp": "core",
    "event.hpp": "core",
    "env.hpp": "core",
    "version.hpp": "core",  # generated from version.hpp.in
    "group.hpp": "comm",
    "host.hpp": "comm",
    "mpi.hpp": "comm",
    "dispatch_types.hpp": "core",  # plain structs over core types; the V2 contract (core) checks them
    "elastic_buffer.hpp": "elastic",
    "agrs.hpp": "elastic",
    "legacy_buffer.hpp": "legacy",
    "provider.hpp": "dispatcher",
    "dispatcher.hpp": "dispatcher",
    "elastic_provider.hpp": "dispatcher",
}

# Folders outside the library that use it (with their subfolders): the internal headers each may
# include besides the public ones and its own folder's, as written in the #include, with the reason.
CLIENTS = {
    "python/src": {},  # the Python extension (moe_ep._C, moe_ep._C_mpi): public headers only
    "tools": {
        "core/arith.hh": "the commands size their buffers and layer model with the library's one round-up and ceil_div",
        "core/bandwidth.hh": "`moe-ep bench` reports its times against this machine's measured memory bandwidth",
        "core/env_vars.hh": "`moe-ep run` and `moe-ep env` read and report variables by their registry constants",
        "core/host_name.hh": "`moe-ep bench` reports name the host they ran on",
        "core/npy.hh": "--dump writes the .npy files that check_dump.py reads",
        "core/timeout.hh": "the buffers the commands build wait MOE_EP_TIMEOUT_SECS (core::timeout_from_env)",
        "cuda/bench_entry.hh": "`moe-ep bench --provider cuda` calls the CUDA provider's bench entry",
        "alltoallv_baseline.hh": "`moe-ep bench --transport mpi` compares with bench/'s MPI_Alltoallv baseline",
        "shared_window_baseline.hh": "`moe-ep bench --transport mpi` compares with bench/'s shared-window baseline",
        "scaleout_alone.hh": "`moe-ep bench --transport mpi` times bench/'s scale-out transfers alone",
        "reference/logfmt_reference.hh": "the layer model encodes LogFMT with tests/reference's independent codec",
        "reference/numeric_reference.hh": "the layer model rounds with tests/reference's independent format definitions",
    },
}

INCLUDE = re.compile(r'^\s*#\s*include\s*"([^"]+)"')


class Violation(Exception):
    pass


def layer_of(root, path):
    """The layer of a file under root (src/... or include/moe_ep/...), or raise Violation."""
    rel = path.relative_to(root)
    parts = rel.parts
    if parts[0] == "src":
        if len(parts) < 3 or parts[1] not in SOURCE_FOLDERS:
            raise Violation(f"{rel}: not in a layer folder of src/ ({', '.join(SOURCE_FOLDERS)})")
        return SOURCE_FOLDERS[parts[1]]
    if parts[:2] == ("include", "moe_ep") and len(parts) == 3:
        name = parts[2].removesuffix(".in")
        if name not in PUBLIC_HEADERS:
            raise Violation(f"{rel}: public header without a layer (add it to PUBLIC_HEADERS in "
                            f"scripts/check_layers.py and to docs/architecture.md)")
        return PUBLIC_HEADERS[name]
    raise Violation(f"{rel}: neither under src/ nor include/moe_ep/")


def resolve(root, including, target):
    """The file an #include "target" of `including` names, or None when it is not the library's."""
    for base in (including.parent, root / "src", root / "include"):
        candidate = base / target
        if candidate.is_file():
            return candidate.resolve()
    if target.startswith("moe_ep/") and (root / "include" / (target + ".in")).is_file():
        return (root / "include" / (target + ".in")).resolve()
    return None


def check(root):
    root = root.resolve()
    files = sorted(p for p in (root / "src").rglob("*") if p.suffix in (".cc", ".hh", ".hpp", ".h", ".cu", ".cuh"))
    files += sorted((root / "include" / "moe_ep").glob("*.hpp"))
    files += sorted((root / "include" / "moe_ep").glob("*.hpp.in"))
    problems = []
    for path in files:
        rel = path.relative_to(root)
        try:
            own = layer_of(root, path)
        except Violation as e:
            problems.append(str(e))
            continue
        public = rel.parts[0] == "include"
        for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            match = INCLUDE.match(line)
            if not match:
                continue
            target = match.group(1)
            found = resolve(root, path, target)
            if found is None:
                first = target.split("/")[0]
                if first in SOURCE_FOLDERS or first == "moe_ep":
                    problems.append(f'{rel}:{number}: includes "{target}", which is not a file of src/ or include/')
                continue  # a header of another project
            found_rel = found.relative_to(root)
            if public and found_rel.parts[0] == "src":
                problems.append(f'{rel}:{number}: public header (layer {own}) includes "{target}", an internal '
                                f'header ({found_rel}); installed headers include only public ones')
                continue
            try:
                theirs = layer_of(root, found)
            except Violation as e:
                problems.append(f'{rel}:{number}: includes "{target}": {e}')
                continue
            if theirs == own:
                continue
            if LAYERS[theirs] >= LAYERS[own]:
                relation = "above" if LAYERS[theirs] > LAYERS[own] else "beside"
                problems.append(f'{rel}:{number}: includes "{target}" of layer {theirs} from layer {own} '
                                f'({theirs} is {relation} {own}; order: core -> comm -> routing -> engine -> '
                                f'elastic | legacy -> dispatcher -> cuda)')
    return problems


def client_of(rel):
    """The CLIENTS key a file (path relative to the root) belongs to, or None."""
    for folder in CLIENTS:
        if rel.as_posix().startswith(folder + "/"):
            return folder
    return None


def check_clients(root):
    """Violations of the clients' rule: includes that are not public, not their own folder's and
    not on their client's allow-list; allow-list entries that nothing includes."""
    root = root.resolve()
    problems = []
    for folder, allowed in CLIENTS.items():
        base = root / folder
        sources = sorted(p for p in base.rglob("*") if p.suffix in (".cc", ".hh", ".hpp", ".h", ".cu", ".cuh"))
        if not sources:
            continue  # a tree without this client's code (the library alone, or a source package of the wheel)
        used = set()
        for path in sources:
            rel = path.relative_to(root)
            for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
                match = INCLUDE.match(line)
                if not match:
                    continue
                target = match.group(1)
                if (path.parent / target).is_file():
                    continue  # its own folder's header
                if target.startswith("moe_ep/") and "/" not in target[len("moe_ep/"):]:
                    name = target[len("moe_ep/"):]
                    if name in PUBLIC_HEADERS and resolve(root, path, target) is not None:
                        continue
                if target in allowed:
                    used.add(target)
                    continue
                problems.append(f'{rel}:{number}: includes "{target}", which is neither a public header '
                                f'(moe_ep/*.hpp) nor a header of {rel.parent.as_posix()}/; {folder}/ uses the '
                                f'library through its public headers (allow-list: CLIENTS["{folder}"] in '
                                f'scripts/check_layers.py, with the reason)')
        for target in sorted(set(allowed) - used):
            problems.append(f'{folder}/: the allow-list names "{target}", which no file of {folder}/ includes '
                            f'(remove it from CLIENTS["{folder}"] in scripts/check_layers.py)')
    return problems


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path(__file__).resolve().parent.parent,
                        help="the source tree to check (holds src/ and include/moe_ep/); default: this one")
    args = parser.parse_args()
    if not (args.root / "src").is_dir() or not (args.root / "include" / "moe_ep").is_dir():
        print(f"check_layers: {args.root} holds no src/ and include/moe_ep/", file=sys.stderr)
        return 2
    problems = check(args.root) + check_clients(args.root)
    for problem in problems:
        print(f"layer violation: {problem}", file=sys.stderr)
    if problems:
        print(f"check_layers: {len(problems)} violation(s) of the layer order or of the clients' public-API rule "
              f"(docs/architecture.md)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
