"""A faster ``__init__`` for frozen dataclasses built once per step or per report.

``dataclasses`` gives a frozen class an ``__init__`` that stores each field through ``object.__setattr__`` (a
call per field); ``fast_init`` replaces it with one that writes the instance ``__dict__`` directly. Everything
else the decorator made stays as it was: the same signature (field order, defaults, default factories,
keyword use), ``__post_init__`` still runs last, equality, hashing, ``repr``, ``dataclasses.replace`` and the
refusal to assign to a field after construction (the class's ``__setattr__`` is untouched).

Invariant: an instance built by the fast ``__init__`` is indistinguishable from one built by the generated
one (same ``__dict__``, same validation); only classes without ``__slots__`` and without ``InitVar`` or
``init=False`` fields are accepted.

Compiled builds (``scripts/build_native_sim.py``: the core and the simulator compiled with mypyc) turn these classes
into native classes without an instance ``__dict__``, whose constructors are fast already: there ``fast_init``
leaves the class as it is and ``replace_fields`` falls back to ``dataclasses.replace``. ``python_class`` marks a
class that must stay an ordinary Python class in such a build (a no-op when interpreted).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

T = TypeVar("T")

try:
    from mypy_extensions import mypyc_attr
except ImportError:  # only a compiled build needs the marker (mypy_extensions comes with mypy)
    mypyc_attr = None  # type: ignore[assignment]


def python_class(cls: type[T]) -> type[T]:
    """Keep ``cls`` an ordinary Python class when its module is compiled with mypyc (it builds instances with
    ``__new__`` or subclasses a builtin type, which native classes do not allow); nothing otherwise."""
    return cls if mypyc_attr is None else mypyc_attr(native_class=False)(cls)


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen dataclass ``cls`` a ``__dict__``-writing ``__init__`` (see the module docstring)."""
    if hasattr(cls, "__mypyc_attrs__"):  # a native class of a compiled build: its __init__ is fast already
        return cls
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    if "__slots__" in cls.__dict__ or any(not f.init for f in fields):
        raise TypeError(f"{cls.__name__}: fast_init needs a dataclass without __slots__ or init=False fields")
    env: dict[str, Any] = {"MISSING": dataclasses.MISSING}
    params, body = [], []
    for f in fields:
        if f.default is not dataclasses.MISSING:
            env[f"_dflt_{f.name}"] = f.default
            params.append(f"{f.name}=_dflt_{f.name}")
            body.append(f"d[{f.name!r}] = {f.name}")
        elif f.default_factory is not dataclasses.MISSING:
            env[f"_fact_{f.name}"] = f.default_factory
            params.append(f"{f.name}=MISSING")
            body.append(f"d[{f.name!r}] = _fact_{f.name}() if {f.name} is MISSING else {f.name}")
        else:
            params.append(f.name)
            body.append(f"d[{f.name!r}] = {f.name}")
    if hasattr(cls, "__post_init__"):
        body.append("self.__post_init__()")
    src = f"def __init__(self, {', '.join(params)}):\n    d = self.__dict__\n    " + "\n    ".join(body)
    exec(src, env)  # noqa: S102 - code built from the class's own field names only
    init = env["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__doc__ = cls.__init__.__doc__
    cls.__init__ = init  # type: ignore[misc,method-assign]
    return cls


def replace_fields(obj: T, **changes: Any) -> T:
    """``dataclasses.replace`` for a ``fast_init`` class: a new instance with ``changes`` applied, validated again
    by its ``__post_init__`` (the instance ``__dict__`` holds exactly the fields, so no field list is walked)."""
    fields = getattr(obj, "__dict__", None)
    if fields is None:  # a native class of a compiled build
        return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
    return type(obj)(**{**fields, **changes})
