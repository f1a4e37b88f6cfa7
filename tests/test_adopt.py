"""`cudaenv adopt`: refusals on what the probe reports (unit), and the whole repair of a
real venv holding the default lock's packages (e2e: real uv, real NVIDIA wheels)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import subprocess
import sys
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from builder.adopt import journal as adopt_journal
from builder.adopt import repair as adopt
from builder.core import proc
from builder.core.errors import ReportError
from builder.spec import lock, policy
from tests.helpers import (
    ENVSPECS,
    FAULTS_PYTHONPATH,
    cudaenv,
    doctor_findings,
    lock_of,
    run_printed,
    write,
)


def an_env(tmp_path: Path, **changes: object) -> adopt_journal.Env:
    base = adopt_journal.Env(
        python=tmp_path / "venv" / "bin" / "python",
        prefix=tmp_path / "venv",
        version="3.12",
        is_env=True,
        purelib=tmp_path / "venv" / "lib" / "python3.12" / "site-packages",
        dists={"torch": "2.14.1", "flashinfer-python": "0.7.2"},
        torch="2.14.1",
        torch_cuda="13.0",
        torch_requires=('cuda-toolkit[cudart,curand]==13.0.3; platform_system == "Linux"',),
        cuda_home="",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("changes", "why"),
    [
        ({"is_env": False}, "not inside a virtual environment or conda env (a system or distro "
                            "Python); pass --force to change it anyway"),
        ({"torch": None, "torch_cuda": None}, "no torch here: adopt matches the toolkit to torch's CUDA"),
        ({"torch_cuda": None}, "torch 2.14.1 is a CPU-only build (torch.version.cuda is None): no "
                               "CUDA to match"),
        ({"torch": "2.9.1", "torch_cuda": "12.8"}, "torch 2.9.1 is built for CUDA 12.8, which has no "
                                                 "nvcc on PyPI, and no CUDA 12.8 toolkit is on this "
                                                 "machine (CUDA_HOME, /usr/local/cuda-12.8): install "
                                                 "CUDA 12.8 there"),
        ({"torch_cuda": "13.x"}, "torch 2.14.1 reports torch.version.cuda = '13.x', not a CUDA "
                                 'major.minor like "13.0": no CUDA to match'),
    ],
)  # fmt: skip
def test_refusals_name_why_and_change_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, changes: dict[str, object], why: str
) -> None:
    monkeypatch.setattr(adopt, "SYSTEM_TOOLKITS", ())
    env = an_env(tmp_path, **changes)
    with pytest.raises(adopt_journal.Refused) as info:
        adopt.plan(env)
    assert str(info.value) == f"{env.python}: {why}; nothing was changed"
    assert info.value.exit_code == 3
    assert not (tmp_path / "venv").exists()


def test_a_cuda_12_torch_uses_the_machines_toolkit_of_its_release(tmp_path: Path) -> None:
    home = tmp_path / "cuda-12.8"
    write(
        home / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n"
    )
    (home / "bin" / "nvcc").chmod(0o755)
    env = an_env(tmp_path, torch="2.9.1", torch_cuda="12.8", cuda_home=str(home))
    planned = adopt.plan(env)
    assert planned.system_toolkit == home and planned.requirements == ()
    assert planned.lines()[1] == f"  toolkit: the machine's {home} (CUDA 12.8)"


def test_torch_pin_reads_torchs_own_requirement(tmp_path: Path) -> None:
    env = an_env(tmp_path, torch_requires=(
        'cuda-toolkit[cudart]==13.0.3; platform_system == "Windows"',
        'cuda-toolkit[cudart,curand]==13.0.2; platform_system == "Linux"',
        "filelock",
    ))  # fmt: skip
    assert adopt.torch_pin(env) == ("cuda-toolkit", "13.0.2")
    old = an_env(
        tmp_path, torch_requires=('nvidia-cuda-runtime-cu12==12.8.90; platform_system == "Linux"',)
    )
    assert adopt.torch_pin(old) == ("nvidia-cuda-runtime-cu12", "12.8.90")
    assert adopt.torch_pin(an_env(tmp_path, torch_requires=())) is None


def test_a_set_uv_cannot_resolve_is_refused_with_uvs_words(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    fake_uv = write(
        tmp_path / "uv",
        "#!/bin/sh\necho '  x No solution found: sglang==0.5.23 depends on nvidia-cuda-nvcc>=13.5' >&2\nexit 1\n",
    )
    fake_uv.chmod(0o755)
    monkeypatch.setenv("CUDAENV_UV", str(fake_uv))
    with pytest.raises(adopt_journal.Refused) as info:
        adopt.plan(an_env(tmp_path))
    assert "uv cannot install the matched toolkit without breaking what this env pins" in str(
        info.value
    )
    assert "sglang==0.5.23 depends on nvidia-cuda-nvcc>=13.5" in str(info.value)


def test_bindings_of_another_major_are_reinstalled_at_torchs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """cuda-python 12.6.2.post1 over torch's cuda-bindings 13.5.0 (`import flashinfer`
    fails): adopt's plan installs both at torch's major, in ranges (no cuda-python 13 admits
    cuda-bindings 13.5.0 yet), cuda-bindings again whatever its version."""
    assert policy.binding_repair({"cuda-bindings": "13.4.4", "cuda-python": "13.4.4"}, 13) == ()
    assert policy.binding_repair(
        {"cuda-bindings": "13.5.0", "cuda-python": "12.6.2.post1"}, 13
    ) == (
        "cuda-python>=13,<14",
        "cuda-bindings>=13,<14",
    )
    asked = tmp_path / "asked"
    fake_uv = write(
        tmp_path / "uv",
        f"""#!/bin/sh
