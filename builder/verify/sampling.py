"""`sampling`: on each visible NVIDIA GPU, cudaenv's kernel (built for that GPU's arch) and
FlashInfer's ``top_k_top_p_sampling_from_probs`` pass the reference verdicts: exact agreement
for given uniforms (our kernel), membership in the top-k ∩ top-p set and a chi-square test
against the renormalised distribution (both). Without a driver or GPU: skipped, with why.

The two halves are reported apart: each passes, fails or is skipped with its own reason (no
FlashInfer is "skipped", a FlashInfer that does not import is "failed"). The check passes when
no half failed and at least one ran. Where ``CUDAENV_GPU_CHECK=1`` (the GPU check sets it, on
a machine that has a GPU by design), nothing may be skipped: no GPU, or a half that did not
run, fails the check naming what was missing; passing on our kernel alone would vouch for
FlashInfer unseen.

Each half first asks whether the driver runs its CUDA (``driver.require``, the table the
build gate uses): our kernel is built by CUDA_HOME's nvcc, FlashInfer runs on torch's CUDA. A
driver too old fails that half with the minimum driver and the ways out, not with
``cudaErrorInsufficientDriver`` from deep inside the run.

GPUs are addressed by UUID with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``, so the device a kernel runs
on is the one its arch was chosen for, and a user's ``CUDA_VISIBLE_DEVICES`` narrows the GPUs
tested (UUIDs, or indexes read in PCI bus order). A GPU in MIG mode is not visible to CUDA as
a whole: it is tested through the MIG instances ``CUDA_VISIBLE_DEVICES`` names, else skipped.

False failures: chi-square at alpha 1e-3 fails a correct sampler in about 1 row in 1000 and
the draws are seeded, so such a failure would repeat on every run. A row whose chi-square
fails is drawn again with an independent seed and fails only if both fail: about 1e-6 per
row, under 1e-5 per half on one GPU (8 rows). Membership and exactness are not redrawn.
"""

from __future__ import annotations

import dataclasses
import json
import random
import struct
import tempfile
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path

import builder.verify.reference as ref
from builder.core import proc, settings
from builder.core.cudaversion import CudaVersion
from builder.core.errors import CudaenvError, DriverTooOld
from builder.core.statuses import FAILED, PASSED, SKIPPED, CheckStatus
from builder.machine import archs, driver
from builder.machine.archs import Gpu
from builder.verify.kernel_compile import build_kernel, nvcc_of
from builder.verify.model import CheckResult, EnvFacts, Target, env_of

DRAWS = 4000  # per row: a sampler ignoring top_k or top_p fails chi-square at alpha 1e-3
KERNEL_SEEDS = (7, 8)  # the uniforms of the first draw and of the independent redraw
FLASHINFER_SEEDS = (20261129, 20261130)
# Set to 1 by the GPU check: a skip (no GPU, a half that did not run) is a failure.
GPU_CHECK = "CUDAENV_GPU_CHECK"
KERNEL, FLASHINFER = "our kernel", "FlashInfer"


def gpu_check_mode(environ: Mapping[str, str] | None = None) -> bool:
    """Whether nothing may be skipped (``CUDAENV_GPU_CHECK=1``)."""
    return settings.of(environ).gpu_check


def uniforms(seed: int, rows: int) -> list[list[float]]:
    rng = random.Random(seed)  # noqa: S311 - reproducible draws, not secrets
    return [[rng.random() for _ in range(DRAWS)] for _ in range(rows)]


def as_float32(values: tuple[float, ...]) -> tuple[float, ...]:
    """FlashInfer samples float32 probabilities: judge it against those, not the float64s."""
    return tuple(struct.unpack(f"{len(values)}f", struct.pack(f"{len(values)}f", *values)))


def judge_kernel(
    cases: list[ref.Case], us: list[list[float]], samples: list[list[int]]
) -> list[ref.Verdict]:
    expected = [
        ref.sample(c.probs, c.top_k, c.top_p, u)
        for c, row in zip(cases, us, strict=True)
        for u in row
    ]
    got = [s for row in samples for s in row]
    verdicts = [ref.exact_verdict(expected, got)]
    verdicts += judge_draws(cases, samples)
    return verdicts


