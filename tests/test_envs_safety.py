"""`cudaenv remove`, `run` and `list` on what is really on disk: they take env names in the
project's envs dir and nothing else, never follow a link out of it, say why a command cannot
run as a shell does, print names that cannot forge output, and find the project root from
any directory below it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from builder.core import paths, proc
from builder.env import manifest
from tests.helpers import a_manifest, cudaenv, workspace, write


def one_error_line(done: subprocess.CompletedProcess[str]) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    lines = [ln for ln in done.stderr.strip().splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, done.stderr
    return lines[0]


def project(tmp_path: Path) -> Path:
    """A project root (it has envspecs/) with an empty .envs/."""
    root = tmp_path / "proj"
    (root / "envspecs").mkdir(parents=True)
    (root / ".envs").mkdir()
    return root


def an_env(env_dir: Path) -> Path:
    """A directory with a manifest cudaenv reads (no interpreter: enough for list/remove)."""
    env_dir.mkdir(parents=True)
    write(env_dir / "lib" / "payload.txt", "x" * 5000)
    manifest.write(a_manifest(name=env_dir.name, spec="gone.yaml", path=str(env_dir)), env_dir)
    return env_dir


def a_venv_env(env_dir: Path) -> Path:
    """A real venv (bin/python) with a manifest: what `run` needs."""
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(env_dir)])
    manifest.write(a_manifest(name=env_dir.name, spec="gone.yaml", path=str(env_dir)), env_dir)
    return env_dir


def not_an_env(directory: Path, marker: Path) -> Path:
    """A directory that merely holds a file named cudaenv.json, and a bin/python that would
    leave ``marker`` if anything ran it."""
    write(directory / "cudaenv.json", "not json at all")
    write(directory / "data" / "precious.txt", "keep me")
    python = write(directory / "bin" / "python", f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    return directory


@pytest.mark.parametrize(
    ("where", "arg"),
    [
        ("root", "ABS"),  # /abs/path/x
        ("root", "../x"),
        ("root", ".envs/../../x"),
        ("x", "."),  # (cd x; cudaenv remove .)
        ("root", ".matrix"),  # cudaenv's own, hidden
        ("root", "junk"),  # .envs/junk holds a cudaenv.json that is not a manifest
    ],
)
def test_remove_and_run_take_only_the_names_of_envs_in_the_envs_dir(
    where: str, arg: str, tmp_path: Path
) -> None:
    root = project(tmp_path)
    marker = tmp_path / "ran"
    outside = not_an_env(tmp_path / "x", marker)
    junk = not_an_env(root / ".envs" / "junk", marker)
    matrix = not_an_env(root / ".envs" / ".matrix", marker)
    arg = str(outside) if arg == "ABS" else arg
    cwd = outside if where == "x" else root
    for argv in (["remove", arg], ["run", arg, "--", "true"]):
        done = cudaenv(*argv, cwd=cwd, check=False)
        assert done.returncode == 2, (argv, done.stderr)
        assert one_error_line(done).startswith(f"error: {arg}: "), done.stderr
    for kept in (outside, junk, matrix):
        assert (kept / "data" / "precious.txt").read_text() == "keep me"
    assert not marker.exists()


def test_remove_deletes_the_env_its_lock_file_and_what_killed_builds_left(
    tmp_path: Path,
) -> None:
    root = project(tmp_path)
    envs = root / ".envs"
    env = an_env(envs / "demo")
    other = an_env(envs / "demo.old-7")  # another env whose name looks like a leftover
    write(envs / ".demo.old-123" / "f", "half deleted")
    write(envs / ".demo.tmp-123-abc_12" / "f", "half built")
    write(envs / ".demo.lock", "")  # what its build left
    write(envs / ".demo.old-7.lock", "")  # the other env's lock
    done = cudaenv("remove", "demo", cwd=root)
    assert done.stderr.strip() == f"cudaenv: removed {env}"
    assert not env.exists()
    assert sorted(p.name for p in envs.iterdir()) == [".demo.old-7.lock", "demo.old-7"]
    assert manifest.exists(other)


@pytest.mark.slow
def test_remove_of_a_linked_env_removes_the_link_not_what_it_points_to(tmp_path: Path) -> None:
    """`.envs/NAME` may be a link to an env elsewhere (another project's, a shared disk): that
    target was not made by this project's build, so `remove` deletes the link only, as `rm`
    of a link does, and leaves no .NAME.old-PID link or .NAME.lock behind."""
    root = project(tmp_path)
    target = an_env(tmp_path / "shared" / "linked")
    link = root / ".envs" / "linked"
    link.symlink_to(target)
    listed = json.loads(cudaenv("list", "--json", cwd=root).stdout)
    assert [e["name"] for e in listed] == ["linked"]
    done = cudaenv("remove", "linked", cwd=root)
    assert done.stderr.strip() == (
        f"cudaenv: removed the link {link} (what it points to, {target}, is left)"
    )
    assert not link.is_symlink() and not link.exists()
    assert manifest.exists(target) and (target / "lib" / "payload.txt").exists()
    assert list((root / ".envs").iterdir()) == []


@pytest.mark.slow
def test_run_never_starts_an_env_a_link_points_to_outside_the_envs_dir(tmp_path: Path) -> None:
    """A checkout can carry `.envs/NAME` as a link to a directory anywhere, with a manifest
    and a bin/python of its author's: `run NAME` started that interpreter. A link to an env
    in the same envs dir is that env."""
    root = project(tmp_path)
    marker = tmp_path / "ran"
    elsewhere = an_env(tmp_path / "elsewhere" / "evil")
    python = write(elsewhere / "bin" / "python", f"#!/bin/sh\ntouch {marker}\n")
    python.chmod(0o755)
    (root / ".envs" / "evil").symlink_to(elsewhere)
    done = cudaenv("run", "evil", "--", "true", cwd=root, check=False)
    assert done.returncode == 2
    assert one_error_line(done) == (
        f"error: evil: {root / '.envs' / 'evil'} is a link to {elsewhere}, outside "
        f"{root / '.envs'}: `cudaenv run` starts only envs that are there (run "
        f"{elsewhere / 'bin' / 'python'} yourself if you trust it)"
    )
    assert not marker.exists()
    a_venv_env(root / ".envs" / "real")
    (root / ".envs" / "alias").symlink_to("real")
    ok = cudaenv("run", "alias", "--", "sh", "-c", "echo ok", cwd=root)
    assert ok.stdout.strip() == "ok"


def test_remove_checks_every_name_before_deleting_any(tmp_path: Path) -> None:
    root = project(tmp_path)
    env = an_env(root / ".envs" / "demo")
    done = cudaenv("remove", "demo", "/etc", cwd=root, check=False)
    assert done.returncode == 2
    assert manifest.exists(env)
    assert one_error_line(done).startswith("error: /etc: not an env name")


@pytest.mark.slow
def test_run_says_which_command_is_missing_or_not_runnable_as_a_shell_does(
    tmp_path: Path,
) -> None:
    root = project(tmp_path)
    a_venv_env(root / ".envs" / "demo")
    script = write(root / "script.sh", "#!/bin/sh\necho hi\n")  # not executable
    cases = [
        (["nosuchcmd", "arg"], 127, "error: nosuchcmd: command not found"),
        ([str(root / "nothere")], 127, f"error: {root / 'nothere'}: No such file or directory"),
        ([str(script)], 126, f"error: {script}: Permission denied"),
        ([str(root)], 126, f"error: {root}: Permission denied"),  # a directory
    ]
    for command, code, line in cases:
        done = cudaenv("run", "demo", "--", *command, cwd=root, check=False)
        assert (done.returncode, done.stderr.strip()) == (code, line), done.stderr
    ok = cudaenv("run", "demo", "--", "sh", "-c", "echo $VIRTUAL_ENV", cwd=root)
    assert ok.stdout.strip() == str(root / ".envs" / "demo")


def test_list_escapes_names_for_the_terminal_and_writes_valid_json(tmp_path: Path) -> None:
    root = project(tmp_path)
    envs = root / ".envs"
    an_env(envs / "plain")
    an_env(envs / "evil\nforged  spec x  lock up to date")
    bad = Path(os.fsdecode(os.fsencode(envs) + b"/bad\xff"))  # not UTF-8
    bad.mkdir()
    write(bad / "cudaenv.json", (envs / "plain" / "cudaenv.json").read_text())
    text = cudaenv("list", cwd=root).stdout.splitlines()
    assert text[0] == f"# envs in {envs} (project root {root})"
    assert len(text) == 4  # the header and one line per env: none forged
    assert text[1].startswith("'bad\\xff'  spec gone.yaml  lock ")
    assert text[2].startswith("'evil\\nforged  spec x  lock up to date'  spec gone.yaml  lock ")
    assert text[3].startswith("plain  spec gone.yaml  lock ")
    # JSON: strict UTF-8, no lone surrogates; an undecodable byte is the text \xNN, as
    # Python's backslashreplace writes it.
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", "list", "--json"],
        cwd=root,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parent.parent)},
        capture_output=True,
        check=True,
    )
    listed = json.loads(done.stdout.decode("utf-8", errors="strict"))
    assert [e["name"] for e in listed] == [
        "bad\\xff",
        "evil\nforged  spec x  lock up to date",
        "plain",
    ]
    for e in listed:
        e["path"].encode("utf-8")  # raises on a lone surrogate
    assert listed[0]["path"] == f"{envs}/bad\\xff"


@pytest.mark.slow
def test_the_project_root_is_found_from_below_it(tmp_path: Path) -> None:
    """Run from envspecs/ or any directory below the root, cudaenv uses the root's .envs/ and
    says which root it took."""
    ws = workspace(tmp_path, "default.yaml")
    env = an_env(ws / ".envs" / "demo")
    deeper = ws / "src" / "pkg" / "deeper"
    deeper.mkdir(parents=True)
    # Built from the root: its spec path is relative to the root, and read from there.
    built = ws / ".envs" / "from-spec"
    built.mkdir()
    manifest.write(a_manifest(name="x", spec="envspecs/default.yaml", path=str(built)), built)
    for cwd in (ws, ws / "envspecs", deeper):
        listed = cudaenv("list", cwd=cwd).stdout.splitlines()
        assert listed[0] == f"# envs in {ws / '.envs'} (project root {ws})"
        assert listed[1].startswith("demo  spec gone.yaml  lock no spec file  ")
        assert listed[2].startswith(
            "from-spec  spec envspecs/default.yaml  lock stale: "
            f"{ws / 'envspecs' / 'default.yaml'} changed since the build  "
        )
    assert not (ws / "envspecs" / ".envs").exists() and not (deeper / ".envs").exists()
    # The spec's env is looked for in the root's .envs/, not envspecs/.envs/.
    done = cudaenv("verify", "default.yaml", cwd=ws / "envspecs", check=False)
    assert one_error_line(done) == (
        f"error: {ws / '.envs' / 'sglang-0.5.23-cu130'} is not built; run "
        "`cudaenv build default.yaml` first"
    )
    assert f"cudaenv: project root {ws} (envs in {ws / '.envs'})" in done.stderr.splitlines()
    cudaenv("remove", "demo", cwd=deeper)
    assert not env.exists()


def test_what_marks_a_project_root(tmp_path: Path) -> None:
    declared = tmp_path / "declared"
    write(declared / "pyproject.toml", '[project]\nname = "x"\n\n[tool.cudaenv]\n')
    (declared / "a" / "b").mkdir(parents=True)
    assert paths.project_root(declared / "a" / "b") == declared
    assert paths.envs_dir(declared / "a") == declared / ".envs"
    # A pyproject.toml without [tool.cudaenv] (or not TOML at all) marks nothing: the one
    # above it decides.
    write(declared / "a" / "pyproject.toml", '[project]\nname = "inner"\n')
    write(declared / "a" / "b" / "pyproject.toml", "not = [toml\n")
    assert paths.project_root(declared / "a" / "b") == declared
    (declared / "a" / "envspecs").mkdir()
    assert paths.project_root(declared / "a" / "b") == declared / "a"


def test_outside_any_project_the_current_directory_is_used(tmp_path: Path) -> None:
    if paths.project_root(tmp_path) is not None:
        pytest.skip(f"{tmp_path} lies inside a project ({paths.project_root(tmp_path)})")
    an_env(tmp_path / ".envs" / "demo")
    listed = cudaenv("list", cwd=tmp_path).stdout.splitlines()
    assert listed[0].startswith(f"# envs in {tmp_path / '.envs'} (no project root")
    assert listed[1].startswith("demo  ")


def test_a_build_waiting_on_a_removed_lock_file_takes_the_one_at_the_path(tmp_path: Path) -> None:
    """`remove` deletes .NAME.lock while holding it. A build that was waiting got the deleted
    file's lock; it must take the lock of the file now at the path, or a third process (which
    opens the path) would build the same env at the same time."""
    import fcntl
    import threading

    from builder.env import place

    target = tmp_path / ".envs" / "demo"
    lock_file = tmp_path / ".envs" / ".demo.lock"
    held, waiting, waiter_has_it, finish = (threading.Event() for _ in range(4))

    def remover() -> None:
        with place.env_lock(target, lambda _msg: None):
            held.set()
            waiting.wait(10)
            lock_file.unlink()  # as envs.remove does, still holding it

    def waiter() -> None:
        # env_lock says "waiting for ..." just before it blocks on the file it opened.
        with place.env_lock(target, lambda _msg: waiting.set()):
            waiter_has_it.set()
            finish.wait(10)

    first = threading.Thread(target=remover)
    first.start()
    assert held.wait(10)
    second = threading.Thread(target=waiter)
    second.start()
    first.join(10)
    assert waiter_has_it.wait(10)
    try:
        # A newcomer opens the path: it must find the waiter holding it.
        with lock_file.open("a+") as fh, pytest.raises(BlockingIOError):
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        finish.set()
        second.join(10)
