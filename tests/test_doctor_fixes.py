"""Every finding the doctor can give, read from its rule modules' source (each ``code="..."``),
is classed by what its fix prints: a command a test runs (the printed line, run as a user
would, then the doctor again: the finding gone), a command no test runs yet (a known debt,
listed here so that it cannot grow unseen), or no command at all. A rule added later fails
this test until it is classed, and a code leaves NOT_YET_RUN by naming the test that runs it."""

from __future__ import annotations

import ast
import re
from pathlib import Path

from builder.doctor.facts import _WHOLE_COMMAND
from tests.helpers import REPO

# code -> (test file, test function) that runs the printed fix and diagnoses again.
RUN_BY_A_TEST = {
    "flashinfer-companion-mismatch": (
        "tests/test_doctor.py",
        "test_the_companion_fix_names_what_the_index_holds_and_running_it_clears_the_finding",
    ),
    "stale-jit-cache": ("tests/test_doctor.py", "test_jit_cache_of_another_toolkit_and_version"),
    "multiple-cuda-majors": (
        "tests/test_doctor.py",
        "test_the_printed_uninstall_of_another_cuda_majors_wheels_clears_the_finding",
    ),
    "nvjitlink-too-old": (
        "tests/test_doctor.py",
        "test_the_printed_install_of_a_matching_nvjitlink_clears_the_finding",
    ),
    "cuda-binding-major": (
        "tests/test_doctor.py",
        "test_cuda_python_of_another_major_than_torchs_is_named_first",
    ),
    "jit-toolkit-mismatch": (
        "tests/test_adopt.py",
        "test_adopt_repairs_the_blackwell_case_and_undo_gives_the_env_back",
    ),
    "rule-crashed": (
        "tests/test_doctor.py",
        "test_the_command_a_crashed_rule_prints_diagnoses_the_same_interpreter",
    ),
    "old-jit-cache": ("tests/test_doctor.py", "test_jit_cache_of_another_toolkit_and_version"),
}
# Findings whose fix prints a command (an install, a removal, `cudaenv adopt`/`build`, an
# export) that no test runs yet, end to end, on a real env showing the finding.
NOT_YET_RUN = frozenset({
    "extension-built-for-other-cuda", "built-for-other-cuda-major",
    "sm12x-nvcc-too-old", "nvcc-broken", "no-nvcc",
    "no-host-compiler", "host-compiler-unsupported", "mixed-toolkit-minors",
    "cache-outside-env", "activation-unwired",
    "env-drift", "remote-cache-unwired", "remote-cache-down", "gpu-arch-missing",
    "extension-ptx-newer-than-torch", "last-verify-failed",
})  # fmt: skip
# Findings that print no command: a fact (no driver here, the remote cache answers), or what
# to do in prose (reinstall what the error names, a newer driver, another CUDA release, the
# server's password), where no one command is right for every machine.
NO_COMMAND = frozenset({
    "no-driver", "remote-cache", "probe-failed", "torch-import-failed",
    "flashinfer-import-failed", "driver-too-old", "glibc-too-new-for-cuda", "remote-cache-auth",
})  # fmt: skip


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


def _literal_parts(node: ast.AST) -> list[str]:
    """The literal text of every string (and every literal part of an f-string) in ``node``,
    each f-string's parts joined with a placeholder where a value goes."""
    out: list[str] = []
    for sub in ast.walk(node):
        if isinstance(sub, ast.JoinedStr):
            out.append(
                "".join(str(v.value) if isinstance(v, ast.Constant) else "X" for v in sub.values)
            )
        elif isinstance(sub, ast.Constant) and isinstance(sub.value, str):
            out.append(sub.value)
    return out


def _says_a_command(texts: list[str]) -> bool:
    # The doctor's own reading of a fix line (Finding.commands): a backtick, or a program first.
    return any("`" in t or _WHOLE_COMMAND.match(t) for t in texts)


def _prints_command(fix: ast.AST, assigned: dict[str, list[ast.AST]], makers: set[str]) -> bool:
    """Whether ``fix`` can print a command: a command-like string in it, a call of a maker
    (a doctor function whose strings are command-like), or a local name that stands for a
    whole line and is bound to either; such a name the reader cannot see into (a parameter)
    counts as one. What an f-string interpolates is a value in a sentence, not a line."""
    if _says_a_command(_literal_parts(fix)):
        return True
    bound = {
        t.id
        for comp in ast.walk(fix)
        if isinstance(comp, ast.comprehension)
        for t in ast.walk(comp.target)
        if isinstance(t, ast.Name)
    }

    def line(node: ast.AST) -> bool:
        if isinstance(node, ast.JoinedStr | ast.Constant | ast.Attribute | ast.Compare):
            return False
        if isinstance(node, ast.IfExp):  # its test is no line of the fix
            return line(node.body) or line(node.orelse)
        if isinstance(node, ast.Name):
            if node.id in bound:
                return False
            values = assigned.get(node.id)
            return values is None or any(_prints_command(v, {}, makers) for v in values)
        if isinstance(node, ast.Call):
            if getattr(node.func, "id", "") in makers:
                return True
            return any(line(a) for a in node.args)
        return any(line(child) for child in ast.iter_child_nodes(node))

    return line(fix)


