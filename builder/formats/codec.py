"""Frozen dataclasses to JSON and back, driven by their fields' type hints.

``to_json(obj)`` writes a dataclass as a JSON object, one key per field in field order;
``from_json(cls, doc, where)`` reads one back through :class:`builder.formats.jsondoc.Reader`, so a
wrong value is one line naming the file and the key path, as packaging's ``pylock.py`` does
("in 'cells[2].status': unknown status 'maybe'; expected one of: passed, failed, ...").

What a field's type hint becomes:

- ``str``, ``int``, ``float``, ``bool``: themselves (an int is no float's error; a bool is
  never a number). ``X | None``: X or null.
- ``Literal["a", "b"]``: a string, one of those.
- ``Path`` and a class with a ``parse(text)`` classmethod (``Arch``): a string, ``str(value)``
  on write, ``parse`` on read (its ValueError is the error).
- a dataclass: a JSON object, read by its own fields.
- ``tuple[X, ...]``, ``list[X]``: a list. ``tuple[tuple[str, X], ...]`` (the hashable form of
  an ordered mapping these models use) and ``dict[str, X]``/``Mapping[str, X]``: an object.
  ``tuple[A, B, C]``: a list of exactly those, reported as a whole when wrong.
- ``Any``: the JSON value as it is.

On read, a key that is absent (or null where the type has no null) takes the field's default,
or the class's :attr:`Form.absent` value (what a document written by an older cudaenv lacks);
without one it is an error. Keys the class does not know are ignored.

Where a format written by an earlier release says something the fields do not, a field's
metadata (:func:`meta`: another key, rounding, its own conversion) and the class's
``json_form`` (:class:`Form`: constant keys such as ``schema_version``, computed keys, the key
order) keep the file byte for byte what it was.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin, get_type_hints

from builder.core.errors import ReportError
from builder.formats.jsondoc import Reader

T = TypeVar("T")
Encode = Callable[[Any], Any]
# A value read from JSON at ``key`` below ``r`` (a path such as "checks[2]"), or r.error(...).
Decode = Callable[[Any, Reader, str], Any]


@dataclasses.dataclass(frozen=True, kw_only=True)
class Field:
    """How one field differs from what its type hint says (see :func:`meta`)."""

    key: str | None = None  # the JSON key, where it is not the field's name
    places: int | None = None  # a float rounded to this many decimals on write
    noun: str | None = None  # what an unknown Literal value is called in the error
    shape: str | None = None  # how a fixed tuple is described in the error
    encode: Encode | None = None  # the field's own conversion, both ways
    decode: Callable[[Reader, str], Any] | None = None  # reads key of the Reader


def meta(
    *,
    key: str | None = None,
    places: int | None = None,
    noun: str | None = None,
    shape: str | None = None,
    encode: Encode | None = None,
    decode: Callable[[Reader, str], Any] | None = None,
) -> dict[str, Field]:
    """A field's metadata for the codec: ``field(metadata=codec.meta(key="verdict"))``."""
    return {"json": Field(key=key, places=places, noun=noun, shape=shape, encode=encode,
                          decode=decode)}  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class Form:
    """A class's JSON where it is more than its fields, as ``json_form: ClassVar[Form]``."""

    # What the document is called in errors ("adopt journal"); by default the class's name in
    # words (VerifyReport: "verify report").
    what: str | None = None
    # Constant keys written first and required on read: ``schema_version`` (checked before
    # anything else, as jsondoc.Reader does), ``kind``.
    head: Mapping[str, object] = dataclasses.field(default_factory=dict)
    # Every key in the order written, where it is not the fields' order; a key that is no
    # field's is a property of that name, written and never read (a report's ``status``).
    keys: tuple[str, ...] = ()
    # Field name -> the value a document without that key (or with null there) means.
    absent: Mapping[str, object] = dataclasses.field(default_factory=dict)
    # Fields a document must hold though they have a default (for code, not for files).
    required: tuple[str, ...] = ()
    # Fields written only where they differ from their default: added to a format later, so
    # a document without them is written back as it was, and a reader of the older release
    # still reads what holds none.
    sparse: tuple[str, ...] = ()