def judge_draws(cases: list[ref.Case], samples: list[list[int]]) -> list[ref.Verdict]:
    """Membership and chi-square, per row, for a sampler with its own randomness."""
    if len(samples) != len(cases):
        return [ref.Verdict(passed=False, detail=f"{len(samples)} rows for {len(cases)} cases")]
    out = []
    for i, (case, row) in enumerate(zip(cases, samples, strict=True)):
        expected = ref.renormalised(case.probs, case.top_k, case.top_p)
        member = ref.membership_verdict(set(expected), row)
        chi = ref.chi_square_verdict(expected, row)
        out.append(ref.Verdict(passed=member.passed, detail=f"row {i}: {member.detail}"))
        out.append(ref.Verdict(passed=chi.passed, detail=f"row {i}: {chi.detail}"))
    return out


def chi_square_failed_rows(cases: list[ref.Case], samples: list[list[int]]) -> set[int]:
    failed = set()
    for i, (case, row) in enumerate(zip(cases, samples, strict=True)):
        if not ref.chi_square_verdict(
            ref.renormalised(case.probs, case.top_k, case.top_p), row
        ).passed:
            failed.add(i)
    return failed


def judge_with_redraw(
    cases: list[ref.Case],
    first: list[list[int]],
    redraw: Callable[[], list[list[int]]],
    extra: list[ref.Verdict] | None = None,
) -> tuple[list[str], str]:
    """(failures, detail). Membership fails at once; a row whose chi-square fails is drawn
    again (``redraw``, an independent seed) and fails only if it fails there too."""
    verdicts = (extra or []) + judge_draws(cases, first)
    failures = [v.detail for v in verdicts if not v.passed and "chi2" not in v.detail]
    suspects = chi_square_failed_rows(cases, first) if len(first) == len(cases) else set()
    pvalues = "; ".join(v.detail for v in verdicts if "chi2" in v.detail)
    if suspects and not failures:
        second = redraw()
        again = chi_square_failed_rows(cases, second) if len(second) == len(cases) else suspects
        for i in sorted(suspects & again):
            failures.append(f"row {i}: chi-square failed on two independent draws")
        pvalues += f"; redrawn rows {sorted(suspects)}: failed again {sorted(suspects & again)}"
    return failures, pvalues


FLASHINFER_SCRIPT = r"""
import json, sys
import torch, flashinfer
doc = json.load(open(sys.argv[1]))
probs = torch.tensor(doc["probs"], dtype=torch.float32, device="cuda")
rows, draws = probs.shape[0], doc["draws"]
indices = torch.arange(rows, device="cuda", dtype=torch.int32).repeat_interleave(draws)
top_k = torch.tensor(doc["top_k"], dtype=torch.int32, device="cuda")
top_p = torch.tensor(doc["top_p"], dtype=torch.float32, device="cuda")
gen = torch.Generator(device="cuda").manual_seed(doc["seed"])
out = flashinfer.sampling.top_k_top_p_sampling_from_probs(
    probs, top_k, top_p, indices=indices, filter_apply_order="joint", generator=gen)
print(json.dumps(out.view(rows, draws).tolist()))
"""


class RunnerFailed(Exception):
    """A sampler's process did not give usable output; the message says why."""


def device_env(env: Mapping[str, str], device: Device) -> dict[str, str]:
    """The env's own environment (a driver library reachable only through LD_LIBRARY_PATH,
    GKE's /usr/local/nvidia/lib64 or an HPC module, must be found as torch finds it), with
    exactly this device visible, numbered in PCI bus order."""
    return {**env, "CUDA_VISIBLE_DEVICES": device.select, "CUDA_DEVICE_ORDER": "PCI_BUS_ID"}


def run_flashinfer(
    target: Target,
    facts: EnvFacts,
    device: Device,
    cases: list[ref.Case],
    work: Path,
    seed: int,
) -> list[list[int]]:
    vocab = len(cases[0].probs)
    doc = {
        "probs": [list(c.probs) for c in cases],
        "top_k": [c.top_k if c.top_k > 0 else vocab for c in cases],
        "top_p": [c.top_p for c in cases],
        "draws": DRAWS,
        "seed": seed,
    }
    path = work / "flashinfer-input.json"
    path.write_text(json.dumps(doc))
    env = device_env(env_of(target, facts), device)
    done = proc.run(
        [target.python, "-c", FLASHINFER_SCRIPT, path], env=env, check=False, timeout=1800
    )
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip()[-1500:]
        raise RunnerFailed(f"exit {done.returncode}: {tail or 'no output'}")
    lines = done.stdout.strip().splitlines()
    try:
        rows = json.loads(lines[-1]) if lines else None
    except ValueError:
        rows = None
    if not isinstance(rows, list) or not all(isinstance(r, list) for r in rows):
        shown = (lines[-1] if lines else "")[:200]
        raise RunnerFailed(f"printed no sample rows (last line: {shown!r})")
    return [[int(x) for x in row] for row in rows]


