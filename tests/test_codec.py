"""The dataclass codec (builder/formats/codec.py): every model it converts round-trips, files written
by earlier releases read and write back byte for byte, and a wrong value is one line naming
the file and the key path."""

from __future__ import annotations

import dataclasses
import json
import types
import typing
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar, Literal

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.adopt import journal as adopt_journal
from builder.audit import fleet
from builder.audit import scan as audit
from builder.commands import compat
from builder.core.errors import ReportError
from builder.doctor import fingerprint
from builder.doctor.facts import CudaHome, Finding, JitEntry
from builder.env import manifest
from builder.formats import codec
from builder.machine.archs import Arch
from builder.spec import lock
from builder.verify import report as report_mod
from tests.helpers import ENVSPECS

DATA = Path(__file__).parent / "data" / "json"

# --------------------------------------------------------------------------- earlier files

# (file, how it is read, whether it was written with sorted keys). Each file was written by
# the hand-written to_json methods the codec replaced.
EARLIER: list[tuple[str, typing.Callable[[Any, str], Any], bool]] = [
    ("verify-report.v1.json", report_mod.VerifyReport.from_json, False),
    ("build-record.v1.json", report_mod.BuildRecord.from_json, False),
    ("matrix-report.v1.json", report_mod.MatrixReport.from_json, False),
    ("manifest.v1.json", manifest.Manifest.from_json, True),
    ("fingerprint.v1.json", fingerprint.Fingerprint.from_json, False),
    ("adopt-journal.json", adopt_journal.Journal.from_json, False),
    ("compat-table.v1.json", compat.from_json, False),
    ("audit-mapped.json", lambda doc, where: audit.Mapped.from_json(doc), False),
    ("lock-memo.v3.json", lambda doc, where: lock._from_memo(doc["lock"]), False),
]


@pytest.mark.parametrize(("name", "read", "sort"), EARLIER, ids=[e[0] for e in EARLIER])
def test_a_file_an_earlier_release_wrote_reads_and_writes_back_byte_for_byte(
    name: str, read: typing.Callable[[Any, str], Any], sort: bool
) -> None:
    path = DATA / name
    text = path.read_text()
    obj = read(json.loads(text), str(path))
    assert obj is not None
    if name.startswith("lock-memo"):
        again: Any = lock._to_memo(obj, json.loads(text)["lock_sha256"])
        assert json.dumps(again) + "\n" == text
    else:
        assert json.dumps(obj.to_json(), indent=2, sort_keys=sort) + "\n" == text


def test_older_documents_take_what_their_missing_keys_mean() -> None:
    before = json.loads((DATA / "manifest.v1.json").read_text())
    del before["platform"], before["assembled"]
    old = manifest.Manifest.from_json(before, "cudaenv.json")
    assert (old.platform, old.assembled) == (None, False)
    path = DATA / "adopt-journal.activate-only.json"
    journal = adopt_journal.Journal.from_json(json.loads(path.read_text()), str(path))
    assert journal.activation == (("activate", "# old\n"),)
    assert (journal.state, journal.before, journal.changes, journal.var_existed) == (
        "done", None, (), False,
    )  # fmt: skip
    path = DATA / "fingerprint.v1.json"
    fp = fingerprint.Fingerprint.from_json(json.loads(path.read_text()), str(path))
    assert fingerprint.digest(fp.parts) == fp.fingerprint  # the hash of the parts is unchanged
    cells = json.loads((DATA / "matrix-report.v1.json").read_text())
    del cells["cells"][0]["seconds"]
    assert report_mod.MatrixReport.from_json(cells, "m.json").cells[0].seconds == 0.0


def test_the_doctor_parts_write_what_they_always_wrote() -> None:
    f = Finding(code="jit-mixed", severity="error", cause="c", evidence=("e1",),
                fix=("f1", "f2"), symptoms=(Finding(code="s", severity="warning",
                                                    cause="sc"),))  # fmt: skip
    home = CudaHome(source="$CUDA_HOME", path="/usr/local/cuda", exists=True,
                    nvcc="/usr/local/cuda/bin/nvcc", release="13.0", max_gcc=14)  # fmt: skip
    entry = JitEntry(version="0.5", archs="9.0a", op="sampling", cuda_home=None)
    doc = {"finding": f.to_json(), "cuda_home": home.to_json(), "jit_entry": entry.to_json()}
    assert json.dumps(doc, indent=2) + "\n" == (DATA / "doctor-parts.json").read_text()


