"""builder/env/wheelproof.py: a source build proven by what it built. Wheels made here from
real ELF files: tests/data/fatbin/libshared.so (nvcc 13.0, sm_120 SASS) and a host-only
extension module of this interpreter (no device code)."""

from __future__ import annotations

import zipfile
from pathlib import Path

from builder.env import recipes, wheelproof
from builder.machine.archs import Arch

FATBIN = Path(__file__).parent / "data" / "fatbin"
CUDA_MEMBERS = frozenset({"setup.py", "csrc/add_one.cu", "pkg/__init__.py"})


def host_module() -> Path:
    """A host-only extension module: this interpreter's _ctypes (a venv links none of its own)."""
    import _ctypes

    return Path(_ctypes.__file__)


def wheel(tmp_path: Path, members: dict[str, Path]) -> Path:
    out = tmp_path / "pkg-0.1-cp311-cp311-linux_x86_64.whl"
    with zipfile.ZipFile(out, "w") as zf:
        zf.writestr("pkg/__init__.py", "")
        for name, source in members.items():
            zf.write(source, name)
    return out


def judge(whl: Path, archs: str = "12.0f", members: frozenset[str] = CUDA_MEMBERS,
          setup_py: str = "", values: dict[str, str] | None = None) -> str | None:  # fmt: skip
    return wheelproof.judge(
        "pkg", "0.1", whl, setup_py=setup_py, members=members,
        archs=[Arch.parse(a) for a in archs.split()],
        values=values or {"FORCE_CUDA": "1", "TORCH_CUDA_ARCH_LIST": "12.0"},
        scratch=whl.parent / "scratch",
    )  # fmt: skip


def test_a_cuda_sdist_is_known_by_its_sources_or_its_setup_py() -> None:
    assert "csrc/add_one.cu" in (wheelproof.cuda_build("", CUDA_MEMBERS) or "")
    declared = "from torch.utils.cpp_extension import CUDAExtension\n"
    assert wheelproof.cuda_build(declared, frozenset({"setup.py"})) is not None
    assert wheelproof.cuda_build("setup()\n", frozenset({"setup.py", "src/a.cpp"})) is None


def test_a_cpu_build_of_a_cuda_sdist_fails_naming_the_switch(tmp_path: Path) -> None:
    """The FORCE_CUDA kind built on a box without a GPU: a module with no device code."""
    whl = wheel(tmp_path, {"pkg/_C.cpython-311-x86_64-linux-gnu.so": host_module()})
    why = judge(whl, values={"FORCE_CUDA": "0"})
    assert why is not None
    assert why.startswith("pkg 0.1 was built without CUDA: its sdist ships CUDA sources")
    assert "FORCE_CUDA=0" in why and "set FORCE_CUDA=1" in why and "\n" not in why
    assert not list((tmp_path / "scratch").iterdir())  # each copy read and removed


def test_a_module_with_code_for_each_arch_passes_beside_a_host_helper(tmp_path: Path) -> None:
    whl = wheel(tmp_path, {
        "pkg/_C.so": FATBIN / "libshared.so",
        "pkg/_cpu_helper.cpython-311-x86_64-linux-gnu.so": host_module(),
    })  # fmt: skip
    assert judge(whl, "12.0f") is None
    why = judge(whl, "12.0f 9.0a")
    assert why is not None and "built without code for 9.0a" in why and "sm_120" in why


def test_no_extension_module_or_no_cuda_sdist_is_not_judged(tmp_path: Path) -> None:
    """Nothing compiled (DeepSpeed with no op prebuilt), or a package that is no CUDA build."""
    assert judge(wheel(tmp_path, {})) is None
    host = wheel(tmp_path, {"pkg/_speedups.so": host_module()})
    assert judge(host, members=frozenset({"setup.py", "src/speedups.c"})) is None


def test_every_source_build_is_asked_for_cuda_and_deepspeed_for_its_accelerator() -> None:
    archs = (Arch.parse("12.0f"),)
    generic = recipes.variables(recipes.recipe_for("mmcv"), archs, jobs=1, nvcc_threads=1)
    assert generic["FORCE_CUDA"] == "1"
    ds = recipes.recipe_for("DeepSpeed")
    assert recipes.variables(ds, archs, jobs=1, nvcc_threads=1)["DS_ACCELERATOR"] == "cuda"
    assert ds.cuda_switch == "DS_ACCELERATOR=cuda"
    # The spec's build-env still wins: a CPU build asked for is one the proof then refuses.
    mine = recipes.variables(recipes.recipe_for("mmcv"), archs, jobs=1, nvcc_threads=1,
                             build_env=(("FORCE_CUDA", "0"),))  # fmt: skip
    assert mine["FORCE_CUDA"] == "0"


def test_a_recipes_host_modules_are_not_judged(tmp_path: Path) -> None:
    """DeepSpeed's CPU Adam is host code by design (its recipe's host_modules): a wheel of it
    alone is no CPU build of a CUDA op; the same module in another package is."""
    whl = wheel(tmp_path, {"deepspeed/ops/adam/cpu_adam_op.cpython-311-x86_64-linux-gnu.so":
                           host_module()})  # fmt: skip
    members = frozenset({"setup.py", "csrc/adam/multi_tensor_adam.cu"})
    ds = wheelproof.judge(
        "deepspeed", "0.19.8", whl, setup_py="", members=members, archs=[Arch.parse("12.0f")],
        values={}, scratch=tmp_path / "s",
    )  # fmt: skip
    assert ds is None
    assert judge(whl, members=members) is not None  # "pkg": no recipe names it host code
