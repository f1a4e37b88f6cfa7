"""Spec loading: every problem at once, located, asserted by exact message."""

from __future__ import annotations

import os
import resource
import subprocess
import sys
import typing
from pathlib import Path

import pytest
import yaml

from builder.core.errors import SpecError
from builder.formats import yamldoc
from builder.formats.yamldoc import Item, Mark
from builder.machine.archs import Arch
from builder.spec import envspec as spec
from tests.helpers import ENVSPECS, REPO, write

GOOD = """\
name: demo
python: "3.12"
cuda: "13.0"
torch: "2.14.1"
packages: [sglang==0.5.23]
archs: ["12.0f"]
"""


def problems(path: Path) -> list[str]:
    with pytest.raises(SpecError) as info:
        spec.load(path)
    return info.value.problems


def test_shipped_specs_load() -> None:
    names = {spec.load(p).name for p in ENVSPECS.glob("*.yaml")}
    assert names == {
        "sglang-0.5.23-cu130",
        "sglang-0.5.17-torch2.11-cu130",
        "flashinfer-0.7.4-torch2.15-cu132",
        "toolchain-cu130",
        "torch2.9-cu128-system",
        "vllm-0.33-cu130",
    }
    default = spec.load(ENVSPECS / "default.yaml")
    assert default.torch == "2.14.1"
    assert default.cuda == "13.0"
    assert default.packages == ("sglang==0.5.23", "flashinfer-python==0.7.2")
    assert default.toolchain.components == ("nvcc", "cudart", "crt", "nvvm", "cccl")
    assert default.archs == (Arch.parse("12.0f"),)


def test_good_spec(in_tmp: Path) -> None:
    s = spec.load(write(in_tmp / "s.yaml", GOOD))
    assert s.name == "demo"
    assert s.toolchain.source == "wheels"
    assert s.verify == spec.CHECKS


def test_five_mistakes_five_located_errors(in_tmp: Path) -> None:
    path = write(
        in_tmp / "bad.yaml",
        """\
name: demo
python: 3.12
cuda: 13
torch: latest
pakages: [sglang==0.5.23]
archs: ["12.0x"]
""",
    )
    assert problems(path) == [
        'bad.yaml:2:9: python: expected a quoted version like "3.12", got the number 3.12 '
        "(YAML reads 3.10 as 3.1: quote it)",
        'bad.yaml:3:7: cuda: expected a quoted CUDA major.minor like "13.0", got the number 13',
        'bad.yaml:4:8: torch: expected an exact torch version like "2.14.1" (quoted), got '
        "'latest'",
        "bad.yaml:5:1: pakages: unknown key; did you mean 'packages'?",
        "bad.yaml:6:9: archs[0]: expected an arch like '9.0a', '10.0a' or '12.0f', got '12.0x'",
    ]


def test_cli_five_mistakes_exit_2_no_traceback(in_tmp: Path) -> None:
    path = write(
        in_tmp / "bad.yaml",
        'name: ../x\npython: "2.7"\ncuda: "11.8"\ntoolchain: {source: conda}\nverify: [cubins]\n',
    )
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", "plan", str(path)],
        capture_output=True,
        text=True,
        cwd=in_tmp,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    errors = [ln for ln in done.stderr.splitlines() if ln.startswith("error: bad.yaml:")]
    assert len(errors) == 5, done.stderr
    assert errors[0].startswith("error: bad.yaml:1:7: name: '../x' is not a valid env name")
    assert errors[4] == (
        "error: bad.yaml:5:10: verify[0]: unknown check 'cubins'; did you mean 'cubin'?"
    )
    assert done.stderr.splitlines()[-1] == "error: 5 problem(s) in the spec; nothing was done"


def test_missing_keys_and_wrong_types(in_tmp: Path) -> None:
    path = write(in_tmp / "s.yaml", "summary: [1]\npackages: sglang\nenv: [A]\n")
    assert problems(path) == [
        "s.yaml:1:1: name: required key is missing",
        "s.yaml:1:1: python: required key is missing",
        "s.yaml:1:1: cuda: required key is missing",
        "s.yaml:1:10: summary: expected a one-line summary, got a list",
        "s.yaml:2:11: packages: expected a list of PEP 508 requirements, got the string 'sglang'",
        "s.yaml:3:6: env: expected a mapping of variables, got a list",
    ]


