"""Source builds without a compile: the recipe table's variables, what is refused before
compiling, the one line a failed build ends in, the store's wheel entries, the spec's
`build-env:` and the manifest's record (the real build: tests/test_sourcebuild_e2e.py)."""

from __future__ import annotations

import base64
import hashlib
import json
import re
from collections.abc import Sequence
from pathlib import Path

import pytest

from builder import store as jit_store
from builder.core.errors import BuildError, SpecError
from builder.env import buildlog, recipes, setuppy, sourcebuild
from builder.env.manifest import Manifest
from builder.machine.archs import Arch
from builder.spec import envspec
from builder.spec.lockmodel import LockedFile, LockedPackage
from tests.helpers import a_manifest, write
from tests.sdist_maker import make_sdist

ARCHS = (Arch.parse("12.0f"), Arch.parse("9.0a"))


def test_flash_attn_is_told_its_archs_its_way_and_to_build_offline() -> None:
    values = recipes.variables(recipes.recipe_for("Flash_Attn"), ARCHS, jobs=2, nvcc_threads=2)
    assert values["FLASH_ATTN_CUDA_ARCHS"] == "120;90"
    assert values["FLASH_ATTENTION_FORCE_BUILD"] == "TRUE"
    assert values["TORCH_CUDA_ARCH_LIST"] == "12.0;9.0"
    assert (values["MAX_JOBS"], values["NVCC_THREADS"]) == ("2", "2")


def test_an_unknown_package_gets_torchs_variables_and_the_specs_build_env_wins() -> None:
    recipe = recipes.recipe_for("my-ext")
    values = recipes.variables(
        recipe, ARCHS, jobs=1, nvcc_threads=1,
        build_env=(("MY_EXT_FORCE_BUILD", "TRUE"), ("TORCH_CUDA_ARCH_LIST", "12.0")),
    )  # fmt: skip
    assert values["MY_EXT_FORCE_BUILD"] == "TRUE"
    assert values["TORCH_CUDA_ARCH_LIST"] == "12.0"
    assert "FLASH_ATTN_CUDA_ARCHS" not in values
    # The parallelism changes no key: the same wheel on a bigger box.
    assert "MAX_JOBS" not in recipes.key_variables(values)


def test_every_row_says_which_setup_py_line_it_follows() -> None:
    assert all(re.match(r"[\w/.-]+\.py: ", r.follows) for r in recipes.RECIPES)
    assert len({r.name for r in recipes.RECIPES}) == len(recipes.RECIPES)


def test_cxx17_against_a_torch_that_needs_cxx20_is_refused_before_compiling() -> None:
    setup = 'import os\ncc_flag = []\nnvcc_flags = ["-O3", "-std=c++17"]\n'
    why = recipes.before_compiling("flash-attn", "2.8.3.post2", setup, "2.14.1")
    assert why is not None and "line 3" in why and "-std=c++17" in why and "C++20" in why
    assert recipes.before_compiling("flash-attn", "2.8.3.post2", setup, "2.12.0") is None
    # A setup.py that names C++20 anywhere may choose between them: not refused.
    both = setup + 'if new: nvcc_flags[-1] = "-std=c++20"\n'
    assert recipes.before_compiling("flash-attn", "2.9", both, "2.14.1") is None


def test_the_sdists_setup_py_is_read_from_the_archive(tmp_path: Path) -> None:
    sdist = make_sdist(tmp_path, extra_nvcc='"-std=c++17"')
    text, members = setuppy.from_sdist(sdist)
    assert "CUDAExtension" in text and '"-std=c++17"' in text
    assert "setup.py" in members and "PKG-INFO" in members
    assert setuppy.from_sdist(write(tmp_path / "x.tar.gz", "not a tar")) == ("", frozenset())


