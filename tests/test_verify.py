"""Offline: the reference sampler, the statistics, and each check's verdict on broken input."""

from __future__ import annotations

import dataclasses
import json
import math
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from builder.core.statuses import FAILED, PASSED, SKIPPED
from builder.machine import archs, driver
from builder.verify import flashinfer_jit, report, sampling, toolchain
from builder.verify import reference as ref
from builder.verify.model import Target
from tests.helpers import a_manifest, env_facts, write

PROBS = (0.1, 0.3, 0.05, 0.3, 0.2, 0.05)  # ties: 1 & 3 (0.3), 2 & 5 (0.05)


def test_order_is_probability_descending_ties_by_index() -> None:
    assert ref.order(PROBS) == [1, 3, 4, 0, 2, 5]


def test_kept_set_is_top_k_intersect_top_p() -> None:
    assert ref.kept_set(PROBS, 0, 1.0) == [1, 3, 4, 0, 2, 5]
    assert ref.kept_set(PROBS, 2, 1.0) == [1, 3]
    assert ref.kept_set(PROBS, 0, 0.5) == [1, 3]  # 0.3 before token 3 < 0.5; 0.6 >= 0.5 stops
    assert ref.kept_set(PROBS, 0, 0.3) == [1]
    assert ref.kept_set(PROBS, 4, 0.7) == [1, 3, 4]
    assert ref.kept_set(PROBS, 1, 0.01) == [1]  # always at least one token


def test_sample_is_inverse_cdf_over_the_renormalised_set() -> None:
    # kept [1, 3], mass 0.6: u < 0.5 -> token 1, else token 3
    assert ref.sample(PROBS, 2, 1.0, 0.0) == 1
    assert ref.sample(PROBS, 2, 1.0, 0.49) == 1
    assert ref.sample(PROBS, 2, 1.0, 0.51) == 3
    assert ref.sample(PROBS, 2, 1.0, 0.9999999) == 3
    assert ref.renormalised(PROBS, 2, 1.0) == pytest.approx({1: 0.5, 3: 0.5})


def test_chi2_survival_function_matches_known_values() -> None:
    # scipy.stats.chi2.sf reference values
    assert ref.chi2_sf(3.841458820694124, 1) == pytest.approx(0.05, rel=1e-9)
    assert ref.chi2_sf(18.307038053275146, 10) == pytest.approx(0.05, rel=1e-9)
    assert ref.chi2_sf(10.0, 5) == pytest.approx(0.07523524614651217, rel=1e-9)
    assert ref.chi2_sf(0.5, 3) == pytest.approx(0.9188914116214535, rel=1e-9)
    assert ref.chi2_sf(0.0, 4) == 1.0


Sampler = Callable[[ref.Case, random.Random], int]


def draw(cases: Sequence[ref.Case], sampler: Sampler, n: int = sampling.DRAWS) -> list[list[int]]:
    rng = random.Random(1)  # noqa: S311 - reproducible
    return [[sampler(c, rng) for _ in range(n)] for c in cases]


def correct(case: ref.Case, rng: random.Random) -> int:
    return ref.sample(case.probs, case.top_k, case.top_p, rng.random())


def ignores_top_p(case: ref.Case, rng: random.Random) -> int:
    return ref.sample(case.probs, case.top_k, 1.0, rng.random())


def ignores_top_k(case: ref.Case, rng: random.Random) -> int:
    return ref.sample(case.probs, 0, case.top_p, rng.random())


def unnormalised_tail(case: ref.Case, rng: random.Random) -> int:
    # Stays inside the set but favours the first kept token: only chi-square can see it.
    kept = ref.kept_set(case.probs, case.top_k, case.top_p)
    return kept[0] if rng.random() < 0.1 else correct(case, rng)


def failed(verdicts: Sequence[ref.Verdict]) -> list[str]:
    return [v.detail for v in verdicts if not v.passed]


@pytest.mark.slow
def test_a_correct_sampler_passes_every_verdict() -> None:
    cases = ref.make_cases()
    assert failed(sampling.judge_draws(cases, draw(cases, correct))) == []


@pytest.mark.slow
@pytest.mark.parametrize("broken", [ignores_top_p, ignores_top_k])
def test_a_sampler_ignoring_a_filter_fails_membership_and_chi_square(broken: Sampler) -> None:
    cases = ref.make_cases()
    bad = failed(sampling.judge_draws(cases, draw(cases, broken)))
    assert any("outside the top-k ∩ top-p set" in b for b in bad)
    assert any(b.split(": ", 1)[1].startswith("chi2=") for b in bad)


