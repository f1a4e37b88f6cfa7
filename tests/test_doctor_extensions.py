"""`cudaenv doctor`, statically: a compiled torch extension built by another CUDA than torch's.

Real inputs: each extension is a real ELF shared object that gcc links against stand-in
libraries named libc10.so, libtorch.so and libcudart.so.N (so its DT_NEEDED entries are the
linker's own), some carrying a real ``.nv_fatbin`` section with PTX of a chosen ISA; they lie
in a fake site-packages whose dist-info RECORD names them, as an installer leaves them.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections.abc import Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from builder.doctor import diagnose as doctor
from builder.doctor import extension_rules
from builder.doctor import rules as doctor_rules
from builder.env import manifest
from builder.machine import archs, fatbin
from tests.helpers import write
from tests.test_doctor import HEALTHY_DISTS, FakeEnv, a_manifest, facts_doc
from tests.test_fatbin import container, entry

CC = shutil.which("cc") or shutil.which("gcc")
pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler to link the extensions")

FLASH = "flash_attn_2_cuda.cpython-312-x86_64-linux-gnu.so"
CODE = "extension-built-for-other-cuda"
NEWER = "extension-ptx-newer-than-torch"

# name -> (the stand-in libraries it links, the PTX ISA its .nv_fatbin carries or None).
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[int, int] | None]] = {
    "cu12": (("libc10.so", "libtorch.so", "libcudart.so.12"), None),
    "cu13": (("libc10.so", "libtorch.so", "libcudart.so.13"), None),
    "plain12": (("libcudart.so.12",), None),  # links CUDA 12, not torch
    "codec": (("libtorchcodec_core.so", "libcudart.so.12"), None),  # "libtorch..." not torch
    "vendored12": (("libc10.so", "libcudart.3eda8113.so.12"), None),
    "ptx87": (("libc10_cuda.so",), (8, 7)),  # CUDA 12.8's PTX, cudart linked statically
    "ptx88": (("libc10_cuda.so",), (8, 8)),
    "ptx90": (("libc10_cuda.so",), (9, 0)),
    "ptx92": (("libc10_cuda.so",), (9, 2)),
    "ptx99": (("libc10_cuda.so",), (9, 9)),  # an ISA newer than every CUDA cudaenv knows
}


def _cc(*args: str) -> None:
    assert CC is not None
    subprocess.run([CC, "-shared", "-fPIC", *args], check=True, capture_output=True)


def _fatbin_c(isa: tuple[int, int]) -> str:
    data = container(entry(1, 90, version=isa))
    body = ", ".join(str(b) for b in data)
    return (
        '__attribute__((section(".nv_fatbin"), used))\n'
        f"static const unsigned char fatbin[{len(data)}] = {{{body}}};\n"
    )


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Mapping[str, Path]:
    """Each variant, linked once for the module."""
    root = tmp_path_factory.mktemp("elf")
    libs = root / "libs"
    empty = write(root / "empty.c", "int stand_in(void) { return 0; }\n")
    sonames = {name for links, _ in VARIANTS.values() for name in links}
    libs.mkdir()
    for soname in sonames:
        _cc(f"-Wl,-soname,{soname}", "-o", str(libs / soname), str(empty))
    out = {}
    for name, (links, isa) in VARIANTS.items():
        source = write(
            root / f"{name}.c", "int ext(void) { return 1; }\n" + (_fatbin_c(isa) if isa else "")
        )
        so = root / f"{name}.so"
        _cc("-o", str(so), str(source), "-Wl,--no-as-needed", f"-L{libs}",
            *(f"-l:{soname}" for soname in links))  # fmt: skip
        assert set(links) <= set(fatbin.needed(so).needed)  # the linker wrote them
        out[name] = so
    return out


def an_env(root: Path, dists: Mapping[str, Mapping[str, Path | bytes]]) -> Path:
    """A prefix whose site-packages holds ``dists`` ("name==version" -> {path in
    site-packages: the file to copy, or its bytes}), each with its dist-info and RECORD."""
    site = root / "lib" / "python3.12" / "site-packages"
    for dist, files in dists.items():
        name, version = dist.split("==")
        info = f"{name.replace('-', '_')}-{version}.dist-info"
        rows = []
        for rel, source in files.items():
            dest = site / rel
            dest.parent.mkdir(parents=True, exist_ok=True)
            if isinstance(source, bytes):
                dest.write_bytes(source)
            else:
                shutil.copyfile(source, dest)
            rows.append(f"{rel},sha256=-,{dest.stat().st_size}")
        write(
            site / info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
        )
        write(site / info / "RECORD", "\n".join([*rows, f"{info}/RECORD,,"]) + "\n")
    return root


def facts_of(
    prefix: Path, built_by: manifest.Manifest | None = None, **changes: Any
) -> doctor.Facts:
    doc = facts_doc(python={"executable": "/e/bin/python", "version": "3.12.1", "prefix": str(prefix)},
                    **changes)  # fmt: skip
    return doctor.Facts.from_json(doc, built_by)


def torch_of(cuda: str) -> dict[str, Any]:
    return {"installed": True, "version": f"2.14.1+cu{cuda.replace('.', '')}", "cuda": cuda}


def found(facts: doctor.Facts) -> list[doctor.Finding]:
    return extension_rules.rule_extension_cuda(facts)


# --------------------------------------------------------------------------- the verdicts


def test_an_extension_linking_another_cuda_runtime_is_an_error(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    """flash-attn compiled with a CUDA 12.8 toolkit beside a cu130 torch: named with its file,
    the runtime it links, torch's version and CUDA, and how to rebuild it in this env."""
    prefix = an_env(tmp_path, {"flash-attn==2.8.3": {FLASH: built["cu12"]}})
    [finding] = found(facts_of(prefix))
    assert finding.code == CODE
    assert finding.severity == doctor.ERROR
    assert finding.cause == (
        f"flash-attn 2.8.3: {FLASH} is a torch extension built by CUDA 12, but torch "
        '2.14.1+cu130 is CUDA 13.0: importing it fails ("libcudart.so.12: cannot open shared '
        "object file\"), or maps a second CUDA runtime beside torch's where another toolkit's "
        "libraries are on the loader's path"
    )
    assert finding.evidence == (
        f"{FLASH}: links libcudart.so.12 (CUDA 12)",
        "torch 2.14.1+cu130 (CUDA 13.0)",
    )
    # Not a cudaenv env: adopt it and rebuild the package with the matched nvcc in one step.
    assert finding.fix == (
        "give this env torch's matched nvcc and rebuild it against that: `cudaenv adopt "
        "--python /e/bin/python --rebuild flash-attn`",
        "or adopt first, then rebuild it by hand: `uv pip install --no-build-isolation "
        "--no-deps --reinstall-package flash-attn --no-binary flash-attn --python "
        "/e/bin/python flash-attn==2.8.3`",
        "what this is and why: docs/troubleshooting/cuda-version-mismatch.md",
    )
    # The whole diagnosis puts it first.
    assert doctor_rules.diagnose(facts_of(prefix))[0].code == CODE


