"""`cudaenv export`: fill a wheelhouse with a spec's locked files (and the env's JIT results),
and/or write a PEP 751 lock with this machine's index URLs."""

from __future__ import annotations

from builder.commands.args import ExportArgs
from builder.commands.pipeline import command_line, known_platform, load_spec, lock_file
from builder.core.errors import UsageError
from builder.core.reporter import Reporter
from builder.spec import lock


def export(request: ExportArgs, reporter: Reporter) -> None:
    from builder.env import build
    from builder.env import export as exporting

    if request.pylock is not None:
        exporting.check_pylock_name(request.pylock)  # before any work
    s = load_spec(request.spec)
    path = lock_file(s)
    lk = lock.read(path, spec=s)
    build.check_lock(s, lk, path)
    wheelhouse = request.wheelhouse.absolute() if request.wheelhouse else None
    if wheelhouse is None and request.pylock is None:
        # The directory the index-neutral lock's paths name: filled, the lock installs as is.
        wheelhouse = exporting.lock_wheelhouse(s, lk, path)
        if wheelhouse is None:
            raise UsageError(
                f"export needs --wheelhouse DIR or --pylock FILE: {path} names its files by "
                "URL, so it has no wheelhouse of its own"
            )
    if request.with_jit and wheelhouse is None:
        raise UsageError(
            "--with-jit puts the env's JIT results into a wheelhouse: add --wheelhouse DIR"
        )
    if wheelhouse is not None:
        platform = known_platform(request.platform)
        out = exporting.export(s, lk, wheelhouse, reporter, platform=platform)
        reporter(f"wrote {out}: {len(lk.packages)} files, every sha256 checked against {path}")
    if request.with_jit:
        assert wheelhouse is not None
        env_dir = (request.env_dir or build.default_env_dir(s)).absolute()
        carried = exporting.export_jit(env_dir, wheelhouse)
        reporter(
            f"carried {carried} JIT result(s) of {env_dir} into "
            f"{wheelhouse / exporting.JIT_DIR}: `cudaenv build --offline --wheelhouse` places "
            "them in the machine's store"
        )
    if request.pylock is not None:
        reporter(f"asking uv for the URL of every file of {path} on this machine's index")
        command = command_line(["export", str(request.spec), "--pylock", str(request.pylock)])
        exporting.export_pylock(s, lk, request.pylock, command=command)
        reporter(f"wrote {request.pylock}: {len(lk.packages)} packages, every sha256 as in {path}")
