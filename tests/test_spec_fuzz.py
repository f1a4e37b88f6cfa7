"""Hostile and broken specs: every input ends in a valid spec or a located SpecError.

Never a traceback, a hang or a memory blow-up: input size, nesting depth and node count are
bounded in yamldoc.py, and each example here runs under a deadline.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from builder.core.errors import SpecError
from builder.formats import yamldoc
from builder.spec import envspec as spec

LOCATED = re.compile(r"^[^\n]+:\d+:\d+: ")
FUZZ = settings(
    max_examples=150,
    deadline=2000,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.floats(allow_nan=True),
    st.text(max_size=40),
    st.sampled_from(["13.0", "3.12", "12.0f", "latest", "../../x", "$(id)"]),
)
keys = st.one_of(st.sampled_from(spec.TOP_KEYS + spec.TOOLCHAIN_KEYS), st.text(max_size=12))
documents = st.recursive(
    scalars,
    lambda inner: st.one_of(st.lists(inner, max_size=5), st.dictionaries(keys, inner, max_size=6)),
    max_leaves=40,
)


def check(path: Path) -> None:
    try:
        loaded = spec.load(path)
    except SpecError as exc:
        assert exc.problems, "a SpecError carries at least one problem"
        for problem in exc.problems:
            assert LOCATED.match(problem), problem
        return
    assert isinstance(loaded, spec.EnvSpec)
    assert "/" not in loaded.name and ".." not in loaded.name


@pytest.mark.slow
@FUZZ
@given(doc=documents)
def test_random_yaml_documents(tmp_path: Path, doc: object) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(doc, allow_unicode=True))
    check(path)


@FUZZ
@given(data=st.binary(max_size=2000))
def test_random_bytes(tmp_path: Path, data: bytes) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_bytes(data)
    check(path)


@FUZZ
@given(text=st.text(alphabet=st.sampled_from(list("[]{}:,-&*!|>'\"#\n abc0.9")), max_size=400))
def test_random_yaml_syntax(tmp_path: Path, text: str) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    check(path)


SECRET_RUN = re.compile(r"[A-Z]{6,}")


@FUZZ
@given(
    text=st.text(
        alphabet=st.sampled_from(list("[]{}:,-&*!|>'\"#%@`\t\n ABCDEFGHIJKLMNOPQRSTUVWXYZ")),
        max_size=400,
    ),
    pure=st.booleans(),
)
def test_a_file_that_is_no_mapping_is_never_quoted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, text: str, pure: bool
) -> None:
    """Whatever its text, a file that does not read as a YAML mapping (an `extends:` target
    that is a key or a password file) has none of it in the messages: no run of its capitals
    (the messages' own words are lower case), with either of yamldoc's loaders."""
    loader = yaml.SafeLoader if pure else getattr(yaml, "CSafeLoader", yaml.SafeLoader)
    monkeypatch.setattr(yamldoc, "_LOADER", loader)
    try:
        is_mapping = isinstance(yaml.compose(text, Loader=loader), yaml.MappingNode)
    except yaml.YAMLError:
        is_mapping = False
    path = tmp_path / "fuzz.yaml"
    path.write_text(text)
    try:
        spec.load(path)
    except SpecError as exc:
        if not is_mapping:
            shown = {run for p in exc.problems for run in SECRET_RUN.findall(p)}
            assert not any(run in text for run in shown), exc.problems


@pytest.mark.slow
@FUZZ
@given(
    base=st.fixed_dictionaries(
        {
            "name": st.text(max_size=20),
            "python": scalars,
            "cuda": scalars,
            "torch": scalars,
            "packages": st.lists(st.text(max_size=30), max_size=4),
            "archs": st.lists(scalars, max_size=3),
            "env": st.dictionaries(st.text(max_size=8), scalars, max_size=3),
        }
    )
)
def test_wrong_types_in_known_keys(tmp_path: Path, base: dict[str, object]) -> None:
    path = tmp_path / "fuzz.yaml"
    path.write_text(yaml.safe_dump(base, allow_unicode=True))
    check(path)


def test_deep_nesting(tmp_path: Path) -> None:
    for text in (
        "a: " + "[" * 5000 + "]" * 5000,
        "a:\n" + "".join("  " * i + "- \n" for i in range(300)),
        "a: " + "{b: " * 3000 + "1" + "}" * 3000,
    ):
        path = tmp_path / "deep.yaml"
        path.write_text(text)
        check(path)


def test_huge_file_is_refused_by_size(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "huge.yaml"
    path.write_text("summary: " + "x" * (spec.MAX_SPEC_BYTES + 1) + "\n")
    size = path.stat().st_size
    with pytest.raises(SpecError) as info:
        spec.load(path)
    # Refused by its size before YAML sees it, so the file as a whole (1:1) is at fault.
    assert info.value.problems == [
        f"huge.yaml:1:1: file is {size} bytes; a spec is at most {spec.MAX_SPEC_BYTES}"
    ]


def test_billion_laughs(tmp_path: Path) -> None:
    lines = ['a: &a ["lol","lol","lol","lol","lol","lol","lol","lol","lol","lol"]']
    for i, name in enumerate("bcdefghij"):
        prev = "abcdefghij"[i]
        lines.append(f"{name}: &{name} [{','.join('*' + prev for _ in range(10))}]")
    path = tmp_path / "laughs.yaml"
    path.write_text("\n".join(lines) + "\n")
    check(path)


def test_names_cannot_escape_the_envs_directory(tmp_path: Path) -> None:
    for name in ("../../x", "/etc", "a/b", "..", ".hidden", "x" * 101, "a\nb"):
        path = tmp_path / "s.yaml"
        path.write_text(yaml.safe_dump({"name": name, "python": "3.12", "cuda": "13.0"}))
        try:
            spec.load(path)
        except SpecError as exc:
            assert "name:" in exc.problems[0], exc.problems
        else:
            raise AssertionError(f"name {name!r} was accepted")