def run_kernel(
    binary: Path,
    device: Device,
    cases: list[ref.Case],
    us: list[list[float]],
    work: Path,
    env: Mapping[str, str],
) -> tuple[list[list[int]] | None, str]:
    inp, out = work / "kernel-input.txt", work / "kernel-output.txt"
    ref.write_input(str(inp), cases, us)
    done = proc.run([binary, inp, out], env=device_env(env, device), check=False, timeout=600)
    if done.returncode != 0:
        return None, (done.stderr or done.stdout).strip() or f"exit {done.returncode}"
    try:
        return [[int(x) for x in line.split()] for line in out.read_text().splitlines()], ""
    except (OSError, ValueError) as exc:
        return None, f"unreadable output: {exc}"


# --------------------------------------------------------------------------- devices


@dataclass(frozen=True, kw_only=True)
class Device:
    """One CUDA device to test: a GPU (or one MIG instance of it) and the
    ``CUDA_VISIBLE_DEVICES`` value that shows exactly it."""

    gpu: Gpu
    select: str

    @property
    def label(self) -> str:
        base = self.gpu.label
        return f"{base[:-1]}, {self.select})" if self.select.startswith("MIG-") else base


def select_devices(gpus: list[Gpu], environ: Mapping[str, str]) -> tuple[list[Device], list[str]]:
    """The devices to test, and a note for each GPU left out (or a selection not understood).

    ``CUDA_VISIBLE_DEVICES`` in the env narrows the set as CUDA would: UUIDs (``GPU-...``,
    prefixes allowed), MIG instances (``MIG-...``), or indexes, which are read in PCI bus order
    (nvidia-smi's, and CUDA's with ``CUDA_DEVICE_ORDER=PCI_BUS_ID``)."""
    notes: list[str] = []
    user = environ.get("CUDA_VISIBLE_DEVICES")
    chosen: list[Device] = []
    if user is None:
        picked = [(g, f"{g.uuid}") for g in gpus]
    else:
        picked = []
        entries = [e.strip() for e in user.split(",") if e.strip()]
        if not entries or entries[0] in ("-1", "NoDevFiles"):
            return [], [f"CUDA_VISIBLE_DEVICES={user!r} hides every GPU"]
        if any(e.isdigit() for e in entries) and environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID":
            notes.append(
                f"CUDA_VISIBLE_DEVICES={user} read in PCI bus order (nvidia-smi's); CUDA's own "
                "default order is fastest first, so set CUDA_DEVICE_ORDER=PCI_BUS_ID to agree"
            )
        mig_gpus = [g for g in gpus if g.mig]
        for entry in entries:
            if entry.startswith("MIG-"):
                if len(mig_gpus) == 1:
                    picked.append((mig_gpus[0], entry))
                else:
                    notes.append(f"{entry}: cannot tell which of {len(mig_gpus)} MIG GPUs it is on")
                continue
            match = [
                g
                for g in gpus
                if (entry.isdigit() and g.index == int(entry))
                or (entry.startswith("GPU-") and g.uuid.startswith(entry))
            ]
            if len(match) != 1:
                notes.append(f"CUDA_VISIBLE_DEVICES entry {entry!r} matches no single GPU")
                continue
            picked.append((match[0], match[0].uuid))
    for gpu, select in picked:
        if gpu.mig and not select.startswith("MIG-"):
            notes.append(
                f"{gpu.label} is in MIG mode: CUDA sees only its instances; name one with "
                "CUDA_VISIBLE_DEVICES=MIG-<uuid> (`nvidia-smi -L` lists them)"
            )
            continue
        if all(d.select != select for d in chosen):
            chosen.append(Device(gpu=gpu, select=select))
    return chosen, notes


# --------------------------------------------------------------------------- the check


@dataclass(frozen=True, kw_only=True)
class Half:
    """One sampler's verdict on one device."""

    who: str  # "our kernel" | "FlashInfer"
    status: CheckStatus
    detail: str
    failures: tuple[str, ...] = ()
    missing_tool: str | None = None


