"""The variable table against what reads it: the start-up hook, every activation script, the
probes, the fingerprint. Each test runs or renders the real thing and compares it with the
table, so a name added in one place only fails here."""

from __future__ import annotations

import ast
import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from builder import store as jit_store
from builder import verify as verify_mod
from builder.core import proc, settings, variables
from builder.core.errors import ReportError, UsageError
from builder.core.variables import Hook, Kind
from builder.doctor import diagnose as doctor
from builder.doctor import fingerprint
from builder.env import caches, hooks, toolchain
from builder.formats import templates
from builder.machine import archs
from builder.spec import envspec as spec
from tests.helpers import cudaenv, write

ARCHS = "9.0a 12.0f"
# The spec's own variable: one the fingerprint hashes, so everything the hook sets is.
SPEC_ENV = {"NVCC_APPEND_FLAGS": "-lineinfo"}
# What a bare process starts with: whatever a variable holds after the hook, the hook set.
# Python itself would set LC_CTYPE in a C locale (PEP 538) were it not told not to.
BARE = {"PATH": "/usr/bin:/bin", "PYTHONCOERCECLOCALE": "0"}


@pytest.fixture
def env(tmp_path: Path) -> Path:
    """An env wired as a build wires it, with every Triton tool in its toolkit (a tool the
    toolkit lacks is left unset), and the venv's bin/activate kept as it was."""
    path = tmp_path / "env"
    proc.run(
        [proc.uv_bin(), "venv", "--quiet", "--relocatable", "--python", sys.executable, str(path)]
    )
    shutil.copy(path / "bin" / "activate", path / "bin" / "activate.venv")
    for tool in {tool for _, tool in caches.TRITON_TOOLS}:
        write(path / "cuda-home" / "bin" / tool, "")
    body = "".join(f"  {k}: {json.dumps(v)}\n" for k, v in SPEC_ENV.items())
    text = f'name: vars\npython: "3.12"\ncuda: "13.0"\narchs: ["9.0a", "12.0f"]\nenv:\n{body}'
    s = spec.load(write(tmp_path / "vars.yaml", text))
    hooks.write_hooks(path, s, archs.parse_list(ARCHS))
    return path


def hook_changes(env: Path) -> dict[str, str]:
    """Each variable the start-up hook adds or changes in a bare process, with its value."""
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    done = subprocess.run(
        [env / "bin" / "python", "-c", code], env=BARE, capture_output=True, text=True, check=True
    )
    after: dict[str, str] = json.loads(done.stdout)
    return {k: v for k, v in after.items() if BARE.get(k) != v}


def test_every_variable_the_hook_sets_is_fingerprinted(env: Path) -> None:
    """Two envs that differ in anything their hook sets fingerprint apart. PATH is only
    prepended (the toolkit it leads to is hashed by content) and CUDAENV_SHELL_CUDA_HOME
    records what the shell had, not what the env uses."""
    not_hashed = {"PATH", "CUDAENV_SHELL_CUDA_HOME"}
    missing = sorted(set(hook_changes(env)) - not_hashed - set(fingerprint.VARIABLES))
    assert missing == []


def test_the_hook_sets_exactly_what_the_table_says(env: Path) -> None:
    changed = hook_changes(env)
    # Not the remote cache's: this env names none (tests/test_remote_cache.py wires one).
    by_hook = {v.name for v in variables.TABLE if v.hook not in (None, Hook.REMOTE)}
    assert set(changed) == by_hook | set(SPEC_ENV)
    assert changed["TVM_FFI_CUDA_ARCH_LIST"] == ARCHS
    assert changed["PATH"] == f"{env / 'cuda-home' / 'bin'}:{env / 'bin'}:/usr/bin:/bin"


def test_bin_activate_sets_what_the_hook_sets(env: Path) -> None:
    """What sourcing bin/activate exports beyond what the venv's own activate does: the
    table's variables the hook sets, and the spec's."""

    def exported(script: str) -> dict[str, str]:
        done = subprocess.run(
            ["bash", "-c", f". {env / 'bin' / script} && env -0"],
            env=BARE,
            capture_output=True,
            text=True,
            check=True,
        )
        pairs = (item.split("=", 1) for item in done.stdout.split("\0") if "=" in item)
        return {k: v for k, v in pairs}

    venv_only, ours = exported("activate.venv"), exported("activate")
    added = {k for k, v in ours.items() if venv_only.get(k) != v} - {"PATH"}
    assert added == set(variables.SET_BY_HOOK) | set(SPEC_ENV)
    assert ours["PATH"].startswith(f"{env / 'cuda-home' / 'bin'}:")
    assert ours["TVM_FFI_CUDA_ARCH_LIST"] == ARCHS


