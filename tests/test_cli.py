"""The command line as a user meets it: help texts, usage errors (exit 2, one line, no
traceback), argument forms, the verdict's exit code, stale locks, and verify refusing an env
that another spec built."""

from __future__ import annotations

import argparse
import ast
import dataclasses
import json
import os
import shutil
import subprocess
import sys
import tempfile
import types
import typing
from pathlib import Path

import pytest

from builder import verify
from builder.cli import main as cli
from builder.cli import parser as cliargs
from builder.commands import args as commandargs
from builder.commands import pipeline
from builder.commands import verify as verifyrun
from builder.commands.options import Command
from builder.core import platforms
from builder.core.errors import ToolMissing, UsageError, VerifyFailed
from builder.core.reporter import silent
from builder.env import manifest
from builder.env.manifest import Manifest
from builder.machine import archs
from builder.spec import envspec as spec
from builder.spec import lock, resolve
from builder.verify.model import CheckResult
from builder.verify.report import VerifyReport
from tests.helpers import ENVSPECS, REPO, a_manifest, cudaenv, lock_of, workspace, write

TOOLCHAIN = ENVSPECS / "toolchain-cu130.yaml"


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


@pytest.mark.slow
def test_help_says_what_cudaenv_is_and_every_command_has_an_example() -> None:
    parser = cli.make_parser()
    top = parser.format_help()
    assert "matched CUDA toolchain" in top
    assert "FILE:CELL" in top and "SPEC is a spec file" in top
    assert "argparse" not in top
    commands = [
        "lock",
        "plan",
        "build",
        "export",
        "verify",
        "doctor",
        "fingerprint",
        "matrix",
        "report",
    ]
    for name in commands:
        done = subprocess.run(
            [sys.executable, "-m", "builder.cli", name, "--help"],
            capture_output=True,
            text=True,
            cwd=REPO,
            check=True,
        )
        assert "example:\n  cudaenv " + name in done.stdout, name