@pytest.mark.parametrize(
    ("log", "said"),
    [
        (
            ["building 'x._C' extension", "[1/2] /env/cuda-home/bin/nvcc -c a.cu",
             "a.cu(3): error: identifier \"foo\" is undefined",
             "error: command '/env/cuda-home/bin/nvcc' failed with exit code 1",
             "ERROR: Failed building wheel for x"],
            'a.cu(3): error: identifier "foo" is undefined',
        ),
        (
            ["nvcc fatal   : Unsupported gpu architecture 'compute_70'", "ERROR: Failed"],
            "nvcc fatal   : Unsupported gpu architecture 'compute_70'",
        ),
        (
            ["Traceback (most recent call last):", "urllib.error.URLError: <urlopen error "
             "[Errno 111] Connection refused>"],
            "the build tried to reach the network",
        ),
        (
            ["Traceback (most recent call last):", "ModuleNotFoundError: No module named 'x'"],
            "ModuleNotFoundError: No module named 'x'",
        ),
        (["RuntimeError: No CUDA GPUs are available"], "the build asked for a GPU"),
    ],
)  # fmt: skip
def test_a_failed_build_is_said_by_its_first_actionable_line(log: list[str], said: str) -> None:
    found = buildlog.first_problem(log)
    assert found is not None and found.startswith(said), found


def test_only_sdist_only_packages_are_compiled() -> None:
    wheel = LockedFile(name="a-1-py3-none-any.whl", url=None, path=None, size=1, sha256="0" * 64)
    sdist = LockedFile(name="b-1.tar.gz", url=None, path=None, size=1, sha256="1" * 64)
    both = LockedPackage(name="a", version="1", wheels=(wheel,), sdist=sdist)
    only = LockedPackage(name="b", version="1", sdist=sdist)
    assert sourcebuild.source_packages([both, only]) == [only]


def entry_doc(name: object) -> dict[str, object]:
    digest = "a" * 64
    return {
        "kind": "wheel",
        "wheel_name": name,
        "files": {"wheel": {"size": 1, "sha256": digest}},
        "inputs": {"@ENV@/torch/version.py": digest},
    }


def test_a_wheel_entry_holds_one_wheel_named_as_a_wheel() -> None:
    jit_store.parse_entry(entry_doc("cudaenv_testext-0.1.0-cp312-cp312-linux_x86_64.whl"))
    for bad in ("../x-1-py3-none-any.whl", "x.whl", ".x-1-py3-none-any.whl", None):
        with pytest.raises(jit_store.EntryError):
            jit_store.parse_entry(entry_doc(bad))


def test_a_stored_wheel_must_be_the_packages_own() -> None:
    pkg = LockedPackage(name="cudaenv-testext", version="0.1.0")
    assert sourcebuild._is_wheel_of("cudaenv_testext-0.1.0-cp312-cp312-linux_x86_64.whl", pkg)
    assert not sourcebuild._is_wheel_of("evil-0.1.0-cp312-cp312-linux_x86_64.whl", pkg)
    assert not sourcebuild._is_wheel_of("cudaenv_testext-0.2.0-cp312-cp312-linux_x86_64.whl", pkg)


GOOD = 'name: t\npython: "3.12"\ncuda: "13.0"\n'


@pytest.mark.parametrize(
    ("line", "problem"),
    [
        ("build-env: {LD_PRELOAD: /tmp/x.so}", "LD_PRELOAD is the env's own"),
        ("build-env: {CUDA_HOME: /usr/local/cuda}", "CUDA_HOME is the env's own"),
        ("build-env: {PYTHONPATH: /tmp}", "PYTHONPATH is the env's own"),
        ("build-env: {UV_INDEX_URL: x}", "UV_INDEX_URL is the env's own"),
        ('build-env: {X: "a\\nb"}', "a value cannot hold a NUL byte or a line break"),
        ("build-env: [X]", "expected a mapping of variables"),
        ("build-env: {1X: y}", "not a valid environment variable name"),
    ],
)
def test_a_hostile_build_env_is_refused_naming_the_key(
    tmp_path: Path, line: str, problem: str
) -> None:
    path = write(tmp_path / "s.yaml", GOOD + line + "\n")
    with pytest.raises(SpecError) as caught:
        envspec.load(path)
    said = str(caught.value)
    assert said.startswith(f"{path}:4:") and problem in said, said
    assert "\n" not in said


