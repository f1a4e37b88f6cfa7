"""The Python reference of top-k/top-p sampling and the two verdicts on a sampler.

Order: probability descending, ties by index ascending. The kept set of a row is the
first ``min(top_k, V)`` tokens (``top_k <= 0`` keeps all) intersected with the shortest
prefix whose mass reaches ``top_p`` of the row's total (a token is kept while the mass
*before* it is below ``top_p * total``). The sample for a uniform ``u`` is inverse-CDF over
the kept set renormalised: the first kept token whose inclusive cumulative mass exceeds
``u * kept_mass``. Sums run in float64, sequentially in that order, exactly as the CUDA
kernel (``builder/kernels/topk_topp.cu``) does, so the two agree bit for bit.

The statistics are the standard library only: a chi-square goodness-of-fit test with the
regularised upper incomplete gamma function (Numerical Recipes' series / continued fraction).
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

ALPHA = 1e-3  # significance of the chi-square test: a correct sampler fails 1 run in 1000


def order(probs: Sequence[float]) -> list[int]:
    return sorted(range(len(probs)), key=lambda i: (-probs[i], i))


def kept_set(probs: Sequence[float], top_k: int, top_p: float) -> list[int]:
    """The top-k ∩ top-p tokens of one row, in sampling order."""
    ranked = order(probs)
    k = len(ranked) if top_k <= 0 else min(top_k, len(ranked))
    total = 0.0
    for p in probs:
        total += p
    threshold = top_p * total
    kept: list[int] = []
    before = 0.0
    for i in ranked[:k]:
        if kept and before >= threshold:
            break
        kept.append(i)
        before += probs[i]
    return kept


def sample(probs: Sequence[float], top_k: int, top_p: float, u: float) -> int:
    kept = kept_set(probs, top_k, top_p)
    mass = 0.0
    for i in kept:
        mass += probs[i]
    target = u * mass
    acc = 0.0
    for i in kept:
        acc += probs[i]
        if acc > target:
            return i
    return kept[-1]


def renormalised(probs: Sequence[float], top_k: int, top_p: float) -> dict[int, float]:
    kept = kept_set(probs, top_k, top_p)
    mass = math.fsum(probs[i] for i in kept)
    return {i: probs[i] / mass for i in kept}


# --------------------------------------------------------------------------- verdicts


@dataclass(frozen=True, kw_only=True)
class Verdict:
    passed: bool
    detail: str


def exact_verdict(expected: Sequence[int], got: Sequence[int]) -> Verdict:
    if len(expected) != len(got):
        return Verdict(passed=False, detail=f"{len(got)} samples for {len(expected)} inputs")
    wrong = [(i, e, g) for i, (e, g) in enumerate(zip(expected, got, strict=True)) if e != g]
    if wrong:
        i, e, g = wrong[0]
        return Verdict(
            passed=False,
            detail=f"{len(wrong)}/{len(expected)} samples differ from the reference "
            f"(first: input {i}: expected token {e}, got {g})",
        )
    return Verdict(passed=True, detail=f"{len(expected)}/{len(expected)} samples exact")


def membership_verdict(kept: set[int], samples: Sequence[int]) -> Verdict:
    outside = [s for s in samples if s not in kept]
    if outside:
        return Verdict(
            passed=False,
            detail=f"{len(outside)}/{len(samples)} samples outside the top-k ∩ top-p set "
            f"(e.g. token {outside[0]})",
        )
    return Verdict(passed=True, detail=f"{len(samples)} samples inside the kept set")


def chi_square(expected: dict[int, float], samples: Sequence[int]) -> tuple[float, int, float]:
    """(statistic, degrees of freedom, p-value) of ``samples`` against ``expected`` probs.

    Tokens outside ``expected`` count into one extra cell with expectation ~0, which makes
    the statistic explode, as it should. Cells expected under 5 draws are pooled.
    """
    n = len(samples)
    counts: dict[int, int] = {}
    for s in samples:
        counts[s] = counts.get(s, 0) + 1
    cells: list[tuple[float, int]] = []
    pool_e, pool_o = 0.0, 0
    for token, p in sorted(expected.items(), key=lambda kv: -kv[1]):
        e = p * n
        if e < 5:
            pool_e += e
            pool_o += counts.get(token, 0)
        else:
            cells.append((e, counts.get(token, 0)))
    if pool_e > 0:
        cells.append((pool_e, pool_o))
    outside = sum(c for t, c in counts.items() if t not in expected)
    if outside:
        cells.append((1e-9, outside))
    stat = math.fsum((o - e) ** 2 / e for e, o in cells)
    dof = max(len(cells) - 1, 1)
    return stat, dof, chi2_sf(stat, dof)


def chi_square_verdict(expected: dict[int, float], samples: Sequence[int]) -> Verdict:
    stat, dof, p = chi_square(expected, samples)
    detail = f"chi2={stat:.1f} dof={dof} p={p:.3g} (alpha {ALPHA:g}, {len(samples)} draws)"
    return Verdict(passed=p >= ALPHA, detail=detail)


def chi2_sf(x: float, k: int) -> float:
    """P(X >= x) for X ~ chi-square(k)."""
    if x <= 0:
        return 1.0
    return _gammaincc(k / 2.0, x / 2.0)


def _gammaincc(a: float, x: float) -> float:
    if x < a + 1.0:
        # Series for P(a, x); Q = 1 - P.
        term = 1.0 / a
        total = term
        ap = a
        for _ in range(10_000):
            ap += 1.0
            term *= x / ap
            total += term
            if abs(term) < abs(total) * 1e-15:
                break
        p = total * math.exp(-x + a * math.log(x) - math.lgamma(a))
        return max(0.0, 1.0 - p)
    # Continued fraction for Q(a, x) (modified Lentz).
    tiny = 1e-300
    b = x + 1.0 - a
    c = 1.0 / tiny
    d = 1.0 / b
    h = d
    for i in range(1, 10_000):
        an = -i * (i - a)
        b += 2.0
        d = an * d + b
        d = tiny if abs(d) < tiny else d
        c = b + an / c
        c = tiny if abs(c) < tiny else c
        d = 1.0 / d
        delta = d * c
        h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return math.exp(-x + a * math.log(x) - math.lgamma(a)) * h


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True, kw_only=True)
class Case:
    probs: tuple[float, ...]
    top_k: int
    top_p: float


# Each row's role: which constraint decides its kept set. A sampler that ignores top-k, or
# ignores top-p (also while top-k is set), or applies them in the wrong order, changes the
# distribution of at least one row by far more than chi-square's tolerance at DRAWS draws.
#   "k"      top-k cuts before top-p would            (top-p set larger than k)
#   "p"      top-p cuts before top-k would, k > 0     (top-p binds while top-k is set)
#   "p-only" top-p cuts, top-k off (k = 0)
#   "both"   both cut at the same token               (a sampler ignoring both fails)
ROWS: tuple[tuple[str, int, float], ...] = (
    ("k", 3, 1.0),
    ("k", 4, 0.9),
    ("p", 20, 0.5),
    ("p", 16, 0.3),
    ("p-only", 0, 0.5),
    ("both", 6, 0.0),  # top_p chosen per row so that the top-p set has exactly 6 tokens
    ("k", 1, 0.3),
    ("p", 8, 0.6),
)


def role(case: Case) -> str:
    """Which constraint decides the kept set of ``case`` (see :data:`ROWS`)."""
    n = len(case.probs)
    by_k = n if case.top_k <= 0 else min(case.top_k, n)
    by_p = len(kept_set(case.probs, 0, case.top_p))
    if case.top_k <= 0:
        return "p-only" if by_p < n else "none"
    if by_k == by_p:
        return "both" if by_k < n else "none"
    return "k" if by_k < by_p else "p"


def make_cases(seed: int = 20261129, vocab: int = 64) -> list[Case]:
    """One row per entry of :data:`ROWS`, each with the role it is meant to test. A row has a
    heavy token, a tie (to pin the tie order) and a long tail, and is redrawn until no set
    boundary is so close that float32 rounding (FlashInfer samples float32) could move a
    token across it, and no tie sits at or next to the boundary (FlashInfer keeps or drops
    tied tokens together; the reference breaks ties by index)."""
    rng = random.Random(seed)  # noqa: S311 - reproducible test inputs, not secrets
    cases = []
    for want, top_k, top_p in ROWS:
        while True:
            weights = [rng.random() ** 4 for _ in range(vocab)]
            weights[rng.randrange(vocab)] = 2.0
            tie = rng.randrange(vocab)
            weights[(tie + 7) % vocab] = weights[tie]
            total = math.fsum(weights)
            probs = tuple(w / total for w in weights)
            p = top_p
            if want == "both":
                ranked = order(probs)
                before = math.fsum(probs[i] for i in ranked[: top_k - 1])
                p = (before + before + probs[ranked[top_k - 1]]) / 2 / math.fsum(probs)
            case = Case(probs=probs, top_k=top_k, top_p=p)
            if role(case) == want and _margin(case) > 1e-4 and not _tie_at_boundary(case):
                cases.append(case)
                break
    return cases


def _margin(case: Case) -> float:
    """Distance of the row from its nearest set boundary (k-th vs k+1-th prob, mass vs p)."""
    ranked = order(case.probs)
    k = len(ranked) if case.top_k <= 0 else min(case.top_k, len(ranked))
    margins = [1.0]
    if k < len(ranked):
        margins.append(case.probs[ranked[k - 1]] - case.probs[ranked[k]])
    threshold = case.top_p * math.fsum(case.probs)
    before = 0.0
    for i in ranked[:k]:
        if before:
            margins.append(abs(before - threshold))
        before += case.probs[i]
    return min(margins)


def _tie_at_boundary(case: Case) -> bool:
    """A tie among the last kept token and its neighbours on either side of the boundary."""
    ranked = order(case.probs)
    b = len(kept_set(case.probs, case.top_k, case.top_p))
    near = [case.probs[i] for i in ranked[max(b - 2, 0) : b + 2]]
    return len(set(near)) < len(near)


def write_input(path: str, cases: Sequence[Case], us: Sequence[Sequence[float]]) -> None:
    """Text format read by the CUDA harness: ``rows vocab draws`` then per row ``top_k top_p``,
    the probabilities, the draws' uniforms. Values with 17 significant digits round-trip."""
    vocab = len(cases[0].probs)
    draws = len(us[0])
    lines = [f"{len(cases)} {vocab} {draws}"]
    for case, row_us in zip(cases, us, strict=True):
        lines.append(f"{case.top_k} {case.top_p!r}")
        lines.append(" ".join(repr(p) for p in case.probs))
        lines.append(" ".join(repr(u) for u in row_us))
    with open(path, "w") as fh:  # noqa: PTH123 - a plain path string from the caller
        fh.write("\n".join(lines) + "\n")
