"""Every finding the doctor can give, read from its rule modules' source (each ``code="..."``),
is classed by what its fix prints: a command a test runs (the printed line, run as a user
would, then the doctor again: the finding gone), a command no test runs yet (a known debt,
listed here so that it cannot grow unseen), or no command at all. A rule added later fails
this test until it is classed, and a code leaves NOT_YET_RUN by naming the test that runs it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from tests.helpers import REPO

# code -> (test file, test function) that runs the printed fix and diagnoses again.
RUN_BY_A_TEST = {
    "flashinfer-companion-mismatch": (
        "tests/test_doctor.py",
        "test_the_companion_fix_names_what_the_index_holds_and_running_it_clears_the_finding",
    ),
    "stale-jit-cache": ("tests/test_doctor.py", "test_jit_cache_of_another_toolkit_and_version"),
    "old-jit-cache": ("tests/test_doctor.py", "test_jit_cache_of_another_toolkit_and_version"),
}
# Findings whose fix prints a command (an install, a removal, `cudaenv adopt`/`build`, an
# export) that no test runs yet, end to end, on a real env showing the finding.
NOT_YET_RUN = frozenset({
    "probe-failed", "cuda-binding-major", "extension-built-for-other-cuda",
    "built-for-other-cuda-major", "torch-import-failed", "flashinfer-import-failed",
    "sm12x-nvcc-too-old", "nvcc-broken", "no-nvcc", "jit-toolkit-mismatch",
    "glibc-too-new-for-cuda", "no-host-compiler", "host-compiler-unsupported",
    "nvjitlink-too-old", "mixed-toolkit-minors", "multiple-cuda-majors", "driver-too-old",
    "cache-outside-env", "activation-unwired", "env-drift",
    "remote-cache-auth", "remote-cache-unwired", "remote-cache-down", "gpu-arch-missing",
    "extension-ptx-newer-than-torch", "last-verify-failed",
})  # fmt: skip
# Findings that print no command: a fact (no driver here, the remote cache answers) or a
# report of cudaenv's own bug.
NO_COMMAND = frozenset({"no-driver", "remote-cache", "rule-crashed"})


def codes_in_source() -> set[str]:
    """Each code a rule module spells out, and each in the rule table's order (rules.ROOT_FIRST,
    which holds those a rule makes from a name: ``f"{key}-import-failed"``)."""
    from builder.doctor import rules

    found: set[str] = set(rules.ROOT_FIRST)
    for path in sorted((REPO / "builder" / "doctor").glob("*.py")):
        found |= set(re.findall(r'\bcode="([a-z0-9-]+)"', path.read_text()))
    return found


def test_every_finding_is_classed_by_what_its_fix_prints() -> None:
    classed = [set(RUN_BY_A_TEST), set(NOT_YET_RUN), set(NO_COMMAND)]
    assert not (classed[0] & classed[1] or classed[0] & classed[2] or classed[1] & classed[2])
    assert codes_in_source() == set().union(*classed)


def test_each_fix_said_to_be_run_names_a_test_that_exists() -> None:
    for code, (file, function) in RUN_BY_A_TEST.items():
        tree = ast.parse(Path(REPO / file).read_text())
        names = {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
        assert function in names, (code, file, function)
