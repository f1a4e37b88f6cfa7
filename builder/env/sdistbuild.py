"""One sdist compiled into a wheel in an env, by the env's own interpreter, against the env's
torch and its matched toolkit: the steps of a build's source packages
(:mod:`builder.env.sourcebuild`) that need no lock or store: the variables, the sdist's fetch and
the compile.

``pip wheel --no-build-isolation --no-index`` runs with the env's ``CUDA_HOME``/``PATH``, the
recipe's variables (:mod:`builder.env.recipes`) and the spec's ``build-env``, passed as an
environment, never through a shell. The network is closed to it (proxies at a port nothing
serves: a ``setup.py`` that downloads fails and is named), no GPU is visible, and it runs
under a deadline that kills its process group. Progress comes every
:data:`buildlog.HEARTBEAT` seconds; a failure is one line with the first compiler error, the
whole log kept.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

from builder.core import proc, settings
from builder.core.errors import BuildError, CommandFailed, ToolMissing
from builder.env import buildlog, recipes, setuppy, treeguard, wheelproof
from builder.machine import archs as archs_mod
from builder.machine import box
from builder.spec.envspec import EnvSpec

# Where a build's log and scratch live, inside the env being built.
WORK = Path("var") / "source-builds"
FETCH_TIMEOUT = 1800.0
# A proxy nobody serves (the discard port): a build's download fails at once, offline or not.
_CLOSED = "http://127.0.0.1:9"


def build_environ(env: Path, spec: EnvSpec, variables: dict[str, str]) -> dict[str, str]:
    """What a source build runs with: ours, with the env's toolkit and bin first on PATH, the
    spec's ``env:`` and the build's ``variables``; no network, no GPU."""
    base = settings.child_environ(CUDAENV_JIT_SHARE=None, CUDAENV_ARCH_LIST=None)
    cuda_home = env / "cuda-home"
    rest = [p for p in base.get("PATH", "").split(os.pathsep) if p]
    base.update(
        CUDA_HOME=str(cuda_home),
        CUDA_PATH=str(cuda_home),
        PATH=os.pathsep.join([str(cuda_home / "bin"), str(env / "bin"), *rest]),
        CUDA_VISIBLE_DEVICES="",
        PIP_DISABLE_PIP_VERSION_CHECK="1",
        PIP_NO_INPUT="1",
    )
    base.update(dict(spec.env))
    base.update(variables)
    return base


def own_tree(environ: dict[str, str], work: Path) -> dict[str, str]:
    """``environ`` with what a build writes for itself kept in its own tree ``work``: its
    ``TMPDIR``, ``HOME`` and caches (pip's, a home-dir config), and the bytecode of what it
    imports (``PYTHONPYCACHEPREFIX``): bytecode written beside the env's torch would be a
    change to the env, which :func:`guarded` rightly counts, and none at all would make each
    of the build's three starts of ``setup.py`` (pip's metadata at the fetch and again at
    the build, then the build) import torch from source, ~3 s each on 2 cores instead of
    ~1 s after the first. It goes with the build's tree."""
    for sub in ("tmp", "home"):
        (work / sub).mkdir(parents=True, exist_ok=True)
    out = {**environ, "TMPDIR": str(work / "tmp"), "HOME": str(work / "home"),
           "XDG_CACHE_HOME": str(work / "home" / ".cache"),
           "PYTHONPYCACHEPREFIX": str(work / "pycache")}  # fmt: skip
    out.pop("PYTHONDONTWRITEBYTECODE", None)
    return out


def in_use(env: Path, target: Path) -> bool:
    """Whether a build in ``env`` for ``target`` runs in an env that may be in use: building
    ahead or rebuilding in place (target is env), not a new tree being built."""
    return target.resolve() == env.resolve()


@dataclass
class Guard:
    """The record of the env at ``env`` that the guarded steps of one build hand on: the fetch
    ends with a record of the env that the compile then starts from, so the env is walked
    three times for the two steps, not four (each walk is an ``lstat`` of every entry: about
    0.3 s for a torch env). Only the steps of one build share it, with nothing of cudaenv's
    writing into the env between them."""

    env: Path
    work: Path  # the build's own tree, left out
    live: bool  # an env in use (treeguard.RUNTIME left out)
    seen: dict[str, treeguard.Entry] | None = None

    def record(self) -> dict[str, treeguard.Entry]:
        return treeguard.record(self.env, skip=self.work, live=self.live)


@contextlib.contextmanager
def guarded(guard: Guard, what: str, *, log: Path | None = None) -> Iterator[None]:
    """Run the body (a step that runs the sdist's own code) and fail with one line naming
    what it changed in ``guard.env`` outside its own tree (:mod:`treeguard`), whether or not
    the body itself failed: such a write is the first thing to know."""
    before = guard.seen if guard.seen is not None else guard.record()
    guard.seen = None
    failed: BaseException | None = None
    try:
        yield
    except (BuildError, CommandFailed) as exc:
        failed = exc
    after = guard.record()
    wrote = treeguard.changes(before, after)
    if wrote:
        tail = f"; the whole log: {log}" if log is not None else ""
        raise BuildError(
            f"{what}: its build wrote outside its own tree, into the env: "
            f"{treeguard.said(wrote)}; nothing of it is installed or stored{tail}"
        ) from failed
    if failed is not None:
        raise failed
    guard.seen = after


