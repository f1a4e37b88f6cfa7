"""`sampling`: on each visible NVIDIA GPU, cudaenv's kernel (built for that GPU's arch) and
FlashInfer's ``top_k_top_p_sampling_from_probs`` pass the reference verdicts: exact agreement
for given uniforms (our kernel), membership in the top-k ∩ top-p set and a chi-square test
against the renormalised distribution (both). Without a driver or GPU: skipped, with why.
"""

from __future__ import annotations

import json
import random
import struct
import tempfile
import time
from pathlib import Path

from builder import archs, proc
from builder.archs import Gpu
from builder.verify import FAILED, PASSED, SKIPPED, CheckResult, EnvFacts, Target, env_of
from builder.verify import reference as ref
from builder.verify.kernel_compile import build_kernel, nvcc_of

DRAWS = 4000  # per row: a sampler ignoring top_k or top_p fails chi-square at alpha 1e-3


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
    out = []
    for i, (case, row) in enumerate(zip(cases, samples, strict=True)):
        expected = ref.renormalised(case.probs, case.top_k, case.top_p)
        member = ref.membership_verdict(set(expected), row)
        chi = ref.chi_square_verdict(expected, row)
        out.append(ref.Verdict(passed=member.passed, detail=f"row {i}: {member.detail}"))
        out.append(ref.Verdict(passed=chi.passed, detail=f"row {i}: {chi.detail}"))
    return out


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


def run_flashinfer(
    target: Target, facts: EnvFacts, gpu: Gpu, cases: list[ref.Case], work: Path
) -> list[list[int]]:
    vocab = len(cases[0].probs)
    doc = {
        "probs": [list(c.probs) for c in cases],
        "top_k": [c.top_k if c.top_k > 0 else vocab for c in cases],
        "top_p": [c.top_p for c in cases],
        "draws": DRAWS,
        "seed": 20261129,
    }
    path = work / "flashinfer-input.json"
    path.write_text(json.dumps(doc))
    env = {**env_of(target, facts), "CUDA_VISIBLE_DEVICES": str(gpu.index)}
    done = proc.run([target.python, "-c", FLASHINFER_SCRIPT, path], env=env, timeout=1800)
    rows: list[list[int]] = json.loads(done.stdout.strip().splitlines()[-1])
    return rows


def run_kernel(
    binary: Path,
    gpu: Gpu,
    cases: list[ref.Case],
    us: list[list[float]],
    work: Path,
    env: dict[str, str],
) -> tuple[list[list[int]] | None, str]:
    inp, out = work / "kernel-input.txt", work / "kernel-output.txt"
    ref.write_input(str(inp), cases, us)
    # The whole environment: a driver library reachable only through LD_LIBRARY_PATH (GKE's
    # /usr/local/nvidia/lib64, HPC modules) must be found as torch finds it.
    env = {**env, "CUDA_VISIBLE_DEVICES": str(gpu.index)}
    done = proc.run([binary, inp, out], env=env, check=False, timeout=600)
    if done.returncode != 0:
        return None, (done.stderr or done.stdout).strip()
    return [[int(x) for x in line.split()] for line in out.read_text().splitlines()], ""


def check(target: Target, facts: EnvFacts) -> CheckResult:
    gpus, why = archs.visible_gpus()
    if not gpus:
        return CheckResult(name="sampling", status=SKIPPED, summary=why or "no GPU")
    evidence: list[tuple[str, str]] = []
    problems: list[str] = []
    started = time.monotonic()
    cases = ref.make_cases()
    us = uniforms(7, len(cases))
    nvcc = nvcc_of(facts)
    env = env_of(target, facts)
    with tempfile.TemporaryDirectory(prefix="cudaenv-sampling-") as tmp:
        work = Path(tmp)
        for gpu in gpus:
            label = gpu.label
            arch = gpu.arch(facts.nvcc_release)
            if arch is None:
                problems.append(f"{label}: the driver reports no compute capability")
                continue
            built = build_kernel(nvcc, arch, target.work, env=env)
            if built.error:
                problems.append(f"{label}: our kernel does not build for {arch}: {built.error}")
                continue
            samples, error = run_kernel(built.path, gpu, cases, us, work, env)
            if samples is None:
                problems.append(f"{label}: our kernel did not run: {error}")
            else:
                verdicts = judge_kernel(cases, us, samples)
                bad = [v.detail for v in verdicts if not v.passed]
                evidence.append(
                    (
                        f"{label} topk_topp {arch}",
                        verdicts[0].detail
                        + (
                            f"; {len(bad)} verdict(s) failed"
                            if bad
                            else "; membership and chi-square pass"
                        ),
                    )
                )
                problems += [f"{label} our kernel: {b}" for b in bad]
            if facts.flashinfer_installed and facts.torch_installed:
                fi_cases = [
                    ref.Case(probs=as_float32(c.probs), top_k=c.top_k, top_p=c.top_p) for c in cases
                ]
                try:
                    draws = run_flashinfer(target, facts, gpu, fi_cases, work)
                except proc.CommandFailed as exc:
                    problems.append(f"{label}: FlashInfer sampling failed: {exc.output[-1500:]}")
                    continue
                verdicts = judge_draws(fi_cases, draws)
                bad = [v.detail for v in verdicts if not v.passed]
                pvals = "; ".join(v.detail for v in verdicts if "chi2" in v.detail)
                evidence.append((f"{label} flashinfer", pvals))
                problems += [f"{label} FlashInfer: {b}" for b in bad]
    seconds = time.monotonic() - started
    if problems:
        return CheckResult(
            name="sampling",
            status=FAILED,
            summary="; ".join(problems[:6]),
            evidence=tuple(evidence),
            seconds=seconds,
            fix="a sampler outside the reference set means a miscompiled or "
            "mismatched kernel: run the toolchain and cubin checks",
        )
    return CheckResult(
        name="sampling",
        status=PASSED,
        summary=f"{len(gpus)} GPU(s): samples exact, inside the set, chi-square passes",
        evidence=tuple(evidence),
        seconds=seconds,
    )