def passed_to(func: ast.FunctionDef, trees: list[ast.Module]) -> dict[str, list[ast.AST]]:
    """For each parameter of ``func``, what its callers in ``trees`` pass it (a ``*args``
    parameter: every positional argument from its place on); a parameter no call is found
    for is left out (unknown: counted as a command)."""
    params = [a.arg for a in func.args.args]
    star = func.args.vararg.arg if func.args.vararg else None
    out: dict[str, list[ast.AST]] = {}
    for tree in trees:
        for call in ast.walk(tree):
            if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == func.name):
                continue
            for i, arg in enumerate(call.args):
                if i < len(params):
                    out.setdefault(params[i], []).append(arg)
                elif star is not None:
                    out.setdefault(star, []).append(arg)
            for kw in call.keywords:
                if kw.arg is not None:
                    out.setdefault(kw.arg, []).append(kw.value)
    return out


def fixes_in_source() -> dict[str, bool]:
    """Each code a rule spells out in a ``Finding(code=..., fix=...)``, and whether its fix
    can print a command (:func:`_prints_command`), read from the rule modules themselves."""
    from builder.doctor import rules

    trees = [ast.parse(p.read_text()) for p in sorted((REPO / "builder" / "doctor").glob("*.py"))]
    makers = {
        f.name
        for tree in trees
        for f in ast.walk(tree)
        if isinstance(f, ast.FunctionDef)
        and not f.name.startswith("rule_")
        and _says_a_command(_literal_parts(f))
    }
    codes = set(rules.ROOT_FIRST) | set(codes_in_source())
    # Module constants (HANG_FIX = "run with --debug ..."), what a parameter may be bound to.
    module_level: dict[str, list[ast.AST]] = {
        t.id: [node.value]
        for tree in trees
        for node in tree.body
        if isinstance(node, ast.Assign)
        for t in node.targets
        if isinstance(t, ast.Name)
    }

    def resolve(value: ast.AST) -> ast.AST:
        if isinstance(value, ast.Name) and value.id in module_level:
            return module_level[value.id][0]
        return value

    found: dict[str, bool] = {}
    for tree in trees:
        for func in ast.walk(tree):
            if not isinstance(func, ast.FunctionDef):
                continue
            assigned: dict[str, list[ast.AST]] = dict(module_level)
            for name, values in passed_to(func, trees).items():
                assigned[name] = [resolve(v) for v in values]
            for node in ast.walk(func):
                if isinstance(node, ast.Assign | ast.AnnAssign | ast.AugAssign) and node.value:
                    targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                    for t in targets:
                        if isinstance(t, ast.Name):
                            assigned.setdefault(t.id, []).append(node.value)
                elif isinstance(node, ast.Call) and getattr(node.func, "attr", "") in (
                    "append",
                    "extend",
                ):  # fixes.append(...): what the list holds
                    owner = getattr(node.func, "value", None)
                    if isinstance(owner, ast.Name):
                        assigned.setdefault(owner.id, []).extend(node.args)
            for call in ast.walk(func):
                if not (isinstance(call, ast.Call) and getattr(call.func, "id", "") == "Finding"):
                    continue
                kw = {k.arg: k.value for k in call.keywords}
                code = kw.get("code")
                if isinstance(code, ast.Constant):
                    named = [str(code.value)]
                elif isinstance(code, ast.JoinedStr):  # f"{key}-import-failed"
                    shape = "".join(
                        re.escape(str(v.value)) if isinstance(v, ast.Constant) else "[a-z0-9]+"
                        for v in code.values
                    )
                    named = [c for c in codes if re.fullmatch(shape, c)]
                else:
                    continue
                fix = kw.get("fix")
                command = fix is not None and _prints_command(fix, assigned, makers)
                for name in named:
                    found[name] = found.get(name, False) or command
    return found


def test_what_each_finding_is_classed_as_is_what_its_fix_prints() -> None:
    """The classes above are checked against the rule modules: a code whose fix can print a
    command is run by a test or named as not yet run, and a code said to print none prints
    none (a fix in prose: what to do, no command to copy)."""
    found = fixes_in_source()
    assert set(found) == codes_in_source()
    prints = {c for c, command in found.items() if command}
    assert prints == set(RUN_BY_A_TEST) | set(NOT_YET_RUN), (
        f"print a command but are classed as not: {sorted(prints & NO_COMMAND)}; "
        f"print none but are classed as printing one: {sorted((set(RUN_BY_A_TEST) | NOT_YET_RUN) - prints)}"
    )