def test_a_matched_extension_and_what_does_not_link_torch_say_nothing(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    prefix = an_env(
        tmp_path,
        {
            "flash-attn==2.8.3": {FLASH: built["cu13"]},  # libcudart.so.13 beside CUDA 13.0
            "some-lib==1.0": {"some_lib/_native.so": built["plain12"]},  # no torch in it
            "torchcodec==0.17.0": {"torchcodec/libtorchcodec_x.so": built["codec"]},
        },
    )
    assert found(facts_of(prefix)) == []
    # The same files against a CUDA 12 torch: the matched one is now the odd one out, and
    # only it (the others link no torch).
    [finding] = found(facts_of(prefix, torch=torch_of("12.8")))
    assert finding.evidence[0] == f"{FLASH}: links libcudart.so.13 (CUDA 13)"


def test_a_vendored_runtime_of_another_major_counts(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    prefix = an_env(tmp_path, {"vision-ext==1.0": {"vision_ext/_C.so": built["vendored12"]}})
    [finding] = found(facts_of(prefix))
    assert finding.evidence[0] == "vision_ext/_C.so: links libcudart.3eda8113.so.12 (CUDA 12)"


def test_ptx_says_which_cuda_compiled_it(tmp_path: Path, built: Mapping[str, Path]) -> None:
    """No libcudart linked (a static runtime): the PTX's ISA names the nvcc. Another major is
    an error naming the release; an older minor of torch's major is fine; a newer one, a note."""
    prefix = an_env(tmp_path / "a", {"ext-a==1.0": {"ext_a/_C.so": built["ptx87"]}})
    [finding] = found(facts_of(prefix))
    assert finding.code == CODE
    assert finding.evidence[0] == "ext_a/_C.so: carries PTX ISA 8.7, made by CUDA 12.8"
    assert "built by CUDA 12.8, but torch 2.14.1+cu130 is CUDA 13.0: it was compiled" in (
        finding.cause
    )
    older = an_env(tmp_path / "b", {"ext-b==1.0": {"ext_b/_C.so": built["ptx90"]}})
    assert found(facts_of(older)) == []
    assert found(facts_of(older, torch=torch_of("13.1"))) == []
    newer = an_env(tmp_path / "c", {"ext-c==1.0": {"ext_c/_C.so": built["ptx92"]}})
    [note] = found(facts_of(newer))
    assert (note.code, note.severity) == (NEWER, doctor.INFO)
    assert note.cause.startswith(
        "ext-c 1.0 carries PTX made by CUDA 13.2 (PTX ISA 9.2), newer than the CUDA of torch "
        "2.14.1+cu130 (CUDA 13.0): a driver older than that CUDA cannot compile it"
    )
    assert note.evidence == (
        "ext_c/_C.so: carries PTX ISA 9.2, made by CUDA 13.2",
        "torch 2.14.1+cu130 (CUDA 13.0)",
    )
    # CUDA 12.9's PTX beside a CUDA 12.8 torch: a note, unless the driver runs CUDA 13 (and
    # so every minor of 12).
    newer12 = an_env(tmp_path / "e", {"ext-e==1.0": {"ext_e/_C.so": built["ptx88"]}})
    cu128 = torch_of("12.8")
    assert [
        f.code for f in found(facts_of(newer12, torch=cu128, driver={"version": "570.86.15"}))
    ] == [NEWER]
    assert found(facts_of(newer12, torch=cu128, driver={"version": "580.65.06"})) == []
    unknown = an_env(tmp_path / "d", {"ext-d==1.0": {"ext_d/_C.so": built["ptx99"]}})
    [note] = found(facts_of(unknown))
    assert (
        note.evidence[0] == "ext_d/_C.so: carries PTX ISA 9.9, newer than every CUDA cudaenv knows"
    )


def test_a_cpu_torch_or_no_torch_is_not_judged(tmp_path: Path, built: Mapping[str, Path]) -> None:
    prefix = an_env(tmp_path, {"flash-attn==2.8.3": {FLASH: built["cu12"]}})
    assert (
        found(facts_of(prefix, torch={"installed": True, "version": "2.14.1", "cuda": None})) == []
    )
    assert found(facts_of(prefix, torch={"installed": False})) == []


# --------------------------------------------------------------------------- cudaenv's envs


def test_in_a_cudaenv_env_the_fix_is_cudaenv_add_and_source_builds_come_first(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    prefix = an_env(
        tmp_path,
        {
            "aaa-ext==1.0": {"aaa_ext/_C.so": built["cu12"]},
            "zzz-ext==2.0": {"zzz_ext/_C.so": built["cu12"], "zzz_ext/_D.so": built["cu12"]},
        },
    )
    made = replace(a_manifest(), source_builds=(("zzz-ext", "2.0", "s" * 64, "k" * 16),))
    first, second = found(facts_of(prefix, made))
    assert first.cause.startswith("zzz-ext 2.0: zzz_ext/_C.so and 1 more of its files is a torch")
    assert first.evidence[-1] == "zzz-ext was built from its sdist by cudaenv (this env's manifest)"
    assert first.fix[0] == (
        "rebuild it with this env's matched nvcc: `cudaenv add zzz-ext==2.0 --spec "
        "envspecs/default.yaml`"
    )
    assert second.cause.startswith("aaa-ext 1.0: aaa_ext/_C.so is a torch extension")
    adopted = replace(a_manifest(), spec=manifest.ADOPTED_SPEC)
    [*_, last] = found(facts_of(prefix, adopted))
    assert last.fix[0] == (
        "rebuild it from its sdist with the toolkit cudaenv adopt gave this env: `cudaenv "
        f"adopt --python {facts_of(prefix, adopted).python} --rebuild zzz-ext`"
    )
    assert last.fix[1].startswith("or by hand (not undone by `cudaenv adopt --undo`): `uv pip")


def test_the_import_error_of_deep_is_grouped_under_the_static_finding(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    prefix = an_env(tmp_path, {"flash-attn==2.8.3": {FLASH: built["cu12"]}})
    error = (
        "ImportError: libcudart.so.12: cannot open shared object file: No such file or "
        f"directory ({prefix}/lib/python3.12/site-packages/{FLASH})"
    )
    facts = facts_of(
        prefix, deep={"torch": {"version": "2.14.1+cu130"}, "imports": {"flash_attn": error}}
    )
    findings = doctor_rules.diagnose(facts)
    assert findings[0].code == CODE
    assert [s.code for s in findings[0].symptoms] == ["built-for-other-cuda-major"]
    assert "built-for-other-cuda-major" not in [f.code for f in findings]


# --------------------------------------------------------------------------- untrusted files


def test_a_corrupt_or_truncated_extension_gives_no_traceback(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    whole = built["cu12"].read_bytes()
    prefix = an_env(
        tmp_path,
        {
            "broken==1.0": {
                "broken/half.so": whole[: len(whole) // 2],
                "broken/garbage.so": b"\x7fELF" + b"\xff" * 60,
                "broken/empty.so": b"",
                "broken/script.so": b"INPUT(-lfoo)\n",  # a linker script named .so
            },
        },
    )
    record = prefix / "lib" / "python3.12" / "site-packages" / "broken-1.0.dist-info" / "RECORD"
    with record.open("a") as fh:  # rows no file has: a NUL, a missing file, a directory
        fh.write('broken/a\0b.so,,\nbroken/missing.so,,\nbroken,,\n"broken/unclosed.so,,\n')
    findings = doctor_rules.diagnose(facts_of(prefix))
    assert [f.code for f in findings if f.code in (CODE, "rule-crashed")] == []
    # Damage anywhere in a real extension: never an exception.
    path = prefix / "lib" / "python3.12" / "site-packages" / "broken" / "half.so"
    for at in range(0, len(whole), 97):
        damaged = bytearray(whole)
        damaged[at : at + 8] = b"\xff" * 8
        path.write_bytes(bytes(damaged))
        assert isinstance(found(facts_of(prefix)), list)


def test_a_symlink_out_of_the_env_is_not_followed(
    tmp_path: Path, built: Mapping[str, Path]
) -> None:
    """Each of these reaches a mismatched extension outside the env: none is read."""
    outside = tmp_path / "outside"
    outside.mkdir()
    shutil.copyfile(built["cu12"], outside / "_C.so")
    prefix = an_env(tmp_path / "env", {"linked==1.0": {}})
    site = prefix / "lib" / "python3.12" / "site-packages"
    (site / "linked").mkdir()
    (site / "linked" / "_C.so").symlink_to(outside / "_C.so")
    (site / "through_dir").symlink_to(outside)
    record = site / "linked-1.0.dist-info" / "RECORD"
    rows = ["linked/_C.so,,", "through_dir/_C.so,,", "../../../../outside/_C.so,,",
            f"{outside}/_C.so,,"]  # fmt: skip
    record.write_text("\n".join(rows) + "\n")
    assert found(facts_of(prefix)) == []
    # The control: the same file inside the env is found.
    shutil.copyfile(built["cu12"], site / "linked" / "_E.so")
    record.write_text(record.read_text() + "linked/_E.so,,\n")
    assert [f.code for f in found(facts_of(prefix))] == [CODE]


def test_a_record_that_is_a_symlink_or_huge_is_not_read(
    tmp_path: Path, built: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    prefix = an_env(tmp_path / "env", {"flash-attn==2.8.3": {FLASH: built["cu12"]}})
    record = (
        prefix / "lib" / "python3.12" / "site-packages" / "flash_attn-2.8.3.dist-info" / "RECORD"
    )
    assert len(found(facts_of(prefix))) == 1
    monkeypatch.setattr(extension_rules, "MAX_RECORD_BYTES", record.stat().st_size - 1)
    assert found(facts_of(prefix)) == []
    monkeypatch.undo()
    kept = tmp_path / "RECORD"
    record.rename(kept)
    record.symlink_to(kept)
    assert found(facts_of(prefix)) == []


# --------------------------------------------------------------------------- the real probe


def test_the_real_probe_of_a_venv_finds_it(
    tmp_path: Path, built: Mapping[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """`cudaenv doctor` on a real venv (the probe run inside it), as a user's pip left it."""
    monkeypatch.setattr(archs, "visible_gpus", lambda: ([], "no GPU in this test"))
    env = FakeEnv(tmp_path)
    env.dists(HEALTHY_DISTS)
    info = env.site / "flash_attn-2.8.3.dist-info"
    shutil.copyfile(built["cu12"], env.site / FLASH)
    write(info / "RECORD", f"{FLASH},,\n{info.name}/RECORD,,\n")
    started = time.monotonic()
    _facts, findings, _ = doctor.probe(str(env.python), deep=False)
    assert time.monotonic() - started < 5  # static: no torch import, no compile
    assert findings[0].code == CODE
    assert (
        findings[0].fix[0].endswith(f"`cudaenv adopt --python {env.python} --rebuild flash-attn`")
    )
    text = doctor.render(env.python, _facts, findings)
    assert (
        f"[error] {CODE}: flash-attn 2.8.3: {FLASH} is a torch extension built by CUDA 12" in text
    )
