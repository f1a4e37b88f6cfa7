"""The JIT store as a package (builder/store/): standard library only and importable by the env
probe inside a foreign interpreter with nothing else of cudaenv; the one flock with a deadline
that the store's key lock and build's env lock share."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from builder.core import proc
from builder.core.errors import EnvBusy, ToolMissing
from builder.env import place
from builder.machine import interpreters
from builder.store import locking

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parent.parent
STORE = ROOT / "builder" / "store"
PROBE = ROOT / "builder" / "probe"
# The oldest Python the probes run on: the store is written for it.
OLDEST = (3, 9)


def foreign_imports(path: Path) -> list[str]:
    """Each import in ``path`` (at any depth: lazy and TYPE_CHECKING ones too) that is neither
    the standard library nor a relative import within the package, as ``LINE: what``."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        elif isinstance(node, ast.ImportFrom):
            # `from . import x` stays in the package; `from .. import x` leaves it (builder).
            names = [] if node.level == 1 else ["." * node.level + (node.module or "")]
        else:
            continue
        # builder.store.x by its absolute name would import builder (not the standard
        # library) and fails in the probe, which imports the package under a name of its own.
        found += [
            f"{node.lineno}: {n}" for n in names if n.split(".")[0] not in sys.stdlib_module_names
        ]
    return found


def test_the_store_imports_only_the_standard_library() -> None:
    modules = sorted(STORE.glob("*.py"))
    assert {p.stem for p in modules} >= {"__init__", "store", "trust", "locking", "ninja_files"}
    found = {p.name: foreign_imports(p) for p in modules}
    assert {name: lines for name, lines in found.items() if lines} == {}


def test_the_store_is_written_in_the_oldest_python_the_probes_run_on() -> None:
    for path in [*STORE.glob("*.py"), PROBE / "env_facts.py"]:
        ast.parse(path.read_text(), str(path), feature_version=OLDEST)
        assert len(path.read_text().splitlines()) < 800, path


def test_every_package_of_builder_ships() -> None:
    """pyproject's package list is written out: builder.store (every package of builder/)
    is in it, or an installed cudaenv would lack its store."""
    shipped = set(
        tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    )
    packages = {
        ".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "builder").rglob("__init__.py")
    }
    assert "builder.store" in packages
    assert packages - shipped == set()


def test_a_foreign_import_is_caught(tmp_path: Path) -> None:
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import json\n"
        "from . import trust\n"
        "from .entries import Entry\n"
        "import yaml\n"
        "from builder.store import trust\n"
        "from .. import paths\n"
        "def lazy():\n"
        "    from builder import proc\n"
    )
    assert foreign_imports(bad) == ["4: yaml", "5: builder.store", "6: ..", "8: builder"]
    with pytest.raises(SyntaxError):
        ast.parse("match x:\n    case 1:\n        pass\n", feature_version=OLDEST)


# What the env's interpreter runs: the probe imported as running it by path imports it (its
# directory first on sys.path), then the store it brings used for real. It prints what it
# imported from where.
DRIVER = """\
import json, os, sys, tempfile
from pathlib import Path
probe, builder_dir = sys.argv[1], sys.argv[2]
sys.path.insert(0, probe)
import env_facts
store = env_facts.jit_store
work = tempfile.mkdtemp()
env = os.path.join(work, "env")
os.makedirs(os.path.join(env, "include"))
header = os.path.join(env, "include", "cub.cuh")
with open(header, "w") as fh:
    fh.write("// a header\\n")
built = os.path.join(work, "kernel.so")
with open(built, "wb") as fh:
    fh.write(b"kernel")
s = store.Store(os.path.join(work, "store"))
key = store.key_of({"kind": "topk_topp", "source": "x"})
lock = s.acquire(key, timeout=5)
path = s.publish(key, {"kernel": built}, [store.normalise(header, [env])],
                 {"kind": "topk_topp"}, env)
lock.release()
found = s.find(key, env)
s.place(found, "kernel", Path(work, "placed.so"))
deps = Path(work, ".ninja_deps")
store.write_deps(deps, [("a.o", 5, ["a.cu", "b.h"])])
ours = [
    name for name, module in sys.modules.items()
    if (getattr(module, "__file__", None) or "").startswith(builder_dir)
]
print(json.dumps({
    "version": list(sys.version_info[:2]),
    "store": store.__name__,
    "store_file": store.__file__,
    "ours": sorted(ours),
    "builder": sorted(m for m in sys.modules if m == "builder" or m.startswith("builder.")),
    "published": os.path.relpath(path, s.root),
    "placed": open(os.path.join(work, "placed.so"), "rb").read().decode(),
    "deps": store.read_deps(deps),
    "hashes": [store.command_hash("cc -c a.cu", h) for h in sorted(store.LOG_HASHES)],
    "path": sys.path,
}))
"""