def test_package_problems(in_tmp: Path) -> None:
    path = write(
        in_tmp / "s.yaml",
        GOOD.replace(
            "packages: [sglang==0.5.23]",
            "packages: [sglang==0.5.23, 'sglang>=0.5', torch==2.1, 'flash infer', "
            "'x @ https://example.invalid/x.whl']",
        ),
    )
    got = problems(path)
    assert got[0] == "s.yaml:5:28: packages[1]: sglang is listed twice (also 'sglang==0.5.23')"
    assert (
        got[1] == "s.yaml:5:43: packages[2]: torch is pinned by the 'torch:' key, not in packages"
    )
    assert got[2].startswith("s.yaml:5:55: packages[3]: not a valid requirement:")
    assert got[3] == (
        "s.yaml:5:70: packages[4]: direct URL requirements cannot be locked by hash here"
    )


def test_toolchain_problems(in_tmp: Path) -> None:
    path = write(
        in_tmp / "s.yaml",
        GOOD + "toolchain: {source: system, componets: [nvcc], path: cuda}\n",
    )
    assert problems(path) == [
        "s.yaml:7:29: toolchain.componets: unknown key; did you mean 'components'?",
        "s.yaml:7:54: toolchain.path: expected an absolute path, got 'cuda'",
    ]
    path = write(in_tmp / "t.yaml", GOOD + "toolchain: {components: [nvcc, nvc]}\n")
    assert problems(path) == [
        "t.yaml:7:32: toolchain.components[1]: unknown component 'nvc'; did you mean 'nvcc'?"
    ]
    path = write(in_tmp / "u.yaml", GOOD + "toolchain: {source: system}\n")
    assert problems(path) == ["u.yaml:7:12: toolchain.path: required when source is 'system'"]


def test_env_values_and_reserved_names(in_tmp: Path) -> None:
    path = write(
        in_tmp / "s.yaml",
        GOOD + "env: {CUDA_HOME: /x, 1BAD: y, OK: [1], FINE: '$(touch x)', N: 3}\n",
    )
    assert problems(path) == [
        "s.yaml:7:7: env.CUDA_HOME: CUDA_HOME is set by cudaenv itself and cannot be overridden",
        "s.yaml:7:22: env.1BAD: not a valid environment variable name",
        "s.yaml:7:35: env.OK: expected a string value, got a list",
    ]
    ok = spec.load(write(in_tmp / "t.yaml", GOOD + "env: {FINE: '$(touch x)', N: 3}\n"))
    assert ok.env == (("FINE", "$(touch x)"), ("N", "3"))
    # A name with a trailing newline (a regex's `$` matches before one): bash and dash
    # activation would fail on it, and fish would run the value as a command.
    bad = write(in_tmp / "n.yaml", GOOD + 'env: {"FOO\\n": "echo pwned"}\n')
    (problem,) = problems(bad)
    assert problem.endswith("not a valid environment variable name"), problem
    assert problem.startswith("n.yaml:7:") and "env.'FOO\\n'" in problem and "\n" not in problem


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("13", "expected a CUDA major.minor like \"13.0\", got '13'"),
        ("13.0.1", "expected a CUDA major.minor like \"13.0\", got '13.0.1'"),
        ("13.00", "expected a CUDA major.minor like \"13.0\", got '13.00'"),
        ("cu130", "expected a CUDA major.minor like \"13.0\", got 'cu130'"),
        ("11.8", "CUDA 11.8 is not supported: 12.x and 13.x are"),
    ],
)
def test_a_cuda_that_is_no_supported_version_is_refused_naming_it(
    in_tmp: Path, text: str, message: str
) -> None:
    path = write(in_tmp / "s.yaml", GOOD.replace('cuda: "13.0"', f'cuda: "{text}"'))
    assert problems(path) == [f"s.yaml:3:7: cuda: {message}"]
    ok = spec.load(write(in_tmp / "t.yaml", GOOD.replace('cuda: "13.0"', 'cuda: "12.9"')))
    assert (ok.cuda, ok.cuda_major, str(ok.cuda_version)) == ("12.9", 12, "12.9")


def test_duplicate_key_is_an_error(in_tmp: Path) -> None:
    path = write(in_tmp / "s.yaml", GOOD + 'cuda: "13.2"\n')
    assert problems(path) == ["s.yaml:7:1: cuda: duplicate key (YAML would keep only the last)"]