def kernel_half(
    target: Target, facts: EnvFacts, device: Device, cases: list[ref.Case], work: Path
) -> Half:
    who = "our kernel"
    arch = device.gpu.arch(facts.nvcc_cuda)
    if arch is None:
        return Half(who=who, status=FAILED, detail="the driver reports no compute capability")
    nvcc = nvcc_of(facts)
    if not nvcc.exists():
        return Half(
            who=who, status=FAILED, detail=f"no nvcc at {nvcc} to build it for {arch}",
            missing_tool="nvcc",
        )  # fmt: skip
    env = env_of(target, facts)
    built = build_kernel(nvcc, arch, target.work, env=env)
    if built.error:
        return Half(
            who=who,
            status=FAILED,
            detail=f"does not build for {arch}: {built.error}",
            missing_tool=built.missing_tool,
        )
    us = uniforms(KERNEL_SEEDS[0], len(cases))
    samples, error = run_kernel(built.path, device, cases, us, work, env)
    if samples is None:
        return Half(who=who, status=FAILED, detail=f"did not run ({arch}): {error}")
    exact = judge_kernel(cases, us, samples)[0]

    def redraw() -> list[list[int]]:
        us2 = uniforms(KERNEL_SEEDS[1], len(cases))
        again, _ = run_kernel(built.path, device, cases, us2, work, env)
        return again or []

    failures, stats = judge_with_redraw(cases, samples, redraw, [exact])
    detail = f"{arch}: {exact.detail}; {stats}"
    return Half(
        who=who, status=FAILED if failures else PASSED, detail=detail, failures=tuple(failures)
    )


def flashinfer_half(
    target: Target, facts: EnvFacts, device: Device, cases: list[ref.Case], work: Path
) -> Half:
    who = "FlashInfer"
    if not facts.flashinfer_installed:
        return Half(who=who, status=SKIPPED, detail="not installed in this env")
    if facts.flashinfer_error:
        return Half(
            who=who,
            status=FAILED,
            detail=f"installed but does not import: {facts.flashinfer_error}",
        )
    if not facts.torch_installed:
        return Half(who=who, status=SKIPPED, detail="torch is not installed in this env")
    if facts.torch_error:
        return Half(who=who, status=FAILED, detail=f"torch does not import: {facts.torch_error}")
    env_list = target.archs
    gpu = device.gpu
    if archs.uncovered(env_list, gpu):
        own = gpu.arch(facts.nvcc_cuda)
        spec = target.spec_path or "SPEC"
        return Half(
            who=who,
            status=FAILED,
            detail=f"env built for {archs.flashinfer_spelling(env_list)}, this GPU is {own}: add "
            f"it with `cudaenv verify {spec} --archs {own}` "
            "or rebuild on this box",
        )
    fi_cases = [ref.Case(probs=as_float32(c.probs), top_k=c.top_k, top_p=c.top_p) for c in cases]
    try:
        draws = run_flashinfer(target, facts, device, fi_cases, work, FLASHINFER_SEEDS[0])
    except RunnerFailed as exc:
        return Half(who=who, status=FAILED, detail=f"top_k_top_p_sampling_from_probs failed: {exc}")

    def redraw() -> list[list[int]]:
        try:
            return run_flashinfer(target, facts, device, fi_cases, work, FLASHINFER_SEEDS[1])
        except RunnerFailed:
            return []

    failures, stats = judge_with_redraw(fi_cases, draws, redraw)
    return Half(
        who=who, status=FAILED if failures else PASSED, detail=stats, failures=tuple(failures)
    )


def _cuda(text: str | None) -> CudaVersion | None:
    try:
        return None if text is None else CudaVersion.parse(text)
    except ValueError:  # a CUDA this table cannot judge: the run itself will say
        return None


def driver_too_old(found: driver.Driver | None, facts: EnvFacts, who: str) -> str | None:
    """DriverTooOld's one line where the driver cannot run what ``who`` runs, else None: our
    kernel is CUDA_HOME's nvcc's; FlashInfer runs on torch's CUDA and its JIT uses nvcc."""
    asks: list[tuple[str, str, CudaVersion | None]] = [
        (f"the kernel built by CUDA_HOME's nvcc {facts.nvcc_release}", "a CUDA_HOME",
         _cuda(facts.nvcc_release)),
    ]  # fmt: skip
    if who == FLASHINFER and not facts.flashinfer_installed:
        return None  # the half is skipped for that, which says more
    if who == FLASHINFER and facts.torch_installed:
        asks.insert(0, (f"torch {facts.torch_version}", "a torch built", _cuda(facts.torch_cuda)))
    for needs, older, cuda in asks:
        if cuda is None:
            continue
        try:
            driver.require(cuda, found, needs=needs, older=older, bypass=None)
        except DriverTooOld as exc:
            return f"driver too old: {exc}"
    return None


