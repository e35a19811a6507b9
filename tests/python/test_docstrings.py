"""Every public callable of ``moe_ep.deep_ep`` has a docstring, and it names each of its parameters.

Public: the names the package exports (``__all__``) and those of the modules beside it that engines
import (``deep_ep.utils``, ``deep_ep.hybrid_ep``, ``deep_ep.cpu_compat``, ``deep_ep.buffers.legacy``,
``deep_ep.buffers.elastic``, ``deep_ep.hybrid_ep_buffer``: their ``__all__``, else the public names
they define), and, recursively, every public method, static method, class method, property and
nested class of each class among them, inherited ones included. A docstring names a parameter when
its "Arguments:" section has a line ``    name: ...`` (DeepEP's layout); a class's constructor
parameters are named in the docstring of the class that defines ``__init__``, or in ``__init__``'s.
The parameters come from ``inspect.signature``; for the extension's functions (pybind11), whose
signature inspect cannot read, from the first line of their docstring, where pybind11 writes it.
"""

import importlib
import inspect
import re

import pytest

from moe_ep import deep_ep

MODULES = ("", ".utils", ".hybrid_ep", ".cpu_compat", ".buffers.legacy", ".buffers.elastic", ".hybrid_ep_buffer")
ROOT = deep_ep.__name__


def own_doc(obj):
    """obj's own docstring, cleaned (never one inherited from a base class's method), or ""."""
    doc = obj.__doc__ if isinstance(obj.__doc__, str) else ""
    return inspect.cleandoc(doc) if doc.strip() else ""


def split_top_level(text):
    """text split at the commas outside brackets."""
    parts, depth, current = [], 0, ""
    for c in text:
        if c in "([{<":
            depth += 1
        elif c in ")]}>":
            depth -= 1
        if c == "," and depth == 0:
            parts.append(current)
            current = ""
        else:
            current += c
    if current.strip():
        parts.append(current)
    return parts


def pybind_signature(name, doc):
    """(parameters, the docstring's text after the signature line) of a pybind11 function, whose
    docstring opens with ``name(arg: type = default, ...) -> type``."""
    first, _, rest = doc.partition("\n")
    m = re.match(r"^\s*" + re.escape(name) + r"\((.*)\)\s*(->.*)?$", first)
    if not m:
        return None, doc
    params = [p.split(":")[0].split("=")[0].strip().lstrip("*") for p in split_top_level(m.group(1))]
    return params, inspect.cleandoc(rest) if rest.strip() else ""


def parameters_and_doc(fn, name):
    """(the parameters a caller passes, the docstring that documents them) of a function."""
    target = fn.__func__ if isinstance(fn, (staticmethod, classmethod)) else fn
    try:
        sig = inspect.signature(target)
    except (TypeError, ValueError):
        params, doc = pybind_signature(name, target.__doc__ or "")
        if params is None:
            return None, doc
        return [p for p in params if p not in ("self", "cls")], doc
    params = [p.name for p in sig.parameters.values()]
    if params and params[0] in ("self", "cls") and not isinstance(fn, staticmethod):
        params = params[1:]
    return params, own_doc(target)


def arguments_section(doc):
    """The lines of the docstring's "Arguments:" section (None when it has none)."""
    lines = doc.split("\n")
    for i, line in enumerate(lines):
        if line.strip() == "Arguments:":
            indent = len(line) - len(line.lstrip())
            section = []
            for follow in lines[i + 1:]:
                if follow.strip() and len(follow) - len(follow.lstrip()) <= indent:
                    break
                section.append(follow)
            return section
    return None


def undocumented(params, doc):
    """The parameters the docstring does not name in its Arguments section."""
    if not params:
        return []
    section = arguments_section(doc)
    if section is None:
        return list(params)
    return [p for p in params if not any(re.match(r"^\s+\**" + re.escape(p) + r"\s*:", line) for line in section)]


def check_function(qualname, fn, name, problems):
    params, doc = parameters_and_doc(fn, name)
    if not doc:
        problems.append(f"{qualname}: no docstring")
        return
    if params is None:
        problems.append(f"{qualname}: its parameters cannot be read (neither inspect nor a pybind11 signature line)")
        return
    missing = undocumented(params, doc)
    if missing:
        problems.append(f"{qualname}: the docstring's Arguments section does not name {missing}")


def defining_class(cls, name):
    """The class of cls's MRO whose __dict__ holds name."""
    return next((c for c in cls.__mro__ if name in c.__dict__), None)


def is_base(cls):
    """object, and pybind11's base of the extension's classes: their attributes are not ours."""
    return cls is object or cls.__module__ == "pybind11_builtins"


def check_class(qualname, cls, problems, seen):
    if not own_doc(cls):
        problems.append(f"{qualname}: no class docstring")
    init_owner = defining_class(cls, "__init__")
    if init_owner is not None and not is_base(init_owner):
        init = init_owner.__dict__["__init__"]
        params, init_doc = parameters_and_doc(init, "__init__")
        if params is None:
            problems.append(f"{qualname}.__init__: its parameters cannot be read")
        else:
            missing = [p for p in undocumented(params, own_doc(init_owner)) if p in undocumented(params, init_doc)]
            if missing:
                problems.append(f"{qualname}: the constructor's parameters {missing} are named neither in the "
                                f"docstring of {init_owner.__qualname__} nor in its __init__'s")
    for name in sorted(dir(cls)):
        if name.startswith("_"):
            continue
        owner = defining_class(cls, name)
        if owner is None or is_base(owner):
            continue
        raw = owner.__dict__[name]
        where = f"{qualname}.{name}"
        if isinstance(raw, property) or type(raw).__name__ in ("property", "pybind11_static_property"):
            if not own_doc(raw) and id(raw) not in seen:
                problems.append(f"{where}: a property without a docstring")
            seen.add(id(raw))
        elif inspect.isclass(raw):
            visit(where, raw, problems, seen)
        elif callable(raw) or isinstance(raw, (staticmethod, classmethod)):
            if id(raw) in seen:
                continue
            seen.add(id(raw))
            check_function(where, raw, name, problems)


