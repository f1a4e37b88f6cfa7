"""`cudaenv adopt --rebuild`: the installed package kept as a wheel for undo (every file held
to its RECORD hash, nothing outside site-packages), the journal's record of it, the
refusals before anything compiles, and the `--build-env` argument."""

from __future__ import annotations

import base64
import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from builder.adopt import journal as adopt_journal
from builder.adopt import rebuild
from builder.adopt import saved as saving
from builder.core.errors import BuildError, UsageError
from builder.env import manifest
from tests.helpers import cudaenv, write
from tests.test_adopt import a_journal, an_env

DIST = "cudaenv_testext-0.1.0.dist-info"
SO = "cudaenv_testext/_C.cpython-312-x86_64-linux-gnu.so"


def _hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def installed(site: Path, *, extra_rows: str = "", so: bytes = b"\x7fELF the user's build") -> Path:
    """An installed distribution as an installer leaves it: files, METADATA, WHEEL, RECORD."""
    files = {
        "cudaenv_testext/__init__.py": b"from . import _C\n",
        SO: so,
        f"{DIST}/METADATA": b"Metadata-Version: 2.1\nName: cudaenv-testext\nVersion: 0.1.0\n",
        f"{DIST}/WHEEL": b"Wheel-Version: 1.0\nRoot-Is-Purelib: false\nTag: cp312-cp312-linux_x86_64\n",
        f"{DIST}/INSTALLER": b"uv\n",
    }
    for rel, data in files.items():
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_bytes(data)
    rows = "".join(f"{rel},{_hash(data)},{len(data)}\n" for rel, data in files.items())
    rows += f"{DIST}/RECORD,,\ncudaenv_testext/__pycache__/__init__.cpython-312.pyc,,\n"
    (site / DIST / "RECORD").write_text(rows + extra_rows)
    return site


def test_the_installed_files_are_saved_as_a_wheel_that_undo_can_check(tmp_path: Path) -> None:
    site = installed(tmp_path / "env" / "lib" / "python3.12" / "site-packages")
    kept = saving.save(tmp_path / "env", site, "cudaenv-testext", "0.1.0")
    wheel = tmp_path / "env" / kept.wheel
    assert wheel.name == "cudaenv_testext-0.1.0-cp312-cp312-linux_x86_64.whl"
    assert wheel.parent == tmp_path / "env" / saving.SAVED
    with zipfile.ZipFile(wheel) as zf:
        names = set(zf.namelist())
        record = zf.read(f"{DIST}/RECORD").decode()
    # The installer's own files are not the wheel's; RECORD is written again with hashes.
    assert f"{DIST}/INSTALLER" not in names and SO in names
    assert f"{SO},{_hash((site / SO).read_bytes())}" in record
    assert saving.checked(tmp_path / "env", kept) == wheel
    assert saving.differs(site, wheel) == []
    (site / SO).write_bytes(b"rebuilt")
    assert saving.differs(site, wheel) == [SO]
    wheel.write_bytes(wheel.read_bytes() + b"x")
    with pytest.raises(BuildError, match="differs from the sha256 the adopt journal gives it"):
        saving.checked(tmp_path / "env", kept)
    outside = saving.Saved(kept.name, kept.version, "var/elsewhere.whl", kept.sha256)
    with pytest.raises(BuildError, match="outside var/cudaenv/adopt-saved"):
        saving.checked(tmp_path / "env", outside)


def test_undo_writes_back_where_the_package_came_from_and_the_record_vouches_for_it(
    tmp_path: Path,
) -> None:
    """What `pip freeze` prints after undo is the user's source again, not the saved wheel
    (which undo removes); RECORD's hash of direct_url.json is the written file's."""
    site = installed(tmp_path / "env" / "site")
    users = json.dumps({"url": "file:///home/u/wheels/x.whl", "archive_info": {}})
    (site / DIST / "direct_url.json").write_text(users)
    kept = saving.save(tmp_path / "env", site, "cudaenv-testext", "0.1.0")
    assert kept.origin == users
    # What the reinstall of the saved wheel leaves: its own direct_url.json.
    ours = b'{"url": "file:///env/var/cudaenv/adopt-saved/x.whl", "archive_info": {}}'
    (site / DIST / "direct_url.json").write_bytes(ours)
    rel = f"{DIST}/direct_url.json"
    record = site / DIST / "RECORD"
    record.write_text(record.read_text() + f"{rel},{_hash(ours)},{len(ours)}\n")
    saving.put_back_origin(site, kept)
    assert (site / DIST / "direct_url.json").read_text() == users
    rows = [line.split(",") for line in record.read_text().splitlines()]
    assert [r[1] for r in rows if r[0] == rel] == [_hash(users.encode())]
    assert saving.differs(site, tmp_path / "env" / kept.wheel) == []
    # A package installed with no direct_url.json has none again after undo.
    bare = saving.Saved(kept.name, kept.version, kept.wheel, kept.sha256, "")
    saving.put_back_origin(site, bare)
    assert not (site / DIST / "direct_url.json").exists()
    assert rel not in record.read_text()
    # A hand-edited journal whose note is not a JSON object writes nothing.
    saving.put_back_origin(site, saving.Saved(kept.name, kept.version, kept.wheel, "", "[1]"))
    assert not (site / DIST / "direct_url.json").exists()