@pytest.mark.slow
def test_chi_square_sees_a_skew_that_membership_cannot() -> None:
    cases = ref.make_cases()
    bad = failed(sampling.judge_draws(cases, draw(cases, unnormalised_tail)))
    assert bad
    assert all("chi2=" in b for b in bad)


@pytest.mark.slow
def test_exact_check_catches_one_index_off() -> None:
    cases = ref.make_cases()
    us = sampling.uniforms(7, len(cases))
    right = [
        [ref.sample(c.probs, c.top_k, c.top_p, u) for u in row]
        for c, row in zip(cases, us, strict=True)
    ]
    assert failed(sampling.judge_kernel(cases, us, right)) == []
    vocab = len(cases[0].probs)
    off = [[(t + 1) % vocab for t in row] for row in right]
    bad = failed(sampling.judge_kernel(cases, us, off))
    assert bad[0].startswith(
        f"{len(cases) * sampling.DRAWS}/{len(cases) * sampling.DRAWS} samples differ"
    )


def test_harness_input_round_trips_floats(tmp_path: Path) -> None:
    cases = ref.make_cases()[:2]
    us = [[0.1, 1 / 3], [0.5, 0.999]]
    path = tmp_path / "in.txt"
    ref.write_input(str(path), cases, us)
    lines = path.read_text().splitlines()
    assert lines[0] == f"2 {len(cases[0].probs)} 2"
    assert [float(x) for x in lines[2].split()] == list(cases[0].probs)
    assert float(lines[3].split()[1]) == 1 / 3


facts = env_facts


TARGET = Target(
    python=Path("/env/bin/python"),
    archs=archs.DEFAULT_ARCHS,
    work=Path("/env/var/cudaenv"),
    env_dir=Path("/env"),
    expected_cuda="13.0",
    spec_name="x",
    spec_path="envspecs/x.yaml",
)


def test_toolchain_passes_when_all_agree() -> None:
    result = toolchain.check(TARGET, facts())
    assert result.status == PASSED
    assert result.summary.startswith("CUDA 13.0: torch.version.cuda, the spec, nvcc in CUDA_HOME")
    assert result.seconds == pytest.approx(0.9)


def test_toolchain_fails_naming_both_versions() -> None:
    bad = facts(
        cuda_home="/usr/local/cuda-12.8",
        nvcc_release="12.8",
        nvcc_path="/usr/local/cuda-12.8/bin/nvcc",
        cudart_version="12.8",
        flashinfer_cuda_path="/usr/local/cuda-12.8",
        flashinfer_cuda_version="12.8",
    )
    result = toolchain.check(TARGET, bad)
    assert result.status == FAILED
    assert (
        "nvcc in CUDA_HOME (/usr/local/cuda-12.8/bin/nvcc) is 12.8 but torch.version.cuda is 13.0"
        in result.summary
    )
    assert "FlashInfer get_cuda_version() is 12.8 but torch.version.cuda is 13.0" in result.summary
    assert result.fix.startswith("rebuild the env: `cudaenv build envspecs/x.yaml`")


def test_toolchain_fails_without_nvcc_even_if_flashinfer_falls_back() -> None:
    # FlashInfer silently falls back to torch.version.cuda when nvcc is missing.
    result = toolchain.check(TARGET, facts(nvcc_release=None, nvcc_error="no bin/nvcc"))
    assert result.status == FAILED
    assert "no working nvcc: no bin/nvcc" in result.summary


def test_flashinfer_jit_verdicts() -> None:
    assert flashinfer_jit.check(TARGET, facts()).status == PASSED
    outside = facts(jit={"library": "/home/user/.cache/flashinfer/sampling.so", "reused": True})
    assert flashinfer_jit.check(TARGET, outside).status == FAILED
    link = facts(jit={"error": "ld: cannot find -lcudart", "seconds": 3.0})
    result = flashinfer_jit.check(TARGET, link)
    assert result.status == FAILED
    assert "flashinfer#5064" in result.summary
    none = flashinfer_jit.check(TARGET, facts(flashinfer_installed=False))
    assert none.status == SKIPPED


