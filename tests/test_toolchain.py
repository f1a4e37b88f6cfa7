"""Start-up hook and activation: values set literally, the hook wins over the shell."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import jinja2
import pytest

from builder.core import platforms, proc
from builder.core.errors import BuildError
from builder.env import caches, hooks, toolchain
from builder.formats import templates
from builder.machine import archs
from builder.spec import envspec as spec
from tests.helpers import write

HOSTILE = {
    "SUBST": "$(touch pwned-subst)",
    "TICKS": "`touch pwned-ticks`",
    # ! is csh's history, '# ends a nushell raw string, \u2018 is a quote to PowerShell.
    "QUOTES": "it's \"quoted\" \\ and ${HOME} !x \u2018q\u2019 '#",
    "NEWLINE": "line1\ntouch pwned-newline",
}


@pytest.fixture
def venv(in_tmp: Path) -> Path:
    path = in_tmp / "env"
    proc.run(
        [proc.uv_bin(), "venv", "--quiet", "--relocatable", "--python", sys.executable, str(path)]
    )
    return path


def hostile_spec(in_tmp: Path) -> spec.EnvSpec:
    # JSON strings are YAML double-quoted scalars: the newline and backslash survive exactly.
    body = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in HOSTILE.items())
    text = 'name: hooktest\npython: "3.12"\ncuda: "13.0"\narchs: ["9.0a", "12.0f"]\nenv:\n'
    return spec.load(write(in_tmp / "hook.yaml", text + body))


def test_hostile_spec_values_parse_exactly(in_tmp: Path) -> None:
    s = hostile_spec(in_tmp)
    assert dict(s.env) == HOSTILE


def test_hook_sets_everything_and_beats_the_shell(in_tmp: Path, venv: Path) -> None:
    s = hostile_spec(in_tmp)
    hooks.write_hooks(venv, s, archs.parse_list("9.0a 12.0f"))
    env = {**os.environ, "CUDA_HOME": "/usr/local/cuda", "PATH": "/usr/bin:/bin"}
    code = (
        "import json, os; print(json.dumps({k: os.environ.get(k) for k in "
        "['CUDA_HOME', 'CUDA_PATH', 'FLASHINFER_CUDA_ARCH_LIST', 'TORCH_CUDA_ARCH_LIST', "
        "'FLASHINFER_WORKSPACE_BASE', 'PATH', 'FLASHINFER_NVCC_THREADS', *"
        + repr(list(HOSTILE))
        + "]}))"
    )
    done = subprocess.run(
        [venv / "bin" / "python", "-c", code],
        env=env,
        capture_output=True,
        text=True,
        check=True,
        cwd=in_tmp,
    )
    got = json.loads(done.stdout)
    home = str(venv / "cuda-home")
    assert got["CUDA_HOME"] == home
    assert got["CUDA_PATH"] == home
    assert got["PATH"] == f"{home}/bin:{venv}/bin:/usr/bin:/bin"
    assert got["FLASHINFER_CUDA_ARCH_LIST"] == "9.0a 12.0f"
    assert got["TORCH_CUDA_ARCH_LIST"] == "9.0;12.0"
    # One nvcc thread per arch: the two gencodes of a file compile side by side.
    assert got["FLASHINFER_NVCC_THREADS"] == "2"
    assert got["FLASHINFER_WORKSPACE_BASE"] == str(venv / "var" / "flashinfer")
    for key, value in HOSTILE.items():
        assert got[key] == value
    assert not list(in_tmp.glob("pwned*"))
    # A stray list from the shell is overridden; an explicit CUDAENV_ARCH_LIST is honoured.
    # TVM-FFI's extension builder gets FlashInfer's list.
    arch_code = (
        "import os; print(os.environ['FLASHINFER_CUDA_ARCH_LIST'], "
        "os.environ['TORCH_CUDA_ARCH_LIST'], os.environ['TVM_FFI_CUDA_ARCH_LIST'], sep='|')"
    )
    for extra, want in (
        ({"FLASHINFER_CUDA_ARCH_LIST": "8.0"}, "9.0a 12.0f|9.0;12.0|9.0a 12.0f"),
        ({"TVM_FFI_CUDA_ARCH_LIST": "8.0"}, "9.0a 12.0f|9.0;12.0|9.0a 12.0f"),
        ({"CUDAENV_ARCH_LIST": "9.0a,10.0a"}, "9.0a 10.0a|9.0;10.0|9.0a 10.0a"),
    ):
        done = subprocess.run(
            [venv / "bin" / "python", "-c", arch_code],
            env={**env, **extra},
            capture_output=True,
            text=True,
            check=True,
        )
        assert done.stdout.strip() == want
    # Opting out shows the interpreter as it is without the hook.
    done = subprocess.run(
        [venv / "bin" / "python", "-c", "import os; print(os.environ['CUDA_HOME'])"],
        env={**env, "CUDAENV_NO_HOOK": "1"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == "/usr/local/cuda"


def test_activate_sets_literally_and_deactivate_restores(in_tmp: Path, venv: Path) -> None:
    s = hostile_spec(in_tmp)
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    script = (
        f"export CUDA_HOME=/usr/local/cuda; unset TORCH_CUDA_ARCH_LIST; "
        # Twice, as a shell that sources it again does: deactivate still gives back the first.
        f". {venv}/bin/activate; . {venv}/bin/activate; "
        'printf "%s\\n---\\n" "$CUDA_HOME" "$FLASHINFER_CUDA_ARCH_LIST" "$SUBST" "$TICKS" '
        '"$QUOTES" "$NEWLINE" "${PATH%%:*}"; '
        'deactivate; printf "%s\\n---\\n" "$CUDA_HOME" '
        '"${TORCH_CUDA_ARCH_LIST-unset}" "${SUBST-unset}"'
    )
    done = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, check=True, cwd=in_tmp
    )
    parts = done.stdout.split("\n---\n")
    home = str(venv / "cuda-home")
    assert parts[:7] == [home, "12.0f", *HOSTILE.values(), f"{home}/bin"]
    assert parts[7:10] == ["/usr/local/cuda", "unset", "unset"]
    assert not list(in_tmp.glob("pwned*")), done.stdout
    override = subprocess.run(
        [
            "bash",
            "-c",
            f"CUDAENV_ARCH_LIST=9.0a,12.0f . {venv}/bin/activate; "
            'echo "$FLASHINFER_CUDA_ARCH_LIST|$TORCH_CUDA_ARCH_LIST|$TVM_FFI_CUDA_ARCH_LIST"',
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=in_tmp,
    )
    assert override.stdout.strip() == "9.0a 12.0f|9.0;12.0|9.0a 12.0f"


def test_templates_are_strict() -> None:
    env = templates.templates()
    with pytest.raises(jinja2.UndefinedError):
        env.get_template("hook.py.j2").render(name="x")


def test_libcuda_stub_has_the_driver_soname(tmp_path: Path) -> None:
    out = toolchain.build_libcuda_stub(tmp_path / "stubs")
    done = subprocess.run(["readelf", "-d", str(out)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip("readelf is not installed")
    assert "Library soname: [libcuda.so.1]" in done.stdout


@pytest.mark.parametrize("machine", ["x86_64", "aarch64"])
def test_the_stub_written_for_another_machine_is_that_machines_with_the_driver_soname(
    tmp_path: Path, machine: str
) -> None:
    plat = platforms.get(f"linux-{machine}")
    stub = tmp_path / "libcuda.so"
    stub.write_bytes(toolchain.elf_libcuda_stub(plat.elf_machine))
    assert toolchain.elf_machine(stub) == plat.elf_machine
    done = subprocess.run(
        ["readelf", "-hd", str(stub)], capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        pytest.skip("readelf is not installed")
    assert "Library soname: [libcuda.so.1]" in done.stdout
    assert "DYN (Shared object file)" in done.stdout
    assert "Warning" not in done.stderr and "Error" not in done.stderr, done.stderr


def test_the_written_stub_links_like_the_compiled_one(tmp_path: Path) -> None:
    """What FlashInfer's link step does with -lcuda: a shared object that records the driver's
    soname as NEEDED, with this machine's own linker (the stub written for it)."""
    cc = proc.which("cc") or proc.which("gcc")
    if cc is None:
        pytest.skip("no C compiler")
    host = platforms.get(platforms.host_name())
    (tmp_path / "stubs").mkdir()
    (tmp_path / "stubs" / "libcuda.so").write_bytes(toolchain.elf_libcuda_stub(host.elf_machine))
    src = write(tmp_path / "use.c", "extern int cuInit(unsigned); int f(void){return cuInit(0);}\n")
    out = tmp_path / "use.so"
    subprocess.run(
        [cc, "-shared", "-fPIC", str(src), "-Wl,--no-as-needed", f"-L{tmp_path / 'stubs'}",
         "-lcuda", "-o", str(out)],
        check=True,
    )  # fmt: skip
    done = subprocess.run(["readelf", "-d", str(out)], capture_output=True, text=True, check=False)
    if done.returncode != 0:
        pytest.skip("readelf is not installed")
    assert "Shared library: [libcuda.so.1]" in done.stdout


