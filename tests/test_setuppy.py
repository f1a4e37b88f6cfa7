"""What a setup.py surely demands of a CUDA build, read without running it
(builder/env/setuppy.py), and the metadata the resolver is handed instead of running one
(builder/env/recipes.py, builder/spec/uvcompile.py)."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from packaging.version import Version

from builder.env import recipes, setuppy
from builder.spec import envspec, uvconfig
from tests.helpers import write

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

# The shape of causal-conv1d 1.7.0's setup.py: -std=c++17 only for a ROCm build, old archs
# only for a CUDA of 12.9 or older, the newest only from 13.0.
CAUSAL = """\
import os
HIP_BUILD = bool(os.getenv("ROCM_PATH"))
cc_flag = []
bare_metal_version = detect()
if bare_metal_version <= Version("12.9"):
    cc_flag.append("arch=compute_62,code=sm_62")
cc_flag.append("arch=compute_75,code=sm_75")
if bare_metal_version >= Version("13.0"):
    cc_flag.append("arch=compute_110,code=sm_110")
if HIP_BUILD:
    args = {"cxx": ["-O3", "-std=c++17"]}
else:
    args = {"cxx": ["-O3"], "nvcc": ["-O3"] + cc_flag}
ext = CUDAExtension(name="c._C", sources=["csrc/a.cpp", "csrc/b.cu"], extra_compile_args=args)
"""
MEMBERS = frozenset({"setup.py", "csrc/a.cpp", "csrc/b.cu"})


def test_what_only_a_rocm_build_or_another_cuda_would_pass_is_not_held_against_it() -> None:
    # The line-by-line reading this replaced refused causal-conv1d 1.7.0 for its ROCm flag.
    assert re.search(r"-std=c\+\+17", CAUSAL)
    assert (
        recipes.before_compiling("c", "1", CAUSAL, "2.14.1", nvcc="13.0", members=MEMBERS) is None
    )
    d = setuppy.read(CAUSAL, "13.0")
    assert d is not None and d.standards == ()
    assert sorted(a for _, a in d.archs) == [75, 110]
    on_12 = setuppy.read(CAUSAL, "12.8")
    assert on_12 is not None and sorted(a for _, a in on_12.archs) == [62, 75]


def test_an_arch_the_toolkit_dropped_is_refused_before_compiling_with_its_line() -> None:
    text = CAUSAL.replace('cc_flag.append("arch=compute_75', 'cc_flag.append("arch=compute_53')
    why = recipes.before_compiling("c", "1.5.2", text, "2.14.1", nvcc="13.0", members=MEMBERS)
    assert why == (
        "c 1.5.2 cannot build with nvcc 13.0: its setup.py (line 7) asks for compute_53, and "
        "nvcc 13.0 compiles for compute_75 and newer; use a release that asks for no older "
        "arch, or a toolkit that still has it"
    )
    # CUDA 12's nvcc still compiles for it.
    assert recipes.before_compiling("c", "1.5.2", text, "2.14.1", nvcc="12.8") is None


def test_a_cuda_build_that_surely_passes_cxx17_is_refused_against_torch_2_13() -> None:
    text = CAUSAL.replace('"cxx": ["-O3"]', '"cxx": ["-O3", "-std=c++17"]')
    why = recipes.before_compiling("c", "1", text, "2.14.1", nvcc="13.0", members=MEMBERS)
    assert why is not None and "(line 13) passes -std=c++17" in why
    assert recipes.before_compiling("c", "1", text, "2.12.0", nvcc="13.0") is None


def test_sources_the_sdist_lacks_are_said_before_compiling() -> None:
    why = recipes.before_compiling(
        "fast-hadamard-transform", "1.1.0", CAUSAL, "2.14.1", nvcc="13.0",
        members=frozenset({"setup.py", "csrc/a.cpp"}),
    )  # fmt: skip
    assert why is not None and why.startswith(
        "fast-hadamard-transform 1.1.0 cannot build: its sdist lacks csrc/b.cu, which its "
        "setup.py (line 14) compiles"
    )


@pytest.mark.parametrize(
    "text",
    [
        # unknown tests and functions that may never run: nothing is sure there
        'if os.getenv("OLD"):\n    f = ["arch=compute_53,code=sm_53", "-std=c++17"]\n',
        'def old():\n    return ["arch=compute_53,code=sm_53", "-std=c++17"]\n',
        'try:\n    pass\nexcept ImportError:\n    f = ["arch=compute_53,code=sm_53"]\n',
        "this is not python (\n",
    ],
)
def test_nothing_unsure_is_held_against_a_release(text: str) -> None:
    assert recipes.before_compiling("c", "1", text, "2.14.1", nvcc="13.0") is None


def test_the_tests_of_a_setup_py_are_judged_where_they_can_be() -> None:
    def truth(src: str, nvcc: str = "13.0") -> bool | None:
        return setuppy.truth(ast.parse(src, mode="eval").body, Version(nvcc))

    assert truth("HIP_BUILD") is False and truth("not IS_ROCM") is True
    assert truth("torch.version.hip") is False and truth("not SKIP_CUDA_BUILD") is True
    assert truth('cuda_version >= Version("12.8")') is True
    assert truth('Version("12.8") > bare_metal_version', "12.4") is True
    assert truth('bare_metal_version >= parse("13.0") and not HIP_BUILD', "12.8") is False
    assert truth("FORCE_BUILD") is None and truth('x >= Version("1")') is None
    # "ship" is not HIP
    assert truth("SHIP_IT") is None


def spec_of(root: Path, packages: str) -> envspec.EnvSpec:
    path = write(
        root / "envspecs" / "s.yaml",
        f'name: s\npython: "3.12"\ncuda: "13.0"\ntorch: "2.14.1"\npackages: [{packages}]\n'
        'archs: ["12.0f"]\n',
    )
    return envspec.load(path)


def test_uv_is_handed_the_metadata_of_known_sdists_and_keeps_the_projects_settings(
    tmp_path: Path,
) -> None:
    write(
        tmp_path / "pyproject.toml",
        '[tool.cudaenv]\nlocks = "urls"\n\n[tool.uv]\nprerelease = "allow"\n'
        'extra-index-url = ["https://example.invalid/simple"]\n\n'
        '[[tool.uv.index]]\nname = "mine"\nurl = "https://example.invalid/mine"\n'
        "explicit = true\n\n[tool.uv.pip]\nstrict = true\n",
    )
    spec = spec_of(tmp_path, "causal-conv1d==1.7.0, sglang")
    (tmp_path / "d").mkdir()
    where = uvconfig.supplied_config(tmp_path / "d", spec)
    assert where is not None
    config = tomllib.loads((where / "uv.toml").read_text())
    assert config["dependency-metadata"] == [
        {"name": "causal-conv1d", "requires-dist": ["torch", "packaging", "ninja"]}
    ]
    table = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["uv"]
    assert {k: v for k, v in config.items() if k != "dependency-metadata"} == table
    # A project uv.toml wins over [tool.uv], as uv reads them.
    write(tmp_path / "uv.toml", 'prerelease = "disallow"\n')
    (tmp_path / "e").mkdir()
    again = uvconfig.supplied_config(tmp_path / "e", spec)
    assert again is not None
    assert tomllib.loads((again / "uv.toml").read_text())["prerelease"] == "disallow"


def test_a_stack_of_wheels_is_resolved_where_it_always_was(tmp_path: Path) -> None:
    assert uvconfig.supplied_config(tmp_path, spec_of(tmp_path, "sglang==0.5.23")) is None


def test_the_projects_own_metadata_for_a_package_wins(tmp_path: Path) -> None:
    write(
        tmp_path / "uv.toml",
        '[[dependency-metadata]]\nname = "Causal_Conv1d"\nrequires-dist = ["torch"]\n',
    )
    write(tmp_path / "pyproject.toml", "[tool.cudaenv]\n")
    (tmp_path / "d").mkdir()
    spec = spec_of(tmp_path, "causal-conv1d==1.7.0, fast-hadamard-transform")
    where = uvconfig.supplied_config(tmp_path / "d", spec)
    assert where is not None
    entries = tomllib.loads((where / "uv.toml").read_text())["dependency-metadata"]
    assert entries == [
        {"name": "Causal_Conv1d", "requires-dist": ["torch"]},
        {"name": "fast-hadamard-transform", "requires-dist": ["torch", "packaging", "ninja"]},
    ]


def test_the_progress_line_names_a_setup_pys_own_gencode_list() -> None:
    from builder.env import sdistbuild

    own = (
        'cc_flag = ["-gencode", "arch=compute_75,code=sm_75"]\n'
        'if bare_metal_version >= Version("13.0"):\n'
        '    cc_flag += ["-gencode", "arch=compute_121,code=sm_121"]\n'
    )
    said = sdistbuild._archs_said(own, "13.0", "12.0f")
    assert said == "its setup.py's own list (7.5, 12.1; the spec's 12.0f does not narrow it)"
    assert "12.1" not in sdistbuild._archs_said(own, "12.8", "12.0f")
    assert sdistbuild._archs_said("setup()\n", "13.0", "12.0f") == "12.0f"


def test_the_projects_uv_settings_are_written_as_toml_reads_them(tmp_path: Path) -> None:
    # A TOML date-time stays one (not its str() as a string), a quoted key stays quoted.
    write(
        tmp_path / "pyproject.toml",
        "[tool.cudaenv]\n\n[tool.uv]\nexclude-newer = 2026-12-01T00:00:00Z\n"
        '"odd key" = "a \\"quoted\\" value"\n',
    )
    (tmp_path / "d").mkdir()
    where = uvconfig.supplied_config(tmp_path / "d", spec_of(tmp_path, "causal-conv1d==1.7.0"))
    assert where is not None
    written = tomllib.loads((where / "uv.toml").read_text())
    table = tomllib.loads((tmp_path / "pyproject.toml").read_text())["tool"]["uv"]
    assert {k: v for k, v in written.items() if k != "dependency-metadata"} == table
