"""The `imports` check, fail-fast ordering and what an interrupted verify says, on real tiny
venvs (uv venv) holding stand-in distributions written as an installer would: package files
plus a dist-info with METADATA and RECORD. Nothing is mocked: the probe runs in the venv."""

from __future__ import annotations

import base64
import dataclasses
import hashlib
import os
import re
import shutil
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest

from builder import verify
from builder.commands import verify as verifyrun
from builder.core.reporter import NOTHING_BUILT, Reporter, run_main
from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.machine import archs
from builder.spec import envspec as spec
from builder.verify import flashinfer_jit, imports
from builder.verify.model import CheckResult, Target
from tests.helpers import cudaenv, env_facts, uv_venv

ENGINE = "sglang/srt/entrypoints/engine.py"


def install(
    python: Path,
    name: str,
    version: str,
    files: Mapping[str, str],
    requires: Sequence[str] = (),
) -> None:
    """``files`` (path in site-packages -> source) installed as distribution ``name``, with
    the RECORD an installer writes (what the probe maps an importing file back through)."""
    site = next(python.parent.parent.glob("lib/python3*/site-packages"))
    info = f"{name.replace('-', '_')}-{version}.dist-info"
    meta = f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    meta += "".join(f"Requires-Dist: {r}\n" for r in requires)
    every = {**files, f"{info}/METADATA": meta, f"{info}/INSTALLER": "tests\n"}
    record = []
    for rel, text in every.items():
        path = site / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=")
        record.append(f"{rel},sha256={digest.decode()},{len(text.encode())}")
    (site / info / "RECORD").write_text("\n".join([*record, f"{info}/RECORD,,"]) + "\n")


def sglang_files(init: str = "", engine: str = "") -> dict[str, str]:
    return {
        "sglang/__init__.py": init,
        "sglang/srt/__init__.py": "",
        "sglang/srt/entrypoints/__init__.py": "",
        ENGINE: engine,
    }


@pytest.fixture
def venv(tmp_path: Path) -> Path:
    return uv_venv(Path(sys.executable).resolve(), tmp_path / "env")


def target_of(python: Path, tmp_path: Path, packages: tuple[str, ...] | None) -> Target:
    return Target(
        python=python,
        archs=archs.DEFAULT_ARCHS,
        work=tmp_path / "work",
        spec_path="envspecs/x.yaml",
        packages=packages,
    )


def run_imports(target: Target) -> CheckResult:
    _, results = verify.run_checks(target, ["imports"])
    (result,) = results
    return result


def test_an_env_where_import_sglang_fails_is_failed_naming_pybase64(
    venv: Path, tmp_path: Path
) -> None:
    """sglang 0.5.2 imports pybase64 without declaring it: `import sglang` fails in an env
    installed from its metadata, and verify says FAILED with the module and who wants it."""
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"))
    result = run_imports(target_of(venv, tmp_path, ("sglang==0.5.2",)))
    assert result.status == FAILED
    assert result.summary.startswith(
        "import sglang failed: No module named 'pybase64' (no installed distribution provides "
        "it; sglang 0.5.2 imports it and does not declare it in its requirements)"
    )
    assert "pybase64" in result.fix
    assert "cudaenv add NAME --spec envspecs/x.yaml" in result.fix