def test_build_env_is_read_literally_and_changes_no_fingerprint(tmp_path: Path) -> None:
    plain = envspec.load(write(tmp_path / "a.yaml", GOOD))
    path = write(tmp_path / "b.yaml", GOOD + 'build-env: {FA_FORCE: "$(rm -rf /)", N: 2}\n')
    with_env = envspec.load(path)
    assert with_env.build_env == (("FA_FORCE", "$(rm -rf /)"), ("N", "2"))
    assert with_env.fingerprint() == plain.fingerprint()


def test_the_manifest_keeps_what_was_built_from_source() -> None:
    made = a_manifest(source_builds=(("x", "1", "a" * 64, "b" * 64),), build_env=(("K", "v"),))
    doc = made.to_json()
    assert Manifest.from_json(json.loads(json.dumps(doc)), "m") == made
    assert "source_builds" not in a_manifest().to_json()


def test_the_heartbeat_says_ninjas_step_and_an_estimate_that_falls_as_it_waits() -> None:
    said: list[str] = []
    now = [100.0]
    watch = buildlog.Watch("x 1", said.append, clock=lambda: now[0])
    assert watch.said().startswith("x 1: compiling, 0s so far") and "ninja" not in watch.said()
    now[0] += 90
    watch.line("[3/4] /env/cuda-home/bin/nvcc -c a.cu")  # 3 steps in 90 s: 30 s a step
    assert watch.said().endswith("ninja [3/4], about 30s left")
    now[0] += 20
    watch.line("[3/4] again")  # the same step said again moves nothing
    assert watch.said().endswith("ninja [3/4], about 10s left")
    now[0] += 40  # the last step takes longer than the others did: no estimate that grows
    assert watch.said().endswith("ninja [3/4], the last 1 step(s) taking longer than the others")
    watch.line("[4/4] c++ -shared a.o -o x.so")
    assert watch.said() == "x 1: compiling, 2m30s so far, ninja [4/4]"


@pytest.mark.parametrize("stored", [True, False])
def test_the_lock_is_proven_before_anything_runs_in_the_env_and_once_on_a_store_hit(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, stored: bool
) -> None:
    """A store hit runs nothing of the package in the env, so the build proves the lock's
    wheels as the placed wheel installs, or with it after (tests below; installproof.Proof):
    each RECORD read once; a miss proves the lock before the sdist's setup.py (which imports
    torch) runs."""
    sdist = LockedFile(name="b-1.tar.gz", url=None, path=None, size=1, sha256="1" * 64)
    pkg = LockedPackage(name="b", version="1", sdist=sdist)
    said: list[str] = []
    wheel = write(tmp_path / "b-1-py3-none-any.whl", "w")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    monkeypatch.setattr(sourcebuild, "key", lambda *a, **k: "k" * 64)
    monkeypatch.setattr(sourcebuild, "values_for", lambda *a, **k: {})
    monkeypatch.setattr(
        sourcebuild,
        "_from_tiers",
        lambda *a, **k: (
            ((wheel, tmp_path / "entry", "e" * 64), "the store") if stored else (None, "")
        ),
    )

    def compile_(*_a: object, **_k: object) -> Path:
        said.append("compile")
        return wheel

    monkeypatch.setattr(sourcebuild, "_compile", compile_)
    monkeypatch.setattr(sourcebuild, "_publish", lambda *a, **k: None)
    monkeypatch.setattr(sourcebuild, "_install", lambda *a, **k: said.append("install"))
    spec = envspec.load(tmp_path / "t.yaml", GOOD)
    made = sourcebuild.build_all(
        tmp_path / "env", spec, None, [pkg], nvcc="13.0", target=tmp_path / "env",  # type: ignore[arg-type]
        progress=said.append, before_running=lambda: said.append("prove the lock"),
    )  # fmt: skip
    assert made[0].reused is stored
    # A placed wheel's sha256 is its entry's record (checked as it was placed), not read again.
    assert (made[0].sha256 == "e" * 64) is stored
    if stored:
        assert said == ["b 1: taken from the store (built once for this key)", "install"]
    else:
        assert said == ["prove the lock", "compile", "install"]