echo "$@" > {asked}
echo ' - cuda-python==12.6.2.post1'
echo ' + cuda-python==13.4.4'
echo ' - cuda-bindings==13.5.0'
echo ' + cuda-bindings==13.4.4'
""",
    )
    fake_uv.chmod(0o755)
    monkeypatch.setenv("CUDAENV_UV", str(fake_uv))
    dists = {"torch": "2.14.1", "cuda-bindings": "13.5.0", "cuda-python": "12.6.2.post1"}
    planned = adopt.plan(an_env(tmp_path, dists=dists))
    assert planned.requirements[1:] == ("cuda-python>=13,<14", "cuda-bindings>=13,<14")
    assert planned.reinstall == ("cuda-bindings",)
    assert "--reinstall-package cuda-bindings" in asked.read_text()
    assert ("cuda-python", "12.6.2.post1", "13.4.4") in planned.changes


# --------------------------------------------------------------------------- e2e


def freeze(python: Path) -> str:
    done = proc.run([proc.uv_bin(), "pip", "freeze", "--python", str(python)], env=proc.uv_env())
    return done.stdout


@pytest.fixture
def plain_venv(tmp_path: Path) -> Iterator[Path]:
    """A venv holding the default lock's packages, made by uv alone: no cudaenv wiring."""
    venv = tmp_path / "plain"
    py = Path(sys.executable).resolve()
    from builder.machine import interpreters

    base = interpreters.find("3.12", allow_download=False).path
    proc.run(
        [proc.uv_bin(), "venv", "--quiet", "--python", str(base), str(venv)], env=proc.uv_env()
    )
    del py
    req = tmp_path / "req.txt"
    req.write_text(lock.read(lock_of(ENVSPECS / "default.yaml")).requirements_txt("linux-x86_64"))
    proc.run([proc.uv_bin(), "pip", "sync", "--quiet", "--require-hashes", "--python",
              str(venv / "bin" / "python"), str(req)], env=proc.uv_env(), timeout=1800)  # fmt: skip
    yield venv


def jit_versions(venv: Path, cuda_home: Path) -> str:
    code = (
        "from flashinfer.jit.cpp_ext import get_cuda_version; import torch; "
        "print(get_cuda_version(), torch.version.cuda)"
    )
    done = subprocess.run([venv / "bin" / "python", "-c", code], capture_output=True, text=True,
                          env={**os.environ, "CUDA_HOME": str(cuda_home)}, check=True)  # fmt: skip
    return done.stdout.strip().splitlines()[-1]


@pytest.fixture
def cuda_128(tmp_path: Path) -> Path:
    home = tmp_path / "cuda-12.8"
    write(
        home / "bin" / "nvcc", "#!/bin/sh\necho 'Cuda compilation tools, release 12.8, V12.8.93'\n"
    )
    (home / "bin" / "nvcc").chmod(0o755)
    return home