def _must_run(half: Half, device: Device) -> Half:
    """In the GPU check a skipped half fails, naming what it lacked."""
    if half.status != SKIPPED:
        return half
    return dataclasses.replace(
        half,
        status=FAILED,
        detail=f"did not run on {device.label} ({half.detail}); {GPU_CHECK}=1: the GPU "
        "check needs both halves",
    )


def _run_halves(
    target: Target, facts: EnvFacts, devices: list[Device], *, strict: bool
) -> list[tuple[Device, Half]]:
    """Both halves (cudaenv's kernel, FlashInfer's) on each device, each its own verdict: a
    driver too old for the env's CUDA, or a tool that failed, fails that half only."""
    found = driver.current()
    cases = ref.make_cases()
    halves: list[tuple[Device, Half]] = []
    with tempfile.TemporaryDirectory(prefix="cudaenv-sampling-") as tmp:
        work = Path(tmp)
        for device in devices:
            for who, run in ((KERNEL, kernel_half), (FLASHINFER, flashinfer_half)):
                too_old = driver_too_old(found, facts, who)
                try:
                    half = (
                        Half(who=who, status=FAILED, detail=too_old)
                        if too_old
                        else run(target, facts, device, cases, work)
                    )
                except CudaenvError as exc:  # a tool or command failed: this half's verdict
                    half = Half(who=who, status=FAILED, detail=str(exc)[-1500:])
                if strict:
                    half = _must_run(half, device)
                halves.append((device, half))
    return halves


def _failed(
    failed: list[tuple[Device, Half]], evidence: list[tuple[str, str]], seconds: float
) -> CheckResult:
    problems = [
        f"{d.label} {h.who}: " + ("; ".join(h.failures[:3]) if h.failures else h.detail)
        for d, h in failed
    ]
    missing = next((h.missing_tool for _, h in failed if h.missing_tool), None)
    fix = (
        "a sample outside the reference set means a miscompiled or mismatched kernel: "
        "run the toolchain and cubin checks; a GPU missing from the env's archs needs "
        "`cudaenv verify SPEC --archs ...` or a rebuild on this box"
    )
    if any(h.detail.startswith("driver too old") for _, h in failed):
        fix = (
            "the driver cannot run this env's CUDA: install the driver the summary names "
            "(or the cuda-compat package it names), or verify an env built for a CUDA "
            "this driver runs"
        )
    return CheckResult(
        name="sampling",
        status=FAILED,
        summary="; ".join(problems)[:1500],
        evidence=tuple(evidence),
        seconds=seconds,
        fix=fix,
        missing_tool=missing,
    )


def check(target: Target, facts: EnvFacts) -> CheckResult:
    strict = gpu_check_mode()
    # Nothing to run is a skip, except in the GPU check, where it is what failed.
    nothing: CheckStatus = FAILED if strict else SKIPPED
    needs = f" ({GPU_CHECK}=1: the GPU check needs a GPU)" if strict else ""
    gpus, why = archs.visible_gpus()
    if not gpus:
        return CheckResult(name="sampling", status=nothing, summary=(why or "no GPU") + needs)
    devices, notes = select_devices(gpus, env_of(target, facts))
    evidence: list[tuple[str, str]] = [("left out", n) for n in notes]
    if not devices:
        return CheckResult(
            name="sampling",
            status=nothing,
            summary="no GPU to test: " + "; ".join(notes) + needs,
            evidence=tuple(evidence),
        )
    started = time.monotonic()
    halves = _run_halves(target, facts, devices, strict=strict)
    evidence += [(f"{d.label} {h.who}", f"{h.status}: {h.detail}") for d, h in halves]
    seconds = time.monotonic() - started
    failed = [(d, h) for d, h in halves if h.status == FAILED]
    ran = [h for _, h in halves if h.status == PASSED]
    parts = []
    for who in (KERNEL, FLASHINFER):
        mine = [h for _, h in halves if h.who == who]
        states = sorted({h.status for h in mine})
        if states == [SKIPPED]:
            parts.append(f"{who} skipped ({mine[0].detail})")
        else:
            parts.append(f"{who} {'/'.join(states)} on {len(mine)} device(s)")
    if failed:
        return _failed(failed, evidence, seconds)
    if not ran:
        return CheckResult(
            name="sampling",
            status=SKIPPED,
            summary="; ".join(parts),
            evidence=tuple(evidence),
            seconds=seconds,
        )
    return CheckResult(
        name="sampling",
        status=PASSED,
        summary=f"{len(devices)} device(s): " + "; ".join(parts),
        evidence=tuple(evidence),
        seconds=seconds,
    )
