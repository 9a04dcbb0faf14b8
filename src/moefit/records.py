"""Frozen records: the planner's frozen dataclasses, made without the ``dataclasses`` module.

``dataclasses.dataclass(frozen=True)`` writes the source of six methods for every class
and compiles it (CPython 3.11 ``dataclasses._create_fn``: one ``exec`` each), checks every
string annotation against ``ClassVar`` / ``InitVar`` with regular expressions and, for a
class without a docstring, builds one with ``inspect.signature``; importing it imports
``inspect`` (with ``ast``, ``dis``, ``tokenize``) and ``copy``. On the 2-core CI machine the
import and the ~70 classes of a ``moefit plan`` process were 20-25 ms of its ~80 ms of CPU
(``python -X importtime``, and ``dataclasses._process_class`` timed, 2026-12-02).

:func:`record` makes the class itself: it reads the fields from the class's annotations
(its own and its record bases'), makes one ``__init__`` (which stores the fields in the
instance's ``__dict__``, the frozen dataclass's ``object.__setattr__`` without its per-field
type lookup; compiled once per field count and renamed for each class, or compiled for the
class when a field has a ``default_factory`` or ``init=False``) and gives every record the same five other methods, written once below. A
record behaves as the frozen dataclass would (tests/test_records.py checks each method
against ``dataclass(frozen=True)``): the same ``__init__`` signature, defaults,
``default_factory`` and ``__post_init__``, the same repr, equality (same class, the compared
fields equal), the same hash value, ``FrozenInstanceError`` when a field is assigned or
deleted; ``copy`` and ``pickle`` work unchanged. The hash is computed once and kept in the
instance's ``__dict__`` (``__record_hash__``; copies and pickles leave it out): a cache keyed
by a geometry hashed all its layers' records at every lookup.

The ``dataclasses`` API works on records too (``dataclasses.fields``, ``replace``,
``asdict``, ``is_dataclass``, a frozen dataclass inheriting from a record): a record's
``__dataclass_fields__`` and ``__dataclass_params__`` are made on first use, by
``dataclasses`` itself from a stand-in class with the record's fields (so the first use
imports ``dataclasses``). The planner uses :func:`field` and :func:`replace` from here,
which do not. A record over a (non-record) dataclass, or with ``ClassVar`` / ``InitVar``
/ ``KW_ONLY`` annotations, is made by ``dataclasses`` itself, at its full cost.
``object.__setattr__`` still sets anything (``__post_init__`` may use it, as with frozen).
``record(frozen=False)`` makes the mutable dataclass (``__hash__`` None, as with ``eq``).
"""

from __future__ import annotations

import sys
from operator import attrgetter
from reprlib import recursive_repr
from types import FunctionType