def test_the_hook_touches_no_variable_the_table_does_not_know(env: Path) -> None:
    """Every name the hook's code reads or writes (``_os.environ[...]``, ``.get``,
    ``.setdefault``) is a row of the table or the spec's own."""
    site = toolchain.site_packages(env)
    tree = ast.parse((site / f"{hooks.HOOK_MODULE}.py").read_text())

    def is_environ(node: ast.AST) -> bool:
        return isinstance(node, ast.Attribute) and node.attr == "environ"

    used = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Subscript) and is_environ(node.value):
            key = node.slice
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            if not (is_environ(node.func.value) and node.args):
                continue
            key = node.args[0]
        else:
            continue
        assert isinstance(key, ast.Constant), ast.unparse(node)
        used.add(key.value)
    assert "TVM_FFI_CUDA_ARCH_LIST" in used
    assert used - set(SPEC_ENV) <= {v.name for v in variables.TABLE}


@pytest.mark.parametrize("template", sorted({t for _, t, _ in hooks.ACTIVATIONS} | {"hook.py.j2"}))
def test_every_activation_names_every_variable_the_hook_sets(template: str) -> None:
    """Each shell's script sets the toolkit and arch-list variables in code of its own: each
    must name every variable of the table the hook sets. Rendered without the save list,
    which names them all anyway."""
    values = {
        "name": "t",
        "pth_name": hooks.PTH_NAME,
        "depth": 3,
        "flashinfer_archs": ARCHS,
        "torch_archs": "9.0;12.0",
        "max_nvcc_threads": archs.MAX_NVCC_THREADS,
        "env": [],
        "caches": [(c.variable, c.subdir) for c in caches.CACHES],
        "tools": list(caches.TRITON_TOOLS),
        "saved": [],
        **hooks.remote_values(None, True),
    }
    text = templates.templates().get_template(template).render(values)
    assert [v for v in variables.SET_BY_HOOK if v not in text] == []


def test_the_probes_report_the_tables_variables(env: Path, tmp_path: Path) -> None:
    """doctor's and verify's probes run in the env's interpreter and report exactly the
    variables the table gives them, as the hook left them."""
    python = env / "bin" / "python"
    facts, _, _ = doctor.probe(python, deep=False)
    assert facts is not None
    assert tuple(facts.env) == variables.DOCTOR_PROBE
    assert facts.env["TVM_FFI_CUDA_ARCH_LIST"] == ARCHS
    target = verify_mod.Target(python=python, archs=archs.parse_list(ARCHS), work=tmp_path)
    verified = verify_mod.probe(target, jit=False)
    assert tuple(verified.env) == variables.VERIFY_PROBE
    assert verified.env["FLASHINFER_CUDA_ARCH_LIST"] == ARCHS


@pytest.mark.slow
def test_fingerprint_json_of_an_env_holds_its_arch_lists(env: Path, tmp_path: Path) -> None:
    """`cudaenv fingerprint --json` hashes TVM-FFI's arch list with the others, and what it
    writes reads back whole."""
    done = cudaenv("fingerprint", "--python", str(env / "bin" / "python"), "--json", cwd=tmp_path)
    doc = json.loads(done.stdout)
    assert {k: doc["parts"]["variables"][k] for k in variables.ARCH_LISTS} == {
        "FLASHINFER_CUDA_ARCH_LIST": ARCHS,
        "TORCH_CUDA_ARCH_LIST": "9.0;12.0",
        "TVM_FFI_CUDA_ARCH_LIST": ARCHS,
    }
    saved = write(tmp_path / "fp.json", done.stdout)
    read = fingerprint.read(saved)
    assert read.to_json() == doc
    assert read.fingerprint == fingerprint.digest(read.parts)
    same = cudaenv("fingerprint", "--compare", str(saved), str(saved), cwd=tmp_path)
    assert same.stdout.strip() == f"same fingerprint {read.fingerprint}"


def test_a_fingerprint_file_is_read_with_the_key_path_in_its_error(tmp_path: Path) -> None:
    doc = {"schema_version": 1, "python": "x", "fingerprint": "sha256:0",
           "parts": {"python": "3.12.1", "distributions": {}}}  # fmt: skip
    path = write(tmp_path / "fp.json", json.dumps(doc))
    with pytest.raises(ReportError) as raised:
        fingerprint.read(path)
    assert str(raised.value) == f"{path}: fingerprint: in 'parts': missing key 'toolkit'"


