"""Plain helpers shared by the test modules: import them from here, never from conftest.py
(pytest's to load, not ours) or from another test module."""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import datetime as dt
import functools
import hashlib
import http.server
import io
import json
import os
import shutil
import subprocess
import sys
import threading
import zipfile
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from packaging.utils import canonicalize_name
from packaging.version import Version

from builder.core import proc
from builder.env.manifest import Manifest
from builder.machine import archs
from builder.spec import envspec as spec
from builder.spec import lock, project
from builder.verify.model import EnvFacts, JitBuild

REPO = Path(__file__).resolve().parent.parent
# A child started with this PYTHONPATH holds at the fault point CUDAENV_FAULT_PAUSE names
# (tests/faults/sitecustomize.py); cudaenv itself reads neither variable.
FAULTS_PYTHONPATH = os.pathsep.join((str(REPO), str(REPO / "tests" / "faults")))
ENVSPECS = REPO / "envspecs"


@functools.cache
def index_view() -> str:
    """The one fixed index view every test that resolves against the package index runs with
    (CUDAENV_EXCLUDE_NEWER, set by conftest.py): the newest view of the committed locks, so a
    release published after them changes no test's answer."""
    views = [lock.read(p).view().at for p in sorted((ENVSPECS / "locks").glob("pylock.*.toml"))]
    return max(v for v in views if v is not None)


def links_only(root: Path, links: Path) -> dict[str, str]:
    """The uv variables that make ``links`` (a find-links directory) the only place uv finds a
    package: the default index an empty directory (a PEP 503 index of nothing). uv 0.13 reads
    no UV_NO_INDEX, so that variable alone left the real index in play."""
    empty = root / "no-index"
    empty.mkdir(parents=True, exist_ok=True)
    return {"UV_DEFAULT_INDEX": empty.as_uri(), "UV_FIND_LINKS": str(links)}


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def program(path: Path, body: str) -> Path:
    """An executable shell script at ``path`` (a fake nvidia-smi, nvcc, ...)."""
    write(path, "#!/bin/sh\n" + body)
    path.chmod(0o755)
    return path


def cudaenv(
    *args: str,
    cwd: Path,
    env: dict[str, str] | None = None,
    check: bool = True,
    timeout: float | None = None,
) -> subprocess.CompletedProcess[str]:
    """The CLI in a child process, on this checkout's sources (``timeout``: seconds before it
    is killed and the test fails)."""
    done = subprocess.run(
        [sys.executable, "-m", "builder.cli", *args],
        cwd=cwd,
        env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})},
        capture_output=True,
        text=True,
        check=False,
        timeout=timeout,
    )
    if check and done.returncode != 0:
        raise AssertionError(f"cudaenv {' '.join(args)} -> {done.returncode}\n{done.stderr}")
    return done


def doctor_findings(python: Path, cwd: Path, env: dict[str, str] | None = None) -> list[Any]:
    """`cudaenv doctor --python PYTHON --json`, its findings as the doctor's own Finding
    values (whose ``commands()`` are what a user copies from the fix)."""
    from builder.doctor.facts import Finding

    done = cudaenv("doctor", "--python", str(python), "--json", cwd=cwd, env=env, check=False)
    doc = json.loads(done.stdout)
    return [
        Finding(code=f["code"], severity=f["severity"], cause=f["cause"],
                evidence=tuple(f["evidence"]), fix=tuple(f["fix"]))
        for f in doc["findings"]
    ]  # fmt: skip


def run_printed(
    command: str, cwd: Path, env: dict[str, str] | None = None, timeout: float = 1800
) -> subprocess.CompletedProcess[str]:
    """A command a fix printed, run as a user runs it: by a shell, whose ``cudaenv`` is this
    checkout's (a shim first on PATH) and whose uv is cudaenv's."""
    shims = cwd / ".shims"
    shims.mkdir(exist_ok=True)
    shim = shims / "cudaenv"
    shim.write_text(f'#!/bin/sh\nexec {sys.executable} -m builder.cli "$@"\n')
    shim.chmod(0o755)
    base = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
    base["PATH"] = f"{shims}:{Path(proc.uv_bin()).parent}:{base.get('PATH', '')}"
    return subprocess.run(["sh", "-c", command], cwd=cwd, env=base, capture_output=True,
                          text=True, timeout=timeout, check=False)  # fmt: skip


def lock_of(spec_file: Path) -> Path:
    """The lock file of the spec at ``spec_file``, named as cudaenv names it."""
    s = spec.load(spec_file)
    return lock.lock_path(s.source, s.name)


