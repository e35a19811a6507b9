"""What this installation of moe_ep holds, and the import of its optional parts.

``features()`` answers without side effects beyond loading what it reports on: the version, the
interpreter the extension was built for, the MPI transport (``moe_ep._C_mpi``, built where MPI was
found, loadable where the MPI library is installed), the CUDA provider (``libmoe_ep_cuda.so``,
built where nvcc was found), and the ``deep_ep`` switch (docs/python.md, "Installing")."""

import glob
import importlib
import importlib.machinery
import os
import sys

_HERE = os.path.dirname(os.path.abspath(__file__))


def extension_suffixes_found():
    """The suffixes of the ``_C`` extensions in this package (``.cpython-311-x86_64-linux-gnu.so``)."""
    return sorted(os.path.basename(p)[len("_C"):] for p in glob.glob(os.path.join(_HERE, "_C.*"))
                  if not os.path.basename(p).startswith("_C_"))


def explain_missing_extension(error):
    """An ImportError saying why ``moe_ep._C`` does not import here: built for another interpreter,
    not built at all, or a library it needs is missing (the loader's message)."""
    found = extension_suffixes_found()
    mine = importlib.machinery.EXTENSION_SUFFIXES
    here = f"CPython {sys.version_info.major}.{sys.version_info.minor} ({sys.executable})"
    if found and not any(s in mine for s in found):
        return ImportError(f"this moe_ep ({_HERE}) holds its extension built for another interpreter ("
                           f"{', '.join('_C' + s for s in found)}), not for {here}, which loads "
                           f"{', '.join('_C' + s for s in mine if s.startswith('.cpython'))}: install the "
                           f"moe-ep wheel built for this Python (pip install moe-ep, or pip install . from "
                           f"the source tree with this interpreter)")
    if not found:
        return ImportError(f"this moe_ep ({_HERE}) has no compiled extension moe_ep._C: it is a source "
                           f"folder, not an installation; pip install . builds one (docs/python.md)")
    return ImportError(f"moe_ep._C ({_HERE}) does not load in {here}: {error}")


def mpi_module():
    """``moe_ep._C_mpi``; TypeError when this moe_ep was built without MPI, ImportError when the
    MPI library it was built against cannot be loaded here."""
    try:
        return importlib.import_module("moe_ep._C_mpi")
    except ModuleNotFoundError as e:
        if e.name != "moe_ep._C_mpi":
            raise
        raise TypeError("group is an mpi4py communicator, but this moe_ep was built without the MPI transport "
                        "(no MPI was found where it was built; moe_ep.features()['mpi'])") from None
    except ImportError as e:
        raise ImportError(f"moe_ep's MPI transport (moe_ep._C_mpi) does not load: {e}; it needs the MPI library "
                          f"it was built against (Open MPI: libmpi.so.40, Debian's libopenmpi3)") from e


def features():
    """A dict: ``version``, ``python`` (the interpreter the extension was built for), ``mpi``
    (True when the MPI transport loads), ``mpi_detail`` (why not, when it does not), ``cuda``
    (True when a CUDA provider library is present and found a device), ``cuda_detail``, and
    ``deep_ep_switch`` (MOE_EP_DEEP_EP as the import hook reads it)."""
    from . import _C
    out = {"version": _C.__version__, "python": ", ".join(extension_suffixes_found())}
    try:
        mpi_module()
        out["mpi"], out["mpi_detail"] = True, ""
    except (TypeError, ImportError) as e:
        out["mpi"], out["mpi_detail"] = False, str(e)
    found = _C.cuda_provider(os.environ.get("MOE_EP_PROVIDER_PATH", ""))
    out["cuda"] = bool(found["available"])
    out["cuda_detail"] = found["origin"] if found["available"] else found["reason"]
    out["deep_ep_switch"] = os.environ.get("MOE_EP_DEEP_EP", "")
    return out