def fake_toolkit_tree(root: Path, e_machine: int) -> Path:
    """cuda-home/ as the overlay lays it out, each binary a minimal ELF of ``e_machine``."""
    elf = toolchain.elf_libcuda_stub(e_machine)
    home = root / "cuda-home"
    for rel in ("bin/nvcc", "bin/ptxas", "nvvm/bin/cicc", "lib64/stubs/libcuda.so"):
        write(home / rel, "").write_bytes(elf)
    prefix = root / "lib" / "python3.12" / "site-packages" / "nvidia" / "cu13" / "lib"
    write(prefix / "libcudart.so.13", "").write_bytes(elf)
    (home / "lib64" / "libcudart.so").symlink_to(
        os.path.relpath(prefix / "libcudart.so.13", home / "lib64")
    )
    for rel in toolchain.ASSEMBLY_INCLUDES:
        write(home / rel, "")
    return root


def test_assembly_checks_pass_a_tree_of_the_platform_and_name_each_fault(tmp_path: Path) -> None:
    arm = platforms.get("linux-aarch64")
    tree = fake_toolkit_tree(tmp_path / "arm", arm.elf_machine)
    assert toolchain.assembly_problems(tree, arm) == []
    # The same tree made of x86_64 files: every binary is named.
    x86 = fake_toolkit_tree(tmp_path / "x86", platforms.get("linux-x86_64").elf_machine)
    problems = toolchain.assembly_problems(x86, arm)
    assert (
        problems[0]
        == "cuda-home/bin/nvcc is an ELF file for machine 62, not linux-aarch64 (machine 183)"
    )
    assert len(problems) == 5  # nvcc, ptxas, cicc, the stub, libcudart
    # A runtime library outside the tree, a text file as ptxas, a missing header.
    outside = tmp_path / "elsewhere.so"
    outside.write_bytes(toolchain.elf_libcuda_stub(arm.elf_machine))
    (tree / "cuda-home" / "lib64" / "libcudart.so").unlink()
    (tree / "cuda-home" / "lib64" / "libcudart.so").symlink_to(outside)
    (tree / "cuda-home" / "bin" / "ptxas").write_text("#!/bin/sh\n")
    (tree / "cuda-home" / "include" / "cuda_runtime.h").unlink()
    assert toolchain.assembly_problems(tree, arm) == [
        "cuda-home/bin/ptxas is missing or not an ELF file, not linux-aarch64 (machine 183)",
        f"cuda-home/lib64/libcudart.so resolves to {outside}, not a linux-aarch64 library inside the env",
        "cuda-home/include/cuda_runtime.h is missing",
    ]