def test_the_table_is_consistent() -> None:
    names = [v.name for v in variables.TABLE]
    assert len(names) == len(set(names))
    for v in variables.TABLE:
        assert (v.cache is not None) == (v.kind is Kind.CACHE), v.name
        assert (v.tool is not None) == (v.kind is Kind.TOOL), v.name
        if v.kind in (Kind.CACHE, Kind.TOOL):
            assert v.hook is Hook.SETS, v.name
        # The fingerprint is taken of doctor's facts: a variable it hashes must be reported.
        if v.fingerprint:
            assert v.doctor, v.name
        if v.hook is Hook.SETS:
            assert v.fingerprint, v.name
    assert set(variables.ARCH_LISTS) <= set(variables.SET_BY_HOOK)


def test_jit_stores_nvcc_variables_are_the_tables() -> None:
    """The JIT store (builder/store/) runs inside the env's interpreter and imports nothing
    of cudaenv, so it writes its list out."""
    assert jit_store.NVCC_ENV == variables.NVCC


# --------------------------------------------------------------------------- numeric values

NUMERIC = [v for v in variables.TABLE if v.number is not None]
# What crashed a check or hung a wait: nan passes float(), requests refuses a timeout of 0
# or below, a socket one of inf or 1e300.
NOT_SECONDS = ["nan", "inf", "-inf", "-1", "1e300", "thirty", "30s"]


def test_every_numeric_variable_is_in_the_table() -> None:
    assert {v.name for v in NUMERIC} == {
        "CUDAENV_JIT_STORE_MAX", "CUDAENV_JIT_LOCK_TIMEOUT", "CUDAENV_JIT_REMOTE_TIMEOUT",
        "CUDAENV_PROBE_TIMEOUT", "CUDAENV_HEARTBEAT_SECONDS", "CUDAENV_SOURCE_BUILD_TIMEOUT",
    }  # fmt: skip


@pytest.mark.parametrize("row", NUMERIC, ids=lambda v: v.name)
def test_a_numeric_variable_refuses_what_is_not_its_kind(row: variables.Variable) -> None:
    assert row.number is not None
    if row.number.unit == "size":
        bad, good = ["nan", "inf", "-1", "lots", "1e300G"], ["10G", "500M", "1048576", "0"]
    else:
        bad = [*NOT_SECONDS, *([] if row.number.zero else ["0", "-0"])]
        good = ["30", "0.5", "1000000", *(["0"] if row.number.zero else [])]
    for text in bad:
        with pytest.raises(UsageError) as caught:
            settings.resolve({row.name: text}, strict=True)
        assert str(caught.value).startswith(f"{row.name}={text}: not a "), text
    for text in good:
        settings.resolve({row.name: text}, strict=True)
    settings.resolve({row.name: ""}, strict=True)  # unset: the default


@pytest.mark.parametrize("value", ["0", "-1", "nan", "inf"])
def test_the_cli_refuses_a_bad_number_at_start_up(
    value: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from builder.cli import main as cli

    monkeypatch.setenv("CUDAENV_JIT_REMOTE_TIMEOUT", value)
    assert cli.main(["store", "list"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: CUDAENV_JIT_REMOTE_TIMEOUT={value}: not a number of seconds")
    assert "Traceback" not in err and len(err.splitlines()) == 1


def test_a_lock_wait_of_nan_is_refused_not_endless() -> None:
    """nan compares false with every deadline: the wait for a held lock never ended."""
    for text in ("nan", "inf", "-5"):
        with pytest.raises(jit_store.StoreError, match=f"CUDAENV_JIT_LOCK_TIMEOUT={text}: "):
            jit_store.lock_timeout({"CUDAENV_JIT_LOCK_TIMEOUT": text})
    assert jit_store.lock_timeout({"CUDAENV_JIT_LOCK_TIMEOUT": "0"}) == 0
    with pytest.raises(ValueError, match="not a size"):
        jit_store.parse_size("inf")  # was an OverflowError out of store_max


def test_vllms_own_caches_are_the_envs() -> None:
    """vLLM's torch.compile cache (VLLM_CACHE_ROOT, ~24 s of a cold start) and DeepGEMM's
    (DG_JIT_CACHE_DIR, where sglang does not set it) live in the env's var/ like the rest."""
    rows = {c.variable: c.subdir for c in caches.CACHES}
    assert rows["VLLM_CACHE_ROOT"] == "vllm"
    # One directory for DeepGEMM whoever names it: sglang writes its own value into it.
    assert rows["DG_JIT_CACHE_DIR"] == rows["SGLANG_DG_CACHE_DIR"] == "deep_gemm"