def test_safe_loader_only(in_tmp: Path) -> None:
    path = write(
        in_tmp / "s.yaml", GOOD + "summary: !!python/object/apply:os.system ['touch pwned']\n"
    )
    got = problems(path)
    assert len(got) == 1
    assert got[0] == (
        "s.yaml:7:10: summary: YAML tag 'tag:yaml.org,2002:python/object/apply:os.system' is "
        "not allowed: a spec is plain data"
    )
    assert not (in_tmp / "pwned").exists()


def test_invalid_yaml_and_encoding(in_tmp: Path) -> None:
    path = write(in_tmp / "s.yaml", "name: [unclosed\n")
    assert problems(path)[0].startswith("s.yaml:2:1: invalid YAML:")
    raw = in_tmp / "b.yaml"
    raw.write_bytes(b'name: demo\nsummary: "caf\xe9"\n')
    assert problems(raw) == ["b.yaml:2:14: not UTF-8 (byte 0xe9)"]
    empty = write(in_tmp / "e.yaml", "")
    assert problems(empty) == ["e.yaml:1:1: the file is empty; a spec is a YAML mapping"]
    scalar = write(in_tmp / "l.yaml", "- a\n")
    assert problems(scalar) == ["l.yaml:1:1: a spec is a YAML mapping, got a list"]


def test_alias_bomb_is_bounded(in_tmp: Path) -> None:
    lines = ['a0: &a0 ["x", "x", "x", "x", "x", "x", "x", "x", "x"]']
    for i in range(1, 9):
        prev = f"*a{i - 1}"
        lines.append(f"a{i}: &a{i} [{', '.join([prev] * 9)}]")
    path = write(in_tmp / "bomb.yaml", "\n".join(lines) + "\n")
    got = problems(path)
    assert any("too many YAML nodes" in p for p in got)


def test_extends_merges_and_locates(in_tmp: Path) -> None:
    write(in_tmp / "base.yaml", GOOD + "toolchain: {source: wheels, components: [nvcc, cudart]}\n")
    child = write(
        in_tmp / "child.yaml",
        "extends: base.yaml\nname: child\ntoolchain: {components: [nvcc, cudart, cccl]}\n",
    )
    s = spec.load(child)
    assert s.name == "child"
    assert s.torch == "2.14.1"
    assert s.toolchain.components == ("nvcc", "cudart", "cccl")
    bad = write(in_tmp / "bad.yaml", "extends: base.yaml\ncuda: 13.0\n")
    assert problems(bad) == [
        'bad.yaml:2:7: cuda: expected a quoted CUDA major.minor like "13.0", got the number 13.0'
    ]
    loop = write(in_tmp / "loop.yaml", "extends: loop.yaml\n")
    assert problems(loop) == [
        "loop.yaml:1:10: extends: cycle: loop.yaml extends itself (via loop.yaml)"
    ]
    missing = write(in_tmp / "m.yaml", "extends: nope.yaml\n" + GOOD)
    assert problems(missing) == ["m.yaml:1:10: extends: no such spec file: nope.yaml"]


@pytest.mark.parametrize("base", ["a\\0b", "x" * 300])
def test_extends_path_the_os_refuses(in_tmp: Path, base: str) -> None:
    # A NUL byte or an over-long name made pathlib raise instead of "no such file".
    path = write(in_tmp / "s.yaml", f'extends: "{base}"\n' + GOOD)
    shown = base.replace("\\0", "\x00")
    assert problems(path) == [f"s.yaml:1:10: extends: not a usable file path: {shown!r}"]


ETC_USERS = (
    "root:x:0:0:root:/root:/bin/bash\n"
    "deploy:x:1000:1000:Deploy Token hunter2SECRET:/home/deploy:/bin/bash\n"
)
SSH_KEY = (
    "-----BEGIN OPENSSH PRIVATE KEY-----\n"
    "b3BlbnNzaC1rZXktdjEAAAAABG5vbmUAAAAEbm9uZQAAAAAAAAABAAAAMwAAAAtzc2gtZW\n"
    "QyNTUxOQAAACBSECRETKEYMATERIALxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx\n"
    "-----END OPENSSH PRIVATE KEY-----\n"
)