def _offline(environ: dict[str, str]) -> dict[str, str]:
    closed = {k: _CLOSED for k in ("http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY")}
    return {**environ, **closed, "ALL_PROXY": _CLOSED, "no_proxy": "", "NO_PROXY": ""}


def bundled_pip(python: Path) -> Path:
    """The pip wheel the interpreter's ``ensurepip`` bundles (pip runs from its wheel), held
    to the rules of what cudaenv runs: a regular file in a directory no other user could
    have written to. ToolMissing when there is none."""
    done = proc.run(
        [python, "-I", "-c", "import ensurepip, os; print(os.path.dirname(ensurepip.__file__))"],
        check=False,
        timeout=60,
    )
    where = Path(done.stdout.strip() or "/nonexistent") / "_bundled"
    wheels = sorted(where.glob("pip-*.whl")) if done.returncode == 0 else []
    if not wheels:
        raise ToolMissing(
            f"{python}: its standard library bundles no pip (ensurepip), which builds a "
            "package from its sdist; install the interpreter's venv/ensurepip package",
            tool="pip",
        )
    for path in (where, wheels[-1]):
        st = os.lstat(path)
        if st.st_uid not in (0, os.getuid()) or st.st_mode & 0o022 or path.is_symlink():
            raise ToolMissing(
                f"{path}: another user could have written it; cudaenv runs no such program",
                tool="pip",
            )
    return wheels[-1]


def values_for(spec: EnvSpec, name: str) -> dict[str, str]:
    """The variables a source build of ``name`` gets in an env of ``spec``: its recipe's, the
    jobs and nvcc threads this machine holds for the spec's arch list, the spec's
    ``build-env``."""
    threads = archs_mod.nvcc_threads(archs_mod.flashinfer_spelling(spec.archs))
    return recipes.variables(
        recipes.recipe_for(name),
        spec.archs,
        jobs=box.compile_jobs(threads),
        nvcc_threads=threads,
        build_env=spec.build_env,
    )


def fetch_sdist(
    env: Path,
    pip: Path,
    name: str,
    version: str,
    hashes: Sequence[str],
    environ: dict[str, str],
    work: Path,
    *,
    guard: Guard,
) -> Path:
    """The sdist of ``name`` ``version``, downloaded into ``work/sdist`` by the interpreter's
    bundled ``pip`` through the machine's index configuration, ``--require-hashes`` against
    ``hashes`` (the lock's sha256, or those the index gives), and checked against them again
    here. pip prepares the sdist's metadata as it fetches it, which runs its ``setup.py``
    (once the hash is checked): that is held to its own tree like the build."""
    python = env / "bin" / "python"
    if not hashes:
        raise BuildError(f"{name} {version}: no sha256 to fetch its sdist against")
    req = work / "requirement.txt"
    req.write_text(f"{name}=={version} " + " ".join(f"--hash=sha256:{h}" for h in hashes) + "\n")
    into = work / "sdist"
    argv: list[str | Path] = [python, f"{pip}/pip", "download", "--no-deps", "--no-build-isolation",
            "--require-hashes", f"--no-binary={name}", "--progress-bar", "off",
            "-d", into, "-r", req]  # fmt: skip
    lines: list[str] = []
    try:
        with guarded(guard, f"{name} {version}"):
            done = proc.run_lines(argv, lines.append, env=own_tree(environ, work),
                                  timeout=FETCH_TIMEOUT, merged=True, cwd=work)  # fmt: skip
    except CommandFailed as exc:
        raise BuildError(f"{name} {version}: fetching its sdist took too long") from exc
    found = sorted(into.glob("*")) if into.is_dir() else []
    if done.returncode != 0 or len(found) != 1:
        said = buildlog.first_problem(lines) or "no sdist"
        raise BuildError(f"{name} {version}: pip could not fetch its sdist: {said}")
    sdist = found[0]
    if hashlib.sha256(sdist.read_bytes()).hexdigest() not in hashes:
        raise BuildError(f"{name} {version}: {sdist.name} differs from the sha256 it was locked by")
    return sdist