def test_a_file_changed_since_install_is_not_saved_as_the_install(tmp_path: Path) -> None:
    site = installed(tmp_path / "site")
    (site / SO).write_bytes(b"edited by hand")
    with pytest.raises(saving.NotSavable, match=r"_C\.cpython-312.*differs from the hash"):
        saving.save(tmp_path, site, "cudaenv-testext", "0.1.0")
    assert not (tmp_path / saving.SAVED).exists() or not any((tmp_path / saving.SAVED).iterdir())


@pytest.mark.parametrize(
    "row", ["../../../bin/testext-tool,,\n", "/etc/passwd,,\n", "linked/evil.py,,\n"]
)
def test_files_outside_site_packages_are_refused(tmp_path: Path, row: str) -> None:
    site = installed(tmp_path / "site", extra_rows=row)
    (tmp_path / "elsewhere").mkdir()
    write(tmp_path / "elsewhere" / "evil.py", "x = 1\n")
    (site / "linked").symlink_to(tmp_path / "elsewhere", target_is_directory=True)
    with pytest.raises(saving.NotSavable, match="which is not a file below"):
        saving.save(tmp_path, site, "cudaenv-testext", "0.1.0")


def test_the_journal_keeps_the_saved_wheel_and_an_older_journal_has_none(tmp_path: Path) -> None:
    row = ("cudaenv-testext", "0.1.0", "var/cudaenv/adopt-saved/x.whl", "ab" * 32, "")
    journal = a_journal(state="done", rebuilt=(row,))
    adopt_journal.write_journal(tmp_path, journal)
    assert adopt_journal.read_journal(tmp_path) == journal
    assert json.loads((tmp_path / adopt_journal.JOURNAL).read_text())["rebuilt"] == [list(row)]
    adopt_journal.write_journal(tmp_path, a_journal(state="done"))
    assert "rebuilt" not in json.loads((tmp_path / adopt_journal.JOURNAL).read_text())
    found = adopt_journal.read_journal(tmp_path)
    assert found is not None and found.rebuilt == ()


def adopted(tmp_path: Path) -> adopt_journal.Env:
    env = an_env(tmp_path, dists={"torch": "2.14.1", "cudaenv-testext": "0.1.0", "six": "1.17.0"})
    installed(env.purelib)
    info = env.purelib / "six-1.17.0.dist-info"
    write(info / "RECORD", f"six.py,,\n{info.name}/RECORD,,\n")
    return env


@pytest.mark.parametrize(
    ("name", "said"),
    [
        ("flash-attn", "flash-attn is not installed there; nothing was changed"),
        ("six", r"six 1\.17\.0 installed no compiled extension \(\.so\)"),
    ],
)
def test_what_cannot_be_rebuilt_is_refused_before_anything_is_saved(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, name: str, said: str
) -> None:
    env = adopted(tmp_path)
    monkeypatch.setattr(manifest, "try_read", lambda _p: _Adopted())
    with pytest.raises(adopt_journal.Refused, match=said):
        rebuild.rebuild(env, a_journal(state="done"), ("cudaenv-testext", name), lambda _: None)
    assert not (env.prefix / saving.SAVED).exists()


class _Adopted:
    spec = manifest.ADOPTED_SPEC


def test_an_env_that_was_not_adopted_is_refused(tmp_path: Path) -> None:
    env = an_env(tmp_path)
    with pytest.raises(adopt_journal.Refused, match="not adopted"):
        rebuild.rebuild(env, a_journal(state="done"), ("torch",), lambda _: None)


def test_names_and_build_env_arguments() -> None:
    assert rebuild.names("Flash_Attn, causal-conv1d,flash-attn,") == ("flash-attn", "causal-conv1d")
    assert rebuild.build_env_arg(["A_B=1", "X=a b;$(c)", "A_B=2"]) == (
        ("A_B", "2"),
        ("X", "a b;$(c)"),
    )
    for bad, said in [
        ("NOEQUALS", "expected KEY=VALUE"),
        ("1X=y", "expected KEY=VALUE"),
        ("CUDA_HOME=/opt/cuda-12.8", "the env's own"),
        ("LD_PRELOAD=/tmp/x.so", "the env's own"),
        ("X=a\nb", "no NUL or line break"),
    ]:
        with pytest.raises(UsageError, match=said):
            rebuild.build_env_arg([bad])


def test_the_command_line_refuses_rebuild_with_undo_and_a_build_env_alone(tmp_path: Path) -> None:
    py = str(tmp_path / "nowhere" / "bin" / "python")
    for args, said in [
        (("--rebuild", "x", "--undo"), "--rebuild and --undo: give one"),
        (("--build-env", "A=1"), "--build-env: only the compiles of --rebuild take variables"),
        (("--rebuild", ","), "--rebuild: name at least one installed package"),
    ]:
        done = cudaenv("adopt", "--python", py, *args, cwd=tmp_path, check=False)
        assert done.returncode == 2, done.stderr
        assert said in done.stderr and "Traceback" not in done.stderr
