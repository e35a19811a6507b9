"""The ``deep_ep`` switch of an installed moe-ep: with ``MOE_EP_DEEP_EP`` set, ``import deep_ep``
resolves to ``moe_ep.deep_ep`` (docs/python.md, "Installing").

The wheel installs ``moe_ep_deep_ep.pth`` beside the packages; at interpreter start-up it imports
this module only when ``MOE_EP_DEEP_EP`` is set to something, so without the variable nothing
happens and a real DeepEP (or none) is what ``import deep_ep`` finds. This module imports nothing
but the standard library until ``deep_ep`` is imported (torch and moe_ep load then).

Values: unset, ``0`` or ``off``: inert. ``1`` or ``on``: ``import deep_ep`` (and every
``deep_ep.<module>``) is moe-ep's. ``cpu``: that, and the CPU compatibility layer
(``moe_ep.deep_ep.cpu_compat``, as ``MOE_EP_CPU_COMPAT=1``) is installed when ``deep_ep`` is
imported. Any other value: ``import deep_ep`` raises ImportError naming the value and these.
When a real ``deep_ep`` is installed too and the switch is on, importing ``deep_ep`` says so on
standard error, naming both.
"""

import importlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys

VARIABLE = "MOE_EP_DEEP_EP"
VALUES = {"": None, "0": None, "off": None, "1": "alias", "on": "alias", "cpu": "cpu"}
ACCEPTED = "unset, 0 or off (inert), 1 or on (import deep_ep resolves to moe_ep.deep_ep), cpu (that, and the CPU compatibility layer)"


def mode(value=None):
    """None (inert), "alias" or "cpu" for a value of MOE_EP_DEEP_EP; ValueError naming the value
    and the accepted ones otherwise."""
    value = os.environ.get(VARIABLE, "") if value is None else value
    key = value.strip().lower()
    if key not in VALUES:
        raise ValueError(f"{VARIABLE}={value!r} is not a value moe-ep knows; accepted: {ACCEPTED}")
    return VALUES[key]


class _AliasLoader(importlib.abc.Loader):
    """Loads ``deep_ep[.x]`` as the module ``moe_ep.deep_ep[.x]`` (the same object in sys.modules)."""

    def __init__(self, target, cpu):
        self.target, self.cpu = target, cpu

    def create_module(self, spec):
        return None  # a placeholder; exec_module puts the real module in its place

    def exec_module(self, module):
        real = importlib.import_module(self.target)
        if self.cpu:
            from moe_ep.deep_ep import cpu_compat
            if not cpu_compat.installed():
                cpu_compat.install()
        # The import system returns what sys.modules holds once exec_module is done.
        sys.modules[module.__spec__.name] = real


class _Refusal(importlib.abc.Loader):
    def __init__(self, error):
        self.error = error

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        raise ImportError(str(self.error), name=module.__spec__.name)


class DeepEpFinder(importlib.abc.MetaPathFinder):
    """Finds ``deep_ep`` and its submodules as moe-ep's, ahead of every other finder."""

    def __init__(self):
        self.warned = False

    def find_spec(self, fullname, path=None, target=None):
        if fullname != "deep_ep" and not fullname.startswith("deep_ep."):
            return None
        try:
            how = mode()
        except ValueError as e:
            return importlib.util.spec_from_loader(fullname, _Refusal(e))
        if how is None:
            return None  # switched off since start-up: the other finders decide
        if fullname == "deep_ep" and not self.warned:
            self.warned = True
            real = importlib.machinery.PathFinder.find_spec("deep_ep")
            if real is not None:
                where = real.origin or ", ".join(real.submodule_search_locations or [])
                ours = importlib.util.find_spec("moe_ep")
                sys.stderr.write(f"moe-ep: {VARIABLE}={os.environ.get(VARIABLE)}: import deep_ep resolves to "
                                 f"moe_ep.deep_ep ({os.path.dirname(ours.origin) if ours and ours.origin else 'moe_ep'}), "
                                 f"not to the DeepEP installed at {where}; unset {VARIABLE} to use that one\n")
        target_name = "moe_ep.deep_ep" + fullname[len("deep_ep"):]
        is_package = fullname == "deep_ep"
        spec = importlib.util.spec_from_loader(fullname, _AliasLoader(target_name, how == "cpu"),
                                               is_package=is_package)
        return spec


def install():
    """Puts the finder first on sys.meta_path (once)."""
    if not any(isinstance(f, DeepEpFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, DeepEpFinder())


def _startup():
    """What moe_ep_deep_ep.pth runs when MOE_EP_DEEP_EP is set: never raises (a .pth's error would
    print a traceback in every Python process); a value it does not know is refused at import deep_ep."""
    try:
        install()
    except Exception:  # pragma: no cover - the standard library only
        pass