class _Sentinel:
    """A marker shown as ``dataclasses`` shows its own (``<factory>`` in a signature)."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


MISSING = _Sentinel("MISSING")
_FACTORY = _Sentinel("<factory>")      # the default a default_factory field shows in __init__


class Field:
    """What :func:`field` gives: the options of one field, as ``dataclasses.Field`` holds
    them (``name`` and ``type`` are set when the class is made)."""

    __slots__ = ("name", "type", "default", "default_factory", "init", "repr", "hash",
                 "compare", "metadata")

    def __init__(self, default, default_factory, init, repr, hash, compare, metadata):
        if default is not MISSING and default_factory is not MISSING:
            raise ValueError("cannot specify both default and default_factory")
        self.name, self.type = None, None
        self.default, self.default_factory = default, default_factory
        self.init, self.repr, self.hash, self.compare = init, repr, hash, compare
        self.metadata = metadata


def field(*, default=MISSING, default_factory=MISSING, init: bool = True, repr: bool = True,
          hash: bool | None = None, compare: bool = True, metadata=None) -> Field:
    """A field's options in a :func:`record`, as ``dataclasses.field`` takes them (without
    ``kw_only``). Raises ValueError with both ``default`` and ``default_factory``."""
    return Field(default, default_factory, init, repr, hash, compare, metadata)


def _frozen_error(message: str) -> Exception:
    from dataclasses import FrozenInstanceError     # the exception frozen dataclasses raise
    return FrozenInstanceError(message)


def _getter(names: tuple[str, ...]):
    """A function of an instance giving the tuple of its ``names`` attributes, as the
    ``(self.a, self.b,)`` tuple a dataclass method builds."""
    if len(names) > 1:
        return staticmethod(attrgetter(*names))
    if names:
        one = attrgetter(names[0])
        return staticmethod(lambda obj: (one(obj),))
    return staticmethod(lambda obj: ())


def _setattr(self, name, value):
    # __init__ writes the instance's __dict__; every assignment after is refused, as frozen does
    raise _frozen_error(f"cannot assign to field {name!r}")


def _delattr(self, name):
    raise _frozen_error(f"cannot delete field {name!r}")


@recursive_repr()
def _repr(self):
    return (f"{type(self).__qualname__}("
            + ", ".join(f"{n}={getattr(self, n)!r}" for n in type(self)._record_repr) + ")")


def _eq(self, other):
    if other.__class__ is self.__class__:
        key = self._record_eq
        return key(self) == key(other)
    return NotImplemented


_HASHED = "__record_hash__"      # the instance's hash, kept in its __dict__ once computed


def _hash(self):
    # a record's fields never change, so neither does its hash: computed once (a geometry's
    # is its layers', recursively: most of a cache lookup keyed by one)
    d = self.__dict__
    h = d.get(_HASHED)
    if h is None:
        h = d[_HASHED] = hash(self._record_hash(self))
    return h


def _getstate(self):
    # copy and pickle leave the kept hash out (str hashes differ from one process to another)
    d = self.__dict__
    if _HASHED in d:
        d = d.copy()
        del d[_HASHED]
    return d


_SPECS = "_record_specs"       # the class's fields (Field, in order, the bases' first)


def _as_field(value) -> Field | None:
    """``value`` (a class attribute) as a Field when it is one (ours or ``dataclasses``')."""
    if isinstance(value, Field):
        return value
    dc = sys.modules.get("dataclasses")
    if dc is not None and isinstance(value, dc.Field):
        if value.kw_only not in (dc.MISSING, False):
            return None                             # made by dataclasses (see _needs_dataclasses)
        conv = lambda v: MISSING if v is dc.MISSING else v     # noqa: E731
        return Field(conv(value.default), conv(value.default_factory), value.init, value.repr,
                     value.hash, value.compare, value.metadata)
    return None


def _needs_dataclasses(cls) -> bool:
    """``cls`` is one :func:`record` leaves to ``dataclasses``: a base that is a dataclass and
    not a record, a ``ClassVar`` / ``InitVar`` / ``KW_ONLY`` annotation, a keyword-only field."""
    if any("__dataclass_fields__" in b.__dict__ and _SPECS not in b.__dict__ for b in cls.__mro__[1:]):
        return True
    own = cls.__dict__.get("__annotations__", {})
    text = " ".join(a if isinstance(a, str) else repr(a) for a in own.values())
    if "ClassVar" in text or "InitVar" in text or "KW_ONLY" in text:
        return True
    dc = sys.modules.get("dataclasses")
    return dc is not None and any(isinstance(cls.__dict__.get(n), dc.Field) and _as_field(cls.__dict__[n]) is None
                                  for n in own)


_TEMPLATES: dict[tuple[int, bool], object] = {}    # (fields, __post_init__) -> code of an __init__


def _init_from_template(specs: tuple[Field, ...], post_init: bool):
    """``__init__`` of fields that all take a plain argument (no ``default_factory``, no
    ``init=False``): the code of one compiled template per field count (``_p0``, ``_p1``...)
    with the field names put in its argument names and its keys (``code.replace``: no
    compile), the defaults as the function's own. None when a field needs the source."""
    names = tuple(f.name for f in specs)
    if any(not f.init or f.default_factory is not MISSING for f in specs) or \
            "self" in names or "__record_dict__" in names:
        return None
    key = (len(specs), post_init)
    code = _TEMPLATES.get(key)
    if code is None:
        params = "".join(f", _p{i}" for i in range(len(specs)))
        body = "".join(f"    __record_dict__['_p{i}'] = _p{i}\n" for i in range(len(specs)))
        names_ns: dict = {}
        exec(f"def __init__(self{params}):\n    __record_dict__ = self.__dict__\n{body}"   # noqa: S102
             + ("    self.__post_init__()\n" if post_init else ""), names_ns)
        code = _TEMPLATES[key] = names_ns["__init__"].__code__
    rename = {f"_p{i}": n for i, n in enumerate(names)}
    code = code.replace(co_varnames=tuple(rename.get(v, v) for v in code.co_varnames),
                        co_consts=tuple(rename.get(c, c) if isinstance(c, str) else c for c in code.co_consts))
    defaults = tuple(f.default for f in specs if f.default is not MISSING)
    return FunctionType(code, {}, "__init__", defaults or None)


def _init_source(specs: tuple[Field, ...], post_init: bool) -> tuple[str, dict]:
    """The source of ``__init__`` and the names it reads (defaults, factories)."""
    params, body, names = ["self"], ["__record_dict__ = self.__dict__"], {"_FACTORY": _FACTORY}
    for i, f in enumerate(specs):
        if f.default_factory is not MISSING:
            names[f"_f{i}"] = f.default_factory
            if f.init:
                params.append(f"{f.name}=_FACTORY")
                body.append(f"__record_dict__[{f.name!r}] = _f{i}() if {f.name} is _FACTORY else {f.name}")
            else:
                body.append(f"__record_dict__[{f.name!r}] = _f{i}()")
            continue
        if f.init:
            if f.default is MISSING:
                params.append(f.name)
            else:
                names[f"_v{i}"] = f.default
                params.append(f"{f.name}=_v{i}")
            body.append(f"__record_dict__[{f.name!r}] = {f.name}")
        elif f.default is not MISSING:
            names[f"_v{i}"] = f.default
            body.append(f"__record_dict__[{f.name!r}] = _v{i}")
    if post_init:
        body.append("self.__post_init__()")
    return f"def __init__({', '.join(params)}):\n    " + "\n    ".join(body) + "\n", names


def record(cls=None, /, *, eq: bool = True, frozen: bool = True):
    """Class decorator: ``cls`` as ``dataclasses.dataclass(frozen=frozen, eq=eq)`` makes it
    (see the module docstring), without importing ``dataclasses``.

    Args:
        cls: the class, its fields annotated as for ``dataclass`` (defaults, :func:`field`).
        eq: compare and hash by the fields (True, as ``dataclass``); False: by identity.
        frozen: True (fields cannot be assigned after ``__init__``); False: a mutable
            dataclass (unhashable with ``eq``, as ``dataclass`` makes it).

    Returns ``cls`` itself (``@record`` or ``@record(eq=False)``).

    Raises TypeError where ``dataclass`` does: a ``__setattr__`` or ``__delattr__`` defined
    in a frozen class, a field without default after one with a default, a field given by
    :func:`field` without an annotation; ValueError for a mutable default (list, dict, set).
    """
    if cls is None:
        return lambda c: record(c, eq=eq, frozen=frozen)
    own = cls.__dict__
    if frozen:
        for name in ("__setattr__", "__delattr__"):
            if name in own:
                raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
    if any(getattr(b, "_record_frozen", frozen) != frozen for b in cls.__mro__[1:] if _SPECS in b.__dict__):
        raise TypeError(f"cannot inherit {'frozen' if frozen else 'non-frozen'} record {cls.__name__} from "
                        f"a {'non-frozen' if frozen else 'frozen'} one")
    if _needs_dataclasses(cls):
        import dataclasses          # the rare class records leave to dataclasses
        return dataclasses.dataclass(cls, frozen=frozen, eq=eq)
    fields: dict[str, Field] = {}
    for base in cls.__mro__[-1:0:-1]:
        for f in base.__dict__.get(_SPECS, ()):
            fields[f.name] = f
    annotations = own.get("__annotations__", {})
    dc = sys.modules.get("dataclasses")
    field_types = (Field,) if dc is None else (Field, dc.Field)
    for name, value in own.items():
        if isinstance(value, field_types) and name not in annotations:
            raise TypeError(f"{name!r} is a field but has no type annotation")
    for name, ann in annotations.items():
        value = own.get(name, MISSING)
        f = _as_field(value) if isinstance(value, field_types) else None
        if f is None:
            f = Field(value, MISSING, True, True, None, True, None)
            if value is not MISSING and type(value).__hash__ is None:
                raise ValueError(f"mutable default {type(value)} for field {name} is not allowed: "
                                 "use default_factory")
        else:
            f = Field(f.default, f.default_factory, f.init, f.repr, f.hash, f.compare, f.metadata)
            if f.default is MISSING:
                delattr(cls, name)
            else:
                setattr(cls, name, f.default)
        f.name, f.type = name, ann
        fields[name] = f
    specs = tuple(fields.values())
    seen_default = False
    for f in specs:
        if f.init:
            if f.default is not MISSING or f.default_factory is not MISSING:
                seen_default = True
            elif seen_default:
                raise TypeError(f"non-default argument {f.name!r} follows default argument")
    post_init = hasattr(cls, "__post_init__")
    init = _init_from_template(specs, post_init)
    if init is None:
        source, names = _init_source(specs, post_init)
        exec(source, names)                 # noqa: S102 (the source is made above)
        init = names["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__annotations__ = {**{f.name: f.type for f in specs if f.init}, "return": None}
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    setattr(cls, _SPECS, specs)
    cls._record_frozen, cls._record_eq_flag = frozen, eq
    cls._record_init = tuple(f.name for f in specs if f.init)
    cls._record_repr = tuple(f.name for f in specs if f.repr)
    if "__init__" not in own:              # as dataclass: a class's own __init__ stays
        cls.__init__ = init
    if "__repr__" not in own:
        cls.__repr__ = _repr
    if frozen:
        cls.__setattr__ = _setattr
        cls.__delattr__ = _delattr
    if eq and "__eq__" not in own:
        cls._record_eq = _getter(tuple(f.name for f in specs if f.compare))
        cls.__eq__ = _eq
    if eq and not explicit_hash:
        if frozen:
            cls._record_hash = _getter(tuple(f.name for f in specs
                                             if (f.compare if f.hash is None else f.hash)))
            cls.__hash__ = _hash
            if "__getstate__" not in own:
                cls.__getstate__ = _getstate
        else:
            cls.__hash__ = None
    if "__match_args__" not in own:
        cls.__match_args__ = cls._record_init
    if cls.__doc__ is None:
        cls.__doc__ = cls.__name__ + "(" + ", ".join(
            f"{f.name}: {f.type!r}" + ("" if f.default is MISSING and f.default_factory is MISSING
                                       else f" = {_FACTORY!r}" if f.default_factory is not MISSING
                                       else f" = {f.default!r}")
            for f in specs if f.init) + ")"
    cls.__dataclass_fields__ = _DataclassView(cls, "__dataclass_fields__")
    cls.__dataclass_params__ = _DataclassView(cls, "__dataclass_params__")
    return cls


class _DataclassView:
    """A record's ``__dataclass_fields__`` / ``__dataclass_params__`` until first read: then
    made by ``dataclasses`` from a stand-in class with the record's fields and options, and
    put on the record in place of this (``dataclasses.fields``, ``replace``, ``asdict``, a
    dataclass inheriting from the record read them)."""

    def __init__(self, owner, name: str) -> None:
        self.owner, self.name = owner, name

    def __get__(self, obj, objtype=None):
        import dataclasses          # first use of the dataclasses API on this record
        cls = self.owner
        body = {"__module__": cls.__module__, "__qualname__": cls.__qualname__,
                "__annotations__": {f.name: f.type for f in getattr(cls, _SPECS)}}
        for f in getattr(cls, _SPECS):
            kw = {"init": f.init, "repr": f.repr, "hash": f.hash, "compare": f.compare,
                  "metadata": f.metadata}
            if f.default is not MISSING:
                kw["default"] = f.default
            if f.default_factory is not MISSING:
                kw["default_factory"] = f.default_factory
            body[f.name] = dataclasses.field(**kw)
        stand_in = dataclasses.dataclass(type(cls.__name__, (), body), frozen=cls._record_frozen,
                                         eq=cls._record_eq_flag)
        for name in ("__dataclass_fields__", "__dataclass_params__"):
            type.__setattr__(cls, name, stand_in.__dict__[name])
        return cls.__dict__[self.name]


def replace(obj, /, **changes):
    """``obj`` with the fields in ``changes`` replaced, as ``dataclasses.replace`` makes it
    (a new instance through ``__init__``, so ``__post_init__`` runs); a dataclass that is not
    a record goes to ``dataclasses.replace``. Raises ValueError for a field with
    ``init=False``, TypeError for a name that is not a field."""
    names = getattr(type(obj), "_record_init", None)
    if names is None or _SPECS not in type(obj).__dict__:
        import dataclasses          # a dataclass that is not a record
        return dataclasses.replace(obj, **changes)
    for f in getattr(type(obj), _SPECS):
        if not f.init and f.name in changes:
            raise ValueError(f"field {f.name} is declared with init=False, it cannot be specified with "
                             "replace()")
    for name in names:
        if name not in changes:
            changes[name] = getattr(obj, name)
    return obj.__class__(**changes)