@pytest.mark.network
@pytest.mark.e2e
def test_adopt_repairs_the_blackwell_case_and_undo_gives_the_env_back(
    plain_venv: Path, cuda_128: Path, tmp_path: Path
) -> None:
    """The report this tool exists for: torch cu130 and FlashInfer in a venv, CUDA_HOME at a
    12.8 toolkit. After adopt FlashInfer's JIT sees 13.0 and doctor is clean; --undo gives
    back the same freeze and no cudaenv file."""
    python = plain_venv / "bin" / "python"
    env = {"CUDA_HOME": str(cuda_128)}
    assert jit_versions(plain_venv, cuda_128) == "12.8 13.0"
    before = freeze(python)
    scripts = {p.name: p.read_text() for p in (plain_venv / "bin").glob("activate*")}
    assert {"activate", "activate.csh", "activate.fish", "activate.nu", "activate.ps1"} <= set(
        scripts
    )
    dry = cudaenv("adopt", "--python", str(python), "--dry-run", cwd=tmp_path, env=env)
    assert "(dry run: nothing changed)" in dry.stdout
    assert not (plain_venv / "cuda-home").exists() and freeze(python) == before
    # The doctor's first finding and the command its fix prints first, run as printed (a
    # shell; the verify that follows an adopt included).
    first = doctor_findings(python, tmp_path, env)[0]
    assert first.code == "jit-toolkit-mismatch", first
    printed = first.commands()[0]
    assert printed == f"cudaenv adopt --python {python}"
    done = run_printed(printed, tmp_path, env)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "PASSED" in done.stdout, done.stdout
    assert jit_versions(plain_venv, cuda_128) == "13.0 13.0"
    for name in scripts:  # every shell's activation carries the env's settings
        if name.endswith((".bat", ".py")):  # Windows' cmd; activate_this.py runs the .pth
            continue
        assert ">>> cudaenv " in (plain_venv / "bin" / name).read_text(), name
    doctor = cudaenv("doctor", "--python", str(python), cwd=tmp_path, env=env, check=False)
    assert doctor.returncode == 0, doctor.stdout
    checks = cudaenv("verify", "--python", str(python), "--checks", "toolchain,kernel-compile",
                     cwd=tmp_path, env=env)  # fmt: skip
    assert "PASSED" in checks.stdout
    cudaenv("adopt", "--undo", "--python", str(python), cwd=tmp_path, env=env)
    assert freeze(python) == before
    assert {p.name: p.read_text() for p in (plain_venv / "bin").glob("activate*")} == scripts
    leftovers = [p for p in plain_venv.rglob("*") if "cudaenv" in p.name or p.name == "cuda-home"]
    assert leftovers == []
    assert not (plain_venv / "var").exists()
    assert jit_versions(plain_venv, cuda_128) == "12.8 13.0"


@pytest.mark.network
@pytest.mark.e2e
def test_a_users_cuda_python_12_over_cuda_bindings_13_is_named_and_repaired(
    tmp_path: Path,
) -> None:
    """As a user gets it: `uv pip install torch==2.14.1 flashinfer-python==0.7.2` (the index
    as it stood on 2026-11-20) pulls cuda-python 12.6.2.post1 over cuda-bindings 13.5.0 and
    `import flashinfer` may fail. doctor names it first; adopt repairs it; doctor is clean."""
    from builder.machine import interpreters

    venv = tmp_path / "user"
    base = interpreters.find("3.12", allow_download=False).path
    proc.run(
        [proc.uv_bin(), "venv", "--quiet", "--python", str(base), str(venv)], env=proc.uv_env()
    )
    python = venv / "bin" / "python"
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--python", str(python),
              "--exclude-newer", "2026-11-20", "torch==2.14.1", "flashinfer-python==0.7.2"],
             env=proc.uv_env(), timeout=1800)  # fmt: skip
    versions = "import importlib.metadata as m; print(m.version('cuda-python'), m.version('cuda-bindings'))"
    assert subprocess.run([python, "-c", versions], capture_output=True, text=True,
                          check=True).stdout.split() == ["12.6.2.post1", "13.5.0"]  # fmt: skip
    # Whether `import flashinfer` then fails depends on which of the two wheels uv wrote the
    # shared cuda/bindings/ files of last (it installs in parallel): the doctor reads the set.
    doctor = cudaenv("doctor", "--python", str(python), cwd=tmp_path, check=False)
    assert doctor.returncode != 0
    assert doctor.stdout.splitlines()[0].startswith(
        "cuda-python 12.6.2.post1 (CUDA 12) binds another CUDA major than torch 2.14.1+cu130"
    ), doctor.stdout
    # The first command the fix prints (adopt, the verify after it included), as printed.
    (found,) = [f for f in doctor_findings(python, tmp_path) if f.code == "cuda-binding-major"]
    printed = found.commands()[0]
    assert printed == f"cudaenv adopt --python {python}"
    done = run_printed(printed, tmp_path)
    assert done.returncode == 0, done.stdout + done.stderr
    subprocess.run([python, "-c", "import flashinfer"], check=True)
    got = subprocess.run([python, "-c", versions], capture_output=True, text=True, check=True)
    assert [v.split(".")[0] for v in got.stdout.split()] == ["13", "13"]
    again = cudaenv("doctor", "--python", str(python), cwd=tmp_path, check=False)
    assert again.returncode == 0, again.stdout