def test_the_jit_check_says_reused_only_when_ninja_ran_nothing() -> None:
    """The probe's account of what ninja ran decides: a library that existed before the
    build while ninja compiled three objects is "built", never "reused"."""
    library = "/env/var/flashinfer/x/sampling.so"
    ran = ["sampling.cuda.o", "renorm.cuda.o", "flashinfer_sampling_binding.cuda.o"]
    built = flashinfer_jit.check(TARGET, facts(jit={"library": library, "reused": False,
                                                    "ran": ran, "seconds": 92.0}))  # fmt: skip
    assert "reused" not in built.summary and "3 command(s) run by ninja" in built.summary
    assert dict(built.evidence)["ninja ran"] == ", ".join(ran)
    same = flashinfer_jit.check(TARGET, facts(jit={"library": library, "reused": True,
                                                   "ran": [], "seconds": 0.4}))  # fmt: skip
    assert "reused from the env's JIT cache (ninja ran nothing)" in same.summary


def test_sampling_skips_without_a_driver(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(driver, "detect", lambda: None)
    monkeypatch.delenv(sampling.GPU_CHECK, raising=False)
    result = sampling.check(TARGET, facts())
    assert result.status == SKIPPED
    assert result.summary == driver.not_found()


def test_report_renders_json_table_and_markdown(tmp_path: Path) -> None:
    results = [
        toolchain.check(TARGET, facts()),
        flashinfer_jit.check(TARGET, facts(jit={"error": "boom"})),
    ]
    rep = report.verify_report(TARGET, facts(), results, 2.5, a_manifest(lock_hash="sha256:abc"))
    out = tmp_path / "r.json"
    report.write_json(rep, out)
    doc = json.loads(out.read_text())
    assert doc["schema_version"] == report.SCHEMA_VERSION
    assert doc["status"] == "failed"
    assert [c["status"] for c in doc["checks"]] == ["passed", "failed"]
    assert doc["lock_hash"] == "sha256:abc"
    table = report.terminal(rep)
    assert table.splitlines()[0] == "verify x: FAILED in 2.5 s"
    assert "fix (flashinfer-jit):" in table
    md = report.markdown(rep)
    assert "| flashinfer-jit | ❌ failed |" in md
    assert "| toolchain | ✅ passed |" in md
    assert math.isfinite(doc["seconds"])


def test_flashinfer_jit_names_the_component_a_missing_header_needs() -> None:
    error = (
        "sampling.cuh:21:10: fatal error: curand.h: No such file or directory\n#include <curand.h>"
    )
    result = flashinfer_jit.check(TARGET, facts(jit={"error": error, "seconds": 24.0}))
    assert result.status == FAILED
    assert (
        result.summary == "FlashInfer's sampling module did not build (the toolkit has no curand.h)"
    )
    assert result.fix.startswith("add 'curand' to the spec's toolchain.components")


def fake_cuobjdump(tmp_path: Path, listing: dict[str, str]) -> Path:
    """A cuobjdump that lists, per artifact file name, the given sm_XX cubins."""
    home = tmp_path / "cuda-home"
    cases = "".join(
        f'  *{name}) for s in {sms}; do echo "ELF file 1: x.$s.cubin"; done ;;\n'
        for name, sms in listing.items()
    )
    tool = write(home / "bin" / "cuobjdump", f'#!/bin/sh\ncase "$2" in\n{cases}esac\n')
    tool.chmod(0o755)
    write(home / "bin" / "nvcc", "#!/bin/sh\n").chmod(0o755)
    return home


def test_cubin_checks_every_artifact_against_every_requested_arch(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from builder.verify import cubin, kernel_compile

    def fake_build(nvcc: Path, arch: Any, work: Path, **kw: Any) -> kernel_compile.KernelBuild:
        return kernel_compile.KernelBuild(
            arch=arch, path=write(tmp_path / f"topk_topp.{arch.sm}", "x"), seconds=0, reused=True
        )

    monkeypatch.setattr(cubin, "build_kernel", fake_build)
    library = write(tmp_path / "sampling.so", "x")
    home = fake_cuobjdump(
        tmp_path,
        {"topk_topp.sm_90a": "sm_90a", "topk_topp.sm_120f": "sm_120", "sampling.so": "sm_120"},
    )
    both = dataclasses.replace(TARGET, archs=archs.parse_list("9.0a 12.0f"))
    f = facts(cuda_home=str(home), jit={"library": str(library)})
    result = cubin.check(both, f)
    # The false PASS this replaces: FlashInfer's library holds no sm_90 but 9.0a was asked.
    assert result.status == FAILED
    assert result.summary == "flashinfer sampling has no sm_90 cubin for 9.0a (it holds sm_120)"
    only = dataclasses.replace(TARGET, archs=archs.parse_list("12.0f"))
    ok = cubin.check(only, f)
    assert ok.status == PASSED
    assert ok.summary == (
        "2 artifact/arch pair(s) checked: topk_topp 12.0f holds sm_120; "
        "flashinfer sampling holds sm_120"
    )


def test_flashinfer_jit_fails_when_it_built_other_archs_than_verified() -> None:
    asked = dataclasses.replace(TARGET, archs=archs.parse_list("9.0a"))
    result = flashinfer_jit.check(asked, facts())
    assert result.status == FAILED
    assert result.summary == "FlashInfer JIT-built for 12.0f but verify asked for 9.0a"
    honoured = facts(env={"FLASHINFER_CUDA_ARCH_LIST": "9.0a"})
    assert flashinfer_jit.check(asked, honoured).status == PASSED


@pytest.mark.slow
def test_a_long_step_says_it_is_still_running(monkeypatch: pytest.MonkeyPatch) -> None:
    """FlashInfer's JIT takes ~90 s: a line with the elapsed time comes every few seconds
    instead of silence; none once the step is over."""
    import time

    from builder import verify

    monkeypatch.setattr(verify, "HEARTBEAT_SECONDS", 0.05)
    said: list[str] = []
    with verify.heartbeat(said.append, "still JIT-building"):
        time.sleep(0.3)
    count = len(said)
    assert count >= 3
    assert all(s.startswith("still JIT-building (") and s.endswith(" s)") for s in said)
    time.sleep(0.2)
    assert len(said) == count


def test_verify_and_doctor_take_the_same_cuda_home(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A plain interpreter (no torch), CUDA_HOME unset, an nvcc on PATH: verify's probe takes
    the toolkit doctor names first (FlashInfer's and torch's lookup order), not "unset"; and
    the fix reads as a sentence."""
    import sys

    from builder import verify
    from builder.doctor import diagnose as doctor
    from builder.machine.archs import Arch
    from builder.verify import toolchain

    home = tmp_path / "cuda-13.0"
    nvcc = home / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True)
    nvcc.write_text("#!/bin/sh\necho 'Cuda compilation tools, release 13.0, V13.0.88'\n")
    nvcc.chmod(0o755)
    monkeypatch.delenv("CUDA_HOME", raising=False)
    monkeypatch.delenv("CUDA_PATH", raising=False)
    monkeypatch.setenv("PATH", f"{home / 'bin'}:/usr/bin:/bin")
    target = verify.Target(
        python=Path(sys.executable), archs=(Arch.parse("12.0f"),), work=tmp_path / "work"
    )
    facts = verify.probe(target, jit=False)
    dfacts, _, _ = doctor.probe(sys.executable, deep=False)
    assert dfacts is not None and dfacts.jit_home is not None
    assert facts.cuda_home == dfacts.jit_home.path == str(home)
    assert facts.cuda_home_source == dfacts.jit_home.source == f"which nvcc ({nvcc})"
    assert facts.nvcc_release == "13.0"
    result = toolchain.check(target, facts)
    assert result.evidence[0] == ("CUDA_HOME", f"{home} (from which nvcc ({nvcc}))")
    assert result.status == "failed"  # no cudart in this stand-in toolkit
    assert result.fix.startswith("point CUDA_HOME at a CUDA 13.0 toolkit (`export CUDA_HOME=")


# --------------------------------------------------------------------------- what verify says


def test_a_warmer_says_where_it_pushed_the_kernel(
    tmp_path: Path, registry: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CUDAENV_JIT_PUSH=1 with a remote: the check says what it pushed; without it, nothing."""
    from builder.verify import kernel_compile
    from tests.test_kernel_compile import env_with, make_toolkit
    from tests.test_kernel_compile import facts as kernel_facts
    from tests.test_kernel_compile import target as kernel_target

    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    home = make_toolkit(tmp_path / "cuda-home")
    quiet = env_with(tmp_path, "gcc 12.2.0", CUDAENV_JIT_REMOTE=registry.url)
    first = kernel_compile.check(kernel_target(tmp_path), kernel_facts(home, quiet))
    assert first.status == PASSED and "pushed" not in first.summary
    warmer = {**quiet, "CUDAENV_JIT_PUSH": "1"}
    again = kernel_compile.check(kernel_target(tmp_path), kernel_facts(home, warmer))
    assert again.status == PASSED, again.summary
    assert again.summary.endswith(
        f"; pushed 2 entry(ies) to {registry.url} (CUDAENV_JIT_PUSH=1)"
    ), again.summary
    assert dict(again.evidence)["12.0f pushed"].endswith(f" to {registry.url}")


def test_flashinfer_jit_pushes_what_the_probe_kept_and_says_so_only_when_it_went_through(
    tmp_path: Path, registry: Any
) -> None:
    """A warmer's verify pushes the entry FlashInfer's probe kept, from cudaenv's own
    process once the probe has answered (the probe used to start an interpreter for it): the
    check says where it went, names a push that failed in a warning, and pushes nothing
    where this machine is no warmer."""
    from builder import store as jit_store
    from builder.jit import remote as jit_remote
    from builder.jit import share as jit_share

    root, env = tmp_path / "store", tmp_path / "env"
    key = "ab" * 32
    store = jit_store.Store(root)
    stored_build(store, key, env, write(env / "include" / "a.h", "a"))
    [(_, variant)] = store.all()
    environ = {
        "CUDAENV_JIT_REMOTE": registry.url,
        "CUDAENV_JIT_SHARE": '["python", "-m", "builder.jit.share"]',
        "CUDAENV_JIT_PUSH": "1",
        "CUDAENV_JIT_STORE": str(root),
    }
    kept = {"used": True, "key": key[:16], "hit": False, "kept": True, "warnings": [],
            "entry": f"v3/{key[:2]}/{key}/{variant.name}"}  # fmt: skip
    jit = {"library": str(env / "var/flashinfer/sampling/sampling.so"), "seconds": 3.0,
           "store": kept}  # fmt: skip
    remote = jit_share.parse(registry.url)
    got = tmp_path / "got"
    got.mkdir()
    target = dataclasses.replace(TARGET, env_dir=env)
    no_push = {k: v for k, v in environ.items() if k != "CUDAENV_JIT_PUSH"}
    quiet = flashinfer_jit.check(target, facts(environ=no_push, jit=jit))
    assert "pushed" not in quiet.summary
    assert jit_remote.fetch(remote, key, got, timeout=5) is None
    result = flashinfer_jit.check(target, facts(environ=environ, jit=jit))
    assert result.status == PASSED and result.warnings == (), result
    assert result.summary.endswith(f"; pushed to {registry.url} (CUDAENV_JIT_PUSH=1)")
    assert jit_remote.fetch(remote, key, got, timeout=5) is not None
    registry.stop()
    failed = flashinfer_jit.check(target, facts(environ=environ, jit=jit))
    assert failed.status == PASSED and "pushed to" not in failed.summary
    (warning,) = failed.warnings
    assert warning.startswith(f"pushing {key[:16]} to the JIT remote {registry.url} failed")


def stored_build(store: Any, key: str, env: Path, header: Path) -> None:
    """A build of FlashInfer's sampling module as the store keeps it, compiled in ``env``
    reading ``header``."""
    from builder import store as jit_store

    out = write(env / "var" / "flashinfer" / "sampling" / "sampling.so", "ELF")
    rel = jit_store.normalise(str(out), [str(env)])
    meta = {
        "kind": "ninja",
        "env": str(env),
        "outputs": [rel],
        "file_of": {rel: "0-sampling.so"},
        "deps": {rel: [jit_store.normalise(str(header), [str(env)])]},
        "ninja_log": next(iter(jit_store.LOG_HASHES)),
    }
    inputs = [jit_store.normalise(str(header), [str(env)])]
    assert store.publish(key, {"0-sampling.so": out}, inputs, meta, str(env)) is not None


def site_dist(env: Path, name: str, version: str, rel: str, text: str) -> Path:
    """``rel`` in ``env``'s site-packages, installed by distribution ``name``."""
    site = env / "lib" / "python3.12" / "site-packages"
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    write(info / "METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    write(info / "RECORD", f"{rel},,\n{info.name}/METADATA,,\n{info.name}/RECORD,,\n")
    return write(site / rel, text)


def test_a_store_miss_names_the_input_that_differs_and_its_distribution(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The env's apache-tvm-ffi differs from the one the stored build read: the miss says
    which distribution, at which version here and there, instead of a silent recompile."""
    from builder import store as jit_store

    rel = "tvm_ffi/include/tvm/ffi/c_api.h"
    old_env, new_env = tmp_path / "old-env", tmp_path / "new-env"
    old_header = site_dist(old_env, "apache-tvm-ffi", "0.1.11", rel, "v0.1.11")
    site_dist(new_env, "apache-tvm-ffi", "0.1.15.post2", rel, "v0.1.15.post2")
    root = tmp_path / "store"
    key = "ab" * 32
    stored_build(jit_store.Store(root), key, old_env, old_header)
    library = new_env / "var" / "flashinfer" / "sampling" / "sampling.so"
    said = flashinfer_jit.why_missed(root, key[:16], library, new_env)
    assert said == (
        "the store has this key, but compiled from other files: apache-tvm-ffi 0.1.15.post2 "
        "here; the stored build's env had 0.1.11 (lib/python3.12/site-packages/" + rel + ") "
        f"(nearest: the build for {old_env})"
    )
    other_key = flashinfer_jit.why_missed(root, "cd" * 8, library, new_env)
    assert other_key is not None and other_key.startswith("no stored build has this key")
    assert flashinfer_jit.why_missed(root, key[:16], library.with_name("other.so"), new_env) is None
    # In the check: a miss that was kept says why the store had nothing to give.
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(root))
    miss = {"used": True, "key": key[:16], "hit": False, "kept": True, "warnings": []}
    target = dataclasses.replace(TARGET, env_dir=new_env)
    jit = {"library": str(library), "seconds": 600.0, "store": miss}
    result = flashinfer_jit.check(target, facts(jit=jit))
    assert result.status == PASSED
    assert "; the store missed: the store has this key, but compiled from other files: " \
        "apache-tvm-ffi 0.1.15.post2 here" in result.summary  # fmt: skip


def test_the_audit_says_a_failed_sgl_kernel_import_is_expected_without_a_driver(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """sgl_kernel's loader raises "Could not load any common_ops library!" where libcuda.so.1
    (the driver's) is missing: the audit's probe keeps that cause and says it is expected."""
    import sys

    from builder.audit import scan as audit
    from tests.helpers import uv_venv

    python = uv_venv(Path(sys.executable).resolve(), tmp_path / "env")
    site = next(python.parent.parent.glob("lib/python3*/site-packages"))
    loader_error = (
        "\n[sgl_kernel] CRITICAL: Could not load any common_ops library!\n\nAttempted "
        "locations:\n1. ...\nError details from previous import attempts:\n- ImportError: "
        "libcuda.so.1: cannot open shared object file: No such file or directory\n"
    )
    write(site / "sgl_kernel" / "__init__.py", f"raise ImportError({loader_error!r})\n")
    mapped = audit.probe_maps(python, ["sgl_kernel"])
    ((name, why),) = mapped.errors
    assert why == (
        "ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library! (- "
        "ImportError: libcuda.so.1: cannot open shared object file: No such file or directory)"
    )
    note = audit.probe_failure_note(name, why)
    assert note.startswith("; expected on a machine without the NVIDIA driver (sgl_kernel links")
    # Without the cause in hand (an older cached probe), the driver's presence decides.
    short = "ImportError: [sgl_kernel] CRITICAL: Could not load any common_ops library!"
    monkeypatch.setattr(driver, "PROC_VERSION", tmp_path / "absent")
    assert "expected on a machine without the NVIDIA driver" in audit.probe_failure_note(
        "sgl_kernel", short
    )
    monkeypatch.setattr(driver, "PROC_VERSION", write(tmp_path / "version", "NVRM 580\n"))
    assert audit.probe_failure_note("sgl_kernel", short).startswith("; not expected")
    assert audit.probe_failure_note("vllm", "ImportError: x") == ""


def test_a_torch_without_its_version_is_a_fact_not_the_probes_traceback(tmp_path: Path) -> None:
    """A damaged torch (no __version__, no torch.version): verify reports it in the toolchain
    check's line; the probe's traceback is never the answer."""
    import sys

    from builder.core import proc
    from tests.helpers import cudaenv, write

    env = tmp_path / "env"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(env)])
    [site] = env.glob("lib/python3*/site-packages")
    write(site / "torch" / "__init__.py", "")
    write(site / "torch-2.14.1.dist-info" / "METADATA", "Metadata-Version: 2.1\nName: torch\n"
          "Version: 2.14.1\n")  # fmt: skip
    write(site / "torch-2.14.1.dist-info" / "RECORD", "torch/__init__.py,,\n")
    done = cudaenv("verify", "--python", str(env / "bin" / "python"), cwd=tmp_path, check=False)
    assert "Traceback" not in done.stdout + done.stderr, done.stderr
    assert done.returncode == 5, done.stdout + done.stderr
    assert "torch does not import: AttributeError: module 'torch' has no attribute" in done.stdout
