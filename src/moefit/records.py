"""Frozen records: the planner's frozen dataclasses, without compiling five of each one's methods.

``dataclasses.dataclass(frozen=True)`` writes the source of six methods for every class
(``__init__``, ``__repr__``, ``__eq__``, ``__hash__``, ``__setattr__``, ``__delattr__``) and
compiles it (CPython 3.11 ``dataclasses._create_fn``: one ``exec`` each), 0.5-1 ms a class
on the CI machine: the planner's 55 classes were about a third of a ``moefit plan`` process.
:func:`record` lets ``dataclasses`` write and compile only the plain ``__init__`` and gives
every record the same five methods, written once below, which read the class's field names
(kept on the class when it is made). A record behaves as the frozen dataclass would
(tests/test_records.py checks each method against ``dataclass(frozen=True)``): the same
``__init__`` signature, defaults and ``__post_init__``, the same repr, equality (same class,
the compared fields equal), the same hash value, ``FrozenInstanceError`` when a field is
assigned or deleted after ``__init__``; ``dataclasses.fields``, ``replace``, ``asdict``,
``copy`` and ``pickle`` work unchanged.

A record's ``__dataclass_params__`` say frozen, so a frozen dataclass may inherit from a
record (a new layer kind or family in a test or a plug-in: docs/extending.md); a record that
inherits from a record or a frozen dataclass is made by ``dataclass(frozen=True)`` itself, at
its full cost (``dataclasses`` refuses to make an unfrozen class over a frozen one).
``object.__setattr__`` still sets anything (``__post_init__`` may use it, as with frozen).
"""

from __future__ import annotations

import dataclasses
from operator import attrgetter
from reprlib import recursive_repr

_FIELDS = "_record_fields"        # frozenset of the field names (set by __init__ once each)
_REPR = "_record_repr"            # names shown by repr, in order
_EQ = "_record_eq"                # tuple of the compared fields' values (staticmethod)
_HASH = "_record_hash"            # tuple of the hashed fields' values (staticmethod)


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
    # __init__ assigns each field once; every other assignment is refused, as frozen does
    # (fields are plain instance attributes: no descriptor to go through)
    d = self.__dict__
    if name not in d and name in getattr(type(self), _FIELDS):
        d[name] = value
    else:
        raise dataclasses.FrozenInstanceError(f"cannot assign to field {name!r}")


def _delattr(self, name):
    raise dataclasses.FrozenInstanceError(f"cannot delete field {name!r}")


@recursive_repr()
def _repr(self):
    return (f"{type(self).__qualname__}("
            + ", ".join(f"{n}={getattr(self, n)!r}" for n in getattr(type(self), _REPR)) + ")")


def _eq(self, other):
    if other.__class__ is self.__class__:
        key = getattr(self, _EQ)
        return key(self) == key(other)
    return NotImplemented


def _hash(self):
    return hash(getattr(self, _HASH)(self))


def record(cls=None, /, *, eq: bool = True):
    """Class decorator: ``cls`` as ``dataclasses.dataclass(frozen=True, eq=eq)`` makes it
    (see the module docstring), at about a quarter of the cost of making it.

    Args:
        cls: the class, its fields annotated as for ``dataclass``.
        eq: compare and hash by the fields (True, as ``dataclass``); False: by identity.

    Returns ``cls`` itself (``@record`` or ``@record(eq=False)``).

    Raises TypeError where ``dataclass(frozen=True)`` does: a ``__setattr__`` or
    ``__delattr__`` defined in the class, a field without default after one with a default.
    """
    if cls is None:
        return lambda c: record(c, eq=eq)
    for name in ("__setattr__", "__delattr__"):
        if name in cls.__dict__:
            raise TypeError(f"Cannot overwrite attribute {name} in class {cls.__name__}")
    if any(getattr(getattr(b, "__dataclass_params__", None), "frozen", False) for b in cls.__mro__[1:]):
        return dataclasses.dataclass(cls, frozen=True, eq=eq)
    own = cls.__dict__
    explicit_hash = "__hash__" in own and not (own["__hash__"] is None and "__eq__" in own)
    dataclasses.dataclass(cls, repr=False, eq=False)
    params = cls.__dataclass_params__
    params.frozen, params.eq, params.repr = True, eq, True     # what the record is
    fields = dataclasses.fields(cls)
    setattr(cls, _FIELDS, frozenset(f.name for f in fields))
    setattr(cls, _REPR, tuple(f.name for f in fields if f.repr))
    if "__repr__" not in own:
        cls.__repr__ = _repr
    cls.__setattr__ = _setattr
    cls.__delattr__ = _delattr
    if eq and "__eq__" not in own:
        setattr(cls, _EQ, _getter(tuple(f.name for f in fields if f.compare)))
        cls.__eq__ = _eq
    if eq and not explicit_hash:
        setattr(cls, _HASH, _getter(tuple(f.name for f in fields
                                          if (f.compare if f.hash is None else f.hash))))
        cls.__hash__ = _hash
    return cls