_MISSING: Any = object()


@dataclasses.dataclass(frozen=True)
class _Slot:
    name: str
    key: str
    encode: Encode
    read: Decode  # of a value that is not null (a computed key's raises)
    fallback: Any  # _MISSING (required), or the value an absent key means
    factory: Callable[[], Any] | None
    nullable: bool


@dataclasses.dataclass(frozen=True)
class _Plan:
    cls: type
    what: str
    head: tuple[tuple[str, object], ...]
    written: tuple[_Slot, ...]  # in the order written
    read: tuple[_Slot, ...]
    sparse: Mapping[str, Any]  # name -> the default that is not written


def to_json(obj: Any) -> dict[str, Any]:
    """The JSON object of the dataclass instance ``obj``."""
    plan = _plan(type(obj))
    out: dict[str, Any] = dict(plan.head)
    for slot in plan.written:
        value = getattr(obj, slot.name)
        if slot.name in plan.sparse and value == plan.sparse[slot.name]:
            continue
        out[slot.key] = slot.encode(value)
    return out


def from_json(cls: type[T], doc: object, where: str, what: str | None = None) -> T:
    """The ``cls`` of the JSON ``doc`` read from ``where``; ReportError naming ``where``,
    ``what`` it is (by default the class's :attr:`Form.what`) and the key path."""
    plan = _plan(cls)
    version = dict(plan.head).get("schema_version")
    reader = Reader(doc, where, what or plan.what, version if isinstance(version, int) else None)
    return from_reader(cls, reader)


def from_reader(cls: type[T], r: Reader) -> T:
    """The ``cls`` of the object ``r`` reads (a part of a larger document)."""
    plan = _plan(cls)
    doc = r.doc
    for key, expected in plan.head:
        if key not in doc:
            raise r.error(f"missing key '{key}'")
        if doc[key] != expected:
            raise r.error(f"{key} is {doc[key]!r}, not {expected!r}", key)
    values: dict[str, Any] = {}
    get = doc.get
    for slot in plan.read:
        value = get(slot.key)
        if value is not None:
            values[slot.name] = slot.read(value, r, slot.key)
        else:
            values[slot.name] = _absent(slot, r)
    return typing.cast(T, plan.cls(**values))


def _absent(slot: _Slot, r: Reader) -> Any:
    """The value of a key that is absent, or null."""
    if slot.nullable and slot.key in r.doc:
        return None
    if slot.factory is not None:
        return slot.factory()
    if slot.fallback is not _MISSING:
        return slot.fallback
    if slot.nullable:
        return None  # as jsondoc.Reader.opt_text reads an absent key
    if slot.key in r.doc:
        return slot.read(None, r, slot.key)  # null: the type's own error
    raise r.error(f"missing key '{slot.key}'")


# --------------------------------------------------------------------------- plans


_PLANS: dict[type, _Plan] = {}


def _plan(cls: type) -> _Plan:
    """What converting ``cls`` takes, worked out once per class."""
    found = _PLANS.get(cls)
    if found is None:
        found = _PLANS[cls] = _make_plan(cls)
    return found