def test_every_jit_cache_lives_in_the_env_and_triton_uses_its_ptxas(
    in_tmp: Path, venv: Path
) -> None:
    """The hook and activate point each library's own cache variable into ENV/var and
    Triton's tool variables at the env's binaries, whatever the shell exported; a tool the
    toolkit lacks is left to Triton (it falls back silently to its bundled one)."""
    s = hostile_spec(in_tmp)
    ptxas = write(venv / "cuda-home" / "bin" / "ptxas", "")
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    names = list(caches.VARIABLES)
    shell = {name: f"/shared/{name.lower()}" for name in names}
    code = f"import json, os; print(json.dumps({{k: os.environ.get(k) for k in {names!r}}}))"
    done = subprocess.run(
        [venv / "bin" / "python", "-c", code],
        env={**os.environ, **shell},
        capture_output=True,
        text=True,
        check=True,
    )
    got = json.loads(done.stdout)
    for cache in caches.CACHES:
        assert got[cache.variable] == str(venv / "var" / cache.subdir)
        assert (venv / "var" / cache.subdir).is_dir()
    assert got["TRITON_PTXAS_PATH"] == got["TRITON_PTXAS_BLACKWELL_PATH"] == str(ptxas)
    # No cuobjdump/nvdisasm in this toolkit: the shell's value stays, as Triton's own default would.
    assert got["TRITON_CUOBJDUMP_PATH"] == shell["TRITON_CUOBJDUMP_PATH"]
    assert caches.outside_env(str(venv), got) == [
        "TRITON_CUOBJDUMP_PATH=/shared/triton_cuobjdump_path (not the env's cuobjdump)",
        "TRITON_NVDISASM_PATH=/shared/triton_nvdisasm_path (not the env's nvdisasm)",
    ]
    # activate: the same values for a shell, and deactivate gives the shell's back.
    script = (
        f'. {venv}/bin/activate; printf "%s\\n" "$TRITON_CACHE_DIR" "$TRITON_PTXAS_PATH" '
        '"$SGLANG_JIT_CACHE_DIR"; deactivate; printf "%s\\n" "$TRITON_CACHE_DIR"'
    )
    done = subprocess.run(
        ["bash", "-c", script],
        env={**os.environ, **shell},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.splitlines() == [
        str(venv / "var" / "triton"),
        f"{venv}/cuda-home/bin/ptxas",
        str(venv / "var" / "sglang" / "jit"),
        "/shared/triton_cache_dir",
    ]


def test_an_empty_environment_keeps_the_os_default_path(in_tmp: Path, venv: Path) -> None:
    """`env -i ENV/bin/python`: CUDA_HOME's bin first, then the OS default path, so nvcc
    still finds gcc."""
    hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    done = subprocess.run(
        ["env", "-i", str(venv / "bin" / "python"), "-c", "import os; print(os.environ['PATH'])"],
        capture_output=True,
        text=True,
        check=True,
    )
    first, *rest = done.stdout.strip().split(":")
    assert first == str(venv / "cuda-home" / "bin")
    assert rest[0] == str(venv / "bin")
    assert rest and "" not in rest and ("/usr/bin" in rest or "/bin" in rest)


def test_every_process_of_the_env_runs_the_envs_own_ninja(
    in_tmp: Path, venv: Path, tmp_path: Path
) -> None:
    """FlashInfer runs `ninja` from PATH. Whoever starts the interpreter (a server without
    activation, verify's probe, warm) gets the env's own: another ninja earlier on the
    caller's PATH would give the module another build command and another store key."""
    hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    for where in (venv / "bin", tmp_path / "elsewhere"):
        where.mkdir(exist_ok=True)
        (where / "ninja").write_text("#!/bin/sh\nexit 0\n")
        (where / "ninja").chmod(0o755)
    done = subprocess.run(
        [venv / "bin" / "python", "-c", "import shutil; print(shutil.which('ninja'))"],
        env={**os.environ, "PATH": f"{tmp_path / 'elsewhere'}:{os.environ['PATH']}"},
        capture_output=True,
        text=True,
        check=True,
    )
    assert done.stdout.strip() == str(venv / "bin" / "ninja")


def test_pip_in_a_built_env_says_how_packages_are_added(in_tmp: Path, venv: Path) -> None:
    """An activated shell's `pip install X` would reach the host's pip: the env's own `pip`
    (and `python -m pip`) says instead how to add a package (`cudaenv add`), and fails."""
    s = hostile_spec(in_tmp)
    written = hooks.write_pip_guard(venv, s)
    site = toolchain.site_packages(venv)
    assert [p.name for p in written] == ["pip", "pip", "pip3", "pip3.12"]
    assert written[0] == site / "pip"
    for command in (f". {venv}/bin/activate; pip install requests",
                    f"{venv}/bin/python -m pip install requests"):  # fmt: skip
        done = subprocess.run(["bash", "-c", command], capture_output=True, text=True, check=False)
        assert done.returncode == 1, done.stderr
        lines = done.stderr.strip().splitlines()
        assert lines[0] == (
            f"pip: {venv} was built by cudaenv from the lock of {s.source} and has no pip; "
            "`pip install` would change it around the lock."
        )
        assert lines[1] == f"  to add a package: cudaenv add PACKAGE --spec {s.source}"


@pytest.mark.slow
def test_pips_read_only_commands_answer_from_the_env(in_tmp: Path, venv: Path) -> None:
    """`pip list` / `freeze` / `show` tell the truth about the env, so torch's collect_env
    (`python -m pip list --format=freeze`) lists its packages."""
    hooks.write_pip_guard(venv, hostile_spec(in_tmp))
    site = toolchain.site_packages(venv)
    dist = site / "demo_pkg-1.2.3.dist-info"
    dist.mkdir()
    (dist / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: demo-pkg\nVersion: 1.2.3\nSummary: a demo\n"
        "Requires-Dist: other-pkg>=1\n"
    )
    other = site / "other_pkg-4.0.dist-info"
    other.mkdir()
    (other / "METADATA").write_text("Metadata-Version: 2.1\nName: other-pkg\nVersion: 4.0\n")
    python = str(venv / "bin" / "python")

    def pip(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [python, "-mpip", *args], capture_output=True, text=True, check=False, cwd=in_tmp
        )

    assert pip("list", "--format=freeze").stdout.splitlines() == [
        "demo-pkg==1.2.3",
        "other-pkg==4.0",
    ]
    assert pip("freeze").stdout.splitlines() == ["demo-pkg==1.2.3", "other-pkg==4.0"]
    listed = pip("list").stdout.splitlines()
    assert listed[0].split() == ["Package", "Version"] and listed[2].split() == [
        "demo-pkg",
        "1.2.3",
    ]
    shown = pip("show", "demo_pkg").stdout.splitlines()
    assert "Name: demo-pkg" in shown and "Version: 1.2.3" in shown
    assert "Requires: other-pkg" in shown
    assert "Required-by: demo-pkg" in pip("show", "other-pkg").stdout.splitlines()
    missing = pip("show", "nope")
    assert missing.returncode == 1 and "not found: nope" in missing.stderr


def test_activate_fish_sets_literally_and_deactivate_restores(in_tmp: Path, venv: Path) -> None:
    fish = shutil.which("fish")
    if fish is None:
        pytest.skip("fish is not installed on this machine")
    s = hostile_spec(in_tmp)
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    script = (
        "set -gx CUDA_HOME /usr/local/cuda; set -e TORCH_CUDA_ARCH_LIST; "
        f"source {venv}/bin/activate.fish; source {venv}/bin/activate.fish; "
        'printf "%s\\n---\\n" "$CUDA_HOME" "$FLASHINFER_CUDA_ARCH_LIST" "$SUBST" "$TICKS" '
        '"$QUOTES" "$NEWLINE" "$PATH[1]" "$TRITON_CACHE_DIR"; '
        'deactivate; printf "%s\\n---\\n" "$CUDA_HOME"; '
        "set -q TORCH_CUDA_ARCH_LIST; and echo set; or echo unset"
    )
    done = subprocess.run(
        [fish, "--no-config", "-c", script], capture_output=True, text=True, check=True, cwd=in_tmp
    )
    parts = done.stdout.split("\n---\n")
    home = str(venv / "cuda-home")
    assert parts[:8] == [
        home,
        "12.0f",
        *HOSTILE.values(),
        f"{home}/bin",
        str(venv / "var" / "triton"),
    ]
    assert parts[8] == "/usr/local/cuda"
    assert parts[9].strip() == "unset"
    assert not list(in_tmp.glob("pwned*")), done.stdout
    override = subprocess.run(
        [fish, "--no-config", "-c",
         f"set -gx CUDAENV_ARCH_LIST 9.0a,12.0f; source {venv}/bin/activate.fish; "
         'echo "$FLASHINFER_CUDA_ARCH_LIST|$TORCH_CUDA_ARCH_LIST|$TVM_FFI_CUDA_ARCH_LIST"'],
        capture_output=True, text=True, check=True, cwd=in_tmp,
    )  # fmt: skip
    assert override.stdout.strip() == "9.0a 12.0f|9.0;12.0|9.0a 12.0f"


def test_activate_xsh_sets_literally_and_deactivate_restores(in_tmp: Path, venv: Path) -> None:
    xonsh = shutil.which("xonsh")
    if xonsh is None:
        pytest.skip("xonsh is not installed on this machine")
    if not (venv / "bin" / "activate.xsh").exists():
        pytest.skip("this venv ships no activate.xsh")
    plain = subprocess.run(
        [xonsh, "--no-rc", "-c", f"source {venv}/bin/activate.xsh\nprint($VIRTUAL_ENV)"],
        capture_output=True,
        text=True,
        check=False,
    )
    if plain.returncode != 0:
        pytest.skip(f"{xonsh} cannot source the venv's own activate.xsh (too old a xonsh)")
    s = hostile_spec(in_tmp)
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    keys = ["CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST", *HOSTILE, "TRITON_CACHE_DIR",
            "TVM_FFI_CUDA_ARCH_LIST"]  # fmt: skip
    script = (
        f"source {venv}/bin/activate.xsh\nsource {venv}/bin/activate.xsh\n"
        f"import json\nprint(json.dumps({{k: str(${{...}}.get(k)) for k in {keys!r}}}))\n"
        "print(str($PATH[0]))\n"
        "deactivate\n"
        "print(json.dumps([${...}.get('CUDA_HOME'), ${...}.get('TORCH_CUDA_ARCH_LIST')]))\n"
    )
    done = subprocess.run(
        [xonsh, "--no-rc", "-c", script],
        capture_output=True,
        text=True,
        check=True,
        cwd=in_tmp,
        env={**os.environ, "CUDA_HOME": "/usr/local/cuda", "TORCH_CUDA_ARCH_LIST": ""},
    )
    got_json, path0, after = done.stdout.strip().splitlines()[-3:]
    got = json.loads(got_json)
    home = str(venv / "cuda-home")
    assert got["CUDA_HOME"] == home and got["FLASHINFER_CUDA_ARCH_LIST"] == "12.0f"
    assert got["TRITON_CACHE_DIR"] == str(venv / "var" / "triton")
    assert got["TVM_FFI_CUDA_ARCH_LIST"] == "12.0f"
    for key, value in HOSTILE.items():
        assert got[key] == value
    assert path0 == f"{home}/bin"
    assert json.loads(after) == ["/usr/local/cuda", ""]  # the shell's values, given back
    assert not list(in_tmp.glob("pwned*"))


@pytest.fixture
def stdlib_venv(in_tmp: Path) -> Path:
    """A venv made by the standard library (what `cudaenv adopt` meets): Activate.ps1 and
    activate.csh, no activate.nu."""
    path = in_tmp / "stdenv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
    return path


def activation_scripts(venv: Path) -> set[str]:
    # Every script a shell sources; .bat is Windows' cmd, activate_this.py runs the .pth.
    return {
        p.name
        for p in (venv / "bin").iterdir()
        if p.name.lower().startswith("activate") and p.suffix not in (".bat", ".py")
    }


@pytest.mark.parametrize("maker", ["venv", "stdlib_venv"])
def test_every_activation_script_the_venv_ships_gets_the_block(
    in_tmp: Path, maker: str, request: pytest.FixtureRequest
) -> None:
    venv = request.getfixturevalue(maker)
    scripts = activation_scripts(venv)
    assert len(scripts) >= 4, scripts
    written = hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    assert {p.name for p in written} >= scripts
    for name in scripts:
        text = (venv / "bin" / name).read_text()
        assert text.count(">>> cudaenv hooktest >>>") == 1, name
        assert text.count("<<< cudaenv hooktest <<<") == 1, name


def test_a_nushell_script_of_another_shape_is_refused_by_name(in_tmp: Path, venv: Path) -> None:
    script = venv / "bin" / "activate.nu"
    script.write_text("export def --env activate [] { $env.VIRTUAL_ENV = 'x' }\n")
    with pytest.raises(BuildError, match=r"activate\.nu: no export-env block"):
        hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)