@pytest.mark.network
@pytest.mark.e2e
def test_adopt_realigns_a_drifted_toolkit(plain_venv: Path, tmp_path: Path) -> None:
    """flashinfer#3493: nvcc/crt/nvvm 13.5 and cccl 13.3 beside torch cu130; after adopt every
    component is 13.0.x and our kernel compiles; undo brings the drifted set back."""
    python = plain_venv / "bin" / "python"
    matched = tmp_path / "matched.json"
    matched.write_text(
        cudaenv("fingerprint", "--python", str(python), "--json", cwd=tmp_path).stdout
    )
    drift = ["nvidia-cuda-nvcc==13.5.37", "nvidia-cuda-crt==13.5.37", "nvidia-nvvm==13.5.37",
             "nvidia-cuda-cccl==13.3.5.0.6"]  # fmt: skip
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--python", str(python), *drift],
             env=proc.uv_env(), timeout=1800)  # fmt: skip
    drifted = freeze(python)
    # The fingerprints of the matched and the drifted env name each drifted component.
    mixed = tmp_path / "mixed.json"
    mixed.write_text(cudaenv("fingerprint", "--python", str(python), "--json", cwd=tmp_path).stdout)
    compared = cudaenv(
        "fingerprint", "--compare", str(matched), str(mixed), cwd=tmp_path, check=False
    )
    assert compared.returncode == 1
    for line in ("distributions.nvidia-cuda-nvcc: 13.0.88 -> 13.5.37",
                 "distributions.nvidia-cuda-crt: 13.0.88 -> 13.5.37",
                 "distributions.nvidia-nvvm: 13.0.88 -> 13.5.37",
                 "distributions.nvidia-cuda-cccl: 13.0.85 -> 13.3.5.0.6"):  # fmt: skip
        assert line in compared.stdout.splitlines(), compared.stdout
    plan = cudaenv("adopt", "--python", str(python), "--dry-run", cwd=tmp_path)
    assert "  replace nvidia-cuda-nvcc 13.5.37 -> 13.0.88" in plan.stdout.splitlines()
    assert "  replace nvidia-cuda-cccl 13.3.5.0.6 -> 13.0.85" in plan.stdout.splitlines()
    cudaenv("adopt", "--python", str(python), "--no-verify", cwd=tmp_path)
    now = dict(line.split("==") for line in freeze(python).splitlines() if "==" in line)
    for name in ("nvidia-cuda-nvcc", "nvidia-cuda-crt", "nvidia-nvvm", "nvidia-cuda-cccl"):
        assert now[name].startswith("13.0."), (name, now[name])
    checks = "toolchain,kernel-compile,flashinfer-jit,cubin"
    done = cudaenv("verify", "--python", str(python), "--checks", checks, cwd=tmp_path)
    assert "PASSED" in done.stdout
    cudaenv("adopt", "--undo", "--python", str(python), cwd=tmp_path)
    assert freeze(python) == drifted