def test_the_memo_of_every_committed_lock_reads_back_equal() -> None:
    for path in sorted((ENVSPECS / "locks").glob("pylock*.toml")):
        lk = lock.read(path)
        doc = json.loads(json.dumps(lock._to_memo(lk, "0" * 64)))
        assert lock._from_memo(doc["lock"]) == lk, path.name
        packages = json.loads(json.dumps(lock.packages_to_json(lk.packages)))
        assert lock.packages_from_json(packages) == lk.packages


# --------------------------------------------------------------------------- round trips

ARCHS = st.sampled_from([Arch.parse(a) for a in ("7.5", "9.0a", "10.0f", "12.0f", "12.1")])
TEXT = st.text(max_size=12)


def strategy(tp: Any, field: dataclasses.Field[Any] | None = None) -> st.SearchStrategy[Any]:
    """Values of the type hint ``tp`` that JSON holds exactly: floats of as many decimals as
    the field is written with, mapping keys unique."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    extra = field.metadata.get("json") if field is not None else None
    if origin in (typing.Union, types.UnionType):
        (inner,) = [a for a in args if a is not type(None)]
        return st.none() | strategy(inner, field)
    if origin is Literal:
        return st.sampled_from(args)
    if tp is str:
        return TEXT
    if tp is bool:
        return st.booleans()
    if tp is int:
        return st.integers(-(2**40), 2**40)
    if tp is float:
        places = extra.places if extra is not None and extra.places is not None else 3
        return st.integers(0, 10**6).map(lambda i: i / 10**places)
    if tp is Path:
        return st.sampled_from([Path("/e/x"), Path("rel/r.json")])
    if tp is Arch:
        return ARCHS
    if dataclasses.is_dataclass(tp):
        return build(typing.cast(type, tp))
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        item = args[0]
        pair = typing.get_args(item)
        if typing.get_origin(item) is tuple and len(pair) == 2 and pair[0] is str:
            value = strategy(pair[1])
            return st.dictionaries(TEXT, value, max_size=3).map(lambda d: tuple(d.items()))
        return st.lists(strategy(item), max_size=3).map(tuple)
    if origin is tuple:
        return st.tuples(*(strategy(a) for a in args))
    if origin in (dict, Mapping):
        return st.dictionaries(TEXT, strategy(args[1]), max_size=3)
    raise TypeError(tp)


def build(cls: type) -> st.SearchStrategy[Any]:
    hints = typing.get_type_hints(cls)
    return st.builds(
        cls, **{f.name: strategy(hints[f.name], f) for f in dataclasses.fields(cls) if f.init}
    )


def json_trip(obj: Any, read: typing.Callable[[Any], Any]) -> Any:
    return read(json.loads(json.dumps(obj.to_json())))


ROUND_TRIPS: list[tuple[type, typing.Callable[[Any], Any]]] = [
    (report_mod.VerifyReport, lambda d: report_mod.VerifyReport.from_json(d, "r.json")),
    (report_mod.BuildRecord, lambda d: report_mod.BuildRecord.from_json(d, "r.json")),
    (report_mod.MatrixReport, lambda d: report_mod.MatrixReport.from_json(d, "m.json")),
    (manifest.Manifest, lambda d: manifest.Manifest.from_json(d, "cudaenv.json")),
    (fingerprint.Fingerprint, lambda d: fingerprint.Fingerprint.from_json(d, "fp.json")),
    (adopt_journal.Journal, lambda d: adopt_journal.Journal.from_json(d, "j.json")),
    (fleet.Verdict, fleet.from_json),
    (compat.Table, compat.from_json),
    (audit.Mapped, audit.Mapped.from_json),
    (lock.LockedPackage, lambda d: lock.packages_from_json([d])[0]),
    (lock.Lock, lock._from_memo),
]


@pytest.mark.parametrize(("cls", "read"), ROUND_TRIPS, ids=[c.__name__ for c, _ in ROUND_TRIPS])
def test_every_converted_model_round_trips(cls: type, read: typing.Callable[[Any], Any]) -> None:
    to_json = (lambda o: codec.to_json(o)) if cls in (lock.LockedPackage, lock.Lock) else None

    @settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
    @given(build(cls))
    def round_trips(obj: Any) -> None:
        doc = json.loads(json.dumps(to_json(obj) if to_json else obj.to_json()))
        assert read(doc) == obj

    round_trips()


# --------------------------------------------------------------------------- located errors


def a_verify_doc() -> dict[str, Any]:
    return typing.cast(dict[str, Any], json.loads((DATA / "verify-report.v1.json").read_text()))


def a_manifest_doc() -> dict[str, Any]:
    return typing.cast(dict[str, Any], json.loads((DATA / "manifest.v1.json").read_text()))


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda d: d["checks"][2].update(status="maybe"),
         "in 'checks[2].status': unknown status 'maybe'; expected one of: passed, failed, skipped"),
        (lambda d: d.update(archs="9.0a"), "in 'archs': expected a list, got str"),
        (lambda d: d["archs"].append("sm_90"), "in 'archs[2]': expected an arch like"),
        (lambda d: d["versions"].update(nvcc=13), "in 'versions.nvcc': expected a string, got int"),
        (lambda d: d.update(seconds="1"), "in 'seconds': expected a number, got str"),
        (lambda d: d.update(seconds=True), "in 'seconds': expected a number, got bool"),
        (lambda d: d.update(spec=1), "in 'spec': expected a string or null, got int"),
        (lambda d: d.update(python=None), "in 'python': expected a string, got NoneType"),
        (lambda d: d.pop("created"), "verify report: missing key 'created'"),
        (lambda d: d.update(kind="matrix"), "in 'kind': kind is 'matrix', not 'verify'"),
        (lambda d: d.update(schema_version=2), "not a cudaenv verify report of schema version 1"),
    ],
)  # fmt: skip
def test_a_wrong_value_is_named_by_file_and_key_path(
    change: typing.Callable[[dict[str, Any]], object], message: str
) -> None:
    doc = a_verify_doc()
    change(doc)
    with pytest.raises(ReportError) as raised:
        report_mod.VerifyReport.from_json(doc, "v.json")
    assert str(raised.value).startswith("v.json: ")
    assert message in str(raised.value)
    assert "\n" not in str(raised.value)


def test_errors_inside_nested_models_carry_the_whole_path() -> None:
    rec = json.loads((DATA / "build-record.v1.json").read_text())
    rec["exit_code"] = True
    with pytest.raises(ReportError, match=r"^r.json: build record: in 'exit_code': expected an "
                       "integer, got bool$"):  # fmt: skip
        report_mod.BuildRecord.from_json(rec, "r.json")
    rec = json.loads((DATA / "build-record.v1.json").read_text())
    rec["verify"]["archs"] = [1]
    with pytest.raises(ReportError, match=r"in 'verify.archs\[0\]': expected a string, got int$"):
        report_mod.BuildRecord.from_json(rec, "r.json")
    doc = a_manifest_doc()
    doc["toolchain_source"] = "conda"
    with pytest.raises(
        ReportError, match="in 'toolchain_source': unknown toolchain_source 'conda'"
    ):
        manifest.Manifest.from_json(doc, "cudaenv.json")
    table = json.loads((DATA / "compat-table.v1.json").read_text())
    table["rows"][0]["verdicts"][0]["target"]["cc"] = "twelve"
    with pytest.raises(
        ValueError, match=r"in 'rows\[0\].verdicts\[0\].target.cc': expected an arch"
    ):
        compat.from_json(table)
    mapped = json.loads((DATA / "audit-mapped.json").read_text())
    mapped["libraries"][0] = ["libcudart", "13", "/x"]
    assert audit.Mapped.from_json(mapped) is None  # the cache entry is redone


# --------------------------------------------------------------------------- the codec itself


@dataclasses.dataclass(frozen=True, kw_only=True)
class Inner:
    where: Path
    count: int = 0


@dataclasses.dataclass(frozen=True, kw_only=True)
class Outer:
    name: str
    kind: Literal["a", "b"] = dataclasses.field(metadata=codec.meta(key="type"))
    inner: Inner | None
    inners: list[Inner]
    sizes: dict[str, int]
    pair: tuple[str, int | None] = dataclasses.field(metadata=codec.meta(shape="[name, size]"))
    extra: Any = None

    json_form: ClassVar[codec.Form] = codec.Form(
        head={"schema_version": 3}, keys=("type", "name", "label", "inner", "inners", "sizes",
                                          "pair", "extra"),
    )  # fmt: skip

    @property
    def label(self) -> str:
        return self.name.upper()


def an_outer() -> Outer:
    return Outer(name="n", kind="b", inner=Inner(where=Path("/x")), inners=[Inner(where=Path("y"),
                 count=2)], sizes={"a": 1}, pair=("p", None), extra={"free": [1]})  # fmt: skip


def test_the_form_says_the_key_order_the_constant_and_computed_keys() -> None:
    doc = codec.to_json(an_outer())
    assert list(doc) == ["schema_version", "type", "name", "label", "inner", "inners", "sizes",
                         "pair", "extra"]  # fmt: skip
    assert doc["label"] == "N" and doc["inner"] == {"where": "/x", "count": 0}
    assert doc["pair"] == ["p", None]
    assert codec.from_json(Outer, json.loads(json.dumps(doc)), "o.json") == an_outer()
    # A key this release does not know is ignored; the computed one is never read.
    assert codec.from_json(Outer, {**doc, "new": 1, "label": 5}, "o.json") == an_outer()


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"type": "c"}, "in 'type': unknown type 'c'; expected one of: a, b"),
        ({"inner": []}, "in 'inner': expected an object or null, got list"),
        ({"inners": [{"where": 1}]}, "in 'inners[0].where': expected a string, got int"),
        ({"inners": [{}]}, "in 'inners[0]': missing key 'where'"),
        ({"sizes": {"a": 1.5}}, "in 'sizes.a': expected an integer, got float"),
        ({"pair": ["p"]}, "in 'pair': expected [name, size], got ['p']"),
        ({"pair": ["p", "q"]}, "in 'pair': expected [name, size], got ['p', 'q']"),
        ({"schema_version": 2}, "not a cudaenv outer of schema version 3"),
    ],
)
def test_the_codec_names_the_key_of_each_wrong_value(change: dict[str, Any], message: str
                                                     ) -> None:  # fmt: skip
    doc = {**codec.to_json(an_outer()), **change}
    with pytest.raises(ReportError) as raised:
        codec.from_json(Outer, doc, "o.json")
    assert message in str(raised.value)


def test_a_type_without_a_json_form_is_refused_when_first_converted() -> None:
    @dataclasses.dataclass(frozen=True)
    class Odd:
        value: set[str]

    with pytest.raises(TypeError, match="no JSON form"):
        codec.to_json(Odd(value=set()))


def test_a_sparse_field_is_written_only_where_it_is_set() -> None:
    path = DATA / "manifest.v1.json"
    old = manifest.Manifest.from_json(json.loads(path.read_text()), str(path))
    assert "remote_cache" not in old.to_json()
    with_cache = dataclasses.replace(old, remote_cache="redis://127.0.0.1:6379/0")
    doc = with_cache.to_json()
    assert doc["remote_cache"] == "redis://127.0.0.1:6379/0"
    assert manifest.Manifest.from_json(doc, "m.json") == with_cache

    @dataclasses.dataclass(frozen=True)
    class Wrong:
        x: int
        json_form: typing.ClassVar[codec.Form] = codec.Form(sparse=("x",))

    with pytest.raises(TypeError, match="sparse names no field with a default"):
        codec.to_json(Wrong(1))