@pytest.mark.parametrize(
    ("content", "secret"),
    [
        (ETC_USERS, "hunter2SECRET"),
        (SSH_KEY, "SECRETKEYMATERIAL"),
        ("123456789\n", "123456789"),  # a PIN: a number is no more shown than a string
        ("- AKIASECRETKEY\n", "AKIASECRETKEY"),
        # Syntax errors whose messages the pure-Python loader would quote.
        ("*SECRETALIAS\n", "SECRETALIAS"),
        ("key: !SECRETHANDLE!x y\n", "SECRETHANDLE"),
        ("token: SECRETVALUE\n\x00\n", "SECRETVALUE"),
    ],
)
@pytest.mark.parametrize("loader", ["libyaml", "pure"])
def test_a_file_that_is_no_spec_is_named_never_shown(
    in_tmp: Path, monkeypatch: pytest.MonkeyPatch, content: str, secret: str, loader: str
) -> None:
    """`extends:` (or the spec argument) naming /etc/passwd or an SSH key: the error names the
    file and the problem, and nothing of its text reaches a CI log."""
    if loader == "pure":  # what yamldoc uses where PyYAML was built without libyaml
        monkeypatch.setattr(yamldoc, "_LOADER", yaml.SafeLoader)
    target = write(in_tmp / "secret", content)
    child = write(in_tmp / "s.yaml", "extends: secret\n" + GOOD)
    for path in (child, target):
        got = problems(path)
        assert len(got) == 1 and got[0].startswith("secret:"), got
        assert secret not in got[0] and "root:x" not in got[0] and "BEGIN" not in got[0]


SHADOW = "root:$6$SALTsalt$SECRETHASHsecrethash:20228:0:99999:7:::\ndaemon:*:20228:0:99999:7:::\n"


@pytest.mark.parametrize("target", ["shadow", "/etc/shadow"])
def test_an_extends_target_with_keys_no_spec_has_is_not_a_spec_and_never_shown(
    in_tmp: Path, target: str
) -> None:
    """A shadow file reads as a mapping whose keys are its lines (each ends in ':'): printed
    as "unknown key", the password hash reached the log. The target is "not a spec", where
    its first strange key is, and nothing of its text."""
    if target == "/etc/shadow" and not os.access(target, os.R_OK):
        pytest.skip("/etc/shadow is not readable here")
    shadow = write(in_tmp / "shadow", SHADOW)
    shadow.chmod(0o600)
    child = write(in_tmp / "s.yaml", f"extends: {target}\n" + GOOD)
    (got,) = problems(child)
    assert got.startswith(f"s.yaml:1:10: extends: {target} is not a spec: it has ")
    assert got.endswith(f"key(s) no spec has, the first at {target}:1:1 (its text is not shown)")
    assert "SECRET" not in got and "$" not in got and ":::" not in got
    # A base with a mistyped key says where it is, no more.
    write(in_tmp / "base.yaml", 'name: demo\npythn: "3.12"\n')
    assert problems(write(in_tmp / "c.yaml", "extends: base.yaml\n" + GOOD)) == [
        "c.yaml:1:10: extends: base.yaml is not a spec: it has 1 key(s) no spec has, the first "
        "at base.yaml:2:1 (its text is not shown)"
    ]


def test_what_a_file_that_is_no_spec_says(in_tmp: Path) -> None:
    write(in_tmp / "passwd", ETC_USERS)
    assert problems(write(in_tmp / "s.yaml", "extends: passwd\n" + GOOD)) == [
        "passwd:1:1: a spec is a YAML mapping, got a single value (not shown)"
    ]
    write(in_tmp / "bad", "*alias\n")
    assert problems(write(in_tmp / "b.yaml", "extends: bad\n" + GOOD)) == [
        "bad:1:1: invalid YAML: found undefined alias"
    ]
    write(in_tmp / "nul", "a: b\n\x00\n")
    assert problems(write(in_tmp / "n.yaml", "extends: nul\n" + GOOD)) == [
        "nul:2:1: invalid YAML: unacceptable character #x0000"
    ]
    # A spec (a mapping) still quotes its own values: that is how its mistakes are found.
    assert problems(write(in_tmp / "v.yaml", "name: demo\npython: 3\ncuda: '13.0'\n")) == [
        'v.yaml:2:9: python: expected a Python version like "3.12", got the number 3'
    ]