def test_a_declared_but_missing_requirement_says_it_is_declared(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"), requires=["pybase64"])
    result = run_imports(target_of(venv, tmp_path, ("sglang",)))
    assert result.status == FAILED
    assert "sglang 0.5.2 imports it and declares it" in result.summary


def test_a_requirement_declared_only_under_an_extra_says_which(venv: Path, tmp_path: Path) -> None:
    """The real sglang 0.5.2: `Requires-Dist: pybase64; extra == "runtime-common"`, and
    `import sglang` imports it unconditionally."""
    install(
        venv,
        "sglang",
        "0.5.2",
        sglang_files(init="import pybase64\n"),
        requires=['pybase64; extra == "runtime-common"'],
    )
    result = run_imports(target_of(venv, tmp_path, ("sglang==0.5.2",)))
    assert result.status == FAILED
    assert (
        "sglang 0.5.2 imports it and declares it only with its extra 'runtime-common', which "
        "the spec does not ask for" in result.summary
    )


def test_a_good_env_passes_and_times_each_module(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.23", sglang_files(engine="import json\n"))
    result = run_imports(target_of(venv, tmp_path, ("sglang==0.5.23",)))
    assert result.status == PASSED, result.summary
    assert result.summary == "2 module(s) import, 1 server start-up module(s) among them"
    evidence = dict(result.evidence)
    assert evidence["sglang 0.5.23"] == "imports sglang"
    assert evidence["import sglang"].startswith("ok in ")
    assert evidence["import sglang.srt.entrypoints.engine"].endswith(" s")


@pytest.mark.slow
def test_an_unchanged_env_reuses_the_recorded_pass_and_any_change_runs_it_again(
    venv: Path, tmp_path: Path
) -> None:
    """A pass is kept with the sha256 of what it depends on: the next verify of the same env
    imports nothing and says when the pass was made; a changed distribution, a new one or
    `--fresh` imports again; a failure is never kept."""
    marker = tmp_path / "imported"
    engine = f"open({str(marker)!r}, 'a').write('x')\n"
    install(venv, "sglang", "0.5.23", sglang_files(engine=engine))
    target = target_of(venv, tmp_path, ("sglang==0.5.23",))

    def runs() -> tuple[CheckResult, int]:
        result = run_imports(target)
        return result, len(marker.read_text()) if marker.exists() else 0

    first, n = runs()
    assert first.status == PASSED and n == 1 and not first.summary.startswith("passed ")
    again, n = runs()
    assert n == 1, "an unchanged env was imported again"
    assert again.status == PASSED and re.match(
        r"passed \d\d:\d\d, env unchanged: 2 module", again.summary
    )
    assert "verify --fresh" in dict(again.evidence)["recorded"]
    install(venv, "pybase64", "1.4.0", {"pybase64/__init__.py": ""})  # a new distribution
    assert runs()[1] == 2
    assert runs()[1] == 2  # and that run's pass is the one kept now
    install(venv, "sglang", "0.5.23", sglang_files(engine=engine + "# patched\n"))  # a change
    assert runs()[1] == 3
    assert run_imports(dataclasses.replace(target, fresh=True)).status == PASSED
    assert len(marker.read_text()) == 4
    install(venv, "sglang", "0.5.23", sglang_files(engine=engine + "import pybase65\n"))
    assert runs()[0].status == FAILED and runs()[0].status == FAILED
    assert len(marker.read_text()) == 6  # a failure is re-run every time


def test_a_server_module_that_fails_fails_though_the_package_imports(
    venv: Path, tmp_path: Path
) -> None:
    """`import sglang` works; the engine the server imports at start-up does not."""
    install(venv, "sglang", "0.5.23", sglang_files(engine="import uvloop_absent\n"))
    result = run_imports(target_of(venv, tmp_path, ("sglang",)))
    assert result.status == FAILED
    assert result.summary.startswith(
        "import sglang.srt.entrypoints.engine failed: No module named 'uvloop_absent'"
    )
    assert dict(result.evidence)["import sglang"].startswith("ok in ")


def test_an_import_error_names_the_file_and_its_distribution(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.23", sglang_files(init="from json import no_such_name\n"))
    result = run_imports(target_of(venv, tmp_path, ("sglang",)))
    assert result.status == FAILED
    assert result.summary.startswith(
        "import sglang failed: ImportError: cannot import name 'no_such_name' from 'json'"
    )
    assert "sglang/__init__.py:1 (sglang 0.5.23)" in result.summary


def test_a_package_the_spec_asks_for_but_not_installed_fails(venv: Path, tmp_path: Path) -> None:
    result = run_imports(target_of(venv, tmp_path, ("sglang==0.5.2",)))
    assert result.status == FAILED
    assert result.summary == "sglang is not installed in this env"


def test_import_names_come_from_the_distribution_not_its_name(venv: Path, tmp_path: Path) -> None:
    """A distribution whose import name differs (flashinfer-python -> flashinfer) is imported
    by what its RECORD installs; a broken one fails under that name."""
    install(venv, "fake-dist-x", "1.0", {"fakepkg/__init__.py": "raise RuntimeError('boom')\n"})
    result = run_imports(target_of(venv, tmp_path, ("fake-dist-x",)))
    assert result.status == FAILED
    assert result.summary.startswith("import fakepkg failed: RuntimeError: boom")


def test_an_interpreter_without_a_spec_imports_the_stack_it_has(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"))
    result = run_imports(target_of(venv, tmp_path, None))
    assert result.status == FAILED
    assert "No module named 'pybase64'" in result.summary
    empty = uv_venv(Path(sys.executable).resolve(), tmp_path / "empty")
    nothing = run_imports(target_of(empty, tmp_path, None))
    assert nothing.status == SKIPPED
    assert nothing.summary == (
        "nothing to import: the env has none of torch, sglang, vllm, flashinfer-python"
    )


@pytest.mark.slow
def test_an_import_that_hangs_fails_at_the_timeout_naming_it(
    venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(imports, "TIMEOUT_SECONDS", 3.0)
    install(venv, "sglang", "0.5.23", sglang_files(engine="import time\ntime.sleep(60)\n"))
    result = run_imports(target_of(venv, tmp_path, ("sglang",)))
    assert result.status == FAILED
    assert result.summary == "import sglang.srt.entrypoints.engine did not finish within 3 s"
    assert dict(result.evidence)["import sglang"].startswith("ok in ")


def test_flashinfer_jit_fails_when_a_server_asked_for_has_no_flashinfer() -> None:
    """sglang without FlashInfer cannot JIT its kernels: FAILED, not "skipped"."""
    no_fi = env_facts(flashinfer_installed=False)
    sglang = Target(
        python=Path("/env/bin/python"),
        archs=archs.DEFAULT_ARCHS,
        work=Path("/env/var/cudaenv"),
        spec_path="envspecs/x.yaml",
        packages=("torch", "sglang==0.5.2"),
    )
    result = flashinfer_jit.check(sglang, no_fi)
    assert result.status == FAILED
    assert result.summary == (
        "sglang needs FlashInfer for its JIT kernels; flashinfer-python is not installed in "
        "this env: add it to packages"
    )
    assert "cudaenv add flashinfer-python --spec envspecs/x.yaml" in result.fix
    vllm = dataclasses.replace(sglang, packages=("vllm==0.33.0",))
    assert flashinfer_jit.check(vllm, no_fi).summary.startswith("vllm needs FlashInfer")
    toolkit_only = dataclasses.replace(sglang, packages=())
    assert flashinfer_jit.check(toolkit_only, no_fi).status == SKIPPED


def test_flashinfer_jit_reads_an_interpreters_servers_from_its_env(venv: Path) -> None:
    install(venv, "sglang", "0.5.23", sglang_files())
    target = Target(python=venv, archs=archs.DEFAULT_ARCHS, work=Path("/w"))
    result = flashinfer_jit.check(target, env_facts(flashinfer_installed=False))
    assert result.status == FAILED
    assert result.summary.startswith("sglang needs FlashInfer")


# --------------------------------------------------------------------------- order, fail fast


def test_checks_run_cheapest_first_whatever_order_they_are_asked_in() -> None:
    assert verify.CHECKS == spec.CHECKS
    assert set(verify.STAGES) == set(verify.CHECKS)
    assert verify.CHECKS[0] == "imports"
    asked = ["sampling", "flashinfer-jit", "cubin", "binaries", "kernel-compile", "imports"]
    assert verify.run_order(asked) == [
        "imports",
        "binaries",
        "kernel-compile",
        "flashinfer-jit",
        "cubin",
        "sampling",
    ]
    stages = [verify.STAGE_ORDER.index(verify.STAGES[n]) for n in verify.CHECKS]
    assert stages == sorted(stages)


def test_failed_imports_stop_what_comes_after_and_the_next_run_waits_for_them(
    venv: Path, tmp_path: Path
) -> None:
    """The imports fail. The compiles ran beside them (the imports had never failed here), so
    each says its own verdict; cubin and the GPU check, which wait for the imports, are not
    run and say so, never passed. The next verify of the env, whose imports failed last time,
    lets the compiles wait for them: FlashInfer's JIT (minutes) is never started."""
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"))
    said: list[str] = []
    target = target_of(venv, tmp_path, ("sglang",))
    names = ["sampling", "cubin", "flashinfer-jit", "kernel-compile", "imports"]
    _, results = verify.run_checks(target, names, said.append)
    assert [r.name for r in results] == [
        "imports",
        "kernel-compile",
        "flashinfer-jit",
        "cubin",
        "sampling",
    ]
    assert results[0].status == FAILED
    for r in results[1:3]:
        assert not r.summary.startswith("not run"), r
    for r in results[3:]:
        assert r.status == SKIPPED
        assert r.summary == "not run: imports failed (`--keep-going` runs it anyway)"
    assert any("JIT-building" in line for line in said)
    said.clear()
    _, results = verify.run_checks(target, names, said.append)
    assert results[0].status == FAILED
    for r in results[1:]:
        assert r.status == SKIPPED
        assert r.summary == "not run: imports failed (`--keep-going` runs it anyway)"
    assert not any("JIT-building" in line for line in said)


def test_a_failed_toolchain_leaves_the_compiles_and_the_gpu_not_run(
    venv: Path, tmp_path: Path
) -> None:
    """No toolkit at CUDA_HOME: the toolchain check fails in seconds, and neither our kernel
    nor FlashInfer's JIT is attempted; the imports (same stage) still run."""
    target = dataclasses.replace(
        target_of(venv, tmp_path, ()), extra_env=(("CUDA_HOME", str(tmp_path / "no-toolkit")),)
    )
    said: list[str] = []
    names = ["sampling", "flashinfer-jit", "kernel-compile", "toolchain", "imports"]
    _, results = verify.run_checks(target, names, said.append)
    got = {r.name: (r.status, r.summary) for r in results}
    assert got["toolchain"][0] == FAILED
    assert got["imports"] == (SKIPPED, "nothing to import: the spec asks for no package")
    for name in ("kernel-compile", "flashinfer-jit", "sampling"):
        assert got[name] == (SKIPPED, "not run: toolchain failed (`--keep-going` runs it anyway)")
    assert "sampling: not run (toolchain failed)" in said
    assert not any("JIT-building" in line for line in said)


def test_keep_going_runs_what_fail_fast_would_not(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"))
    target = dataclasses.replace(target_of(venv, tmp_path, ("sglang",)), keep_going=True)
    said: list[str] = []
    _, results = verify.run_checks(target, ["imports", "flashinfer-jit"], said.append)
    assert [r.status for r in results] == [FAILED, FAILED]
    assert results[1].summary.startswith("sglang needs FlashInfer")
    assert any("JIT-building" in line for line in said)


@pytest.mark.slow
def test_verify_exits_5_naming_pybase64_and_the_checks_not_run(venv: Path, tmp_path: Path) -> None:
    install(venv, "sglang", "0.5.2", sglang_files(init="import pybase64\n"))
    # The second time the imports failed last time: the JIT waits for them, and is not run.
    for said in ("No module named 'pybase64'", "not run: imports failed"):
        done = cudaenv("verify", "--python", str(venv), "--checks", "flashinfer-jit,imports",
                       cwd=tmp_path, check=False)  # fmt: skip
        assert done.returncode == 5, done.stderr
        assert said in done.stdout
        assert "PASSED" not in done.stdout


# --------------------------------------------------------------------------- Ctrl-C


def verify_only(target: Target, reporter: Reporter) -> int:
    verifyrun.verify_and_report(target, None, reporter)
    return 0


class InterruptedAt(Reporter):
    """A reporter whose progress line ``at`` is where the user pressed Ctrl-C."""

    def __init__(self, at: str) -> None:
        super().__init__(quiet=True)
        self.at = at

    def __call__(self, msg: str) -> None:
        if msg.startswith(self.at):
            raise KeyboardInterrupt


def test_ctrl_c_during_verify_does_not_say_nothing_was_built(
    venv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = target_of(venv, tmp_path, ())
    reporter = InterruptedAt("probing")
    code = run_main(lambda: verify_only(target, reporter), reporter)
    assert code == 130
    err = capsys.readouterr().err
    assert NOTHING_BUILT not in err
    assert err.strip() == (
        f"error: interrupted; verify stopped before its report was written; {venv} is unchanged"
    )


def test_ctrl_c_during_build_verify_keeps_what_the_build_left(
    venv: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reporter = InterruptedAt("probing")
    reporter.leaves("/envs/x is the new env, complete (built from x.lock)")
    target = target_of(venv, tmp_path, ())
    code = run_main(lambda: verify_only(target, reporter), reporter)
    assert code == 130
    assert capsys.readouterr().err.strip() == (
        "error: interrupted; /envs/x is the new env, complete (built from x.lock); verify "
        "stopped before its report was written"
    )


def test_an_env_that_passed_before_is_probed_once(
    venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One check at a time (a 1-core box), the JIT waits for the cheap checks only where they
    may fail: an env whose imports passed last time gets one probe (one torch import), JIT
    included; after a failure, two. (With more cores the JIT's probe runs beside the imports:
    tests/test_verify_concurrent.py.)"""
    monkeypatch.setattr(verify, "cores", lambda: 1)
    install(venv, "sglang", "0.5.23", sglang_files())
    target = target_of(venv, tmp_path, ("sglang==0.5.23",))

    def probes() -> list[str]:
        said: list[str] = []
        verify.run_checks(target, ["flashinfer-jit", "imports"], said.append)
        return [line for line in said if line.startswith("probing ")]

    first = probes()
    assert len(first) == 2 and "JIT-building" in first[1] and "JIT-building" not in first[0]
    (again,) = probes()
    assert "JIT-building" in again
    install(venv, "sglang", "0.5.23", sglang_files(init="import pybase65\n"))
    assert len(probes()) == 1  # it passed last time: one probe, and now the imports fail
    assert len(probes()) == 1  # failed last time: no JIT at all (imports fail first)


def test_the_imports_leave_the_bytecode_of_what_was_imported(
    venv: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """PYTHONDONTWRITEBYTECODE=1 (as many images set) and an installer that compiles
    nothing: the check still leaves the bytecode of each module it imported from the env,
    so a server's first start imports from it; what is there already is not written again."""
    import importlib.util

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    install(venv, "sglang", "0.5.23", sglang_files(engine="import json\n"))
    site = next(venv.parent.parent.glob("lib/python3*/site-packages"))
    engine = (site / ENGINE).resolve()
    first = run_imports(target_of(venv, tmp_path, ("sglang==0.5.23",)))
    assert first.status == PASSED
    assert Path(importlib.util.cache_from_source(str(engine))).is_file()
    said = dict(first.evidence)["bytecode of what was imported"]
    assert said.startswith("4 written, 0 already there"), said
    again = run_imports(target_of(venv, tmp_path / "other", ("sglang==0.5.23",)))
    assert dict(again.evidence)["bytecode of what was imported"].startswith("0 written, 4 ")


def test_an_identical_env_reuses_the_pass_of_the_first_and_its_bytecode(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A second env of one lock and spec, at another path: its verify reuses the first one's
    pass (saying where and when it was made) and imports nothing, and copies the first env's
    bytecode for each source that is the same file here (uv links both envs' files from one
    cache: same mtime and size), so its servers also start from bytecode. An env that differs
    in one distribution runs the check."""
    import importlib.util
    import os

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    marker = tmp_path / "imported"
    engine = f"open({str(marker)!r}, 'a').write('x')\n"
    envs = {n: uv_venv(Path(sys.executable).resolve(), tmp_path / n) for n in ("a", "b", "c")}
    for python in envs.values():
        install(python, "sglang", "0.5.23", sglang_files(engine=engine))
    install(envs["c"], "pybase64", "1.4.0", {"pybase64/__init__.py": ""})
    sites = {n: next(p.parent.parent.glob("lib/python3*/site-packages")) for n, p in envs.items()}
    for rel in sglang_files():
        st = (sites["a"] / rel).stat()
        os.utime(sites["b"] / rel, ns=(st.st_atime_ns, st.st_mtime_ns))  # one cache's file
    # One source that is another file in b: its bytecode is not b's.
    os.utime(sites["b"] / "sglang/srt/__init__.py", (1, 1))

    def run(name: str) -> CheckResult:
        return run_imports(target_of(envs[name], tmp_path / f"work-{name}", ("sglang==0.5.23",)))

    assert run("a").status == PASSED and marker.read_text() == "x"
    # Bytecode another user could have written is never copied (it would run here).
    (writable,) = (sites["a"] / "sglang" / "__pycache__").glob("__init__.*.pyc")
    writable.chmod(0o666)
    second = run("b")
    assert marker.read_text() == "x", "an identical env was imported again"
    assert second.status == PASSED
    assert re.match(
        rf"passed \d\d:\d\d in {re.escape(str(tmp_path / 'a'))}, an identical env: ", second.summary
    ), second.summary
    said = dict(second.evidence)["bytecode"]
    assert said.startswith(f"2 file(s) copied from {tmp_path / 'a'}"), said
    assert not (sites["b"] / "sglang" / "__pycache__" / writable.name).exists()
    assert Path(importlib.util.cache_from_source(str(sites["b"] / ENGINE))).is_file()
    assert not Path(
        importlib.util.cache_from_source(str(sites["b"] / "sglang/srt/__init__.py"))
    ).exists()
    # Its own record now: the next verify of b says its env is unchanged.
    assert re.match(r"passed \d\d:\d\d, env unchanged: ", run("b").summary)
    # One distribution more: not identical, imported.
    assert run("c").status == PASSED and marker.read_text() == "xx"
    # The env that ran it, gone: the next identical env runs the check itself (and is the
    # one named from then on); a pass reused from it never named the borrower.
    shutil.rmtree(tmp_path / "a")
    d = uv_venv(Path(sys.executable).resolve(), tmp_path / "d")
    install(d, "sglang", "0.5.23", sglang_files(engine=engine))
    envs["d"] = d
    count = len(marker.read_text())
    assert run("d").status == PASSED and len(marker.read_text()) == count + 1
    # --fresh never borrows.
    fresh = dataclasses.replace(
        target_of(envs["b"], tmp_path / "w2", ("sglang==0.5.23",)), fresh=True
    )
    count = len(marker.read_text())
    assert run_imports(fresh).status == PASSED and len(marker.read_text()) == count + 1


def test_a_second_identical_env_is_probed_once(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """One check at a time (a 1-core box): an env never verified, of the signature of one
    whose imports passed: one probe (one torch import), the JIT in it, as for an env that
    passed before."""
    monkeypatch.setattr(verify, "cores", lambda: 1)
    envs = {n: uv_venv(Path(sys.executable).resolve(), tmp_path / n) for n in ("a", "b", "c")}
    for python in envs.values():
        install(python, "sglang", "0.5.23", sglang_files())
    install(envs["c"], "pybase64", "1.4.0", {"pybase64/__init__.py": ""})

    def probes(name: str) -> list[str]:
        said: list[str] = []
        target = target_of(envs[name], tmp_path / f"work-{name}", ("sglang==0.5.23",))
        verify.run_checks(target, ["flashinfer-jit", "imports"], said.append)
        return [line for line in said if line.startswith("probing ")]

    assert len(probes("a")) == 2  # never verified, nothing like it verified either
    (only,) = probes("b")
    assert "JIT-building" in only
    assert len(probes("c")) == 2  # another signature


def test_an_interpreter_without_a_spec_is_sent_to_the_doctor_not_to_a_rebuild(
    venv: Path, tmp_path: Path
) -> None:
    """An adopted env (or any interpreter) has no spec: `cudaenv build SPEC --force` does not
    apply there; the fix names the doctor, which reads the installed set for the cause."""
    install(venv, "sglang", "0.5.23", sglang_files(init="raise AttributeError('cudaLibrary_t')\n"))
    target = dataclasses.replace(target_of(venv, tmp_path, ("sglang",)), spec_path=None)
    result = run_imports(target)
    assert result.status == FAILED
    assert result.fix == (
        f"`cudaenv doctor --python {venv}` names the installed packages that do not work "
        "together, with the command that repairs them"
    )


NOBODY = 65534  # another user's uid


def _two_identical_envs(tmp_path: Path) -> tuple[dict[str, Path], dict[str, Path], Path]:
    marker = tmp_path / "imported"
    engine = f"open({str(marker)!r}, 'a').write('x')\n"
    envs = {n: uv_venv(Path(sys.executable).resolve(), tmp_path / n) for n in ("theirs", "mine")}
    for python in envs.values():
        install(python, "sglang", "0.5.23", sglang_files(engine=engine))
    sites = {n: next(p.parent.parent.glob("lib/python3*/site-packages")) for n, p in envs.items()}
    for rel in sglang_files():
        st = (sites["theirs"] / rel).stat()
        os.utime(sites["mine"] / rel, ns=(st.st_atime_ns, st.st_mtime_ns))
    return envs, sites, marker


def test_nothing_is_borrowed_from_an_env_another_user_owns(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Her env B and root's env R hold the same distributions: B's recorded pass and its
    bytecode (which she can rewrite) are never taken for R; R's check imports for itself."""
    if os.geteuid() != 0:
        pytest.skip("chown to another user needs root")
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    envs, _, marker = _two_identical_envs(tmp_path)
    run = {n: target_of(p, tmp_path / f"work-{n}", ("sglang==0.5.23",)) for n, p in envs.items()}
    assert run_imports(run["theirs"]).status == PASSED and marker.read_text() == "x"
    for dirpath, dirnames, filenames in os.walk(tmp_path / "theirs"):
        for name in [*dirnames, *filenames]:
            os.lchown(Path(dirpath) / name, NOBODY, NOBODY)
    os.lchown(tmp_path / "theirs", NOBODY, NOBODY)
    mine = run_imports(run["mine"])
    assert mine.status == PASSED
    assert marker.read_text() == "xx", "root's env took her env's pass"
    assert "an identical env" not in mine.summary and "bytecode" not in dict(mine.evidence)


def test_nothing_is_borrowed_for_an_env_whose_files_differ(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """This env's source has the other's size and mtime but other bytes (its RECORD as it
    was): a .pyc header (mtime, size) would match, and the RECORDs are equal; neither the
    pass nor the bytecode is taken, the check imports here."""
    import importlib.util

    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    envs, sites, marker = _two_identical_envs(tmp_path)
    ran = run_imports(target_of(envs["theirs"], tmp_path / "w1", ("sglang==0.5.23",)))
    assert ran.status == PASSED and marker.read_text() == "x"
    mine = sites["mine"] / ENGINE
    st = mine.stat()
    mine.write_text(mine.read_text().replace("'x'", "'y'"))  # same size, other bytes
    os.utime(mine, ns=(st.st_atime_ns, st.st_mtime_ns))
    checked = run_imports(target_of(envs["mine"], tmp_path / "w2", ("sglang==0.5.23",)))
    assert "an identical env" not in checked.summary, checked.summary
    assert marker.read_text() == "xy", "the check did not import in this env"
    assert not Path(importlib.util.cache_from_source(str(mine))).exists() or (
        "bytecode" not in dict(checked.evidence)
    )


def test_a_recorded_pass_is_not_believed_once_a_file_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An env that passed, then a module edited with its size and mtime put back (RECORD
    unchanged): the next verify imports again and fails, as `import` would."""
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    envs, sites, _ = _two_identical_envs(tmp_path)
    target = target_of(envs["mine"], tmp_path / "w", ("sglang==0.5.23",))
    assert run_imports(target).status == PASSED
    engine = sites["mine"] / ENGINE
    st = engine.stat()
    broken = ("import no_such_module_cudaenv  # " + "x" * st.st_size)[: st.st_size - 1] + "\n"
    engine.write_text(broken)
    os.utime(engine, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert (engine.stat().st_size, engine.stat().st_mtime_ns) == (st.st_size, st.st_mtime_ns)
    again = run_imports(target)
    # Run again, not believed: Python itself takes the old bytecode here (its header holds
    # the source's mtime and size), so the run says what an import does.
    assert "env unchanged" not in again.summary and "recorded" not in dict(again.evidence)
    engine.write_text(broken)  # now as an editor leaves it: a new mtime (another second's:
    os.utime(engine, ns=(st.st_atime_ns, st.st_mtime_ns + 10**10))  # bytecode keys whole ones)
    assert run_imports(target).status == FAILED


def test_a_pyc_swapped_after_its_check_is_not_the_one_taken(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The file judged through a descriptor is the file linked or copied: one renamed over
    its path between the check and the link (her RENAME_EXCHANGE loop) is never taken."""
    from builder.verify import imports

    pycache = tmp_path / "theirs" / "__pycache__"
    pycache.mkdir(parents=True)
    (tmp_path / "theirs" / "m.py").write_text("X = 1\n")
    (tmp_path / "mine").mkdir()
    source = tmp_path / "mine" / "m.py"
    os.link(tmp_path / "theirs" / "m.py", source)  # one cache's file in both envs
    st = source.stat()
    header = (
        b"\x00" * 4
        + (0).to_bytes(4, "little")
        + (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
        + st.st_size.to_bytes(4, "little")
    )
    src = pycache / "m.cpython-312.pyc"
    src.write_bytes(header + b"judged")
    evil = pycache / "evil"
    evil.write_bytes(header + b"swapped in")
    real_pread = os.pread

    def pread_then_swap(fd: int, n: int, offset: int) -> bytes:
        data = real_pread(fd, n, offset)
        if evil.exists():
            evil.replace(src)  # after the descriptor was judged, before the link
        return data

    monkeypatch.setattr(os, "pread", pread_then_swap)
    into = tmp_path / "mine" / "__pycache__"
    assert imports._borrow_one(str(src), str(into), src.name, made=False)
    assert (into / src.name).read_bytes() == header + b"judged"
