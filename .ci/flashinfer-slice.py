#!/usr/bin/env python3
"""The part of an env's FlashInfer that its sampling module needs, as one small archive.

For a machine with a GPU, torch and nvcc but no package index: the flashinfer-python wheel
unpacks to ~460 MB (CUTLASS, CCCL, every kernel's sources), while its JIT sampling module
reads ~1000 of those files. This builds the sampling module once here, for the GPU's arch,
asks ninja which files the compile read (`ninja -t deps`), and writes an archive holding
FlashInfer's Python code, exactly those files, apache-tvm-ffi (FlashInfer's FFI, a compiled
abi3 module) and both dist-infos, with its sha256 beside it (``OUT.sha256``). Unpacked on the GPU machine and put on PYTHONPATH, it lets
`import flashinfer` and the sampling JIT run there (FlashInfer's other dependencies, numpy,
requests, tqdm, nvidia-ml-py, ninja, must already be installed there).

    python3 .ci/flashinfer-slice.py --python .envs/NAME/bin/python --arch 9.0a \
        --out .gpu-carry/flashinfer-slice.tar.gz

Then unpack it and check, on a machine without FlashInfer, that the sampling module builds
from it alone: `--check PYTHON` (an interpreter with torch) does that here after writing.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

# Printed by the env's interpreter: where FlashInfer and tvm_ffi live and where the sampling
# module was built.
PROBE = """
import json, os
import flashinfer, tvm_ffi
from flashinfer.jit.sampling import gen_sampling_module
spec = gen_sampling_module()
spec.build(verbose=False)
print(json.dumps({"flashinfer": os.path.dirname(flashinfer.__file__),
                  "tvm_ffi": os.path.dirname(tvm_ffi.__file__),
                  "build_dir": str(spec.build_dir),
                  "library": str(spec.get_library_path())}))
"""

# FlashInfer's own files kept whole: code and the small data its Python reads at import.
KEEP_SUFFIXES = {".py", ".json", ".typed"}


def build_sampling(python: str, arch: str, work: Path, failed: str, **env: str) -> dict[str, str]:
    """Run PROBE in ``python``: the sampling module built for ``arch`` with its workspace in
    ``work``; ``env`` added to the environment. Exits with ``failed`` and stderr on failure."""
    environ = {
        **os.environ,
        "FLASHINFER_WORKSPACE_BASE": str(work),
        "FLASHINFER_CUDA_ARCH_LIST": arch,
        "CUDAENV_ARCH_LIST": arch,  # a cudaenv env's start-up hook honours this one
        **env,
    }
    done = subprocess.run(
        [python, "-c", PROBE], env=environ, capture_output=True, text=True, check=False
    )
    if done.returncode != 0:
        sys.exit(f"flashinfer-slice: {failed}:\n{done.stderr[-3000:]}")
    info: dict[str, str] = json.loads(done.stdout.strip().splitlines()[-1])
    return info


def files_read(build_dir: Path) -> set[Path]:
    """Every file the compiles read, from ninja's own record of the depfiles."""
    ninja = shutil.which("ninja")
    if ninja is None:
        sys.exit("flashinfer-slice: ninja is not on PATH")
    done = subprocess.run(
        [ninja, "-C", str(build_dir), "-t", "deps"], capture_output=True, text=True, check=True
    )
    read = set()
    for line in done.stdout.splitlines():
        if line.startswith("    "):
            read.add(Path(line.strip()).resolve())
    if not read:
        sys.exit(f"flashinfer-slice: ninja recorded no dependencies in {build_dir}")
    return read


def slice_members(info: dict[str, str], read: set[Path]) -> list[tuple[Path, str]]:
    """(file, name in the archive) for everything the slice holds."""
    fi_root = Path(info["flashinfer"]).resolve()
    ffi_root = Path(info["tvm_ffi"]).resolve()
    site = fi_root.parent
    members: dict[str, Path] = {}
    for path in sorted(fi_root.rglob("*")):
        rel = path.relative_to(fi_root)
        if path.is_file() and rel.parts[0] != "data" and path.suffix in KEEP_SUFFIXES:
            members[str(path.relative_to(site))] = path
    for path in read:
        if path.is_relative_to(fi_root) or path.is_relative_to(ffi_root):
            members[str(path.relative_to(site))] = path
    for path in sorted(ffi_root.rglob("*")):
        if path.is_file() and "__pycache__" not in path.parts:
            members[str(path.relative_to(site))] = path
    for pattern in ("flashinfer_python-*.dist-info", "apache_tvm_ffi-*.dist-info"):
        for dist in site.glob(pattern):
            for path in dist.rglob("*"):
                if path.is_file():
                    members[str(path.relative_to(site))] = path
    return [(p, name) for name, p in sorted(members.items())]


def write_archive(members: list[tuple[Path, str]], out: Path) -> Path:
    """The archive at ``out`` and its sha256 at ``out.sha256`` (``sha256sum`` format), which
    the GPU check compares before unpacking: a slice copied short fails there by name."""
    out.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(out, "w:gz") as tar:
        for path, name in members:
            tar.add(path, arcname=name, recursive=False)
    digest = hashlib.sha256(out.read_bytes()).hexdigest()
    sums = out.with_name(out.name + ".sha256")
    sums.write_text(f"{digest}  {out.name}\n")
    return sums


def check(python: str, archive: Path, arch: str) -> None:
    """Unpacked alone on PYTHONPATH, the slice builds the sampling module from scratch."""
    with tempfile.TemporaryDirectory(prefix="flashinfer-slice-check-") as tmp:
        site = Path(tmp) / "site"
        with tarfile.open(archive) as tar:
            tar.extractall(site, filter="data")
        info = build_sampling(python, arch, Path(tmp) / "ws", "the slice does not build alone",
                              PYTHONPATH=str(site))  # fmt: skip
        if not Path(info["flashinfer"]).resolve().is_relative_to(site.resolve()):
            sys.exit(
                f"flashinfer-slice: {python} imported another FlashInfer: {info['flashinfer']}"
            )
        print(f"flashinfer-slice: checked: the sampling module builds from the slice alone "
              f"({Path(info['library']).name} for {arch})")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--python", required=True, help="an interpreter with FlashInfer installed")
    ap.add_argument("--arch", default="9.0a", help="the GPU's arch, FlashInfer's spelling")
    ap.add_argument("--out", required=True, type=Path, help="the archive to write (.tar.gz)")
    ap.add_argument("--check", metavar="PYTHON", help="an interpreter with torch and without "
                    "FlashInfer: build the sampling module from the unpacked slice with it")  # fmt: skip
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="flashinfer-slice-") as tmp:
        info = build_sampling(args.python, args.arch, Path(tmp),
                              "building the sampling module failed")  # fmt: skip
        members = slice_members(info, files_read(Path(info["build_dir"])))
        write_archive(members, args.out)
    raw = sum(p.stat().st_size for p, _ in members)
    print(f"flashinfer-slice: {args.out}: {len(members)} files, {raw / 2**20:.1f} MiB unpacked, "
          f"{args.out.stat().st_size / 2**20:.1f} MiB packed")  # fmt: skip
    if args.check:
        check(args.check, args.out, args.arch)


if __name__ == "__main__":
    main()