def test_yaml_error_text_keeps_one_character_and_token_names() -> None:
    assert yamldoc._without_text("found character '\\t' that cannot start any token") == (
        "found character '\\t' that cannot start any token"
    )
    assert yamldoc._without_text("expected ',' or ']', but got '<stream end>'") == (
        "expected ',' or ']', but got '<stream end>'"
    )
    assert yamldoc._without_text("found undefined alias 'id_rsa_body'") == (
        "found undefined alias (text not shown)"
    )


def test_the_cli_names_an_extended_ssh_key_without_printing_it(in_tmp: Path) -> None:
    write(in_tmp / "id_ed25519", SSH_KEY)
    write(in_tmp / "s.yaml", "extends: id_ed25519\n" + GOOD)
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", "plan", "s.yaml"],
        capture_output=True,
        text=True,
        cwd=in_tmp,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        check=False,
    )
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: id_ed25519:1:1: a spec is a YAML mapping, got a single value (not shown)",
        "error: 1 problem(s) in the spec; nothing was done",
    ]


def bounded(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """`cudaenv ARGS` in a child with a deadline and 2 GiB of address space: a read that
    blocks on a FIFO, or never ends on /dev/zero, fails the test instead of hanging it or
    exhausting the machine's memory."""

    def limit() -> None:
        resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))

    return subprocess.run(
        [sys.executable, "-m", "builder.cli", *args],
        capture_output=True,
        text=True,
        cwd=cwd,
        env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"},
        timeout=60,
        preexec_fn=limit,
        check=False,
    )


@pytest.mark.slow
def test_a_spec_that_is_no_regular_file_is_refused_at_once(in_tmp: Path) -> None:
    """/dev/zero was read until memory ran out (a MemoryError traceback); a FIFO hung."""
    os.mkfifo(in_tmp / "fifo.yaml")
    write(in_tmp / "child.yaml", "extends: fifo.yaml\n" + GOOD)
    write(in_tmp / "zero.yaml", "extends: /dev/zero\n" + GOOD)
    for arg, shown, what in (
        ("/dev/zero", "/dev/zero", "a character device"),
        ("fifo.yaml", "fifo.yaml", "a FIFO"),
        ("child.yaml", "fifo.yaml", "a FIFO"),
        ("zero.yaml", "/dev/zero", "a character device"),
        (".", ".", "a directory"),
    ):
        done = bounded("plan", arg, cwd=in_tmp)
        assert done.returncode == 2, (arg, done.stderr)
        assert done.stderr.splitlines() == [
            f"error: {shown}:1:1: {what}, not a file; a spec is a regular file",
            "error: 1 problem(s) in the spec; nothing was done",
        ], arg


def test_a_matrix_file_that_is_no_regular_file_is_refused(in_tmp: Path) -> None:
    os.mkfifo(in_tmp / "m.yaml")
    done = bounded("matrix", "m.yaml", "--emit", "github", cwd=in_tmp)
    assert done.returncode == 2, done.stderr
    assert done.stderr.splitlines() == [
        "error: m.yaml:1:1: a FIFO, not a file; a matrix file is a regular file",
        "error: 1 problem(s) in the matrix file; nothing was done",
    ]


def test_fingerprint_ignores_what_does_not_change_the_install(in_tmp: Path) -> None:
    a = spec.load(write(in_tmp / "a.yaml", GOOD))
    b = spec.load(write(in_tmp / "b.yaml", GOOD.replace('["12.0f"]', '["9.0a"]') + "summary: x\n"))
    c = spec.load(write(in_tmp / "c.yaml", GOOD.replace("sglang==0.5.23", "sglang==0.5.22")))
    assert a.fingerprint() == b.fingerprint()
    assert a.fingerprint() != c.fingerprint()


def test_arch_model() -> None:
    a = Arch.parse("12.0f")
    assert (a.major, a.minor, a.suffix, a.sm, a.cubin_sm) == (12, 0, "f", "sm_120f", "sm_120")
    with pytest.raises(ValueError, match="got '120'"):
        Arch.parse("120")


def test_unknown_top_key_lists_every_key_in_order(in_tmp: Path) -> None:
    path = write(in_tmp / "s.yaml", GOOD + "zzz: 1\n")
    assert problems(path) == [
        "s.yaml:7:1: zzz: unknown key; expected one of: name, summary, extends, python, cuda, "
        "torch, packages, toolchain, archs, env, build-env, verify, indexes, platforms, targets, remote-cache"
    ]