@pytest.mark.network
@pytest.mark.e2e
@pytest.mark.parametrize("stage", ["adopt-overlay", "adopt-hooks"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL])
def test_a_killed_adopt_leaves_the_env_as_it_was_or_a_rerun_finishes(
    plain_venv: Path, tmp_path: Path, stage: str, sig: int
) -> None:
    """Killed at each stage: SIGTERM is undone on the way out; after SIGKILL the env starts as
    before (the hook's .pth is written last) and the next adopt undoes the rest, then adopts."""
    python = plain_venv / "bin" / "python"
    before = freeze(python)
    env = {**os.environ, "PYTHONPATH": FAULTS_PYTHONPATH,
           "CUDAENV_FAULT_PAUSE": stage, "CUDAENV_FAULT_PAUSE_SECONDS": "60"}  # fmt: skip
    child = subprocess.Popen(
        [sys.executable, "-m", "builder.cli", "adopt", "--python", str(python), "--no-verify"],
        cwd=tmp_path, env=env, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    assert child.stderr is not None
    deadline = time.monotonic() + 300
    for line in child.stderr:
        if f"fault point {stage}" in line:
            break
        assert time.monotonic() < deadline
    child.send_signal(sig)
    child.wait(timeout=120)
    code = "import os; print(os.environ.get('CUDA_HOME', '-'))"
    plain = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True,
                           env={**os.environ, "CUDA_HOME": "/shell/cuda"})  # fmt: skip
    assert plain.stdout.strip() == "/shell/cuda"  # the hook is not active: works as before
    if sig == signal.SIGTERM:
        assert freeze(python) == before
        assert not (plain_venv / "cuda-home").exists()
        assert adopt_journal.read_journal(plain_venv) is None
    rerun = cudaenv("adopt", "--python", str(python), "--no-verify", cwd=tmp_path)
    if sig == signal.SIGKILL:
        assert "did not finish: undoing it first" in rerun.stderr
    adopted = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    assert adopted.stdout.strip() == str(plain_venv / "cuda-home")


@pytest.mark.parametrize("old_journal", [False, True])
def test_undo_gives_back_every_shells_activation_script(tmp_path: Path, old_journal: bool) -> None:
    """write_hooks adds a block to each shell's script; undo puts each back as journalled (a
    journal from before every script was kept holds bin/activate alone)."""
    from builder.env import hooks
    from builder.machine import archs
    from builder.spec import envspec as spec

    venv = tmp_path / "venv"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(venv)])
    scripts = adopt_journal.activation_scripts(venv)
    assert {"activate", "activate.fish", "activate.nu", "activate.ps1"} <= set(scripts)
    before = {name: path.read_text() for name, path in scripts.items()}
    # A journal as a file: the old one is one no current cudaenv writes.
    journal = {"activate": before["activate"]} if old_journal else {"activation": before}
    write(venv / adopt_journal.JOURNAL, json.dumps(journal))
    s = spec.load(write(tmp_path / "s.yaml", 'name: a\npython: "3.12"\ncuda: "13.0"\n'))
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    assert all(path.read_text() != before[name] for name, path in scripts.items())
    done = adopt_journal.undo(venv, venv / "bin" / "python", lambda _: None)
    after = {name: path.read_text() for name, path in scripts.items()}
    if old_journal:
        assert after["activate"] == before["activate"] and done.count("restored bin/activate") == 1
    else:
        assert after == before
        assert sorted(d for d in done if d.startswith("restored")) == sorted(
            f"restored bin/{n}" for n in scripts
        )


@pytest.mark.parametrize("existed", [False, True])
def test_undo_removes_what_adopt_added_under_var_of_every_kind(
    tmp_path: Path, existed: bool
) -> None:
    """What an adopt (or its prefetch, or a verify after it) added under var/ goes at undo,
    whatever its kind: a directory (FlashInfer's cache), a file (the prefetch's record,
    var/cudaenv-prefetched.json) and a link (removed, what it points to left); what was there
    before stays, and a var/ the env did not have goes too."""
    venv = tmp_path / "venv"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(venv)])
    var = venv / "var"
    outside = tmp_path / "outside"
    write(outside / "data", "not the env's")
    if existed:
        write(var / "keep" / "mine", "the user's")
    journal = a_journal(
        before=None, activation=(), var_before=("var/keep",) if existed else (), var_existed=existed
    )
    adopt_journal.write_journal(venv, journal)
    write(var / "flashinfer" / ".cache" / "sampling.so", "a module")
    write(var / "cudaenv-prefetched.json", "[]\n")
    (var / "link").symlink_to(outside, target_is_directory=True)
    adopt_journal.undo(venv, venv / "bin" / "python", lambda _: None)
    if existed:
        assert sorted(p.name for p in var.iterdir()) == ["keep"]
        assert (var / "keep" / "mine").read_text() == "the user's"
    else:
        assert not var.exists() and not var.is_symlink()
    assert (outside / "data").read_text() == "not the env's"
    assert adopt_journal.read_journal(venv) is None


