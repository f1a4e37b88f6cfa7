""".ci/flashinfer-slice.py: the files a JIT build read, from real ninja's record, and the
archive that holds FlashInfer's code, exactly those files and tvm_ffi."""

from __future__ import annotations

import importlib.util
import shutil
import subprocess
import tarfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.helpers import REPO, write


def slicer() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "flashinfer_slice", REPO / ".ci" / "flashinfer-slice.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def fake_site(root: Path) -> Path:
    """A site-packages with a FlashInfer of code, data headers and a tvm_ffi."""
    site = root / "site"
    write(site / "flashinfer" / "__init__.py", "")
    write(site / "flashinfer" / "jit" / "sampling.py", "")
    write(site / "flashinfer" / "tuning.json", "{}")
    write(site / "flashinfer" / "kernels" / "big.so", "binary")
    write(site / "flashinfer" / "data" / "include" / "used.h", "#define USED 1\n")
    write(site / "flashinfer" / "data" / "include" / "unused.h", "#define UNUSED 1\n")
    write(site / "flashinfer" / "data" / "csrc" / "sampling.c",
          '#include "used.h"\nint f(void) { return USED; }\n')  # fmt: skip
    write(site / "flashinfer" / "data" / "csrc" / "other.c", "int g(void) { return 0; }\n")
    write(site / "tvm_ffi" / "__init__.py", "")
    write(site / "tvm_ffi" / "lib" / "libtvm_ffi.so", "binary")
    write(site / "flashinfer_python-0.7.2.dist-info" / "METADATA", "Name: flashinfer-python\n")
    write(site / "apache_tvm_ffi-0.1.11.dist-info" / "METADATA", "Name: apache-tvm-ffi\n")
    write(site / "unrelated" / "__init__.py", "")
    return site


def test_the_slice_holds_code_what_the_build_read_and_tvm_ffi(tmp_path: Path) -> None:
    ninja, cc = shutil.which("ninja"), shutil.which("cc") or shutil.which("gcc")
    if ninja is None or cc is None:
        pytest.skip("ninja and a C compiler are needed for the toy build")
    site = fake_site(tmp_path)
    data = site / "flashinfer" / "data"
    build = tmp_path / "build"
    write(build / "build.ninja",
          "rule cc\n"
          f"  command = {cc} -MMD -MF $out.d -I{data / 'include'} -c $in -o $out\n"
          "  depfile = $out.d\n  deps = gcc\n"
          f"build sampling.o: cc {data / 'csrc' / 'sampling.c'}\n")  # fmt: skip
    subprocess.run([ninja, "-C", str(build)], check=True, capture_output=True)
    mod = slicer()
    read = mod.files_read(build)
    assert (data / "include" / "used.h").resolve() in read
    info = {"flashinfer": str(site / "flashinfer"), "tvm_ffi": str(site / "tvm_ffi")}
    names = {name for _, name in mod.slice_members(info, read)}
    assert names == {
        "flashinfer/__init__.py",
        "flashinfer/jit/sampling.py",
        "flashinfer/tuning.json",
        "flashinfer/data/csrc/sampling.c",
        "flashinfer/data/include/used.h",
        "tvm_ffi/__init__.py",
        "tvm_ffi/lib/libtvm_ffi.so",
        "flashinfer_python-0.7.2.dist-info/METADATA",
        "apache_tvm_ffi-0.1.11.dist-info/METADATA",
    }


def test_a_build_dir_without_ninjas_record_is_refused(tmp_path: Path) -> None:
    if shutil.which("ninja") is None:
        pytest.skip("ninja is not installed")
    write(tmp_path / "build.ninja", "rule touch\n  command = touch $out\nbuild x: touch\n")
    subprocess.run(["ninja", "-C", str(tmp_path)], check=True, capture_output=True)
    with pytest.raises(SystemExit, match="ninja recorded no dependencies"):
        slicer().files_read(tmp_path)


def test_the_archive_unpacks_to_the_same_tree(tmp_path: Path) -> None:
    site = fake_site(tmp_path)
    mod = slicer()
    info = {"flashinfer": str(site / "flashinfer"), "tvm_ffi": str(site / "tvm_ffi")}
    members = mod.slice_members(info, set())
    archive = tmp_path / "slice.tar.gz"
    with tarfile.open(archive, "w:gz") as tar:
        for path, name in members:
            tar.add(path, arcname=name, recursive=False)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path / "out", filter="data")
    for path, name in members:
        assert (tmp_path / "out" / name).read_bytes() == path.read_bytes()
    assert not (tmp_path / "out" / "flashinfer" / "data").exists()  # nothing read, none kept


def test_the_archive_is_written_with_its_sha256_beside_it(tmp_path: Path) -> None:
    """``sha256sum -c`` format: the GPU check compares it before unpacking (a slice copied
    short fails there by name: tests/test_gpu_check.py)."""
    import hashlib

    site = fake_site(tmp_path)
    mod = slicer()
    info = {"flashinfer": str(site / "flashinfer"), "tvm_ffi": str(site / "tvm_ffi")}
    out = tmp_path / "carry" / "flashinfer-slice.tar.gz"
    sums = mod.write_archive(mod.slice_members(info, set()), out)
    assert sums == tmp_path / "carry" / "flashinfer-slice.tar.gz.sha256"
    assert sums.read_text() == (
        f"{hashlib.sha256(out.read_bytes()).hexdigest()}  flashinfer-slice.tar.gz\n"
    )
    done = subprocess.run(["sha256sum", "-c", sums.name], cwd=sums.parent, check=False,
                          capture_output=True, text=True)  # fmt: skip
    assert done.returncode == 0, done.stdout + done.stderr
    with tarfile.open(out) as tar:
        assert "flashinfer/__init__.py" in tar.getnames()