def test_each_validator_returns_its_envspec_field() -> None:
    # _validate passes the validators' results to EnvSpec(**...), which mypy cannot check.
    fields = typing.get_type_hints(spec.EnvSpec)
    assert {spec.FIELDS.get(k, k) for k in spec._VALIDATORS} == set(fields) - {"source"}
    for key, check in spec._VALIDATORS.items():
        returns = typing.get_type_hints(check)["return"]
        field = fields[spec.FIELDS.get(key, key)]
        assert returns in (field, field | None), key


# --------------------------------------------------------------------------- yamldoc


def test_suggest_keys_checks_and_components() -> None:
    assert yamldoc.suggest("pakages", spec.TOP_KEYS) == "unknown key; did you mean 'packages'?"
    assert (
        yamldoc.suggest("zzz", ("source", "path")) == "unknown key; expected one of: source, path"
    )
    assert yamldoc.suggest("cubins", spec.CHECKS, "check") == (
        "unknown check 'cubins'; did you mean 'cubin'?"
    )
    assert yamldoc.suggest("x", ("nvcc", "cudart"), "component") == (
        "unknown component 'x'; expected one of: nvcc, cudart"
    )


def test_compose_keeps_value_and_key_marks(in_tmp: Path) -> None:
    found = yamldoc.Problems()
    root = yamldoc.compose(write(in_tmp / "m.yaml", "a:\n  - 1\n  - x\n"), found)
    assert not found
    assert root is not None and isinstance(root.value, dict)
    a = root.value["a"]
    assert (str(a.key_mark), str(a.mark)) == ("m.yaml:1:1", "m.yaml:2:3")
    assert isinstance(a.value, list)
    assert [(i.value, str(i.mark)) for i in a.value] == [(1, "m.yaml:2:5"), ("x", "m.yaml:3:5")]


@pytest.mark.parametrize(
    ("text", "max_bytes", "message"),
    [
        ("- a\n", 100, "m.yaml:1:1: a matrix file is a YAML mapping, got a list"),
        ("", 100, "m.yaml:1:1: the file is empty; a matrix file is a YAML mapping"),
        (
            "cells: !!set {a}\n",
            100,
            "m.yaml:1:8: cells: YAML tag 'tag:yaml.org,2002:set' is not allowed: "
            "a matrix file is plain data",
        ),
        ("cells: [x]\n", 10, "m.yaml:1:1: file is 11 bytes; a matrix file is at most 10"),
    ],
)
def test_compose_names_the_kind_of_file(
    in_tmp: Path, text: str, max_bytes: int, message: str
) -> None:
    found = yamldoc.Problems()
    path = write(in_tmp / "m.yaml", text)
    assert yamldoc.compose(path, found, what="matrix file", max_bytes=max_bytes) is None
    assert found.messages() == [message]


def test_problems_sorted_by_position_and_deduplicated() -> None:
    found = yamldoc.Problems()
    assert not found
    found.add(Mark("b.yaml", 1, 1), "", "other file")
    found.add(Mark("a.yaml", 10, 1), "x", "line ten")
    found.add(Mark("a.yaml", 9, 4), "y", "col four")
    found.add(Mark("a.yaml", 9, 2), "y", "col two")
    found.add(Mark("a.yaml", 10, 1), "x", "line ten")
    assert found
    assert found.messages() == [
        "a.yaml:9:2: y: col two",
        "a.yaml:9:4: y: col four",
        "a.yaml:10:1: x: line ten",
        "b.yaml:1:1: other file",
    ]


def test_display_is_relative_to_the_cwd_below_it(in_tmp: Path) -> None:
    assert yamldoc.display(in_tmp / "sub" / "s.yaml") == "sub/s.yaml"
    assert yamldoc.display(Path("/nonexistent-root/s.yaml")) == "/nonexistent-root/s.yaml"


@pytest.mark.parametrize(
    ("value", "text"),
    [
        (None, "null"),
        (True, "a boolean"),
        (3, "the number 3"),
        (1.5, "the number 1.5"),
        ("x", "the string 'x'"),
        ([], "a list"),
        ({}, "a mapping"),
    ],
)
def test_kind(value: object, text: str) -> None:
    assert yamldoc.kind(value) == text