def test_the_block_goes_above_a_powershell_signature(in_tmp: Path, stdlib_venv: Path) -> None:
    script = stdlib_venv / "bin" / "Activate.ps1"
    signed = (
        script.read_text()
        + "\n# SIG # Begin signature block\n# MIIvabc\n# SIG # End signature block\n"
    )
    script.write_text(signed)
    hooks.write_hooks(stdlib_venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    text = script.read_text()
    assert text.index("<<< cudaenv hooktest <<<") < text.index("# SIG # Begin signature block")
    assert text.endswith("# SIG # End signature block\n")


@pytest.mark.parametrize(
    ("value", "literal"),
    [
        ("plain", "'plain'"),
        ("it's", "r#'it's'#"),
        ("a'#b", "r##'a'#b'##"),
        ("'##'#", "r###''##'#'###"),
    ],
)
def test_nushell_literals_end_only_where_they_should(value: str, literal: str) -> None:
    assert templates._nuquote(value) == literal


def test_activate_nu_sets_literally_and_deactivate_restores(in_tmp: Path, venv: Path) -> None:
    nu = shutil.which("nu")
    if nu is None:
        pytest.skip("nushell (nu) is not installed on this machine")
    s = hostile_spec(in_tmp)
    hooks.write_hooks(venv, s, archs.DEFAULT_ARCHS)
    keys = ["CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST", *HOSTILE,
            "TRITON_CACHE_DIR"]  # fmt: skip
    script = (
        f"overlay use {venv}/bin/activate.nu; overlay use {venv}/bin/activate.nu; "
        f"print ([{' '.join(f'$env.{k}' for k in keys)} ($env.PATH | first)] | to json -r); "
        "deactivate; "
        "print ([$env.CUDA_HOME ($env.TORCH_CUDA_ARCH_LIST? | default unset)] | to json -r)"
    )
    done = subprocess.run(
        [nu, "--no-config-file", "-c", script], capture_output=True, text=True, check=True,
        cwd=in_tmp, env={**os.environ, "CUDA_HOME": "/usr/local/cuda"},
    )  # fmt: skip
    got, after = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    home = str(venv / "cuda-home")
    assert got == [home, "12.0f", "12.0", *HOSTILE.values(), str(venv / "var" / "triton"),
                   f"{home}/bin"]  # fmt: skip
    assert after == ["/usr/local/cuda", "unset"]
    assert not list(in_tmp.glob("pwned*"))
    override = subprocess.run(
        [nu, "--no-config-file", "-c",
         f"overlay use {venv}/bin/activate.nu; "
         'print $"($env.FLASHINFER_CUDA_ARCH_LIST)|($env.TORCH_CUDA_ARCH_LIST)|($env.TVM_FFI_CUDA_ARCH_LIST)"'],
        capture_output=True, text=True, check=True, cwd=in_tmp,
        env={**os.environ, "CUDAENV_ARCH_LIST": "9.0a,12.0f 9.0"},
    )  # fmt: skip
    assert override.stdout.strip() == "9.0a 12.0f 9.0|9.0;12.0|9.0a 12.0f 9.0"


def test_activate_csh_sets_literally_and_deactivate_restores(
    in_tmp: Path, stdlib_venv: Path
) -> None:
    tcsh = shutil.which("tcsh") or shutil.which("csh")
    if tcsh is None:
        pytest.skip("csh/tcsh is not installed on this machine")
    s = hostile_spec(in_tmp)
    hooks.write_hooks(stdlib_venv, s, archs.DEFAULT_ARCHS)
    shown = " ".join(f'"${k}:q"' for k in ["CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST", *HOSTILE,
                                            "TRITON_CACHE_DIR", "PATH"])  # fmt: skip
    # The standard library's activate.csh reads $prompt, which a non-interactive csh lacks.
    script = (
        'set prompt = "> "\n'
        "setenv CUDA_HOME /usr/local/cuda\n"
        "unsetenv TORCH_CUDA_ARCH_LIST\n"
        f"source {stdlib_venv}/bin/activate.csh\n"
        f"source {stdlib_venv}/bin/activate.csh\n"
        f"printf '%s\\n---\\n' {shown}\n"
        "deactivate\n"
        'printf \'%s\\n---\\n\' "$CUDA_HOME:q" "$?TORCH_CUDA_ARCH_LIST" "$?_CUDAENV_OLD_CUDA_HOME"\n'
        "alias\n"
    )
    (in_tmp / "t.csh").write_text(script)
    done = subprocess.run([tcsh, "-f", "t.csh"], capture_output=True, text=True, cwd=in_tmp,
                          check=True)  # fmt: skip
    parts = done.stdout.split("\n---\n")
    home = str(stdlib_venv / "cuda-home")
    assert parts[:7] == [home, "12.0f", *HOSTILE.values(), str(stdlib_venv / "var" / "triton")]
    assert parts[7].startswith(f"{home}/bin:{stdlib_venv}/bin:")
    assert parts[8:11] == ["/usr/local/cuda", "0", "0"]
    assert "cudaenv" not in parts[11] and "deactivate" not in parts[11]  # no alias left behind
    assert not list(in_tmp.glob("pwned*"))
    (in_tmp / "o.csh").write_text(
        'set prompt = "> "\n'
        f"source {stdlib_venv}/bin/activate.csh\n"
        'echo "$FLASHINFER_CUDA_ARCH_LIST|$TORCH_CUDA_ARCH_LIST|$TVM_FFI_CUDA_ARCH_LIST"\n'
    )
    override = subprocess.run([tcsh, "-f", "o.csh"], capture_output=True, text=True, cwd=in_tmp,
                              check=True, env={**os.environ, "CUDAENV_ARCH_LIST": "9.0a,12.0f 9.0"})  # fmt: skip
    assert override.stdout.strip() == "9.0a 12.0f 9.0|9.0;12.0|9.0a 12.0f 9.0"


def powershell_literals(path: Path) -> tuple[bool, list[str], list[str]]:
    """Parsed with tree-sitter's PowerShell grammar: whether the script has a syntax error,
    each single-quoted literal's value, and the text of every expandable part (a "..."
    string or a $( ) subexpression) that mentions "pwned"."""
    ts = pytest.importorskip("tree_sitter")
    grammar = pytest.importorskip("tree_sitter_powershell")
    tree = ts.Parser(ts.Language(grammar.language())).parse(path.read_bytes())
    literals: list[str] = []
    expanding: list[str] = []
    stack = [tree.root_node]
    while stack:
        node = stack.pop()
        text = (node.text or b"").decode()
        if node.type == "verbatim_string_characters":
            body = text[1:-1]
            for q in "'\u2018\u2019\u201a\u201b":
                body = body.replace(q + q, q)
            literals.append(body)
        elif node.type in ("expandable_string_literal", "sub_expression") and "pwned" in text:
            expanding.append(text)
        stack.extend(node.children)
    return tree.root_node.has_error, literals, expanding


@pytest.mark.parametrize(
    ("maker", "script"), [("venv", "activate.ps1"), ("stdlib_venv", "Activate.ps1")]
)
def test_activate_ps1_parses_and_every_value_is_one_literal(
    in_tmp: Path, maker: str, script: str, request: pytest.FixtureRequest
) -> None:
    venv = request.getfixturevalue(maker)
    hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    has_error, literals, expanding = powershell_literals(venv / "bin" / script)
    assert not has_error
    for value in HOSTILE.values():
        assert value in literals, value
    assert expanding == []


def test_the_powershell_check_fails_a_value_quoted_for_another_shell(
    in_tmp: Path, venv: Path
) -> None:
    path = venv / "bin" / "activate.ps1"
    path.write_text(path.read_text() + f"$env:QUOTES = {templates._cshquote(HOSTILE['QUOTES'])}\n")
    has_error, literals, _ = powershell_literals(path)
    assert has_error or HOSTILE["QUOTES"] not in literals
    path.write_text(f'$env:SUBST = "{HOSTILE["SUBST"]}"\n')
    assert powershell_literals(path)[2] != []


@pytest.mark.parametrize(
    ("maker", "script"), [("venv", "activate.ps1"), ("stdlib_venv", "Activate.ps1")]
)
def test_activate_ps1_sets_literally_and_deactivate_restores(
    in_tmp: Path, maker: str, script: str, request: pytest.FixtureRequest
) -> None:
    pwsh = shutil.which("pwsh")
    if pwsh is None:
        pytest.skip("PowerShell (pwsh) is not installed on this machine")
    venv = request.getfixturevalue(maker)
    hooks.write_hooks(venv, hostile_spec(in_tmp), archs.DEFAULT_ARCHS)
    keys = ["CUDA_HOME", "FLASHINFER_CUDA_ARCH_LIST", "TORCH_CUDA_ARCH_LIST",
            "TVM_FFI_CUDA_ARCH_LIST", *HOSTILE, "TRITON_CACHE_DIR"]  # fmt: skip
    command = (
        f"Set-StrictMode -Version Latest; . '{venv}/bin/{script}'; . '{venv}/bin/{script}'; "
        f"@({', '.join(f'$env:{k}' for k in keys)}, ($env:PATH -split ':')[0]) | ConvertTo-Json -Compress; "
        "deactivate; "
        "@($env:CUDA_HOME, [string]($null -eq $env:TORCH_CUDA_ARCH_LIST), "
        "[string](Test-Path function:deactivate)) | ConvertTo-Json -Compress"
    )
    done = subprocess.run(
        [pwsh, "-NoProfile", "-NonInteractive", "-Command", command], capture_output=True,
        text=True, check=True, cwd=in_tmp, env={**os.environ, "CUDA_HOME": "/usr/local/cuda"},
    )  # fmt: skip
    got, after = (json.loads(line) for line in done.stdout.strip().splitlines()[-2:])
    home = str(venv / "cuda-home")
    assert got == [home, "12.0f", "12.0", "12.0f", *HOSTILE.values(),
                   str(venv / "var" / "triton"), f"{home}/bin"]  # fmt: skip
    assert after == ["/usr/local/cuda", "True", "False"]
    assert not list(in_tmp.glob("pwned*"))


def two_envs(in_tmp: Path, stdlib: bool) -> tuple[Path, Path]:
    """Envs A and B, each with a variable of its own in `env:`."""
    made = []
    for name, key in (("enva", "ONLY_A"), ("envb", "ONLY_B")):
        path = in_tmp / name
        if stdlib:
            subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True)
        else:
            proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(path)])
        text = f'name: {name}\npython: "3.12"\ncuda: "13.0"\nenv:\n  {key}: "{name}"\n'
        hooks.write_hooks(path, spec.load(write(in_tmp / f"{name}.yaml", text)),
                              archs.DEFAULT_ARCHS)  # fmt: skip
        made.append(path)
    return made[0], made[1]