def _toolkit_wheel(site: Path, content: bytes, recorded: bytes) -> Path:
    """An NVIDIA wheel's nvcc installed below ``site`` holding ``content``, its RECORD row
    stating ``recorded``'s sha256 and size; cuda-home/bin/nvcc a hard link of it."""
    nvcc = site / "nvidia" / "cu13" / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_bytes(content)
    digest = base64.urlsafe_b64encode(hashlib.sha256(recorded).digest()).rstrip(b"=").decode()
    write(
        site / "nvidia_cuda_nvcc-13.0.88.dist-info" / "RECORD",
        f"nvidia/cu13/bin/nvcc,sha256={digest},{len(recorded)}\n"
        "nvidia_cuda_nvcc-13.0.88.dist-info/RECORD,,\n",
    )
    home = site.parent.parent.parent / "cuda-home" / "bin"
    home.mkdir(parents=True)
    (home / "nvcc").hardlink_to(nvcc)
    return home.parent


class _Counting(jit_store.Hasher):
    def __init__(self) -> None:
        super().__init__(None)
        self.read: list[str] = []

    def sha256(self, path: str | Path, limit: int | None = None) -> str | None:
        self.read.append(Path(path).name)
        return super().sha256(path, limit)


@pytest.mark.parametrize("recorded", [b"nvcc 13.0", b"nvcc 13.0 and more"])
def test_a_key_takes_the_toolkits_binaries_as_their_wheels_record_states_them(
    tmp_path: Path, recorded: bytes
) -> None:
    """A node's first build reads no toolkit binary for its key (~190 MB) where the wheel's
    RECORD, which the lock's hash vouches for, states it at the size on disk; a file of
    another size than its row is hashed."""
    site = tmp_path / "env" / "lib" / "python3.12" / "site-packages"
    home = _toolkit_wheel(site, b"nvcc 13.0", recorded)
    hasher = _Counting()
    rows = jit_store.RecordedTools.in_env(tmp_path / "env")
    said = jit_store.tool_identities(hasher, str(home), (), {}, rows)
    assert said["bin/nvcc"] == hashlib.sha256(b"nvcc 13.0").hexdigest()
    assert ("nvcc" in hasher.read) is (recorded != b"nvcc 13.0")


def test_a_wheel_built_by_a_toolkit_its_record_misstates_is_not_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """nvcc changed in place after uv unpacked it (same size, other bytes): the lookup's key
    names the toolkit the RECORD states, so what this one builds is installed here but never
    kept in the store under that key."""
    env = tmp_path / "env"
    site = env / "lib" / "python3.12" / "site-packages"
    _toolkit_wheel(site, b"nvcc 13.1", b"nvcc 13.0")
    sdist = LockedFile(name="b-1.tar.gz", url=None, path=None, size=1, sha256="1" * 64)
    pkg = LockedPackage(name="b", version="1", sdist=sdist)
    wheel = write(tmp_path / "b-1-py3-none-any.whl", "w")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    monkeypatch.setattr(sourcebuild, "values_for", lambda *a, **k: {})
    monkeypatch.setattr(sourcebuild, "build_environ", lambda *a, **k: {"PATH": ""})
    monkeypatch.setattr(sourcebuild, "_compile", lambda *a, **k: wheel)
    monkeypatch.setattr(sourcebuild, "_install", lambda *a, **k: None)
    published: list[str] = []
    monkeypatch.setattr(sourcebuild, "_publish", lambda _s, k, *a: published.append(k))
    lock = type("L", (), {"packages_on": lambda self, host: ()})()
    said: list[str] = []
    spec = envspec.load(tmp_path / "t.yaml", GOOD)
    made = sourcebuild.build_all(
        env, spec, lock, [pkg], nvcc="13.0", target=env,
        progress=said.append,
    )  # fmt: skip
    assert not made[0].reused and published == []
    assert any("not what their wheels' RECORD says" in line for line in said), said
    # The same toolkit as its RECORD states: kept under the key the lookup used.
    (site / "nvidia" / "cu13" / "bin" / "nvcc").write_bytes(b"nvcc 13.0")
    sourcebuild.build_all(env, spec, lock, [pkg], nvcc="13.0", target=env,
                          progress=said.append)  # fmt: skip
    assert published == [made[0].key]