@pytest.mark.parametrize(
    "argv",
    [
        ["verify"],
        ["verify", str(TOOLCHAIN), "--checks", "bogus"],
        ["verify", str(TOOLCHAIN), "--archs", "12.0q"],
        ["build", "--env-dir", "x", str(TOOLCHAIN), str(TOOLCHAIN)],
        ["verify", "--python", tempfile.gettempdir()],
        ["verify", "--python", "/etc/passwd"],
        ["doctor", "--python", tempfile.gettempdir()],
        ["matrix", "m.yaml", "-j", "0"],
    ],
)
def test_usage_errors_exit_2_with_one_line(argv: list[str], tmp_path: Path) -> None:
    done = cudaenv(*argv, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    one_error_line(done)


@pytest.mark.slow
def test_debug_is_taken_after_the_subcommand_too(tmp_path: Path) -> None:
    bad = write(tmp_path / "bad.yaml", "name: [\n")
    quiet = cudaenv("plan", str(bad), cwd=tmp_path, check=False)
    assert quiet.returncode == 2 and "Traceback" not in quiet.stderr
    loud = cudaenv("plan", "--debug", str(bad), cwd=tmp_path, check=False)
    assert "Traceback" in loud.stderr  # --debug shows where it came from
    before = cudaenv("--debug", "plan", str(bad), cwd=tmp_path, check=False)
    assert "Traceback" in before.stderr


def test_archs_take_commas_and_spaces() -> None:
    assert pipeline.parse_archs("12.0f,9.0a") == archs.parse_list("12.0f 9.0a")
    with pytest.raises(UsageError, match=r"--archs '12\.0f,x'"):
        pipeline.parse_archs("12.0f,x")


def test_verify_of_any_python_with_comma_archs_reports_without_a_traceback(
    tmp_path: Path,
) -> None:
    out = tmp_path / "r.json"
    done = cudaenv(
        "verify",
        "--python",
        sys.executable,
        "--checks",
        "toolchain",
        "--archs",
        "12.0f,9.0a",
        "--report",
        str(out),
        cwd=tmp_path,
        check=False,
        env={"CUDA_HOME": str(tmp_path / "no-toolkit")},
    )
    assert done.returncode == 5, done.stderr
    assert one_error_line(done) == "error: 1 check(s) failed: toolchain"
    assert json.loads(out.read_text())["archs"] == ["12.0f", "9.0a"]


def test_the_check_names_agree_everywhere() -> None:
    assert spec.CHECKS == verify.CHECKS == tuple(verify.registry())
    assert verify.parse_checks("cubin, toolchain") == ("cubin", "toolchain")
    with pytest.raises(UsageError, match="unknown check\\(s\\) 'bogus'"):
        verify.parse_checks("toolchain,bogus")


def a_report(*checks: CheckResult) -> VerifyReport:
    return VerifyReport(
        spec="x",
        env=None,
        python="p",
        lock_hash=None,
        archs=archs.DEFAULT_ARCHS,
        versions=(),
        checks=checks,
        seconds=1.0,
        created="2026-11-30T00:00:00+00:00",
    )


def test_a_missing_host_compiler_exits_6_a_failed_check_5() -> None:
    ok = CheckResult(name="toolchain", status="passed", summary="")
    no_cc = CheckResult(
        name="kernel-compile",
        status="failed",
        summary="no host compiler",
        fix="install a C++ compiler",
        missing_tool="host compiler",
    )
    bad = CheckResult(name="cubin", status="failed", summary="no sm_120 cubin")
    assert verifyrun.verdict(a_report(ok)) is None
    assert isinstance(verifyrun.verdict(a_report(ok, bad)), VerifyFailed)
    verdict = verifyrun.verdict(a_report(no_cc, bad))
    assert isinstance(verdict, ToolMissing) and verdict.exit_code == 6
    assert "install a C++ compiler" in str(verdict)


def built_manifest(s: spec.EnvSpec, lk: lock.Lock, **changes: object) -> Manifest:
    own: dict[str, object] = {
        "name": s.name,
        "spec": str(s.source),
        "fingerprint": s.fingerprint(),
        "lock_hash": lk.content_hash(),
        "archs": s.archs,
        "spec_archs": s.archs,
    }
    return a_manifest(**{**own, **changes})


def test_verify_refuses_an_env_another_spec_or_lock_built(tmp_path: Path) -> None:
    s = spec.load(TOOLCHAIN)
    lk = lock.read(lock.lock_path(s.source, s.name))
    good = built_manifest(s, lk)
    target = verifyrun.spec_target(s, tmp_path, lk, good)
    assert target.archs == s.archs and target.checks == s.verify
    other = built_manifest(s, lk, fingerprint="sha256:" + "1" * 64, spec="specs/b.yaml")
    with pytest.raises(VerifyFailed, match=r"built from another spec .*specs/b\.yaml") as info:
        verifyrun.spec_target(s, tmp_path, lk, other)
    assert str(info.value).endswith(f"rebuild it: `cudaenv build {s.source}`")
    stale = built_manifest(s, lk, lock_hash="sha256:" + "2" * 64)
    with pytest.raises(VerifyFailed, match="built from another lock"):
        verifyrun.spec_target(s, tmp_path, lk, stale)


def test_manifest_round_trip_and_unknown_schema(tmp_path: Path) -> None:
    s = spec.load(TOOLCHAIN)
    lk = lock.read(lock.lock_path(s.source, s.name))
    m = built_manifest(s, lk)
    manifest.write(m, tmp_path)
    assert manifest.read(tmp_path) == m
    doc = json.loads((tmp_path / manifest.FILE).read_text())
    doc["schema_version"] = 7
    (tmp_path / manifest.FILE).write_text(json.dumps(doc))
    with pytest.raises(Exception, match="not a cudaenv manifest of schema version 1 "):
        manifest.read(tmp_path)
    assert manifest.try_read(tmp_path) is None
    del doc["archs"]
    doc["schema_version"] = 1
    (tmp_path / manifest.FILE).write_text(json.dumps(doc))
    with pytest.raises(Exception, match="missing key 'archs'"):
        manifest.read(tmp_path)
    doc = {**m.to_json(), "toolchain_source": "conda"}
    (tmp_path / manifest.FILE).write_text(json.dumps(doc))
    with pytest.raises(Exception, match="in 'toolchain_source': unknown toolchain_source 'conda'"):
        manifest.read(tmp_path)


def test_a_stale_lock_is_re_resolved_only_when_asked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    body = TOOLCHAIN.read_text()
    path = write(tmp_path / "t.yaml", body)
    s = spec.load(path)
    committed = lock.read(lock.lock_path(TOOLCHAIN, s.name))
    stale = dataclasses.replace(committed, fingerprint="sha256:" + "0" * 64)
    lock.write(stale, lock.lock_path(path, s.name))
    calls: list[str] = []

    def fake_resolve(sp: spec.EnvSpec, **kw: object) -> resolve.Plan:
        calls.append(sp.name)
        return resolve.Plan(lock=committed, requirements=(), seconds=0.0)

    monkeypatch.setattr(resolve, "resolve", fake_resolve)
    kept = pipeline.ensure_lock(s, path, offline=False, relock=False, reporter=silent())
    assert kept.fingerprint == stale.fingerprint and calls == []
    fresh = pipeline.ensure_lock(s, path, offline=False, relock=True, reporter=silent())
    assert fresh == committed and calls == [s.name]
    assert lock.read(lock.lock_path(path, s.name)).fingerprint == committed.fingerprint
    lock.write(stale, lock.lock_path(path, s.name))
    with pytest.raises(Exception, match="is stale and --offline cannot resolve one"):
        pipeline.ensure_lock(s, path, offline=True, relock=True, reporter=silent())


def test_plan_says_where_the_lock_is(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    body = (ws / "envspecs" / "toolchain-cu130.yaml").read_text()
    dotted = write(
        ws / "envspecs" / "tc.yaml", body.replace("name: toolchain-cu130", "name: toolchain.v1")
    )
    s = spec.load(dotted)
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    lock.write(
        dataclasses.replace(committed, spec_name=s.name, fingerprint=s.fingerprint()),
        lock.lock_path(s.source, s.name),
    )
    done = cudaenv("plan", "envspecs/tc.yaml", cwd=ws)
    lines = done.stdout.splitlines()
    assert lines[0] == (
        "# plan for toolchain.v1 from envspecs/locks/pylock.toolchain-v1.toml (up to date); "
        "nothing installed"
    )
    assert lines[1].split() == ["lock", "envspecs/locks/pylock.toolchain-v1.toml"]


@pytest.mark.parametrize(
    "argv",
    [
        ["lock", "envspecs/dotted.yaml"],
        ["plan", "envspecs/dotted.yaml"],
        ["build", "--offline", "envspecs/dotted.yaml"],
        ["export", "envspecs/dotted.yaml"],
    ],
)
def test_two_spec_names_for_one_lock_file_are_refused(argv: list[str], tmp_path: Path) -> None:
    """`toolchain.cu130` and `toolchain-cu130` both map to pylock.toolchain-cu130.toml: the
    lock says whose it is, and no command uses or overwrites another spec's lock."""
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    body = (ws / "envspecs" / "toolchain-cu130.yaml").read_text()
    write(
        ws / "envspecs" / "dotted.yaml",
        body.replace("name: toolchain-cu130", "name: toolchain.cu130"),
    )
    lock_file = lock_of(ws / "envspecs" / "toolchain-cu130.yaml")
    before = lock_file.read_text()
    done = cudaenv(*argv, cwd=ws, check=False, env={"CUDAENV_UV": "/nonexistent/uv"})
    assert done.returncode == 4, done.stderr
    assert one_error_line(done) == (
        "error: envspecs/locks/pylock.toolchain-cu130.toml is the lock of spec "
        "'toolchain-cu130', not of 'toolchain.cu130': both names map to "
        "pylock.toolchain-cu130.toml (dots become '-'); rename one of the specs"
    )
    assert lock_file.read_text() == before
    assert not (ws / ".envs").exists()


def test_plan_shows_one_platform_of_the_lock(tmp_path: Path) -> None:
    """The committed default lock covers both platforms; --platform picks the table."""
    ws = workspace(tmp_path, "default.yaml")
    done = cudaenv("plan", "envspecs/default.yaml", "--platform", "linux-aarch64", cwd=ws)
    table = {
        line.split("  ", 1)[0].strip(): line.split("  ", 1)[1].strip()
        for line in done.stdout.splitlines()[1:]
        if "  " in line
    }
    assert table["platform"] == "linux-aarch64 (the lock also holds linux-x86_64)"
    assert table["torch"] == "2.14.1"
    assert table["torch's CUDA"] == "13.0"
    components = {
        k: v for k, v in table.items() if k.startswith("nvidia-cuda-") or k == "nvidia-nvvm"
    }
    assert {"nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-cuda-cccl", "nvidia-nvvm"} <= set(
        components
    )
    assert all(v.startswith("13.0.") for v in components.values()), components
    # The aarch64 table lists what aarch64 installs (the lock marks x86_64-only entries).
    lk = lock.read(lock_of(ENVSPECS / "default.yaml"))
    assert table["packages"] == str(len(lk.packages_on("linux-aarch64")))
    assert lk.packages_on("linux-aarch64") != lk.packages_on("linux-x86_64")


@pytest.mark.parametrize(
    ("platform", "message"),
    [
        ("linux-arm64", "error: --platform 'linux-arm64': unknown platform; expected one of: "
                        "linux-x86_64, linux-aarch64"),
        ("linux-aarch64", "error: --platform linux-aarch64: envspecs/torch2.9-cu128-system.yaml "
                          "is locked for linux-x86_64 only; add linux-aarch64 to its `platforms:` "
                          "and re-lock"),
    ],
)  # fmt: skip
def test_plan_refuses_a_platform_the_lock_lacks(
    tmp_path: Path, platform: str, message: str
) -> None:
    ws = workspace(tmp_path, "torch2.9-cu128-system.yaml")
    done = cudaenv(
        "plan", "envspecs/torch2.9-cu128-system.yaml", "--platform", platform, cwd=ws, check=False
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [message]


def test_build_refuses_a_lock_without_this_machines_platform(tmp_path: Path) -> None:
    host = platforms.host_name()
    other = next(p for p in platforms.KNOWN if p != host)
    ws = workspace(tmp_path, "toolchain-cu130.yaml")
    path = ws / "envspecs" / "toolchain-cu130.yaml"
    write(path, path.read_text() + f"platforms: [{other}]\n")
    s = spec.load(path)
    committed = lock.read(lock_of(ENVSPECS / "toolchain-cu130.yaml"))
    lock.write(
        dataclasses.replace(committed, fingerprint=s.fingerprint(), platforms=(other,)),
        lock_of(path),
    )
    done = cudaenv("build", "--offline", "envspecs/toolchain-cu130.yaml", cwd=ws, check=False)
    assert done.returncode == 4, done.stderr
    assert done.stderr.strip().splitlines()[-1] == (
        f"error: envspecs/locks/pylock.toolchain-cu130.toml is locked for {other}, not for "
        f"this machine ({host}): add {host} to `platforms:` in "
        "envspecs/toolchain-cu130.yaml and re-lock"
    )
    assert not (ws / ".envs").exists() or not any((ws / ".envs").iterdir())


def fingerprint_doc(**versions: str) -> dict[str, object]:
    from builder.doctor import fingerprint

    parts = fingerprint.Parts(
        python="3.12.1",
        distributions=(("torch", "2.14.1"), ("flashinfer-python", "0.7.2"), *versions.items()),
        toolkit=fingerprint.Toolkit(cuda_home="ENV/cuda-home", nvcc_release="13.0", binaries=()),
        variables=(("FLASHINFER_CUDA_ARCH_LIST", "12.0f"),),
    )
    doc = fingerprint.Fingerprint(python="x", fingerprint=fingerprint.digest(parts), parts=parts)
    return doc.to_json()


@pytest.mark.slow
def test_fingerprint_compare_names_each_difference(tmp_path: Path) -> None:
    """The default env against a venv whose toolkit drifted (flashinfer#3493): nvcc, crt,
    nvvm and cccl are named with both versions; equal fingerprints say so and exit 0."""
    matched = {"nvidia-cuda-nvcc": "13.0.88", "nvidia-cuda-crt": "13.0.88", "nvidia-nvvm": "13.0.88",
               "nvidia-cuda-cccl": "13.0.85"}  # fmt: skip
    mixed = {"nvidia-cuda-nvcc": "13.5.37", "nvidia-cuda-crt": "13.5.37", "nvidia-nvvm": "13.5.37",
             "nvidia-cuda-cccl": "13.3.5.0.6"}  # fmt: skip
    a = write(tmp_path / "a.json", json.dumps(fingerprint_doc(**matched)))
    b = write(tmp_path / "b.json", json.dumps(fingerprint_doc(**mixed)))
    done = cudaenv("fingerprint", "--compare", str(a), str(b), cwd=tmp_path, check=False)
    assert done.returncode == 1
    assert done.stdout.splitlines() == [
        "distributions.nvidia-cuda-cccl: 13.0.85 -> 13.3.5.0.6",
        "distributions.nvidia-cuda-crt: 13.0.88 -> 13.5.37",
        "distributions.nvidia-cuda-nvcc: 13.0.88 -> 13.5.37",
        "distributions.nvidia-nvvm: 13.0.88 -> 13.5.37",
    ]
    same = cudaenv("fingerprint", "--compare", str(a), str(a), cwd=tmp_path)
    assert same.stdout.startswith("same fingerprint sha256:")
    bad = write(tmp_path / "bad.json", "{}")
    done = cudaenv("fingerprint", "--compare", str(a), str(bad), cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        f"error: {bad}: not a fingerprint of this cudaenv (write it with `cudaenv fingerprint --json`)"
    ]


def test_fingerprint_ignores_where_the_env_is(tmp_path: Path) -> None:
    """Two copies of one env at different paths (two nodes, two --env-dir): one hash; a
    changed arch list or toolkit binary: another."""
    from builder.doctor import diagnose as doctor
    from builder.doctor import fingerprint

    def facts(prefix: Path, arch: str) -> doctor.Facts:
        if not (prefix / "cuda-home" / "bin" / "nvcc").exists():
            write(prefix / "cuda-home" / "bin" / "nvcc", "nvcc 13.0.88")
        doc = {
            "python": {"executable": str(prefix / "bin" / "python"), "version": "3.12.1",
                       "prefix": str(prefix)},
            "distributions": {"torch": "2.14.1"},
            "cuda_homes": [{"source": "CUDA_HOME", "path": str(prefix / "cuda-home"),
                            "nvcc": str(prefix / "cuda-home" / "bin" / "nvcc"), "exists": True,
                            "release": "13.0"}],
            "env": {"CUDA_HOME": str(prefix / "cuda-home"), "FLASHINFER_CUDA_ARCH_LIST": arch,
                    "TRITON_CACHE_DIR": str(prefix / "var" / "triton")},
        }  # fmt: skip
        return doctor.Facts.from_json(doc, None)

    one = fingerprint.document("a", facts(tmp_path / "node1" / "env", "12.0f"))
    two = fingerprint.document("b", facts(tmp_path / "node2" / "other", "12.0f"))
    assert one.fingerprint == two.fingerprint
    assert dict(one.parts.variables)["TRITON_CACHE_DIR"] == "ENV/var/triton"
    other_arch = fingerprint.document("c", facts(tmp_path / "node3", "9.0a"))
    assert fingerprint.differences(one.parts, other_arch.parts) == [
        "variables.FLASHINFER_CUDA_ARCH_LIST: 12.0f -> 9.0a"
    ]
    write(tmp_path / "node2" / "other" / "cuda-home" / "bin" / "nvcc", "nvcc 13.5.37")
    changed = fingerprint.document("b", facts(tmp_path / "node2" / "other", "12.0f"))
    assert [d.split(":")[0] for d in fingerprint.differences(one.parts, changed.parts)] == [
        "toolkit.binaries.bin/nvcc"
    ]


@pytest.mark.slow
def test_list_run_and_remove_an_env(tmp_path: Path) -> None:
    """`list` shows the env with its lock state, size and last verify; `run` executes a
    command with the env's hook settings and its exit status; `remove` deletes it whole."""
    from builder.env import hooks
    from tests.helpers import a_manifest

    env_dir = tmp_path / ".envs" / "demo"
    from builder.core import proc

    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(env_dir)])
    s = spec.load(write(tmp_path / "demo.yaml", 'name: demo\npython: "3.12"\ncuda: "13.0"\n'))
    hooks.write_hooks(env_dir, s, archs.DEFAULT_ARCHS)
    manifest.write(a_manifest(name="demo", spec="gone/demo.yaml", path=str(env_dir)), env_dir)
    listed = json.loads(cudaenv("list", "--json", cwd=tmp_path).stdout)
    assert [(e["name"], e["lock"], e["last_verify"]) for e in listed] == [
        ("demo", "no spec file", None)
    ]
    assert listed[0]["bytes"] > 0
    text = cudaenv("list", cwd=tmp_path).stdout.splitlines()
    assert text[0].startswith(f"# envs in {tmp_path / '.envs'} (")
    assert text[1].startswith("demo  spec gone/demo.yaml  lock no spec file  ")
    ran = cudaenv("run", "demo", "--", "sh", "-c", 'echo "$CUDA_HOME|$VIRTUAL_ENV"', cwd=tmp_path)
    assert ran.stdout.strip() == f"{env_dir.absolute()}/cuda-home|{env_dir.absolute()}"
    failed = cudaenv("run", "demo", "--", "sh", "-c", "exit 7", cwd=tmp_path, check=False)
    assert failed.returncode == 7
    unknown = cudaenv("run", "nope", "--", "true", cwd=tmp_path, check=False)
    assert unknown.returncode == 2
    assert unknown.stderr.strip().splitlines() == [
        f"error: nope: no env of that name in {tmp_path / '.envs'} (built here: demo)"
    ]
    cudaenv("remove", "demo", cwd=tmp_path)
    assert not env_dir.exists()
    assert cudaenv("list", cwd=tmp_path).stdout.splitlines()[1:] == ["no envs built"]


def test_plan_json_is_the_table_for_scripts(tmp_path: Path) -> None:
    ws = workspace(tmp_path, "default.yaml")
    doc = json.loads(cudaenv("plan", "envspecs/default.yaml", "--json", cwd=ws).stdout)
    assert (doc["name"], doc["torch"], doc["torch_cuda"], doc["toolkit"]) == (
        "sglang-0.5.23-cu130",
        "2.14.1",
        "13.0",
        "13.0.3.0",
    )
    assert doc["platforms"] == ["linux-x86_64", "linux-aarch64"]
    assert doc["packages"]["nvidia-cuda-nvcc"] == "13.0.88"
    assert doc["lock"].endswith("pylock.sglang-0-5-23-cu130.toml") and doc["lock_written"]


def completion_project(tmp_path: Path) -> tuple[Path, dict[str, str]]:
    """A project with an env "demo-env" and a file "decoy.txt" beside it, and a `cudaenv` on
    PATH running this checkout (the scripts call it for env names)."""
    root = tmp_path / "proj"
    (root / "envspecs").mkdir(parents=True)
    env_dir = root / ".envs" / "demo-env"
    env_dir.mkdir(parents=True)
    manifest.write(a_manifest(name="demo-env", path=str(env_dir)), env_dir)
    write(root / "decoy.txt", "")
    write(root / "dfile", "")
    exe = write(
        tmp_path / "bin" / "cudaenv",
        f'#!/bin/sh\nPYTHONPATH={REPO} exec {sys.executable} -m builder.cli "$@"\n',
    )
    exe.chmod(0o755)
    return root, {**os.environ, "PATH": f"{exe.parent}{os.pathsep}{os.environ['PATH']}"}


# (typed so far, what is offered): env names for run and remove, never files; the
# subcommands of completion, report and store; --help once.
ASKED = [
    ("cudaenv run d", ["demo-env"]),
    ("cudaenv remove d", ["demo-env"]),
    ("cudaenv remove demo-env d", ["demo-env"]),
    ("cudaenv completion ", ["bash", "fish", "zsh"]),
    ("cudaenv report ", ["merge"]),
    ("cudaenv store g", ["gc"]),
    ("cudaenv store gc --", ["--debug", "--help", "--max", "--quiet"]),
    ("cudaenv build --h", ["--help"]),
]


@pytest.mark.slow
@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_offers_env_names_subcommands_and_help_once(shell: str, tmp_path: Path) -> None:
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed on this machine")
    root, env = completion_project(tmp_path)
    script = write(tmp_path / f"cudaenv.{shell}", cudaenv("completion", shell, cwd=root).stdout)
    if shell == "fish":
        asks = "; echo ---; ".join(f"complete -C '{typed}'" for typed, _ in ASKED)
        done = subprocess.run(
            [exe, "--no-config", "-c", f"source {script}; {asks}"],
            cwd=root, env=env, capture_output=True, text=True, check=True,
        )  # fmt: skip
        # fish offers --debug and --quiet only where the parser shows them (not hidden ones).
        offered = [
            sorted(ln.split("\t")[0] for ln in block.splitlines())
            for block in done.stdout.split("---\n")
        ]
        wanted = [[w for w in words if w not in ("--debug", "--quiet")] for _, words in ASKED]
        assert offered == wanted, done.stderr
        return
    lines = []
    for typed, _ in ASKED:
        words = typed.split(" ")
        quoted = " ".join(f"'{w}'" for w in words)
        lines.append(
            f"COMP_WORDS=({quoted}); COMP_CWORD={len(words) - 1}; _cudaenv; "
            'printf "%s\\n" "${COMPREPLY[@]}" | sort | tr "\\n" " "; echo'
        )
    ask = f"source {script}; " + "; ".join(lines)
    argv = (
        [exe, "-c", ask]
        if shell == "bash"
        else [exe, "-f", "-c", "autoload -U compinit && compinit -u; " + ask]
    )
    done = subprocess.run(argv, cwd=root, env=env, capture_output=True, text=True, check=True)
    offered = [line.split() for line in done.stdout.splitlines()]
    if shell == "zsh":
        # Through bashcompinit, zsh filters by what is typed itself: the candidates may be more.
        for got, (typed, words) in zip(offered, ASKED, strict=True):
            assert set(words) <= set(got) and "decoy.txt" not in got, (typed, got)
            assert got.count("--help") <= 1, (typed, got)
        return
    assert offered == [words for _, words in ASKED], done.stderr


@pytest.mark.parametrize("shell", ["bash", "zsh", "fish"])
def test_completion_offers_commands_and_each_commands_options(shell: str, tmp_path: Path) -> None:
    exe = shutil.which(shell)
    if exe is None:
        pytest.skip(f"{shell} is not installed on this machine")
    script = write(tmp_path / f"cudaenv.{shell}", cudaenv("completion", shell, cwd=tmp_path).stdout)
    if shell == "fish":
        ask = (f"source {script}; complete -C 'cudaenv bu'; echo ---; "
               f"complete -C 'cudaenv build --ve'")  # fmt: skip
        done = subprocess.run(
            [exe, "--no-config", "-c", ask], capture_output=True, text=True, check=True
        )
        first, second = done.stdout.split("---\n")
        assert [ln.split("\t")[0] for ln in first.splitlines()] == ["build"]
        assert "--verify" in [ln.split("\t")[0] for ln in second.splitlines()]
        return
    ask = (
        f"source {script}; COMP_WORDS=(cudaenv bu); COMP_CWORD=1; _cudaenv; "
        'echo "${COMPREPLY[@]}"; COMP_WORDS=(cudaenv build --ve); COMP_CWORD=2; _cudaenv; '
        'echo "${COMPREPLY[@]}"'
    )
    if shell == "bash":
        done = subprocess.run([exe, "-c", ask], capture_output=True, text=True, check=True)
        assert done.stdout.splitlines() == ["build", "--verify"]
        return
    # zsh through bashcompinit: the candidates are the command's; zsh filters by what is typed.
    ask = "autoload -U compinit && compinit -u; " + ask
    done = subprocess.run([exe, "-f", "-c", ask], capture_output=True, text=True, check=True)
    offered = [line.split() for line in done.stdout.splitlines()]
    assert "build" in offered[0] and "--verify" not in offered[0]
    assert "--verify" in offered[1] and "build" not in offered[1]


# Output to a pipe is block-buffered unless PYTHONUNBUFFERED is set (as it often is in CI):
# then a command's whole output is written by the interpreter's flush at exit, after main.
BUFFERED = {k: v for k, v in os.environ.items() if k != "PYTHONUNBUFFERED"}


@pytest.mark.parametrize(
    "argv",
    [
        ["plan", str(ENVSPECS / "default.yaml")],
        ["plan", str(ENVSPECS / "default.yaml"), "--json"],
        ["list"],
        ["completion", "bash"],
        ["--help"],
        ["lock", "--help"],
    ],
)
@pytest.mark.parametrize("buffered", [True, False])
@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_traceback(argv: list[str], buffered: bool) -> None:
    # `cudaenv plan SPEC | head -1` where head has gone: the pipe's reading end is closed
    # before cudaenv writes anything, so its first write fails, wherever it happens.
    read_end, write_end = os.pipe()
    os.close(read_end)
    env = BUFFERED if buffered else {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        done = subprocess.run(
            [sys.executable, "-m", "builder.cli", *argv],
            cwd=REPO,
            env={**env, "PYTHONPATH": str(REPO)},
            stdout=write_end,
            stderr=subprocess.PIPE,
            text=True,
            check=False,
        )
    finally:
        os.close(write_end)
    # argparse itself ignores a failed write of --help (its _print_message); unbuffered, that
    # write is the only one, and it exits 0 as argparse does.
    code = 0 if "--help" in argv and not buffered else 141
    assert (done.returncode, done.stderr) == (code, "")


@pytest.mark.slow
def test_head_after_cudaenv_never_gets_a_traceback(tmp_path: Path) -> None:
    """The race a user sees: head reads one line and exits while cudaenv may still write.
    Output over the 8 KiB buffer (`list --json` of 60 envs) is written partly while the
    command runs and the rest at exit, after head has gone in about half the runs; whichever
    way each run goes, cudaenv exits 0 or 141 and says nothing."""
    root = tmp_path / "proj"
    (root / "envspecs").mkdir(parents=True)
    for i in range(60):
        env_dir = root / ".envs" / f"env-{i:02d}"
        env_dir.mkdir(parents=True)
        manifest.write(a_manifest(name=env_dir.name, path=str(env_dir)), env_dir)
    cli_ = f"{sys.executable} -m builder.cli"
    loop = f"""
        run() {{ {cli_} "$@" 2>>{tmp_path / "err"} | head -1 >/dev/null; echo "${{PIPESTATUS[0]}}"; }}
        for i in $(seq 20); do run list --json; done
        for i in $(seq 5); do run plan {ENVSPECS / "default.yaml"}; run fingerprint --json; done
    """
    done = subprocess.run(
        ["bash", "-c", loop],
        cwd=root,
        env={**BUFFERED, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        check=True,
    )
    assert len(done.stdout.split()) == 30
    assert set(done.stdout.split()) <= {"0", "141"}, done.stdout
    assert (tmp_path / "err").read_text() == ""


@pytest.mark.parametrize(
    ("argv", "named"),
    [
        (["lock", ""], "argument SPEC"),
        (["plan", ""], "argument SPEC"),
        (["doctor", "--python", ""], "argument --python"),
        (["verify", str(TOOLCHAIN), "--checks", ""], "argument --checks"),
        (["verify", str(TOOLCHAIN), "--checks", " "], "argument --checks"),
        (["verify", str(TOOLCHAIN), "--archs", ""], "argument --archs"),
        (["run", "", "--", "true"], "argument NAME"),
        (["remove", ""], "argument NAME"),
    ],
)
def test_an_empty_argument_is_a_usage_error_naming_it(
    argv: list[str], named: str, tmp_path: Path
) -> None:
    done = cudaenv(*argv, cwd=tmp_path, check=False)
    assert done.returncode == 2, done.stderr
    assert one_error_line(done) == f"error: cudaenv {argv[0]}: {named}: must not be empty"


def test_an_unknown_option_shows_the_usage_of_its_command(tmp_path: Path) -> None:
    done = cudaenv("lock", "--bogus", "X", cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.startswith(
        "usage: cudaenv lock [-h] [--upgrade] [--upgrade-package NAME]\n"
        "                    [--exclude-newer TIME]\n"
        "                    SPEC [SPEC ...]\n"
    )
    assert one_error_line(done) == "error: cudaenv lock: unrecognized arguments: --bogus"
    nested = cudaenv("store", "gc", "--bogus", cwd=tmp_path, check=False)
    assert nested.returncode == 2
    assert nested.stderr.startswith("usage: cudaenv store gc ")
    assert one_error_line(nested) == "error: cudaenv store gc: unrecognized arguments: --bogus"


@pytest.mark.parametrize(
    ("argv", "said"),
    [
        (["biuld", "x.yaml"], "unknown command 'biuld': did you mean 'build'?"),
        (["--debug", "verfy"], "unknown command 'verfy': did you mean 'verify'?"),
        (["zzz"], "unknown command 'zzz': see `cudaenv --help` for the commands"),
    ],
)
def test_a_mistyped_command_gets_the_closest_one(
    argv: list[str], said: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as exc:
        cliargs.parse(cliargs.make_parser(), argv)
    assert exc.value.code == 2
    assert said in capsys.readouterr().err


def test_a_spec_that_is_not_there_lists_the_specs_that_are(tmp_path: Path) -> None:
    write(tmp_path / "envspecs" / "default.yaml", 'name: d\npython: "3.12"\ncuda: "13.0"\n')
    write(tmp_path / "envspecs" / "vllm.yaml", 'name: v\npython: "3.12"\ncuda: "13.0"\n')
    done = cudaenv("build", "envspecs/defualt.yaml", cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        "error: envspecs/defualt.yaml: no such spec file; did you mean envspecs/default.yaml? "
        "(specs in envspecs: default.yaml, vllm.yaml)"
    )
    # From a directory without specs, the project's envspecs/ are the ones listed.
    (tmp_path / "sub").mkdir()
    done = cudaenv("plan", "nope.yaml", cwd=tmp_path / "sub", check=False)
    assert done.returncode == 2
    assert f"(specs in {tmp_path / 'envspecs'}: default.yaml, vllm.yaml)" in done.stderr


def _leaf_commands(
    parser: argparse.ArgumentParser, prog: str = "cudaenv"
) -> list[tuple[str, argparse.ArgumentParser]]:
    """Every command a user runs (``cudaenv store gc``), with its parser."""
    subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
    if not subs:
        return [(prog, parser)]
    return [
        leaf for name, p in subs[0].choices.items() for leaf in _leaf_commands(p, f"{prog} {name}")
    ]


def test_every_command_has_one_typed_handler() -> None:
    """Each command names the dataclass of its arguments; the CLI maps that type to exactly
    one handler, whose ``args`` is annotated with it, and the dataclass has one field per
    argument of the command (no more, no fewer)."""
    kinds = []
    for prog, parser in _leaf_commands(cliargs.make_parser()):
        kind = parser.get_default("args_type")
        assert isinstance(kind, type) and issubclass(kind, Command), prog
        kinds.append(kind)
        dests = {a.dest for a in parser._actions} - {"help", "debug", "quiet"}
        fields = {f.name for f in dataclasses.fields(kind)}
        assert dests == fields, prog
        handler = cli.HANDLERS[kind]
        assert typing.get_type_hints(handler)["args"] is kind, prog
    assert len(kinds) == len(set(kinds)) == len(cli.HANDLERS) >= 24
    assert set(kinds) == set(cli.HANDLERS)


def test_an_untyped_table_is_caught() -> None:
    """The check above fails where a command's dataclass and its handler disagree."""
    wrong = {**cli.HANDLERS, commandargs.LockArgs: cli.cmd_plan}
    assert typing.get_type_hints(wrong[commandargs.LockArgs])["args"] is not commandargs.LockArgs


HANDLER_MAX_LINES = 25


def test_every_handler_is_short_and_reads_typed_arguments() -> None:
    """cli.py parses, calls one use case, prints: each handler fits in a screenful, and none
    reads an argument by name at run time (getattr)."""
    tree = ast.parse(Path(cli.__file__).read_text())
    handlers = [
        n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("cmd_")
    ]
    assert len(handlers) == len(cli.HANDLERS)
    long = {h.name: h.end_lineno - h.lineno + 1 for h in handlers
            if h.end_lineno is not None and h.end_lineno - h.lineno + 1 > HANDLER_MAX_LINES}  # fmt: skip
    assert long == {}
    calls = [n for h in handlers for n in ast.walk(h) if isinstance(n, ast.Call)]
    assert not [c for c in calls if isinstance(c.func, ast.Name) and c.func.id == "getattr"]
    assert len(Path(cli.__file__).read_text().splitlines()) < 400


def test_typed_arguments_are_filled_from_the_parser() -> None:
    parsed = cliargs.parse(
        cliargs.make_parser(), ["--quiet", "build", "a.yaml", "b.yaml", "--record", "r.json"]
    )
    assert parsed.quiet and not parsed.debug
    args = parsed.args
    assert isinstance(args, commandargs.BuildArgs)
    assert args.specs == (Path("a.yaml"), Path("b.yaml"))  # a tuple: frozen all the way
    assert args.record == Path("r.json") and args.env_dir is None
    assert args.picks_env()
    with pytest.raises(dataclasses.FrozenInstanceError):
        args.force = True  # type: ignore[misc]


def test_an_option_is_declared_once() -> None:
    """A field added to a command's dataclass, and nothing else, is an option of the parser,
    in its help, its shell completion and the reference page, read back typed, and given
    again on a matrix cell's command line (commands/options.py derives all of them)."""
    from builder.cli import completion, docgen
    from builder.commands import matrix
    from builder.commands.options import flag, option

    @dataclasses.dataclass(frozen=True, kw_only=True)
    class Extended(commandargs.BuildArgs):
        fake_level: str | None = option("--fake-level", metavar="N", help="a level only a test has")
        fake_switch: bool = flag("--fake-switch", help="a switch only a test has")

    commands = tuple(
        dataclasses.replace(c, args=Extended) if c.name == "build" else c for c in cliargs.COMMANDS
    )
    parser = cliargs.make_parser(commands)
    build = dict(_leaf_commands(parser))["cudaenv build"]
    assert (
        "--fake-level N" in build.format_help()
        and "a switch only a test has" in build.format_help()
    )
    assert "--fake-switch" in completion.script("bash", parser)
    assert "| `--fake-level N` | a level only a test has |" in docgen.commands_page(parser)
    parsed = cliargs.parse(parser, ["build", "x.yaml", "--fake-level", "-3", "--fake-switch"])
    assert isinstance(parsed.args, Extended)
    assert (parsed.args.fake_level, parsed.args.fake_switch) == ("-3", True)
    argv = matrix.cell_argv(parsed.args)
    assert "--fake-level=-3" in argv and "--fake-switch" in argv
    assert cliargs.parse(parser, argv[3:]).args == parsed.args
    # The parser cudaenv runs has neither: the table, not the test, decides.
    assert "--fake-level" not in cliargs.make_parser().format_help()
    with pytest.raises(SystemExit):
        cliargs.parse(cliargs.make_parser(), ["build", "x.yaml", "--fake-switch"])


def test_every_command_line_reads_back_to_its_arguments() -> None:
    """``Command.argv`` of every command's arguments, each given a value unlike its default
    (one that starts with ``-`` where a text may), parses back to the same arguments."""
    from builder.commands.options import options

    samples = {str: "-v", int: 3, bool: True, Path: Path("-p.yaml")}
    for prog, parser in _leaf_commands(cliargs.make_parser()):
        kind = parser.get_default("args_type")
        if kind is commandargs.RunArgs:
            continue  # what follows NAME is the command's own, `--` included
        hints = typing.get_type_hints(kind)
        values: dict[str, object] = {}
        for f, opt in options(kind):
            hint = hints[f.name]
            union = typing.get_origin(hint) in (typing.Union, types.UnionType)
            base = next(a for a in typing.get_args(hint) if a is not type(None)) if union else hint
            many = typing.get_origin(base) is tuple
            one = samples[typing.get_args(base)[0] if many else base]
            if "choices" in opt.argparse:
                one = opt.argparse["choices"][0]
            elif opt.argparse.get("type") not in (None, int):
                one = "2026-12-01T00:00:00Z"  # --exclude-newer: a time as a lock writes it
            nargs = opt.argparse.get("nargs")
            if isinstance(nargs, int):  # --compare A B: values apart, none like an option
                values[f.name] = ("a.json",) * nargs
            else:
                values[f.name] = (one, one) if many else one
        args = kind(**values)
        parsed = cliargs.parse(cliargs.make_parser(), [*prog.split()[1:], *args.argv()])
        assert parsed.args == args, prog