# --------------------------------------------------------------------------- the journal


def a_journal(**changes: object) -> adopt_journal.Journal:
    base = adopt_journal.Journal(
        state="started",
        python="/v/bin/python",
        before=(("torch", "2.14.1"),),
        changes=(("cuda-toolkit", None, "13.0.3"), ("nvidia-cuda-nvcc", "13.5.1", "13.0.88")),
        activation=(("activate", "# the venv's own\n"),),
        var_before=("var/keep",),
        var_existed=True,
        started_at="2026-11-30T00:00:00+00:00",
    )
    return dataclasses.replace(base, **changes)  # type: ignore[arg-type]


def test_the_journal_reads_back_what_was_written(tmp_path: Path) -> None:
    assert adopt_journal.read_journal(tmp_path) is None
    for journal in (
        a_journal(),
        a_journal(state="done", before=None),
        a_journal(state="undoing", broken_before=("/v/x-1.dist-info",), site_before=("nvidia",),
                  nvidia_before=("nvidia/cu13/lib/libcudart.so.13",)),
    ):  # fmt: skip
        adopt_journal.write_journal(tmp_path, journal)
        assert adopt_journal.read_journal(tmp_path) == journal
    # The file's keys are the ones adopt has always written.
    assert set(json.loads((tmp_path / adopt_journal.JOURNAL).read_text())) == {
        "state", "python", "before", "changes", "activation", "var_before", "var_existed",
        "started_at", "broken_before", "site_before", "nvidia_before",
    }  # fmt: skip


def test_a_journal_where_earlier_releases_kept_it_is_read_and_moved(tmp_path: Path) -> None:
    """var/cudaenv/adopt.json (its directory made first, which a kill could leave behind) is
    still read; the next write puts the journal at the env's top and removes the old file."""
    old = write(tmp_path / adopt_journal.OLD_JOURNAL, json.dumps(a_journal().to_json()))
    assert adopt_journal.read_journal(tmp_path) == a_journal()
    adopt_journal.write_journal(tmp_path, a_journal(state="undoing"))
    assert not old.exists()
    assert adopt_journal.read_journal(tmp_path) == a_journal(state="undoing")
    assert (tmp_path / adopt_journal.JOURNAL).is_file()


def test_an_old_journal_with_bin_activate_alone_still_reads(tmp_path: Path) -> None:
    write(tmp_path / adopt_journal.JOURNAL, json.dumps({"activate": "# old\n"}))
    journal = adopt_journal.read_journal(tmp_path)
    assert journal is not None
    # Not marked done: an adopt that did not finish. No "before": undo leaves packages alone.
    assert (journal.state, journal.before, journal.activation) == (
        "started", None, (("activate", "# old\n"),),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("doc", "message"),
    [
        ({"state": "finished"}, "in 'state': unknown state 'finished'; expected one of: started, done, undoing"),
        ({"before": {"torch": 2}}, "in 'before.torch': expected a string, got int"),
        ({"activation": ["activate"]}, "in 'activation': expected an object, got list"),
        ({"changes": [["torch", "2.9"]]}, "in 'changes[0]': expected [name, version before or "
         "null, version after or null], got ['torch', '2.9']"),
        ({"var_existed": "yes"}, "in 'var_existed': expected true or false, got str"),
        ([], "an adopt journal is a JSON object, got list"),
    ],
)  # fmt: skip
def test_a_malformed_journal_names_the_file_and_the_key(
    tmp_path: Path, doc: object, message: str
) -> None:
    path = write(tmp_path / adopt_journal.JOURNAL, json.dumps(doc))
    with pytest.raises(ReportError) as info:
        adopt_journal.read_journal(tmp_path)
    assert str(info.value) == f"{path}: adopt journal: {message}"


def test_a_journal_that_is_not_json_is_an_error_not_no_journal(tmp_path: Path) -> None:
    path = write(tmp_path / adopt_journal.JOURNAL, '{"state": "do')
    with pytest.raises(ReportError, match=f"^{path}: the adopt journal is not JSON"):
        adopt_journal.read_journal(tmp_path)