SWITCH = {
    # shell: (argv, script); {a}/{b}: the envs. Prints CUDA_HOME, ONLY_B, then after deactivate
    # CUDA_HOME and ONLY_B again, one per line.
    "bash": (["bash", "-c"], ". {a}/bin/activate; . {b}/bin/activate; "
             'printf "%s\\n" "$CUDA_HOME" "$ONLY_B"; deactivate; printf "%s\\n" "$CUDA_HOME" "$ONLY_B"'),
    "zsh": (["zsh", "-f", "-c"], ". {a}/bin/activate; . {b}/bin/activate; "
            'printf "%s\\n" "$CUDA_HOME" "$ONLY_B"; deactivate; printf "%s\\n" "$CUDA_HOME" "$ONLY_B"'),
    "fish": (["fish", "--no-config", "-c"], "source {a}/bin/activate.fish; source {b}/bin/activate.fish; "
             'printf "%s\\n" "$CUDA_HOME" "$ONLY_B"; deactivate; printf "%s\\n" "$CUDA_HOME" "$ONLY_B"'),
    "xonsh": (["xonsh", "--no-rc", "-c"], "source {a}/bin/activate.xsh\nsource {b}/bin/activate.xsh\n"
              "print($CUDA_HOME); print($ONLY_B)\ndeactivate\nprint($CUDA_HOME); print($ONLY_B)\n"),
    "pwsh": (["pwsh", "-NoProfile", "-NonInteractive", "-Command"], "Set-StrictMode -Version Latest; "
             ". '{a}/bin/activate.ps1'; . '{b}/bin/activate.ps1'; $env:CUDA_HOME; $env:ONLY_B; "
             "deactivate; $env:CUDA_HOME; $env:ONLY_B"),
    "nu": (["nu", "--no-config-file", "-c"], "overlay use {a}/bin/activate.nu; overlay use "
           "{b}/bin/activate.nu; print $env.CUDA_HOME $env.ONLY_B; deactivate; print $env.CUDA_HOME $env.ONLY_B"),
    # csh expands aliases when it reads a line: one command per line, from a file.
    "tcsh": (["tcsh", "-f"], 'set prompt = "> "\nsource {a}/bin/activate.csh\n'
             "source {b}/bin/activate.csh\nprintf '%s\\n' \"$CUDA_HOME\" \"$ONLY_B\"\ndeactivate\n"
             "printf '%s\\n' \"$CUDA_HOME\" \"$ONLY_B\"\n"),
}  # fmt: skip