def test_string_and_strings_record_located_problems() -> None:
    def at(line: int) -> Mark:
        return Mark("f.yaml", line, 3)

    found = yamldoc.Problems()
    assert yamldoc.string(Item(" x ", at(1)), "k", found, "a name") == "x"
    assert yamldoc.string(Item(3, at(2)), "k", found, "a name") is None
    entries = [Item("a", at(4)), Item(None, at(5)), Item(" ", at(6))]
    got = list(yamldoc.strings(Item(entries, at(3)), "l", found, "names"))
    assert [(text, str(item.mark), path) for text, item, path in got] == [
        ("a", "f.yaml:4:3", "l[0]")
    ]
    assert list(yamldoc.strings(Item({}, at(7)), "m", found, "names")) == []
    assert found.messages() == [
        "f.yaml:2:3: k: expected a name, got the number 3",
        "f.yaml:5:3: l[1]: expected names, got null",
        "f.yaml:6:3: l[2]: expected names, got the string ' '",
        "f.yaml:7:3: m: expected a list of names, got a mapping",
    ]


def test_platforms_default_to_both_and_are_checked(in_tmp: Path) -> None:
    assert spec.load(write(in_tmp / "s.yaml", GOOD)).platforms == ("linux-x86_64", "linux-aarch64")
    narrow = spec.load(write(in_tmp / "n.yaml", GOOD + "platforms: [linux-aarch64]\n"))
    assert narrow.platforms == ("linux-aarch64",)
    # The platforms decide what is resolved: another list is another lock.
    assert narrow.fingerprint() != spec.load(in_tmp / "s.yaml").fingerprint()
    path = write(in_tmp / "bad.yaml", GOOD + "platforms: [linux-arm64, macos-arm64]\n")
    assert problems(path) == [
        "bad.yaml:7:13: platforms[0]: unknown platform 'linux-arm64'; did you mean 'linux-aarch64'?",
        "bad.yaml:7:26: platforms[1]: unknown platform 'macos-arm64'; expected one of: "
        "linux-x86_64, linux-aarch64",
    ]
    assert problems(write(in_tmp / "e.yaml", GOOD + "platforms: []\n")) == [
        "e.yaml:7:12: platforms: name at least one platform"
    ]


def test_the_reference_documents_every_key() -> None:
    """docs/reference/specs.md names every spec key, toolchain key, check, platform and matrix key:
    a key added to a validator table without a line there fails here."""
    from builder.core import platforms
    from builder.spec import matrixfile
    from tests.helpers import REPO

    text = (REPO / "docs" / "reference" / "specs.md").read_text()
    names = [*spec.TOP_KEYS, *spec.TOOLCHAIN_KEYS, *spec.CHECKS, *platforms.KNOWN,
             *matrixfile.MATRIX_KEYS, *matrixfile.AXES]  # fmt: skip
    missing = [n for n in names if f"`{n}`" not in text]
    assert missing == []


@pytest.mark.parametrize("key", ["_OLD_VIRTUAL_PATH", "_CUDAENV_OLD_CUDA_HOME", "_cudaenv_saved",
                                 "VIRTUAL_ENV_PROMPT"])  # fmt: skip
def test_what_activation_keeps_for_deactivate_is_reserved(in_tmp: Path, key: str) -> None:
    path = write(in_tmp / "s.yaml", GOOD + f"env: {{{key}: x}}\n")
    assert problems(path) == [
        f"s.yaml:7:7: env.{key}: {key} is set by cudaenv itself and cannot be overridden"
    ]


def test_a_file_of_another_kind_is_no_spec_and_none_of_its_text_is_shown(in_tmp: Path) -> None:
    """/etc/shadow named as a spec reads as a mapping whose keys are its lines: it is said to
    be no spec, and no line of it reaches the terminal or a CI log."""
    line = "root:$6$saltsalt$hashhashhash:19000:0:99999:7:::"  # a shadow entry
    path = write(in_tmp / "shadow", f"{line}\ndaemon:*:19000:0:99999:7:::\n")
    path.chmod(0o600)
    (problem,) = problems(path)
    assert problem == (
        "shadow:1:1: shadow is not a spec: none of its 2 key(s) is a spec's (the first at "
        "shadow:1:1; its text is not shown)"
    )
    assert "saltsalt" not in problem and "daemon" not in problem
    # A spec with one key misspelt is still a spec: the key is named, with a suggestion.
    typo = write(in_tmp / "t.yaml", GOOD + "pakages: [x]\n")
    assert any("pakages: unknown key" in p for p in problems(typo))