def visit(qualname, obj, problems, seen):
    if id(obj) in seen:
        return
    seen.add(id(obj))
    if inspect.isclass(obj):
        check_class(qualname, obj, problems, seen)
    elif callable(obj):
        check_function(qualname, obj, qualname.rsplit(".", 1)[-1], problems)


def public_names(module):
    if hasattr(module, "__all__"):
        return list(module.__all__)
    return [n for n, v in vars(module).items()
            if not n.startswith("_") and getattr(v, "__module__", None) == module.__name__]


def public_callables():
    """(qualified name, object) of every public name of the modules, callables and classes only."""
    out = []
    for suffix in MODULES:
        module = importlib.import_module(ROOT + suffix)
        for name in public_names(module):
            obj = getattr(module, name)
            if inspect.ismodule(obj) or not (callable(obj) or inspect.isclass(obj)):
                continue  # topk_idx_t (a torch.dtype), __version__, constants
            out.append((f"{module.__name__}.{name}", obj))
    return out


def problems_of(items):
    problems, seen = [], set()
    for qualname, obj in items:
        visit(qualname, obj, problems, seen)
    return problems


def test_every_public_callable_documents_its_parameters():
    problems = problems_of(public_callables())
    assert not problems, "undocumented:\n" + "\n".join(problems)


def test_the_walk_reaches_every_kind_of_callable():
    """The walk sees what the check must cover, so that it cannot pass by looking at nothing."""
    reached = {name for name, _ in public_callables()}
    for expected in (f"{ROOT}.ElasticBuffer", f"{ROOT}.Buffer", f"{ROOT}.Config", f"{ROOT}.HybridEPBuffer",
                     f"{ROOT}.EPHandle", f"{ROOT}.EventOverlap", f"{ROOT}.get_logical_domain_size",
                     f"{ROOT}.hybrid_ep.Buffer", f"{ROOT}.cpu_compat.Stream", f"{ROOT}.cpu_compat.install"):
        assert expected in reached, expected
    # Methods of each kind: Python, static, mixin, wrapped (serialised, contextmanager), pybind11.
    params, doc = parameters_and_doc(deep_ep.ElasticBuffer.dispatch, "dispatch")
    assert params[:3] == ["x", "topk_idx", "topk_weights"] and "Arguments:" in doc
    params, _ = parameters_and_doc(inspect.getattr_static(deep_ep.ElasticBuffer, "get_buffer_size_hint"),
                                   "get_buffer_size_hint")
    assert params[0] == "group"
    params, _ = parameters_and_doc(deep_ep.ElasticBuffer.agrs_new_session, "agrs_new_session")
    assert params == ["enabled"]
    params, _ = parameters_and_doc(deep_ep.HybridEPBuffer.combine, "combine")
    assert params == ["hidden", "probs", "handle"]
    params, doc = parameters_and_doc(deep_ep.Config.get_nvl_buffer_size_hint, "get_nvl_buffer_size_hint")
    assert params == ["hidden_bytes", "num_ranks"] and doc.startswith("DeepEP's num_nvl_bytes")
    params, _ = parameters_and_doc(deep_ep.Config.__init__, "__init__")
    assert params == ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
                      "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]


# The check itself, on made-up objects: each of these must be reported.

def _no_doc(a):
    return a


def _undocumented_argument(a, b=1):
    """Something.

    Arguments:
        a: documented.
    """


def _no_arguments_section(a):
    """Something about a."""


class _NoClassDoc:
    def method(self):
        """Documented."""


class _ConstructorUndocumented:
    """A class.

    Arguments:
        a: documented.
    """

    def __init__(self, a, b):
        pass


class _MethodUndocumented:
    """A class."""

    def method(self, x):
        return x

    @staticmethod
    def static(y):
        """A static method.

        Arguments:
            z: not y.
        """


class _PropertyUndocumented:
    """A class."""

    @property
    def value(self):
        return 1


class _FakePybind:
    """Stands for a pybind11 function: no signature inspect can read, the signature in its docstring."""

    __doc__ = "fake(self: X, alpha: int = 1, beta: object = None) -> int\n\nText.\n\nArguments:\n    alpha: one."

    @property
    def __signature__(self):
        raise ValueError("no signature")

    def __call__(self):
        pass


@pytest.mark.parametrize("obj, expected", [
    (_no_doc, "no docstring"),
    (_undocumented_argument, "does not name ['b']"),
    (_no_arguments_section, "does not name ['a']"),
    (_NoClassDoc, "no class docstring"),
    (_ConstructorUndocumented, "parameters ['b'] are named neither"),
    (_MethodUndocumented, "_MethodUndocumented.method: no docstring"),
    (_MethodUndocumented, "_MethodUndocumented.static: the docstring's Arguments section does not name ['y']"),
    (_PropertyUndocumented, "_PropertyUndocumented.value: a property without a docstring"),
])
def test_the_check_reports_what_is_missing(obj, expected):
    problems = problems_of([(obj.__qualname__, obj)])
    assert any(expected in p for p in problems), problems


def test_the_check_reads_a_pybind11_signature_line():
    problems = []
    check_function("fake", _FakePybind(), "fake", problems)
    assert problems == ["fake: the docstring's Arguments section does not name ['beta']"]
