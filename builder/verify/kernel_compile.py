"""`kernel-compile`: cudaenv's own top-k/top-p kernel (CUB from the toolkit's CCCL) compiles
for every arch with the env's nvcc, static cudart, into the env's own work dir, run with the
env's own environment (so a spec's ``NVCC_APPEND_FLAGS`` takes part).

A build is keyed by everything that makes the binary: the kernel source, the nvcc binary
and its version, the flags (ours and the ``NVCC_*_FLAGS`` of the env), the arch, and the host
compiler nvcc drives (its path and ``--version``). An unchanged env reuses it and says
"reused"; ``verify --fresh`` rebuilds.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re
import shlex
import time
from collections.abc import Mapping
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING

from builder import store as jit_store
from builder.core import cachefiles, proc, settings, variables
from builder.core.paths import jit_store_here
from builder.core.statuses import FAILED, PASSED
from builder.jit import share as jit_share
from builder.machine.archs import Arch
from builder.spec import channels
from builder.verify.model import CheckResult, EnvFacts, Target, env_of

if TYPE_CHECKING:
    from builder.jit.oci import Remote

FLAGS = ("-O2", "--fmad=false", "-std=c++17")
NO_HOST_COMPILER_FIX = (
    "install a C++ compiler nvcc supports (`apt-get install g++`), or point nvcc at one with "
    "NVCC_CCBIN or `-ccbin` in NVCC_PREPEND_FLAGS"
)


@dataclass(frozen=True, kw_only=True)
class KernelBuild:
    arch: Arch
    path: Path
    seconds: float
    reused: bool
    error: str | None = None
    missing_tool: str | None = None
    # Set when the binary came from the machine-wide store: when and for which env it was built.
    stored: tuple[str, str] | None = None
    # What the store did that the user should hear of (an entry discarded, the store or its
    # remote unusable): warnings of the check, never its verdict.
    notes: tuple[str, ...] = ()
    # Where this machine, a warmer (CUDAENV_JIT_PUSH=1), pushed the entry: "KEY to REMOTE".
    pushed: str | None = None
    # The store's entry placed or kept (``v3/ab/KEY/VARIANT``): what `cudaenv warm` pushes.
    entry: str | None = None


@dataclass(frozen=True, kw_only=True)
class HostCompiler:
    """The host compiler nvcc will run: ``-ccbin``/``NVCC_CCBIN``, else ``gcc`` on PATH
    (nvcc runs ``gcc`` through the shell to preprocess host code)."""

    path: str | None
    identity: str  # path and --version banner: part of the build key
    error: str | None = None


def source() -> str:
    return resources.files("builder.kernels").joinpath("topk_topp.cu").read_text()


def nvcc_of(facts: EnvFacts) -> Path:
    return Path(facts.cuda_home) / "bin" / "nvcc"


def host_compiler(env: Mapping[str, str]) -> HostCompiler:
    named = env.get("NVCC_CCBIN") or ""
    for var in ("NVCC_PREPEND_FLAGS", "NVCC_APPEND_FLAGS"):
        words = shlex.split(env.get(var) or "")
        for i, word in enumerate(words):
            if word in ("-ccbin", "--compiler-bindir") and i + 1 < len(words):
                named = words[i + 1]
            elif word.startswith(("-ccbin=", "--compiler-bindir=")):
                named = word.split("=", 1)[1]
    want = named or "gcc"
    if Path(want).is_dir():  # -ccbin may name the compiler's directory
        want = str(Path(want) / "gcc")
    found = want if Path(want).is_absolute() else proc.which(want, path=env.get("PATH", ""))
    if not found or not os.access(found, os.X_OK):
        where = f"named by -ccbin/NVCC_CCBIN ({named})" if named else "on the env's PATH"
        return HostCompiler(path=None, identity="", error=f"no host compiler {want} {where}")
    real = os.path.realpath(found)
    st = Path(real).stat()
    return HostCompiler(path=found, identity=f"{real} {_banner(real, st.st_size, st.st_mtime_ns)}")


@functools.lru_cache(maxsize=32)
def _banner(compiler: str, size: int, mtime_ns: int) -> str:
    """The first line of ``compiler --version``, once per compiler file (size and mtime are
    the key's part, so a replaced compiler is asked again): every arch of every check that
    builds our kernel would otherwise start it again."""
    try:
        done = proc.run([compiler, "--version"], check=False, timeout=60)
    except proc.CommandFailed:
        return ""
    return next(iter((done.stdout or done.stderr).strip().splitlines()), "")


def _key(*parts: str) -> str:
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()[:16]


def build_kernel(
    nvcc: Path,
    arch: Arch,
    work: Path,
    *,
    env: Mapping[str, str] | None = None,
    fresh: bool = False,
    owner: str = "",
) -> KernelBuild:
    """Our kernel for ``arch`` with ``nvcc``: reused from ``work`` when this env built it,
    else from the machine-wide JIT store when an env of the same toolchain did (``owner``
    names this env there), else compiled and kept in both."""
    env = dict(env) if env is not None else settings.child_environ()
    src = source()
    host = host_compiler(env)
    out_name = f"topk_topp.{arch.sm}"
    if host.path is None:
        return KernelBuild(
            arch=arch,
            path=work / "kernels" / out_name,
            seconds=0.0,
            reused=False,
            error=host.error,
            missing_tool="host compiler",
        )
    # The nvcc binary is named by its resolved path, size and mtime: what `nvcc --version`
    # would add is derived from that file, and asking it cost a process per arch and check.
    real = os.path.realpath(nvcc)
    stat = Path(real).stat()
    key = _key(
        src,
        real,
        str(stat.st_size),
        str(stat.st_mtime_ns),
        *FLAGS,
        arch.gencode(),
        host.identity,
        *(f"{k}={env.get(k, '')}" for k in variables.NVCC),
    )
    out_dir = work / "kernels" / key
    out = out_dir / out_name
    # A warmer (CUDAENV_JIT_PUSH=1 with a remote) goes through the store even when this env
    # has the kernel already: what it pushes is the store's checked entry.
    warming = jit_share.pushing(env) and bool(env.get(jit_share.REMOTE_VAR, "off") != "off")
    # Reused only as the cache's rules allow (the sampling check runs it): a kernel another
    # user could have written, or a link, is rebuilt instead.
    if not fresh and not warming and out.exists() and cachefiles.usable(out):
        return KernelBuild(arch=arch, path=out, seconds=0.0, reused=True)
    if out.is_symlink() or out.exists():
        out.unlink()  # never compiled into through a link left at the name
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "topk_topp.cu").write_text(src)
    store = jit_store_here()
    if store is None:
        return _compile(nvcc, arch, out, env)
    cuda_home = str(Path(nvcc).parent.parent)
    material = {
        "kind": "topk_topp",
        "source": hashlib.sha256(src.encode()).hexdigest(),
        "flags": [*FLAGS, arch.gencode()],
        "tools": jit_store.tool_identities(store.hasher, cuda_home, [host.path], env),
    }
    key = jit_store.key_of(material)
    seen = set(store.notes)
    try:
        remote = jit_share.configured(env)
        lock = store.acquire(key, timeout=settings.current().jit_lock_timeout)
    except (jit_store.StoreError, jit_share.ShareError, OSError) as exc:
        # The store is a cache: whatever is wrong with it costs a compile, never the check.
        built = _compile(nvcc, arch, out, env)
        return dataclasses.replace(built, notes=(f"the JIT store was not used: {exc}",))
    try:
        built = _through_store(store, key, remote, nvcc, arch, out, env, fresh=fresh, owner=owner)
        # The store is this process's one: only what it noted during this build is this
        # build's.
        return dataclasses.replace(built, notes=tuple(n for n in built.notes if n not in seen))
    finally:
        lock.release()
        store.hasher.save()


def _through_store(
    store: jit_store.Store,
    key: str,
    remote: Remote | None,
    nvcc: Path,
    arch: Arch,
    out: Path,
    env: Mapping[str, str],
    *,
    fresh: bool,
    owner: str,
) -> KernelBuild:
    """Place the kernel from the store (or its remote tier) or compile it and publish it;
    a store that fails on the way is noted and the compile goes on without it."""
    # Paths in the depfile are kept relative to the toolkit's parent (the env's root for a
    # cudaenv env), so another env's toolkit at another path can match.
    prefix = str(Path(nvcc).parent.parent.parent)
    notes: list[str] = []
    usable = True
    entry = None
    if not fresh:
        try:
            entry = store.find(key, prefix)
            if entry is None and remote is not None:
                entry, warning = jit_share.pull(store, key, prefix, remote)
                notes += [warning] if warning else []
            if entry is not None:
                store.place(entry, "kernel", out)
                _check_placed(arch, out)
        except jit_store.EntryError as exc:
            assert entry is not None
            store.discard(entry.path, str(exc))
            entry = None
        except (jit_store.StoreError, OSError) as exc:
            notes.append(f"the JIT store was not used: {exc}")
            usable, entry = False, None
    if entry is not None:
        out.chmod(0o755)
        jit_store.note_use(store, entry.path, owner or prefix)
        pushed = _pushed(store, entry, remote, env, notes)
        stored = (entry.provenance.get("first_built", "?")[:10], _made_for(entry))
        return KernelBuild(
            arch=arch,
            path=out,
            seconds=0.0,
            reused=True,
            stored=stored,
            notes=(*store.notes, *notes),
            pushed=pushed,
            entry=str(entry.path.relative_to(store.root)),
        )
    built = _compile(nvcc, arch, out, env, depfile=out.with_suffix(".d"))
    if built.error is None and usable:
        # The source is in the key already; its copy in this work dir is not an input.
        deps = [d for d in _depfile(out.with_suffix(".d")) if not d.startswith(str(out.parent))]
        inputs = [jit_store.normalise(d, jit_store.env_roots(prefix)) for d in deps]
        meta = {"kind": "topk_topp", "env": owner or prefix}
        try:
            kept = store.publish(key, {"kernel": out}, inputs, meta, prefix)
            if kept is not None:
                jit_store.note_use(store, kept, owner or prefix)
                pushed = _pushed(store, store.load(key, kept), remote, env, notes)
                entry_of = str(kept.relative_to(store.root))
                built = dataclasses.replace(built, pushed=pushed, entry=entry_of)
        except (jit_store.StoreError, jit_store.EntryError, OSError) as exc:
            notes.append(f"the kernel was not kept in the JIT store: {exc}")
    return dataclasses.replace(built, notes=(*store.notes, *notes))


def _check_placed(arch: Arch, out: Path) -> None:
    """The kernel just placed from the store is what compiling it makes (:func:`kernel_problem`).
    An entry's record vouches that its files are what was published, not that what was
    published is a kernel: one that is not is removed here (EntryError: the entry is
    discarded) and the kernel compiled."""
    problem = kernel_problem(arch, out)
    if problem is not None:
        out.unlink(missing_ok=True)
        raise jit_store.EntryError(f"its kernel {problem}")


def kernel_problem(arch: Arch | None, path: Path) -> str | None:
    """Why ``path`` is not what compiling our kernel for ``arch`` makes, an ELF file holding
    a cubin of ``arch`` (of some arch, when None), read from its fatbin headers as the cubin
    check would find it; None when it is."""
    from builder.machine import fatbin

    found = fatbin.scan(path)
    if not found.elf:
        return "is not an ELF file"
    if found.error is not None:
        return f"cannot be read ({found.error})"
    cubins = [c for c in found.codes if c.kind == "sass"]
    if not any(arch is None or c.arch.cubin_sm == arch.cubin_sm for c in cubins):
        held = " ".join(str(c) for c in found.codes) or "no device code"
        wanted = "a cubin" if arch is None else f"a {arch.cubin_sm} cubin for {arch}"
        return f"holds no {wanted} (it holds {held})"
    return None


def stored_kernel_problem(entry: jit_store.Entry) -> str | None:
    """What :func:`kernel_problem` finds in a kernel entry of the store (``store verify``).
    The entry does not record its arch (the key does, hashed), so any cubin will do here;
    placing it checks the arch. None for an entry of another kind."""
    if entry.content.get("kind") != "topk_topp":
        return None
    problem = kernel_problem(None, entry.path / "files" / "kernel")
    return None if problem is None else f"its kernel {problem}"


def _made_for(entry: jit_store.Entry) -> str:
    return entry.provenance.get("env") or entry.provenance.get("origin") or "?"


def _pushed(
    store: jit_store.Store,
    entry: jit_store.Entry,
    remote: Remote | None,
    env: Mapping[str, str],
    notes: list[str],
) -> str | None:
    """Pushed to the remote tier where this machine is a warmer (CUDAENV_JIT_PUSH=1): what
    was pushed where ("KEY to REMOTE"), or None (a failure is added to ``notes``)."""
    if remote is None or not jit_share.pushing(env):
        return None
    warning = jit_share.push(store, entry, remote)
    if warning:
        notes.append(warning)
        return None
    return f"{entry.key[:16]} to {remote.url}"


def _depfile(path: Path) -> list[str]:
    """The files of a make-style depfile (``out: a b \\``), empty when it cannot be read."""
    try:
        text = path.read_text().replace("\\\n", " ")
    except OSError:
        return []
    _, _, rest = text.partition(":")
    return [word for word in rest.split() if word]


def _compile(
    nvcc: Path, arch: Arch, out: Path, env: Mapping[str, str], depfile: Path | None = None
) -> KernelBuild:
    src_file = out.parent / "topk_topp.cu"
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    deps = ["--generate-dependencies-with-compile", "-MF", str(depfile)] if depfile else []
    started = time.monotonic()
    done = proc.run(
        [nvcc, *FLAGS, *deps, arch.gencode(), "-o", tmp, src_file],
        env=env,
        check=False,
        timeout=1800,
    )
    seconds = time.monotonic() - started
    if done.returncode != 0:
        tmp.unlink(missing_ok=True)
        text = (done.stderr + done.stdout).strip()
        message = text.splitlines()
        missing = None
        # nvcc runs the host compiler through the shell: "gcc: No such file or directory",
        # then "Failed to preprocess host compiler properties".
        if "Failed to preprocess host compiler properties" in text or re.search(
            r"\b(gcc|g\+\+|cc|c\+\+|cl|clang\+\+)\S*: (not found|No such file or directory)", text
        ):
            missing = "host compiler"
        return KernelBuild(
            arch=arch,
            path=out,
            seconds=seconds,
            reused=False,
            error="\n".join(message[-8:]) or f"nvcc exited {done.returncode}",
            missing_tool=missing,
        )
    os.replace(tmp, out)
    return KernelBuild(arch=arch, path=out, seconds=seconds, reused=False)


def _why_failed(
    release: str | None,
    host_error: str | None,
    failures: list[str],
    missing_tool: str | None,
    headers: list[tuple[str, str | None]],
) -> tuple[str, str]:
    """The summary and the fix of a failed compile: no host compiler, a header the toolkit
    lacks (and the component that has it), else an arch this nvcc cannot build."""
    if missing_tool:
        return (
            f"nvcc {release} has no host compiler: {host_error or failures[0]}",
            NO_HOST_COMPILER_FIX,
        )
    if headers:
        header, component = headers[0]
        return (
            f"nvcc {release} cannot find {header}: " + "; ".join(failures),
            channels.component_fix(header, component),
        )
    return (
        f"nvcc {release} cannot build " + "; ".join(failures),
        "drop the arch from the spec's archs, or use a CUDA that supports it "
        "(12.0f needs 12.9+, 12.0a 12.8+); if NVCC_*_FLAGS are set in the spec's env, "
        "check them",
    )


def check(target: Target, facts: EnvFacts) -> CheckResult:
    nvcc = nvcc_of(facts)
    if not nvcc.exists():
        return CheckResult(
            name="kernel-compile",
            status=FAILED,
            summary=f"no nvcc at {nvcc}",
            fix="build the env with a wheels toolchain that includes 'nvcc', or set CUDA_HOME",
        )
    env = env_of(target, facts)
    evidence: list[tuple[str, str]] = [("nvcc", str(nvcc))]
    host = host_compiler(env)
    evidence.append(("host compiler", host.identity or str(host.error)))
    failures: list[str] = []
    missing_tool: str | None = None
    headers: list[tuple[str, str | None]] = []
    reused: list[str] = []
    stored: list[str] = []
    pushed: list[str] = []
    warnings: list[str] = []
    total = 0.0
    for arch in target.archs:
        owner = str(target.env_dir or target.python)
        built = build_kernel(nvcc, arch, target.work, env=env, fresh=target.fresh, owner=owner)
        total += built.seconds
        warnings += [n for n in built.notes if n not in warnings]
        if built.pushed:
            pushed.append(built.pushed)
            evidence.append((f"{arch} pushed", built.pushed))
        if built.error:
            failures.append(f"{arch}: {built.error}")
            missing_tool = missing_tool or built.missing_tool
            found = channels.missing_header(built.error)
            if found:
                headers.append(found)
            evidence.append((str(arch), f"failed after {built.seconds:.1f} s"))
        elif built.stored is not None:
            day, owner = built.stored
            stored.append(f"{arch}: first built {day} for {owner}")
            evidence.append(
                (str(arch), f"{built.path} reused from the store (first built {day} for {owner})")
            )
        elif built.reused:
            reused.append(str(arch))
            evidence.append(
                (str(arch), f"{built.path} reused (same source, nvcc, flags, host compiler)")
            )
        else:
            evidence.append((str(arch), f"{built.path} compiled in {built.seconds:.1f} s"))
    if failures:
        release = facts.nvcc_release
        summary, fix = _why_failed(release, host.error, failures, missing_tool, headers)
        return CheckResult(
            name="kernel-compile",
            status=FAILED,
            summary=summary,
            evidence=tuple(evidence),
            seconds=total,
            fix=fix,
            missing_tool=missing_tool,
            warnings=tuple(warnings),
        )
    how = f" (reused for {' '.join(reused)})" if reused else ""
    if stored:
        how += f" (reused from the store: {'; '.join(stored)})"
    if pushed:
        remotes = sorted({p.split(" to ", 1)[1] for p in pushed})
        how += f"; pushed {len(pushed)} entry(ies) to {', '.join(remotes)} (CUDAENV_JIT_PUSH=1)"
    return CheckResult(
        name="kernel-compile",
        status=PASSED,
        summary=f"top-k/top-p kernel built for {' '.join(map(str, target.archs))} "
        f"with nvcc {facts.nvcc_release}{how}",
        evidence=tuple(evidence),
        seconds=total,
        warnings=tuple(warnings),
    )