def workspace(tmp: Path, *names: str) -> Path:
    """A copy of the named specs with their committed locks and this repository's
    ``[tool.cudaenv]`` settings, so builds land under tmp and locks are written as here."""
    (tmp / "envspecs" / "locks").mkdir(parents=True)
    settings = project.settings_for(ENVSPECS / "default.yaml")
    write(
        tmp / "pyproject.toml",
        f"[tool.cudaenv]\nlocks = {json.dumps(settings.locks)}\n"
        f"wheelhouse = {json.dumps(settings.wheelhouse)}\n",
    )
    for name in names:
        shutil.copy(ENVSPECS / name, tmp / "envspecs" / name)
        shutil.copy(lock_of(ENVSPECS / name), lock_of(tmp / "envspecs" / name))
    return tmp


# --------------------------------------------------------------------------- local indexes


def tiny_wheel(
    directory: Path, name: str, version: str, body: str, requires: Sequence[str] = ()
) -> Path:
    """A pure-Python wheel holding one module (``body`` its source) in ``directory``."""
    dist = f"{name.replace('-', '_')}-{version}"
    meta = "".join(f"Requires-Dist: {r}\n" for r in requires)
    files = {
        f"{name.replace('-', '_')}.py": body,
        f"{dist}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        + meta,
        f"{dist}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: cudaenv-tests\n"
        "Root-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    for path, text in files.items():
        digest = hashlib.sha256(text.encode()).digest()
        b64 = base64.urlsafe_b64encode(digest).rstrip(b"=").decode()
        record.append(f"{path},sha256={b64},{len(text.encode())}")
    files[f"{dist}.dist-info/RECORD"] = "\n".join([*record, f"{dist}.dist-info/RECORD,,"]) + "\n"
    wheel = directory / f"{dist}-py3-none-any.whl"
    wheel.parent.mkdir(parents=True, exist_ok=True)
    with zipfile.ZipFile(wheel, "w") as zf:
        for path, text in files.items():
            zf.writestr(path, text)
    return wheel


PAGES = ("index.html", "index.json")
# PEP 691's JSON form of a simple index page; uv asks for it first.
JSON_PAGE = "application/vnd.pypi.simple.v1+json"


# A time before every committed lock's view (see index_view): the upload time of a release a
# test puts on its own index unless it says otherwise. uv applies --exclude-newer to local
# (file://) indexes too, by the file's mtime, so a wheel written "now" would be unseen there.
PUBLISHED = dt.datetime(2026, 1, 1, tzinfo=dt.timezone.utc).timestamp()


def upload_time(path: Path) -> str:
    """The upload time the test index serves for a file: its mtime (set it with os.utime)."""
    when = dt.datetime.fromtimestamp(path.stat().st_mtime, dt.timezone.utc)
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def simple_index(root: Path) -> Path:
    """(Re)write the pages of ``root/simple/``, one project per directory, each file linked
    with its sha256: PEP 503 HTML (what a ``file://`` index is: no upload times) and the PEP
    691 JSON that :func:`served` gives a client asking for it, with each file's upload time
    (PEP 700: api-version 1.1), its mtime. Returns the ``simple`` directory."""
    simple = root / "simple"
    projects = sorted(d for d in simple.iterdir() if d.is_dir())
    for d in projects:
        files = [f for f in sorted(d.iterdir()) if f.name not in PAGES]
        digests = {f.name: hashlib.sha256(f.read_bytes()).hexdigest() for f in files}
        links = "".join(f'<a href="{f.name}#sha256={digests[f.name]}">{f.name}</a>' for f in files)
        (d / "index.html").write_text(f"<html><body>{links}</body></html>")
        page = {
            "meta": {"api-version": "1.1"},
            "name": d.name,
            "versions": [],
            "files": [
                {
                    "filename": f.name,
                    "url": f.name,
                    "hashes": {"sha256": digests[f.name]},
                    "size": f.stat().st_size,
                    "upload-time": upload_time(f),
                }
                for f in files
            ],
        }
        (d / "index.json").write_text(json.dumps(page))
    links = "".join(f'<a href="{d.name}/">{d.name}</a>' for d in projects)
    (simple / "index.html").write_text(f"<html><body>{links}</body></html>")
    listing = {"meta": {"api-version": "1.1"}, "projects": [{"name": d.name} for d in projects]}
    (simple / "index.json").write_text(json.dumps(listing))
    return simple


def add_to_index(
    root: Path, name: str, version: str, body: str, requires: Sequence[str] = ()
) -> Path:
    """Put a tiny wheel of ``name`` on the index at ``root`` (replacing a same-named file),
    uploaded at :data:`PUBLISHED`: before the fixed view the network tests resolve at, so a
    test's own index is seen whole under it (a test wanting a later release sets the file's
    mtime, its upload time)."""
    wheel = tiny_wheel(root / "simple" / canonicalize_name(name), name, version, body, requires)
    os.utime(wheel, (PUBLISHED, PUBLISHED))
    simple_index(root)
    return wheel


def add_tiny_pair(root: Path, version: str = "1.0") -> None:
    """``cudaenv-tiny-alpha`` (which requires ``cudaenv-tiny-beta``) and ``cudaenv-tiny-beta``
    at ``version`` on the index at ``root``: the two-package stack the lock tests install."""
    add_to_index(root, "cudaenv-tiny-beta", version, "WHO = 'beta'\n")
    add_to_index(
        root, "cudaenv-tiny-alpha", version, "WHO = 'alpha'\n", requires=["cudaenv-tiny-beta"]
    )


def local_index(root: Path, name: str, version: str, body: str) -> str:
    """A PEP 503 index on disk holding one pure-Python wheel; returns its file:// URL."""
    add_to_index(root, name, version, body)
    return (root / "simple").as_uri()


class _Quiet(http.server.SimpleHTTPRequestHandler):
    """Files of a directory; a directory's page in PEP 691 JSON to a client that asks for it
    (as PyPI answers uv), else its HTML."""

    def send_head(self) -> Any:
        page = Path(self.translate_path(self.path)) / "index.json"
        if (
            self.path.endswith("/")
            and JSON_PAGE in self.headers.get("Accept", "")
            and page.is_file()
        ):
            body = page.read_bytes()
            self.send_response(200)
            self.send_header("Content-Type", JSON_PAGE)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            return io.BytesIO(body)
        return super().send_head()

    def log_message(self, format: str, *args: Any) -> None:
        pass


@contextlib.contextmanager
def served(root: Path) -> Iterator[str]:
    """``root`` over HTTP on 127.0.0.1 (an ephemeral port, in a thread: what
    `python -m http.server` does, without a port to race for); yields its base URL."""
    handler = functools.partial(_Quiet, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)


@contextlib.contextmanager
def served_index(root: Path) -> Iterator[str]:
    """``root`` served (:func:`served`); yields the index URL of ``root/simple``. uv and pip
    reach it as any index, with no internet."""
    with served(root) as base:
        yield f"{base}/simple"


@contextlib.contextmanager
def the_only_index(root: Path, uv_cache: Path) -> Iterator[str]:
    """``root/simple`` served (:func:`served_index`) and made the one index of uv and pip, in
    this process and every child (their config files and extra indexes off, uv's cache at
    ``uv_cache``): an index frozen for the test, nothing reaches the internet. Yields its URL."""
    saved = dict(os.environ)
    for name in ("PIP_FIND_LINKS", "PIP_EXTRA_INDEX_URL", "UV_EXTRA_INDEX_URL", "UV_FIND_LINKS"):
        os.environ.pop(name, None)
    try:
        with served_index(root) as url:
            os.environ.update(
                {
                    "UV_DEFAULT_INDEX": url,
                    "UV_INDEX_URL": url,
                    "UV_NO_CONFIG": "1",
                    "UV_CACHE_DIR": str(uv_cache),
                    "UV_PYTHON_DOWNLOADS": "never",
                    "PIP_INDEX_URL": url,
                    "PIP_CONFIG_FILE": os.devnull,  # the machine's pip.conf names other indexes
                    "PIP_NO_CACHE_DIR": "1",
                }
            )
            yield url
    finally:
        os.environ.clear()
        os.environ.update(saved)


# --------------------------------------------------------------------------- fresh venvs


def pip_venv(python: Path, dest: Path) -> Path:
    """A fresh venv of ``python`` whose pip reads PEP 751 files (pip >= 26): seeded offline
    from the pip wheel virtualenv embeds, upgraded from the index only if that one is older.
    Returns its interpreter."""
    subprocess.run(
        [sys.executable, "-m", "virtualenv", "--no-download", "--no-setuptools", "--no-wheel",
         "-q", "--python", str(python), str(dest)],
        check=True,
    )  # fmt: skip
    py = dest / "bin" / "python"
    if pip_version(py) < Version("26"):
        subprocess.run([py, "-m", "pip", "install", "-q", "pip>=26"], check=True)
    assert pip_version(py) >= Version("26")
    return py


def pip_version(python: Path) -> Version:
    code = "import importlib.metadata as m; print(m.version('pip'))"
    done = subprocess.run([python, "-c", code], capture_output=True, text=True, check=True)
    return Version(done.stdout.strip())


def uv_venv(python: Path, dest: Path) -> Path:
    """A fresh, empty venv of ``python`` made by uv; returns its interpreter."""
    subprocess.run(
        [proc.uv_bin(), "venv", "-q", "--python", str(python), str(dest)],
        check=True,
        env={**os.environ, "UV_PYTHON_DOWNLOADS": "never"},
    )
    return dest / "bin" / "python"


def installed(python: Path) -> set[tuple[str, str]]:
    """(name, version) of every distribution in ``python``'s environment, pip left out."""
    code = (
        "import importlib.metadata as m, json; "
        "print(json.dumps([[d.metadata['Name'], d.version] for d in m.distributions()]))"
    )
    # -I: neither the cwd (this checkout's cudaenv.egg-info) nor PYTHONPATH joins sys.path.
    done = subprocess.run([python, "-I", "-c", code], capture_output=True, text=True, check=True)
    return {
        (str(canonicalize_name(n)), v) for n, v in json.loads(done.stdout) if n.lower() != "pip"
    }


def env_facts(**changes: Any) -> EnvFacts:
    """The facts of a healthy default env (torch 2.14.1, CUDA 13.0, FlashInfer 0.7.2), with
    ``changes`` applied: what a check reads, without a probe."""
    base = EnvFacts(
        python="/env/bin/python",
        python_version="3.12.1",
        cuda_home="/env/cuda-home",
        env={"FLASHINFER_CUDA_ARCH_LIST": "12.0f"},
        nvcc_release="13.0",
        nvcc_path="/env/cuda-home/bin/nvcc",
        nvcc_error=None,
        cudart_version="13.0",
        cudart_error=None,
        torch_installed=True,
        torch_version="2.14.1+cu130",
        torch_cuda="13.0",
        torch_error=None,
        flashinfer_installed=True,
        flashinfer_version="0.7.2",
        flashinfer_cuda_path="/env/cuda-home",
        flashinfer_cuda_version="13.0",
        flashinfer_error=None,
        jit=JitBuild(library="/env/var/flashinfer/x/sampling.so", reused=True, seconds=0.1),
        seconds=1.0,
    )
    if isinstance(changes.get("jit"), dict):  # the probe's JSON, as a check reads it parsed
        changes["jit"] = JitBuild.from_json(changes["jit"])
    return dataclasses.replace(base, **changes)


def a_manifest(**changes: Any) -> Manifest:
    """A built env's manifest, with ``changes`` applied."""
    base = Manifest(
        name="x",
        spec="envspecs/x.yaml",
        fingerprint="sha256:f",
        lock_hash="sha256:l",
        python="3.12.1",
        cuda="13.0",
        torch="2.14.1",
        torch_cuda="13.0",
        toolkit="13.0.3.0",
        nvcc="13.0",
        toolchain_source="wheels",
        archs=archs.DEFAULT_ARCHS,
        spec_archs=archs.DEFAULT_ARCHS,
        packages=(("torch", "2.14.1"),),
        env=(),
        built_at="2026-11-30T00:00:00+00:00",
        cudaenv="0.1.0",
        path="/env",
    )
    return dataclasses.replace(base, **changes)


@contextlib.contextmanager
def loopback_server(reply: bytes | None) -> Iterator[int]:
    """A TCP port on 127.0.0.1 that is no real service: with ``reply`` None it accepts and
    never answers (a hung server); else it reads a request and answers ``reply`` (a server
    speaking something else). Yields the port; every connection is closed at the end."""
    import socket

    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    held: list[socket.socket] = []
    stop = threading.Event()

    def serve() -> None:
        listener.settimeout(0.1)
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            if reply is None:
                held.append(conn)
                continue
            with conn:
                try:
                    conn.settimeout(2)
                    conn.recv(4096)
                    conn.sendall(reply)
                except OSError:
                    pass

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield listener.getsockname()[1]
    finally:
        stop.set()
        thread.join(timeout=5)
        for conn in held:
            conn.close()
        listener.close()


def command_arguments() -> list[tuple[tuple[str, ...], str, Any, Any]]:
    """Every argument of every (sub)command in the command table (cli/parser.py), as
    (command words, field name, its Option, its type hint): the tests that must cover each
    command and argument take them from here, so a command added later is in them."""
    import dataclasses
    import typing

    from builder.cli.parser import COMMANDS, Sub
    from builder.commands.options import KEY, Option

    found: list[tuple[tuple[str, ...], str, Any, Any]] = []

    def walk(subs: tuple[Sub, ...], above: tuple[str, ...]) -> None:
        for sub in subs:
            words = (*above, sub.name)
            if sub.args is not None:
                hints = typing.get_type_hints(sub.args)
                for f in dataclasses.fields(sub.args):
                    option = f.metadata.get(KEY)
                    if isinstance(option, Option):
                        found.append((words, f.name, option, hints[f.name]))
            walk(sub.subs, words)

    walk(COMMANDS, ())
    return found