@pytest.mark.parametrize("shell", sorted(SWITCH))
def test_switching_envs_then_deactivate_gives_the_shells_own_values_back(
    in_tmp: Path, shell: str
) -> None:
    """A shell that sources env B's activation over env A's: deactivate gives back what the
    shell had, including a variable of B's that the shell had set itself."""
    argv, script = SWITCH[shell]
    exe = shutil.which(argv[0])
    if exe is None:
        pytest.skip(f"{argv[0]} is not installed on this machine")
    a, b = two_envs(in_tmp, stdlib=shell == "tcsh")
    if shell == "xonsh":
        probe = subprocess.run([exe, "--no-rc", "-c", f"source {a}/bin/activate.xsh"],
                               capture_output=True, check=False)  # fmt: skip
        if probe.returncode != 0:
            pytest.skip(f"{exe} cannot source the venv's own activate.xsh (too old a xonsh)")
    text = script.format(a=a, b=b)
    if shell == "tcsh":
        text = str(write(in_tmp / "switch.csh", text))
    done = subprocess.run(
        [exe, *argv[1:], text], capture_output=True, text=True, check=True,
        cwd=in_tmp, env={**os.environ, "CUDA_HOME": "/usr/local/cuda", "ONLY_B": "the shell's"},
    )  # fmt: skip
    lines = done.stdout.strip().splitlines()[-4:]
    assert lines == [str(b / "cuda-home"), "envb", "/usr/local/cuda", "the shell's"], done.stdout