def _make_plan(cls: type) -> _Plan:
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    form: Form = getattr(cls, "json_form", None) or Form()
    hints = get_type_hints(cls)
    by_name: dict[str, _Slot] = {}
    for f in dataclasses.fields(cls):
        extra: Field = f.metadata.get("json") or Field()
        key = extra.key or f.name
        tp = hints[f.name]
        nullable = False
        if extra.encode is not None and extra.decode is not None:
            encode: Encode = extra.encode
            decode: Decode = _hook(extra.decode)
        elif _is_optional(tp):
            # from_reader calls a decoder only for a value that is not null.
            nullable = True
            encode = _convert(tp, extra, key, nullable=False)[0]
            decode = _convert(_not_none(tp), extra, key, nullable=True)[1]
        else:
            encode, decode, _ = _convert(tp, extra, key, nullable=False)
        fallback = form.absent.get(f.name, f.default)
        if fallback is dataclasses.MISSING:
            fallback = _MISSING
        factory = None
        if f.name not in form.absent and f.default_factory is not dataclasses.MISSING:
            factory = f.default_factory
        if f.name in form.required:
            fallback, factory = _MISSING, None
        by_name[f.name] = _Slot(f.name, key, encode, decode, fallback, factory, nullable)
    read = tuple(by_name.values())
    if form.keys:
        by_key = {slot.key: slot for slot in read}
        extra_keys = set(by_key) - set(form.keys)
        if extra_keys:
            raise TypeError(f"{cls.__name__}.json_form.keys lacks {sorted(extra_keys)}")
        written = tuple(
            by_key.get(k) or _Slot(k, k, _same, _computed, _MISSING, None, True) for k in form.keys
        )
    else:
        written = read
    what = form.what or _words(cls.__name__)
    defaults = {f.name: f.default for f in dataclasses.fields(cls)}
    unknown = [
        n for n in form.sparse if defaults.get(n, dataclasses.MISSING) is dataclasses.MISSING
    ]
    if unknown:
        raise TypeError(f"{cls.__name__}.json_form.sparse names no field with a default: {unknown}")
    sparse = {n: defaults[n] for n in form.sparse}
    return _Plan(cls, what, tuple(form.head.items()), written, read, sparse)


def _hook(read: Callable[[Reader, str], Any]) -> Decode:
    return lambda _value, r, k: read(r, k)


def _words(name: str) -> str:
    """``VerifyReport`` -> ``verify report``."""
    return "".join(" " + c.lower() if c.isupper() else c for c in name).strip()


def _same(value: Any) -> Any:
    return value


def _computed(value: Any, r: Reader, key: str) -> Any:
    raise AssertionError(f"{key} is computed, never read")


def _not_none(tp: Any) -> Any:
    rest = [a for a in get_args(tp) if a is not type(None)]
    if len(rest) != 1:
        raise TypeError(f"only X | None unions convert, not {tp}")
    return rest[0]


def _is_optional(tp: Any) -> bool:
    return get_origin(tp) in (Union, types.UnionType) and type(None) in get_args(tp)


def _got(value: object) -> str:
    return type(value).__name__


def _convert(tp: Any, extra: Field, key: str, *, nullable: bool) -> tuple[Encode, Decode, str]:
    """(encode, decode, what the JSON value is called) for the type hint ``tp``."""
    origin, args = get_origin(tp), get_args(tp)
    or_null = " or null" if nullable else ""
    if origin in (Union, types.UnionType):
        enc, dec, name = _convert(_not_none(tp), extra, key, nullable=True)
        return (
            lambda v: None if v is None else enc(v),
            lambda v, r, k: None if v is None else dec(v, r, k),
            f"{name} or null",
        )
    if tp is Any or tp is object:
        return _same, lambda v, r, k: v, "a value"
    if origin is Literal:
        allowed = args
        noun = extra.noun or key

        def literal(v: Any, r: Reader, k: str) -> Any:
            for known in allowed:
                if v == known and type(v) is type(known):
                    return known
            if not isinstance(v, str):
                raise r.error(f"expected a string{or_null}, got {_got(v)}", k)
            raise r.error(
                f"unknown {noun} {v!r}; expected one of: {', '.join(map(str, allowed))}", k
            )

        return _same, literal, "a string"
    if tp in (str, bool, int, float):
        name = {str: "a string", bool: "true or false", int: "an integer", float: "a number"}[tp]
        enc, dec = _scalar(tp, name + or_null, extra.places)
        return enc, dec, name

    if tp is Path:

        def path(v: Any, r: Reader, k: str) -> Path:
            if not isinstance(v, str):
                raise r.error(f"expected a string{or_null}, got {_got(v)}", k)
            return Path(v)

        return str, path, "a string"
    if isinstance(tp, type) and callable(getattr(tp, "parse", None)):
        parse = getattr(tp, "parse")  # noqa: B009 - a duck-typed classmethod

        def text(v: Any, r: Reader, k: str) -> Any:
            if not isinstance(v, str):
                raise r.error(f"expected a string{or_null}, got {_got(v)}", k)
            try:
                return parse(v)
            except ValueError as exc:
                raise r.error(str(exc), k) from exc

        return str, text, "a string"
    if isinstance(tp, type) and dataclasses.is_dataclass(tp):
        cls = tp

        def nested(v: Any, r: Reader, k: str) -> Any:
            if not isinstance(v, dict):
                raise r.error(f"expected an object{or_null}, got {_got(v)}", k)
            return from_reader(cls, r.child(v, k))

        return to_json, nested, "an object"
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        if get_origin(item) is tuple and len(get_args(item)) == 2 and get_args(item)[0] is str:
            return _pairs(get_args(item)[1], extra, key, or_null)
        return _sequence(item, extra, key, or_null, tuple)
    if origin is list:
        return _sequence(args[0], extra, key, or_null, list)
    if origin is tuple:
        return _fixed(args, extra, key, or_null)
    if origin in (dict, Mapping) and args and args[0] is str:
        return _mapping(args[1], extra, key, or_null)
    raise TypeError(f"{key}: no JSON form for {tp!r}")