def compile_sdist(
    env: Path,
    spec: EnvSpec,
    name: str,
    version: str,
    sdist: Path,
    values: dict[str, str],
    work: Path,
    *,
    pip: Path,
    torch: str | None,
    nvcc: str,
    target: Path,
    progress: Callable[[str], None],
    guard: Guard,
) -> Path:
    """The wheel ``sdist`` (of ``name`` ``version``, its hash checked by the caller) builds in
    the env at ``env`` with the build's ``values`` and ``pip`` (:func:`bundled_pip`), written
    below ``work``; BuildError with one line where :func:`recipes.before_compiling` or the
    compiler says it cannot."""
    python = env / "bin" / "python"
    environ = build_environ(env, spec, values)
    (work / "wheel").mkdir(exist_ok=True)
    environ = own_tree(environ, work)
    text, members = setuppy.from_sdist(sdist)
    why = recipes.before_compiling(name, version, text, torch, nvcc=nvcc, members=members)
    if why is not None:
        raise BuildError(why)
    archs = _archs_said(text, nvcc, archs_mod.flashinfer_spelling(spec.archs))
    progress(
        f"{name} {version}: compiling from its sdist with nvcc {nvcc} for {archs} "
        f"(MAX_JOBS={values['MAX_JOBS']}, NVCC_THREADS={values['NVCC_THREADS']})"
    )
    log_path = work / "build.log"
    argv: list[str | Path] = [python, f"{pip}/pip", "wheel", "--verbose", "--no-deps", "--no-build-isolation",
            "--no-index", "-w", work / "wheel", sdist]  # fmt: skip
    watch = buildlog.Watch(f"{name} {version}", progress)
    with log_path.open("w", encoding="utf-8", errors="replace") as log:

        def seen(line: str) -> None:
            log.write(line + "\n")
            watch.line(line)

        # A flash-attn build is about an hour of nvcc on a small box: the default four hours
        # is a build that hangs (CUDAENV_SOURCE_BUILD_TIMEOUT moves it).
        bound = settings.current().source_build_timeout
        watch.start()
        try:
            with guarded(guard, f"{name} {version}", log=_kept_path(target, name, version)):
                done = proc.run_lines(
                    argv, seen, env=_offline(environ), timeout=bound, merged=True, cwd=work
                )
        except BuildError:
            log.flush()
            _keep_log(log_path, target, name, version)
            raise
        except CommandFailed as exc:
            kept = _keep_log(log_path, target, name, version)
            raise BuildError(
                f"{name} {version}: the source build ran past {bound:.0f} s "
                f"(CUDAENV_SOURCE_BUILD_TIMEOUT) and was stopped; the whole log: {kept}"
            ) from exc
        finally:
            watch.stop()
    return _built(
        spec, name, version, done.returncode, work, (text, members), values,
        nvcc=nvcc, log_path=log_path, target=target,
    )  # fmt: skip


def _built(
    spec: EnvSpec,
    name: str,
    version: str,
    returncode: int,
    work: Path,
    sdist_read: tuple[str, frozenset[str]],
    values: dict[str, str],
    *,
    nvcc: str,
    log_path: Path,
    target: Path,
) -> Path:
    """The one wheel a build made, proven by what it holds (wheelproof.judge: a CUDA sdist
    whose setup.py chose a CPU build on this GPU-less box is refused here, before anything is
    stored or installed); else BuildError in one line with the first thing in the log to act
    on, the build's log kept (:func:`_keep_log`)."""
    wheels = sorted((work / "wheel").glob("*.whl"))
    if returncode != 0 or len(wheels) != 1:
        first = buildlog.first_problem(
            log_path.read_text(encoding="utf-8", errors="replace").splitlines()
        )
        why = f"{name} {version}: the source build with nvcc {nvcc} failed: "
        why += first or "no wheel was made"
    else:
        text, members = sdist_read
        refused = wheelproof.judge(name, version, wheels[0], setup_py=text, members=members,
                                   archs=spec.archs, values=values, scratch=work / "proof")  # fmt: skip
        if refused is None:
            return wheels[0]
        why = refused
    kept = _keep_log(log_path, target, name, version)
    raise BuildError(f"{why}; the whole log: {kept}")


def _archs_said(setup_py: str, nvcc: str, spec_archs: str) -> str:
    """The archs a build compiles for, as the progress line says them: the spec's, unless
    the setup.py surely passes its own ``-gencode`` list (causal-conv1d 1.7.0 on nvcc 13.0:
    75 to 121), which torch's arch variables do not narrow."""
    demands = setuppy.read(setup_py, nvcc)
    own = sorted({arch for _, arch in demands.archs}) if demands is not None else []
    if not own:
        return spec_archs
    listed = ", ".join(f"{a // 10}.{a % 10}" for a in own)
    return f"its setup.py's own list ({listed}; the spec's {spec_archs} does not narrow it)"


def _kept_path(target: Path, name: str, version: str) -> Path:
    """Where :func:`_keep_log` keeps a failed build's log."""
    where = target / WORK if (target / "var").is_dir() else target.parent / f".{target.name}.logs"
    return where / f"{name}-{version}.log"


def _keep_log(log_path: Path, target: Path, name: str, version: str) -> Path:
    """The failed build's log copied where it outlives the env being built: the previous
    env's ``var/source-builds/`` when there is one (nothing else of it changes), else beside
    where the env would have been."""
    kept = _kept_path(target, name, version)
    with contextlib.suppress(OSError):
        kept.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(log_path, kept)
        return kept
    return log_path
