"""moefit.records.record against the reference it stands for, dataclasses.dataclass(frozen=True):
the same class built both ways must behave the same (init, defaults, repr, equality, hash,
frozenness, fields / replace / asdict, copy and pickle, inheritance)."""

from __future__ import annotations

import copy
import dataclasses
import pickle
from functools import cached_property

import pytest

from moefit.records import record


def _body(name: str) -> dict:
    return {
        "__module__": __name__, "__qualname__": name, "__doc__": f"{name} fields",
        "__annotations__": {"a": "int", "b": "str", "c": "tuple", "d": "dict", "e": "float"},
        "b": "x", "c": (), "d": dataclasses.field(default_factory=dict, compare=False),
        "e": dataclasses.field(default=1.5, repr=False),
        "twice": cached_property(lambda self: 2 * self.a),
    }


Ref = dataclasses.dataclass(frozen=True)(type("Ref", (), _body("Ref")))
Rec = record(type("Rec", (), _body("Rec")))
globals().update(Ref=Ref, Rec=Rec)        # pickle finds the classes by module and name


@record
class One:
    x: int


@record
class Base:
    n: int

    def __post_init__(self) -> None:
        if self.n < 0:
            raise ValueError("n < 0")


@record
class Child(Base):
    m: int = 3


@record(eq=False)
class ByIdentity:
    x: int


CASES = [((1,), {}), ((2, "y"), {"c": (1, 2)}), ((3,), {"d": {"k": 1}, "e": 2.0})]


@pytest.mark.parametrize("args, kw", CASES)
def test_a_record_is_made_and_shown_as_the_frozen_dataclass(args, kw):
    ref, rec = Ref(*args, **kw), Rec(*args, **kw)
    assert repr(rec) == repr(ref).replace("Ref(", "Rec(", 1)
    assert dataclasses.astuple(rec) == dataclasses.astuple(ref)
    assert dataclasses.asdict(rec) == dataclasses.asdict(ref)
    assert [f.name for f in dataclasses.fields(Rec)] == [f.name for f in dataclasses.fields(Ref)]
    assert hash(rec) == hash(ref)
    assert rec.twice == ref.twice == 2 * args[0]


def test_equality_is_the_frozen_dataclass_s():
    for (a1, k1) in CASES:
        for (a2, k2) in CASES + [((1,), {"d": {"other": 2}})]:
            assert (Rec(*a1, **k1) == Rec(*a2, **k2)) == (Ref(*a1, **k1) == Ref(*a2, **k2))
            assert (hash(Rec(*a1, **k1)) == hash(Rec(*a2, **k2))) == \
                (hash(Ref(*a1, **k1)) == hash(Ref(*a2, **k2)))
    assert Rec(1) != Ref(1) and (Rec(1) == (1, "x", (), 1.5)) is False
    assert One(1) == One(1) and hash(One(1)) == hash((1,)) and One(1) != One(2)
    assert Child(1) != Base(1)                    # another class: not equal, as dataclass
    a = ByIdentity(1)
    assert a == a and a != ByIdentity(1) and hash(a) == object.__hash__(a)


def test_fields_cannot_be_assigned_or_deleted_after_init():
    ref, rec = Ref(1), Rec(1)
    for obj in (ref, rec):
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.a = 2
        with pytest.raises(dataclasses.FrozenInstanceError):
            del obj.b
        with pytest.raises(dataclasses.FrozenInstanceError):
            obj.other = 1
    assert rec.a == 1 and rec.b == "x"


def test_init_signature_defaults_and_post_init():
    with pytest.raises(TypeError):
        Rec()
    with pytest.raises(TypeError):
        Rec(1, a=2)
    r = Rec(1)
    assert r.d == {} and r.d is not Rec(1).d          # default_factory: a new dict each
    with pytest.raises(ValueError, match="n < 0"):
        Child(-1)
    c = Child(1)
    assert (c.n, c.m) == (1, 3) and repr(c) == "Child(n=1, m=3)"
    assert dataclasses.replace(c, m=4) == Child(1, 4)
    with pytest.raises(ValueError):
        dataclasses.replace(c, n=-2)


def test_copy_and_pickle_give_equal_records():
    r = Rec(2, "y", (1,), {"k": 1})
    assert copy.copy(r) == r and copy.deepcopy(r) == r
    assert pickle.loads(pickle.dumps(r)) == r
    assert pickle.loads(pickle.dumps(Child(1, 2))) == Child(1, 2)


def test_a_frozen_dataclass_may_inherit_from_a_record():
    @dataclasses.dataclass(frozen=True)
    class Plugin(Base):
        k: int = 5

    x = Plugin(1)
    assert (x.n, x.k) == (1, 5) and x == Plugin(1) and hash(x) == hash(Plugin(1))
    with pytest.raises(dataclasses.FrozenInstanceError):
        x.k = 6
    with pytest.raises(ValueError):
        Plugin(-1)
    assert Base.__dataclass_params__.frozen and Child.__dataclass_params__.frozen


def test_a_class_that_sets_attributes_itself_is_refused():
    with pytest.raises(TypeError, match="__setattr__"):
        record(type("Bad", (), {"__annotations__": {"a": "int"},
                                "__setattr__": lambda self, k, v: None}))


def test_the_hash_is_kept_once_computed_and_left_out_of_copies_and_pickles():
    r = Rec(2, "y", (1,), {"k": 1})
    h = hash(r)
    assert r.__dict__["__record_hash__"] == h == hash(Ref(2, "y", (1,), {"k": 1}))
    for other in (copy.copy(r), copy.deepcopy(r), pickle.loads(pickle.dumps(r))):
        assert "__record_hash__" not in other.__dict__ and other == r and hash(other) == h
    assert dataclasses.asdict(r) == dataclasses.asdict(Ref(2, "y", (1,), {"k": 1}))


def test_init_of_a_template_and_of_its_own_source_bind_like_the_dataclass():
    # One: one plain field (the shared template, renamed); Rec: a default_factory field
    # (its own compiled source); both bind positionally and by name as the dataclass does
    import inspect
    assert One.__init__.__code__.co_varnames[:2] == ("self", "x")
    assert One(x=4) == One(4) and One(4).__dict__ == {"x": 4}
    assert str(inspect.signature(One)) == str(inspect.signature(dataclasses.dataclass(frozen=True)(
        type("One", (), {"__annotations__": {"x": "int"}}))))
    assert str(inspect.signature(Rec)).replace("Rec", "") == str(inspect.signature(Ref)).replace("Ref", "")
    with pytest.raises(TypeError):
        One(1, 2)


def test_a_class_s_own_init_stays_as_with_the_dataclass():
    body = lambda: {"__annotations__": {"x": "int"},                      # noqa: E731
                    "__init__": lambda self, v: object.__setattr__(self, "x", 2 * v)}
    rec = record(type("OwnInit", (), body()))
    ref = dataclasses.dataclass(frozen=True)(type("OwnInit", (), body()))
    assert repr(rec(2)) == repr(ref(2)) == "OwnInit(x=4)"