def test_a_built_wheel_that_is_a_link_is_refused_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The wheel a build left is read for the manifest's sha256 without following a link."""
    sdist = LockedFile(name="b-1.tar.gz", url=None, path=None, size=1, sha256="1" * 64)
    pkg = LockedPackage(name="b", version="1", sdist=sdist)
    elsewhere = write(tmp_path / "elsewhere.whl", "w")
    wheel = tmp_path / "b-1-py3-none-any.whl"
    wheel.symlink_to(elsewhere)
    monkeypatch.setenv("CUDAENV_JIT_STORE", "off")
    monkeypatch.setattr(sourcebuild, "key", lambda *a, **k: "k" * 64)
    monkeypatch.setattr(sourcebuild, "values_for", lambda *a, **k: {})
    monkeypatch.setattr(sourcebuild, "_compile", lambda *a, **k: wheel)
    installed: list[object] = []
    monkeypatch.setattr(sourcebuild, "_install", lambda *a, **k: installed.append(a))
    spec = envspec.load(tmp_path / "t.yaml", GOOD)
    with pytest.raises(BuildError, match=r"^b 1: the built wheel: .* is a symbolic link$"):
        sourcebuild.build_all(
            tmp_path / "env", spec, None, [pkg], nvcc="13.0", target=tmp_path / "env",  # type: ignore[arg-type]
            progress=lambda _: None,
        )  # fmt: skip
    assert installed == []


def _wheel(path: Path, files: dict[str, str]) -> Path:
    """A wheel of distribution ``b`` 1 holding ``files`` and its own metadata."""
    import zipfile

    info = "b-1.dist-info"
    files = {
        **files,
        f"{info}/METADATA": "Metadata-Version: 2.1\nName: b\nVersion: 1\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: t\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    rows = []
    for name, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        rows.append(f"{name},sha256={b64},{len(text.encode())}")
    rows.append(f"{info}/RECORD,,")
    with zipfile.ZipFile(path, "w") as archive:
        for name, text in files.items():
            archive.writestr(name, text)
        archive.writestr(f"{info}/RECORD", "\n".join(rows) + "\n")
    return path


def _venv(tmp_path: Path) -> Path:
    import sys

    from builder.core import proc

    env = tmp_path / "env"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(env)],
             env=proc.uv_env())  # fmt: skip
    return env


def _children() -> list[int]:
    """This process's child processes (Linux): an unreaped one is listed until waited for."""
    kids: list[int] = []
    for task in Path("/proc/self/task").iterdir():
        kids += [int(pid) for pid in (task / "children").read_text().split()]
    return kids


B = LockedPackage(name="b", version="1")