def _scalar(tp: type, name: str, places: int | None) -> tuple[Encode, Decode]:
    if tp is float:

        def number(v: Any, r: Reader, k: str) -> float:
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                return float(v)
            raise r.error(f"expected {name}, got {_got(v)}", k)

        return ((lambda v: round(v, places)) if places is not None else _same), number

    def exact(v: Any, r: Reader, k: str) -> Any:
        if type(v) is tp:  # a bool is no int here, nor a str subclass a str
            return v
        raise r.error(f"expected {name}, got {_got(v)}", k)

    return _same, exact


def _sequence(
    item: Any, extra: Field, key: str, or_null: str, kind: type
) -> tuple[Encode, Decode, str]:
    enc, dec, _ = _convert(item, extra, key, nullable=False)

    def read(v: Any, r: Reader, k: str) -> Any:
        if not isinstance(v, list):
            raise r.error(f"expected a list{or_null}, got {_got(v)}", k)
        return kind(dec(x, r, f"{k}[{i}]") for i, x in enumerate(v))

    if enc is _same:
        return list, read, "a list"
    return (lambda v: [enc(x) for x in v]), read, "a list"


def _pairs(value: Any, extra: Field, key: str, or_null: str) -> tuple[Encode, Decode, str]:
    enc, dec, _ = _convert(value, extra, key, nullable=False)

    def read(v: Any, r: Reader, k: str) -> tuple[tuple[str, Any], ...]:
        if not isinstance(v, dict):
            raise r.error(f"expected an object{or_null}, got {_got(v)}", k)
        return tuple((name, dec(x, r, f"{k}.{name}")) for name, x in v.items())

    if enc is _same:
        return dict, read, "an object"
    return (lambda v: {name: enc(x) for name, x in v}), read, "an object"


def _mapping(value: Any, extra: Field, key: str, or_null: str) -> tuple[Encode, Decode, str]:
    enc, dec, _ = _convert(value, extra, key, nullable=False)

    def read(v: Any, r: Reader, k: str) -> dict[str, Any]:
        if not isinstance(v, dict):
            raise r.error(f"expected an object{or_null}, got {_got(v)}", k)
        return {name: dec(x, r, f"{k}.{name}") for name, x in v.items()}

    return (lambda v: {name: enc(x) for name, x in v.items()}), read, "an object"


def _fixed(items: tuple[Any, ...], extra: Field, key: str, or_null: str
           ) -> tuple[Encode, Decode, str]:  # fmt: skip
    parts = [_convert(t, extra, key, nullable=False) for t in items]
    shape = extra.shape or "[" + ", ".join(name for _, _, name in parts) + "]"

    def read(v: Any, r: Reader, k: str) -> tuple[Any, ...]:
        if isinstance(v, list) and len(v) == len(parts):
            try:
                return tuple(dec(x, r, k) for (_, dec, _), x in zip(parts, v, strict=True))
            except ReportError:
                pass
        raise r.error(f"expected {shape}{or_null}, got {v!r}", k)

    return (lambda v: [enc(x) for (enc, _, _), x in zip(parts, v, strict=True)]), read, shape