def users_build(where: Path) -> Path:
    """The test package as a user's own compile left it (a wheel of the same name and version
    whose extension is another toolkit's build: here bytes no loader opens)."""
    from tests.sdist_maker import INIT, MODULE

    info = f"{MODULE}-0.1.0.dist-info"
    files = {
        f"{MODULE}/__init__.py": INIT,
        f"{MODULE}/_C.cpython-312-x86_64-linux-gnu.so": "built by another CUDA\n",
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: cudaenv-testext\nVersion: 0.1.0\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n",
    }
    where.mkdir(parents=True)
    wheel = where / f"{MODULE}-0.1.0-cp312-cp312-linux_x86_64.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        for rel, text in files.items():
            zf.writestr(rel, text)
        zf.writestr(f"{info}/RECORD", "".join(f"{rel},,\n" for rel in [*files, f"{info}/RECORD"]))
    return wheel


@pytest.mark.network
@pytest.mark.e2e
def test_adopt_rebuilds_a_users_compiled_package_and_undo_puts_the_users_build_back(
    plain_venv: Path, cuda_128: Path, tmp_path: Path
) -> None:
    """A package the user compiled at install with another toolkit: `adopt --rebuild` builds
    it again from its sdist with the env's matched nvcc 13.0 (CUDA_HOME at a 12.8 one), its
    extension imports and holds sm_120, verify's imports check covers it; --undo gives back
    the user's own files, byte for byte, and the same freeze."""
    from builder.machine import fatbin
    from builder.machine.archs import Arch
    from tests.sdist_maker import FORCE, MODULE, NAME, make_sdist

    python = plain_venv / "bin" / "python"
    # The sdist on an index page with its sha256 (PEP 503), as a mirror serves it: a
    # find-links directory gives no hash to fetch it against, and adopt has no lock.
    sdist = make_sdist(tmp_path / "simple" / NAME)
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()
    write(sdist.parent / "index.html", f'<a href="{sdist.name}#sha256={digest}">{sdist.name}</a>\n')
    index = (tmp_path / "simple").as_uri()
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--no-deps", "--python", str(python),
              str(users_build(tmp_path / "users"))], env=proc.uv_env())  # fmt: skip
    ext = next((plain_venv / "lib" / "python3.12" / "site-packages" / MODULE).glob("_C*.so"))
    users, before = ext.read_bytes(), freeze(python)
    env = {"CUDA_HOME": str(cuda_128), "UV_EXTRA_INDEX_URL": index, "PIP_EXTRA_INDEX_URL": index}
    done = cudaenv("adopt", "--python", str(python), "--rebuild", NAME, "--build-env",
                   f"{FORCE}=TRUE", "--no-verify", cwd=tmp_path, env=env)  # fmt: skip
    assert f"{NAME} 0.1.0: compiling from its sdist with nvcc 13.0 for 12.0f" in done.stderr
    assert f"{NAME} 0.1.0: rebuilt with nvcc 13.0 and installed" in done.stderr
    assert ext.read_bytes() != users
    got = subprocess.run([python, "-c", f"import torch, {MODULE}._C as c; print(c.add_one)"],
                         capture_output=True, text=True, check=False)  # fmt: skip
    assert got.returncode == 0, got.stderr[-2000:]
    codes = {(c.kind, c.arch) for c in fatbin.scan(ext).codes}
    assert ("sass", Arch(major=12, minor=0, suffix="")) in codes, codes
    made = json.loads((plain_venv / "cudaenv.json").read_text())["source_builds"]
    assert [row[:2] for row in made] == [[NAME, "0.1.0"]]
    journal = adopt_journal.read_journal(plain_venv)
    assert journal is not None and [r[:2] for r in journal.rebuilt] == [(NAME, "0.1.0")]
    checks = cudaenv("verify", "--python", str(python), "--checks", "imports", cwd=tmp_path,
                     env=env)  # fmt: skip
    assert "imports  PASSED" in checks.stdout, checks.stdout
    report = json.loads((plain_venv / "var" / "cudaenv" / "verify.json").read_text())
    evidence = next(c["evidence"] for c in report["checks"] if c["name"] == "imports")
    assert evidence[f"import {MODULE}._C"].startswith("ok"), evidence  # by the manifest's row
    cudaenv("adopt", "--undo", "--python", str(python), cwd=tmp_path, env=env)
    assert ext.read_bytes() == users and freeze(python) == before
    assert not (plain_venv / "var").exists()