def other_python() -> str:
    """The oldest Python from 3.9 up to this one's on this machine, without a download (uv's
    discovery, PATH, pyenv, conda: :mod:`builder.machine.interpreters`); this one when none is."""
    for minor in range(OLDEST[1], sys.version_info[1]):
        try:
            return str(interpreters.find(f"3.{minor}", allow_download=False).path)
        except ToolMissing:
            continue
    return sys.executable


@pytest.mark.slow
def test_the_probe_imports_the_store_in_a_foreign_interpreter(tmp_path: Path) -> None:
    """A real ``uv venv`` of another Python, nothing of cudaenv on its path: the probe imports
    the store from its directory, and nothing else of builder comes with it."""
    venv = tmp_path / "venv"
    python = other_python()
    proc.run([proc.uv_bin(), "venv", "--no-python-downloads", "--python", python, venv])
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "VIRTUAL_ENV"))}
    done = subprocess.run(
        [venv / "bin" / "python", driver, PROBE, str(ROOT / "builder")],
        capture_output=True,
        text=True,
        env=env,
        cwd=tmp_path,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    facts = json.loads(done.stdout)
    assert facts["store"] == "cudaenv_store"
    assert facts["store_file"] == str(STORE / "__init__.py")
    assert facts["builder"] == []
    # Only the probes and the store: every module of builder that was imported lies in them.
    modules = set(facts["ours"])
    assert {m for m in modules if not m.startswith("cudaenv_store")} == {
        "env_facts",
        "doctor_probe",
        "flashinfer_light",
    }
    assert "cudaenv_store.store" in modules and "cudaenv_store.locking" in modules
    assert str(ROOT) not in facts["path"] and str(STORE) not in facts["path"]
    assert not any(p.startswith(sys.prefix + os.sep) for p in facts["path"])
    assert facts["published"].startswith("v3/") and facts["placed"] == "kernel"
    assert facts["deps"] == {"a.o": [5, ["a.cu", "b.h"]]}
    from builder.store import LOG_HASHES, command_hash

    assert facts["hashes"] == [command_hash("cc -c a.cu", h) for h in sorted(LOG_HASHES)]
    if python != sys.executable:
        assert tuple(facts["version"]) < sys.version_info[:2]


# --------------------------------------------------------------------------- flock with a deadline


def held(path: Path, seconds: float) -> subprocess.Popen[str]:
    """A real second process holding an exclusive flock on ``path`` for ``seconds``."""
    code = textwrap.dedent(
        f"""
        import fcntl, os, sys, time
        fd = os.open({str(path)!r}, os.O_RDWR | os.O_CREAT)
        fcntl.flock(fd, fcntl.LOCK_EX)
        print("held", flush=True)
        time.sleep({seconds})
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "held"
    return child


@pytest.mark.slow
def test_flock_within_gives_up_at_its_deadline_and_takes_a_freed_lock(tmp_path: Path) -> None:
    path = tmp_path / "x.lock"
    child = held(path, 1.5)
    fd = os.open(path, os.O_RDWR)
    try:
        started = time.monotonic()
        assert locking.flock_within(fd, 0) is False
        assert time.monotonic() - started < 0.2
        started = time.monotonic()
        assert locking.flock_within(fd, 0.4) is False
        assert 0.4 <= time.monotonic() - started < 1.2
        # Taken once the holder lets go (1.5 s after it took it), long before the deadline.
        assert locking.flock_within(fd, 10) is True
        assert child.wait(timeout=10) == 0
        assert time.monotonic() - started < 3
    finally:
        os.close(fd)
        child.kill()
        child.wait(timeout=10)


@pytest.mark.slow
def test_builds_env_lock_waits_through_the_same_helper(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """place.env_lock with a wait gives up through locking.flock_within: EnvBusy naming the
    holder once the helper says the deadline passed."""
    target = tmp_path / "env"
    lock_file = tmp_path / ".env.lock"
    lock_file.write_text("cudaenv build pid 1")
    child = held(lock_file, 30)
    asked: list[float] = []

    def spy(fd: int, wait: float) -> bool:
        asked.append(wait)
        return locking.flock_within(fd, wait)

    monkeypatch.setattr(place, "flock_within", spy)
    try:
        with (
            pytest.raises(EnvBusy, match=r"cudaenv build pid 1 holds its lock .* 0.3 s"),
            place.env_lock(target, lambda _m: None, wait=0.3),
        ):
            pass
    finally:
        child.kill()
        child.wait(timeout=10)
    assert asked == [0.3]