@pytest.mark.parametrize(
    ("extra", "adds"),
    [({}, []), ({"b-1.data/purelib/b_more/x.py": ""}, ["b_more"]),
     ({"odd.data/purelib/x.py": ""}, ["odd.data"]),  # a package's own directory, not PEP 427's
     ({"b-1.data/scripts/b-tool": "#!python\n"}, None), ({"already.py": ""}, None),
     ({"b-1.dist-info/entry_points.txt": "[console_scripts]\nb-tool = b:main\n"}, None)],
)  # fmt: skip
def test_a_wheel_from_the_store_installs_while_the_lock_is_proven(
    tmp_path: Path, extra: dict[str, str], adds: list[str] | None
) -> None:
    """uv installs a placed wheel while the lock's RECORDs are read, where the wheel only adds
    entries of its own to site-packages (the proof is told their names); a wheel writing
    into bin/ (.data/scripts, an entry point's script) or into an entry already there is
    installed alone, and proven after."""
    env = _venv(tmp_path)
    site = next(env.glob("lib/python3*/site-packages"))
    (site / "already.py").write_text("")
    wheel = _wheel(tmp_path / "b-1-py3-none-any.whl", {"b/__init__.py": "x = 1\n", **extra})
    seen: list[tuple[list[str], list[int]]] = []
    got = sourcebuild._install_meanwhile(
        env, wheel, B, lambda arriving: seen.append((list(arriving), _children()))
    )
    if adds is not None:
        [(arriving, running)] = seen
        assert arriving == sorted(["b", "b-1.dist-info", *adds]) == list(got)
        assert running, "the install was not running beside the proof"
    else:
        assert seen == [] and got == ()
    assert (site / "b" / "__init__.py").read_text() == "x = 1\n"
    assert (site / "b-1.dist-info" / "RECORD").is_file() and _children() == []


def test_a_failed_install_beside_the_proof_is_one_line_and_a_failed_proof_stops_it(
    tmp_path: Path,
) -> None:
    env = _venv(tmp_path)
    broken = _wheel(tmp_path / "b-1-py3-none-any.whl", {"b/__init__.py": ""})
    wrong = tmp_path / "c-1-py3-none-any.whl"  # the name says c, the metadata b: uv refuses it
    wrong.write_bytes(broken.read_bytes())
    with pytest.raises(BuildError, match=r"^b 1: installing the wheel built from its sdist failed"):
        sourcebuild._install_meanwhile(env, wrong, B, lambda _arriving: None)
    assert _children() == []

    def proof_fails(_arriving: Sequence[str]) -> None:
        raise BuildError("the install is incomplete")

    good = _wheel(tmp_path / "b-1-py3-none-any.whl", {"b/__init__.py": ""})
    with pytest.raises(BuildError, match="the install is incomplete"):
        sourcebuild._install_meanwhile(env, good, B, proof_fails)
    assert _children() == []  # uv was killed and waited for


def test_an_sdist_is_read_by_the_locks_path_once_and_checked_by_its_hash(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """env/sdistcheck.py on real sdists: one that passes -std=c++17 is refused against torch
    2.14 from its setup.py, read by the lock's relative path with its sha256 checked; the
    second look reads the cache, not the file; a file whose hash is not the lock's, or that
    cannot be fetched, is not judged (the build judges it) and is said."""
    from builder.env import sdistcheck

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.delenv("CUDAENV_CACHE_DIR", raising=False)
    sdist = make_sdist(tmp_path / "links", version="0.2.0", extra_nvcc='"-std=c++17"')
    digest = hashlib.sha256(sdist.read_bytes()).hexdigest()

    def package(sha: str, path: str) -> LockedPackage:
        return LockedPackage(name="cudaenv-testext", version="0.2.0",
                             sdist=LockedFile(name=sdist.name, sha256=sha, path=path))  # fmt: skip

    said: list[str] = []

    def refusal(pkg: LockedPackage) -> str | None:
        return sdistcheck.refusal([pkg], torch="2.14.1", nvcc="13.0", lock_dir=tmp_path,
                                  say=said.append)  # fmt: skip

    good = package(digest, f"links/{sdist.name}")
    why = refusal(good)
    assert why is not None and "passes -std=c++17" in why and "line 9" in why
    sdist.rename(sdist.with_suffix(".moved"))  # the cache answers now
    assert refusal(good) == why
    assert said == []
    assert refusal(package("0" * 64, f"links/{sdist.name}")) is None  # not cached, not there
    assert len(said) == 1 and "its sdist was not read before installing" in said[0]
    sdist.with_suffix(".moved").rename(sdist)
    assert refusal(package("1" * 64, f"links/{sdist.name}")) is None
    assert "its sha256 is not the lock's" in said[-1]
