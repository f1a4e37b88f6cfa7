"""`cudaenv warm` and the prefetch of build/adopt, without FlashInfer: the probe's process is
replaced at the one subprocess seam (``proc.run_lines``) by one that says what a probe says,
and the probe's selection runs with FlashInfer's generators replaced. The real thing (nvcc,
FlashInfer, a registry) is tests/test_warm_e2e.py."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib
import io
import json
import os
import platform
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from builder import store as jit_store
from builder.commands import store as storerun
from builder.commands import warm as warmrun
from builder.core import proc
from builder.core.errors import BuildError, UsageError
from builder.core.reporter import Reporter
from builder.jit import prefetch
from builder.machine import archs
from tests.helpers import REPO, write

PROBE_DIR = REPO / "builder" / "probe"


class Said:
    """What a Reporter said, line by line."""

    def __init__(self) -> None:
        self.buffer = io.StringIO()

    def reporter(self) -> Reporter:
        return Reporter(stream=self.buffer)

    @property
    def lines(self) -> list[str]:
        return self.buffer.getvalue().splitlines()


def events(*docs: dict[str, Any]) -> list[str]:
    return [json.dumps(d) for d in docs]


def fake_probe(
    monkeypatch: pytest.MonkeyPatch, lines: list[str], seen: list[dict[str, Any]], rc: int = 0
) -> None:
    """``proc.run_lines`` answering with ``lines``; what each run was asked in ``seen``."""

    def run_lines(
        argv: Sequence[Any],
        on_line: Callable[[str], None],
        *,
        env: dict[str, str] | None = None,
        input_text: str = "",
        timeout: float,
    ) -> proc.Completed:
        seen.append({"argv": [str(a) for a in argv], "env": env, "request": json.loads(input_text)})
        for line in lines:
            on_line(line)
        return proc.Completed(argv=tuple(map(str, argv)), returncode=rc, stdout="", stderr="boom")

    monkeypatch.setattr(proc, "run_lines", run_lines)


REQ = warmrun.WarmRequest(spec="s.yaml", modules=("*_and_mul",), head_dims=(64,), dtypes=("fp16",))


def test_a_target_warms_with_count_eta_and_already_warm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """The count and the ETA (the mean of the modules compiled so far times those left; one
    the store held costs nothing), each module's result, the probe asked for this target's
    archs with the patterns, head dims and dtypes, and the env's bin/ first on PATH."""
    seen: list[dict[str, Any]] = []
    fake_probe(
        monkeypatch,
        [
            *events(
                {"event": "plan", "total": 3, "modules": ["a", "b", "c"]},
                {"event": "start", "module": "a"},
                {"event": "done", "module": "a", "status": "built", "seconds": 10, "entry": "v3/x"},
                {"event": "start", "module": "b"},
                {"event": "done", "module": "b", "status": "warm", "seconds": 0.1},
                {"event": "start", "module": "c"},
                {"event": "done", "module": "c", "status": "built", "seconds": 30},
                {"event": "end"},
            ),
            "FlashInfer printed this",
        ],
        seen,
    )
    said = Said()
    results, warnings = warmrun.warm_target(
        tmp_path / "env", tmp_path / "store", "9.0a 12.0f", REQ, None, said.reporter()
    )
    assert said.lines == [
        "cudaenv: warming 3 FlashInfer module(s) for 9.0a 12.0f",
        "cudaenv: [1/3] a (9.0a 12.0f)",
        "cudaenv: a (9.0a 12.0f): built in 10.0 s",
        "cudaenv: [2/3, ETA 20s] b (9.0a 12.0f)",
        "cudaenv: b (9.0a 12.0f): already warm",
        "cudaenv: [3/3, ETA 10s] c (9.0a 12.0f)",
        "cudaenv: c (9.0a 12.0f): built in 30.0 s",
    ]
    assert [(r.module, r.status, r.entry) for r in results] == [
        ("a", "built", "v3/x"),
        ("b", "warm", None),
        ("c", "built", None),
    ]
    assert warnings == []
    (run,) = seen
    assert run["argv"][1:] == [str(PROBE_DIR / "jit_warm.py"), "warm"]
    jobs = run["request"].pop("jobs")
    assert run["request"] == {"modules": ["*_and_mul"], "head_dims": [64], "dtypes": ["fp16"]}
    assert isinstance(jobs, int) and jobs >= 1  # the compile slots of this machine
    assert run["env"]["CUDAENV_ARCH_LIST"] == "9.0a,12.0f"
    assert run["env"]["CUDAENV_JIT_STORE"] == str(tmp_path / "store")
    assert run["env"]["PATH"].split(":")[0] == str(tmp_path / "env" / "bin")
    assert run["env"]["CUDAENV_JIT_REMOTE"] == "off" and "CUDAENV_JIT_PUSH" not in run["env"]


def test_a_module_flashinfer_refuses_is_listed_with_its_reason_and_exits_4(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    reason = "RuntimeError: FlashInfer requires GPUs with sm75 or higher."
    fake_probe(
        monkeypatch,
        events(
            {"event": "plan", "total": 2},
            {"event": "done", "module": "norm", "status": "failed", "reason": reason},
            {"event": "done", "module": "page", "status": "built", "seconds": 2},
            {"event": "end"},
        ),
        [],
    )
    results, _ = warmrun.warm_target(tmp_path, tmp_path / "s", "7.0", REQ, None, Said().reporter())
    report = warmrun.WarmReport(results=results, seconds=4.0)
    with pytest.raises(BuildError, match="1 of 2 FlashInfer module") as raised:
        warmrun.outcome(report, Said().reporter(), as_json=False)
    assert raised.value.exit_code == 4
    out = capsys.readouterr().out
    assert f"norm (7.0): failed: {reason}" in out
    assert "2 module(s): 1 built, 0 already warm, 1 failed, in 4.0 s (2.0 s compiling)" in out
    # All built: exit 0, and JSON says the share that was compiling.
    ok = warmrun.WarmReport(results=results[1:], seconds=4.0)
    assert warmrun.outcome(ok, Said().reporter(), as_json=True) == 0
    doc = json.loads(capsys.readouterr().out)
    assert (doc["built"], doc["failed"], doc["compile_seconds"]) == (1, 0, 2.0)


@pytest.mark.parametrize(
    ("lines", "rc", "match"),
    [
        (events({"event": "end", "error": "ImportError: no flashinfer"}), 1, "no flashinfer"),
        ([], 137, "boom"),  # killed: no end event, its stderr said
    ],
)
def test_a_probe_that_fails_is_a_build_error_naming_why(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, lines: list[str], rc: int, match: str
) -> None:
    fake_probe(monkeypatch, lines, [], rc=rc)
    with pytest.raises(BuildError, match=match):
        warmrun.warm_target(tmp_path, tmp_path, "12.0f", REQ, None, Said().reporter())


def test_patterns_that_match_nothing_are_a_usage_error(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    fake_probe(monkeypatch, events({"event": "plan", "total": 0}, {"event": "end"}), [])
    with pytest.raises(UsageError, match="no module of the default set matches"):
        warmrun.warm_target(tmp_path, tmp_path, "12.0f", REQ, None, Said().reporter())


def test_targets_are_the_specs_list_or_each_list_named() -> None:
    spec_archs = archs.parse_list("9.0a,12.0f")
    assert warmrun.targets(spec_archs, ()) == ["9.0a 12.0f"]
    assert warmrun.targets(spec_archs, ("9.0a", "12.0f", "9.0a")) == ["9.0a", "12.0f"]
    with pytest.raises(UsageError, match="--archs 'sm_90'"):
        warmrun.targets(spec_archs, ("sm_90",))


def test_eta_and_clock_text() -> None:
    assert [warmrun.clock_text(s) for s in (4.6, 65, 3725)] == ["5s", "1m05s", "1h02m"]
    progress = warmrun.Progress("12.0f", Said().reporter())
    progress.event({"event": "plan", "total": 4})
    assert progress.eta() is None  # nothing compiled yet: no guess
    progress.event({"event": "done", "status": "built", "seconds": 6})
    progress.event({"event": "done", "status": "built", "seconds": 2})
    assert progress.eta() == 8.0  # 4 s a module, 2 left


# --------------------------------------------------------------------------- the probe's choice


@pytest.fixture
def probe(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """builder/probe/jit_warm.py imported as the env's interpreter imports it (its directory
    first on sys.path), FlashInfer's generators replaced."""
    monkeypatch.syspath_prepend(str(PROBE_DIR))
    for name in ("jit_warm", "env_facts", "jobserver"):
        sys.modules.pop(name, None)
    module = importlib.import_module("jit_warm")
    monkeypatch.setattr(module, "activations", lambda: ["gelu", "silu"])

    class Spec:
        def __init__(self, name: str) -> None:
            self.name = name

    def generate(recipe: list[Any]) -> Spec:
        kind, params = recipe
        if kind == "rope":
            raise RuntimeError("No supported CUDA architectures found for major versions [9]")
        if kind == "act":
            return Spec(f"{params['act']}_and_mul")
        if kind in ("prefill", "decode"):
            return Spec(
                f"batch_{kind}_with_kv_cache_dtype_q_{params['dtype']}_hd_{params['head_dim']}"
            )
        return Spec(kind)

    monkeypatch.setattr(module, "generate", generate)
    yield module
    sys.modules.pop("jit_warm", None)


@pytest.fixture
def jobs(probe: Any) -> Any:
    """builder/probe/jobserver.py as jit_warm.py imported it (the module its warm uses)."""
    return sys.modules["jobserver"]


def test_the_default_set_is_flashinfers_misc_activations_and_attention(probe: Any) -> None:
    names = [c[0] for c in probe.select([], [128, 256], ["bf16"])]
    assert names[:7] == ["norm", "rope", "page", "sampling", "cascade", "quantization", "topk"]
    assert names[7:9] == ["gelu_and_mul", "silu_and_mul"]
    assert names[9:] == [
        "batch_prefill_with_kv_cache_dtype_q_bf16_hd_128",
        "batch_decode_with_kv_cache_dtype_q_bf16_hd_128",
        "batch_prefill_with_kv_cache_dtype_q_bf16_hd_256",
        "batch_decode_with_kv_cache_dtype_q_bf16_hd_256",
    ]


def test_patterns_match_flashinfers_names_or_the_label(probe: Any) -> None:
    chosen = probe.select(["silu*", "batch_decode_*", "rope"], [128], ["fp16"])
    assert [(c[0], c[3]) for c in chosen] == [
        # A generator FlashInfer refuses for these archs: selected by its label, with the reason.
        ("rope", "RuntimeError: No supported CUDA architectures found for major versions [9]"),
        ("silu_and_mul", None),
        ("batch_decode_with_kv_cache_dtype_q_fp16_hd_128", None),
    ]
    assert probe.select(["nothing*"], [128], ["bf16"]) == []


def test_a_recipe_from_elsewhere_generates_nothing_unknown(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Recipes come from store entries (a registry's too): only FlashInfer's generators of the
    known kinds run, never a module a recipe names."""
    monkeypatch.syspath_prepend(str(PROBE_DIR))
    sys.modules.pop("jit_warm", None)
    module = importlib.import_module("jit_warm")
    try:
        # Each refused by its shape, before FlashInfer or torch is imported (neither is here).
        bad_attention = [{"head_dim": "1", "dtype": "bf16"}, {"head_dim": True, "dtype": "bf16"},
                         {"head_dim": 0, "dtype": "bf16"}, {"head_dim": 128, "dtype": ["bf16"]},
                         {"head_dim": 128, "dtype": "fp8"}]  # fmt: skip
        for bad in (["os", {}], ["norm"], "norm", ["act", []],
                    *(["prefill", p] for p in bad_attention),
                    *(["decode", p] for p in bad_attention)):  # fmt: skip
            with pytest.raises(ValueError, match=r"not a module recipe|not an attention recipe"):
                module.generate(bad)
    finally:
        sys.modules.pop("jit_warm", None)


def test_the_prefetch_probe_goes_on_past_a_module_that_fails(
    probe: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One module whose key cannot be computed (ninja's compdb failing, here) is one warning
    and its generated build dir removed; the modules after it are still placed."""
    import subprocess
    import types

    class Spec:
        is_compiled = False

        def __init__(self, name: str) -> None:
            self.name = name
            self.ninja_path = str(tmp_path / "cache" / name / "build.ninja")

    def store_key(spec: Spec, store: Any, ninja: str) -> tuple[str, Path]:
        write(Path(spec.ninja_path), "rule cc\n")  # FlashInfer's write_ninja
        if spec.name == "norm":
            raise subprocess.CalledProcessError(1, [ninja, "-t", "compdb"])
        return spec.name * 8, Path(spec.ninja_path).parent

    class Store:
        def __init__(self, root: Path) -> None:
            self.notes: list[str] = []
            self.hasher = types.SimpleNamespace(save=lambda: None)

        def locked(self, key: str, timeout: float) -> Any:
            return contextlib.nullcontext()

    fake = types.SimpleNamespace(Store=Store, place_ninja=lambda *a: object())
    monkeypatch.setattr(probe, "generate", lambda recipe: Spec(recipe[0]))
    monkeypatch.setattr(probe, "store_key", store_key)
    monkeypatch.setattr(probe, "jit_store", fake)
    monkeypatch.setattr(probe.shutil, "which", lambda name: "/usr/bin/ninja")
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    assert probe.prefetch({"recipes": [["norm", {}], ["page", {}]]}) == 0
    doc = json.loads(capsys.readouterr().out.splitlines()[-1])
    assert (doc["placed"], doc["missed"]) == (["page"], ["norm"])
    assert len(doc["warnings"]) == 1 and doc["warnings"][0].startswith("norm: Command ")
    assert not (tmp_path / "cache" / "norm").exists()


# --------------------------------------------------------------------------- prefetch


def module_entry(store: jit_store.Store, tmp_path: Path, key: str, **module: Any) -> Path | None:
    built = write(tmp_path / f"{key[:4]}.so", key)
    header = write(tmp_path / "in.h", "header")
    meta = {"kind": "topk_topp", "env": str(tmp_path), "module": module}
    return store.publish(key, {"kernel": built}, [str(header)], meta, str(tmp_path))


def test_prefetch_candidates_are_the_modules_of_the_envs_flashinfer(tmp_path: Path) -> None:
    store = jit_store.Store(tmp_path / "store")
    act = ["act", {"act": "silu"}]
    module_entry(store, tmp_path, "a" * 64, name="silu_and_mul", recipe=act, flashinfer="0.7.2")
    module_entry(store, tmp_path, "b" * 64, name="silu_and_mul", recipe=act, flashinfer="0.7.2")
    module_entry(store, tmp_path, "c" * 64, name="norm", recipe=["norm", {}], flashinfer="0.6.0")
    module_entry(store, tmp_path, "d" * 64, name="x", recipe="not a recipe", flashinfer="0.7.2")
    assert prefetch.candidates(store, "0.7.2") == [act]  # each recipe once
    assert prefetch.candidates(store, "0.9.9") == []
    # Another arch list or another machine's entry never starts the probe.
    gelu = ["act", {"act": "gelu"}]
    module_entry(store, tmp_path, "e" * 64, name="gelu_and_mul", recipe=gelu,
                 flashinfer="0.7.2", archs="9.0a", machine=platform.machine())  # fmt: skip
    module_entry(store, tmp_path, "f" * 64, name="norm", recipe=["norm", {}],
                 flashinfer="0.7.2", archs="12.0f", machine="not-this-machine")  # fmt: skip
    assert prefetch.candidates(store, "0.7.2", "12.0f") == [act]
    assert prefetch.candidates(store, "0.7.2", "9.0a") == [act, gelu]


def test_prefetch_runs_the_probe_and_says_one_line(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    store = jit_store.Store(tmp_path / "store")
    module_entry(store, tmp_path, "a" * 64, recipe=["norm", {}], flashinfer="0.7.2")
    seen: list[dict[str, Any]] = []
    answer = {"placed": ["norm"], "present": [], "missed": [], "warnings": []}
    fake_probe(monkeypatch, [json.dumps(answer)], seen)
    python = tmp_path / "env" / "bin" / "python"
    done = prefetch.prefetch(python, flashinfer="0.7.2")
    assert done.line() == "prefetched 1 of 1 warmed FlashInfer module(s) from the JIT store"
    assert seen[0]["request"] == {"recipes": [["norm", {}]]}
    assert seen[0]["argv"][2] == "prefetch"
    assert "CUDAENV_ARCH_LIST" not in seen[0]["env"]  # the env's own archs, as it serves
    # A probe that answers nothing usable: one warning, nothing said placed, no exception.
    fake_probe(monkeypatch, ["not json"], [], rc=1)
    done = prefetch.prefetch(python, flashinfer="0.7.2")
    said = Said()
    prefetch.say_prefetched(done, said.reporter())
    assert (
        said.lines[0] == "cudaenv: prefetched 0 of 1 warmed FlashInfer module(s) from the JIT store"
    )
    assert len(said.lines) == 2 and said.lines[1].startswith(
        "cudaenv: warning: prefetch failed in "
    )
    # Off: nothing runs.
    monkeypatch.setenv("CUDAENV_NO_PREFETCH", "1")
    assert prefetch.prefetch(python, flashinfer="0.7.2").skipped == "off (CUDAENV_NO_PREFETCH=1)"


def test_a_reused_env_is_judged_again_only_for_modules_warmed_since(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    store = jit_store.Store(tmp_path / "store")
    module_entry(store, tmp_path, "a" * 64, recipe=["norm", {}], flashinfer="0.7.2")
    python = tmp_path / "env" / "bin" / "python"
    python.parent.mkdir(parents=True)
    seen: list[dict[str, Any]] = []
    answer = {"placed": ["norm"], "present": [], "missed": [], "warnings": []}
    fake_probe(monkeypatch, [json.dumps(answer)], seen)
    assert prefetch.prefetch(python, flashinfer="0.7.2").placed == ("norm",)
    # Reused with nothing warmed since: no probe, nothing said.
    again = prefetch.prefetch(python, flashinfer="0.7.2", only_new=True)
    assert (again.skipped, len(seen)) == ("nothing warmed since the last", 1)
    # A module warmed since: the probe judges that one alone.
    module_entry(store, tmp_path, "b" * 64, recipe=["rope", {}], flashinfer="0.7.2")
    prefetch.prefetch(python, flashinfer="0.7.2", only_new=True)
    assert seen[-1]["request"] == {"recipes": [["rope", {}]]}
    # A record that is not ours (a link out of the env) is not read: every module judged.
    record = tmp_path / "env" / prefetch.JUDGED
    record.unlink()
    record.symlink_to(write(tmp_path / "elsewhere.json", json.dumps([json.dumps(["rope", {}])])))
    prefetch.prefetch(python, flashinfer="0.7.2", only_new=True)
    assert len(seen[-1]["request"]["recipes"]) == 2


def test_store_list_of_a_spec_keeps_what_its_env_would_get() -> None:
    wanted = {"flashinfer": "0.7.2", "cuda": "13.0", "archs": "12.0f", "machine": "x86_64"}
    ok = {"flashinfer": "0.7.2", "cuda": "13.0.88", "archs": "12.0f", "machine": "x86_64"}
    assert storerun.fits(ok, wanted)
    assert not storerun.fits(None, wanted)
    for field, other in (("flashinfer", "0.7.3"), ("cuda", "13.1"), ("archs", "9.0a 12.0f"),
                         ("machine", "aarch64"), ("cuda", "13.01")):  # fmt: skip
        assert not storerun.fits({**ok, field: other}, wanted), field


def test_store_list_cannot_be_forged_by_what_an_entry_records(tmp_path: Path) -> None:
    """An entry's record comes from whoever made it (a registry's): a module name, arch list,
    kind or maker holding a newline or an escape is shown quoted, one line per entry."""
    hostile = "norm\n0000000000000000/v  ninja  1 B  used 2026-01-01 00:00  made for x\x1b[2J"
    row = jit_store.Listed(key="a" * 64, variant="v", kind="ninja\r", size=1, last_used=0.0,
                           first_built=None, made_for="/env\x1b]0;x\x07",
                           module={"name": hostile, "archs": "12.0f\n"})  # fmt: skip
    found = storerun.Listing(root=tmp_path, cap=1, entries=(row,))
    lines = found.lines()
    assert len(lines) == 2
    assert all(c.isprintable() for c in lines[0]), lines[0]
    assert "'norm\\n0000" in lines[0] and "'12.0f\\n'" in lines[0]
    plain = dataclasses.replace(row, kind="ninja", made_for="/env",
                                module={"name": "norm", "archs": "9.0a 12.0f"})  # fmt: skip
    line = storerun.Listing(root=tmp_path, cap=1, entries=(plain,)).lines()[0]
    assert line.endswith("made for /env  norm for 9.0a 12.0f"), line


def test_run_lines_hands_each_line_over_and_is_bounded(tmp_path: Path) -> None:
    """The seam itself, with a real child: stdout line by line as it comes, stdin given,
    stderr kept, and a child that outlives its deadline killed and said so."""
    code = (
        "import sys; print(sys.stdin.read().upper()); print('two'); print('err', file=sys.stderr)"
    )
    got: list[str] = []
    done = proc.run_lines([sys.executable, "-c", code], got.append, input_text="one", timeout=30)
    assert (got, done.returncode, done.stderr.strip()) == (["ONE", "two"], 0, "err")
    slow = "import time; print('started', flush=True); time.sleep(30)"
    got.clear()
    with pytest.raises(proc.CommandFailed, match=r"timed out after 0\.5 s"):
        proc.run_lines([sys.executable, "-c", slow], got.append, timeout=0.5)
    assert got == ["started"]


def test_a_module_built_but_not_kept_is_a_failure_of_the_warm(
    probe: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A warm exists to fill the store: a module the store would not keep is "failed" with
    the store's reason (warmrun then exits non-zero), never "built"."""
    import types

    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.2"))
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    refused = "'0-batch_prefill.cuda.o' is not a file name inside the entry"
    outcomes = {
        "norm": {"used": True, "entry": "e1", "key": "k1", "hit": False, "warnings": []},
        "page": {"used": False, "entry": None, "key": "k2", "warnings": [refused]},
        "rope": {"used": False, "entry": None, "key": "k3"},
    }
    monkeypatch.setattr(
        probe,
        "build_through_store",
        lambda spec, root, compiled, recipe, waiting: outcomes[spec.name],
    )
    monkeypatch.setattr(probe, "recipes", lambda hd, dt: [(n, [n, {}]) for n in outcomes])
    monkeypatch.setattr(probe, "generate", lambda recipe: types.SimpleNamespace(name=recipe[0]))
    assert probe.warm({"modules": []}) == 0
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    done = {e["module"]: e for e in events if e["event"] == "done"}
    assert done["norm"]["status"] == "built"
    assert done["page"]["status"] == "failed" and refused in done["page"]["reason"]
    assert done["rope"]["status"] == "failed"
    assert done["rope"]["reason"] == "built, but not kept in the JIT store: the store refused it"


def test_the_jit_probe_reads_what_ninja_ran_not_what_existed(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """verify's probe (env_facts.jit_sampling) with the module's library already there (what
    made the old check say "reused"): ninja's log, read around the build, decides."""
    import types

    monkeypatch.syspath_prepend(str(PROBE_DIR))
    for name in ("env_facts", "doctor_probe", "flashinfer_light"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    env_facts = importlib.import_module("env_facts")
    build_dir = tmp_path / "cached_ops" / "sampling"
    build_dir.mkdir(parents=True)
    log = build_dir / ".ninja_log"
    log.write_text("# ninja log v7\n0\t10\t5\tsampling.cuda.o\tabc\n")
    (build_dir / "sampling.so").write_bytes(b"placed earlier")

    class Spec:
        is_compiled = True  # the library exists before the build
        ninja_path = str(build_dir / "build.ninja")
        compiles = True

        def build(self, verbose: bool) -> None:
            if self.compiles:  # ninja appends one record per command it runs
                with log.open("a") as f:
                    f.write("0\t90\t7\tsampling.cuda.o\tdef\n0\t95\t8\tsampling.so\t12\n")

        def get_library_path(self) -> str:
            return str(build_dir / "sampling.so")

    spec = Spec()
    jit = types.SimpleNamespace(gen_sampling_module=lambda: spec)
    monkeypatch.setattr(env_facts, "import_flashinfer_jit", lambda module: (jit, "stub"))
    monkeypatch.setenv("CUDAENV_JIT_STORE", "off")
    out = env_facts.jit_sampling()
    assert (out["reused"], out["ran"]) == (False, ["sampling.cuda.o", "sampling.so"])
    spec.compiles = False
    out = env_facts.jit_sampling()
    assert (out["reused"], out["ran"]) == (True, [])
    log.unlink()  # no log after the build: no evidence, so not "reused"
    assert env_facts.jit_sampling()["reused"] is False


def jobserver_ninja() -> str:
    found = Path(sys.executable).parent / "ninja"
    if not found.is_file():
        pytest.skip("no ninja in this venv (the test group installs one)")
    done = subprocess.run([found, "--version"], capture_output=True, text=True, check=True)
    if tuple(int(p) for p in done.stdout.split(".")[:2]) < (1, 13):
        pytest.skip(f"ninja {done.stdout.strip()} joins no jobserver")
    return str(found)


def most_at_once(log: Path) -> int:
    """The most commands running together, from their start and end stamps."""
    events = sorted(
        (float(stamp), 1 if kind == "start" else -1)
        for kind, _, stamp in (line.split() for line in log.read_text().splitlines())
    )
    running = most = 0
    for _, change in events:
        running += change
        most = max(most, running)
    return most


SLEEPER = """rule s
  command = echo "start $out $$(date +%s.%N)" >> {log}; sleep $pause; echo "end $out $$(date +%s.%N)" >> {log}; touch $out
"""


def spans(log: Path) -> dict[str, tuple[float, float]]:
    """Each command's (start, end), by its output's name, from the sleeper's log."""
    stamps: dict[str, dict[str, float]] = {}
    for line in log.read_text().splitlines():
        kind, out, stamp = line.split()
        stamps.setdefault(out, {})[kind] = float(stamp)
    return {out: (s["start"], s["end"]) for out, s in stamps.items()}


def warm_sleepers(
    probe: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    edges: dict[str, list[float]],
) -> tuple[list[dict[str, Any]], float, Path]:
    """A warm on 2 slots whose modules are real ninjas running ``sleep`` commands (each
    module's list is its commands' pauses, in build.ninja's order): its events, its wall time
    and the commands' log."""
    import types

    ninja = jobserver_ninja()
    monkeypatch.setitem(sys.modules, "flashinfer", types.SimpleNamespace(__version__="0.7.2"))
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store"))
    monkeypatch.setenv("PATH", f"{Path(ninja).parent}:{os.environ['PATH']}")
    # The probe sets both for its own ninjas; monkeypatch puts them back after.
    monkeypatch.setenv("MAKEFLAGS", "")
    monkeypatch.setenv("MAX_JOBS", "8")
    log = tmp_path / "log"

    def build(spec: Any, root: Path, compiled: bool, recipe: Any, waiting: Any) -> dict[str, Any]:
        where = tmp_path / spec.name
        where.mkdir()
        (where / "build.ninja").write_text(
            SLEEPER.format(log=log)
            + "".join(
                f"build {spec.name}.o{i}: s\n  pause = {pause}\n"
                for i, pause in enumerate(edges[spec.name])
            )
        )
        assert "MAX_JOBS" not in os.environ  # FlashInfer would pass -j and leave the jobserver
        subprocess.run([ninja, "-C", str(where)], check=True, capture_output=True)
        return {"used": True, "entry": f"e-{spec.name}", "key": spec.name, "hit": False}

    monkeypatch.setattr(probe, "build_through_store", build)
    monkeypatch.setattr(probe, "recipes", lambda hd, dt: [(n, [n, {}]) for n in edges])
    monkeypatch.setattr(probe, "generate", lambda recipe: types.SimpleNamespace(name=recipe[0]))
    started = time.monotonic()
    assert probe.warm({"modules": [], "jobs": 2}) == 0
    wall = time.monotonic() - started
    events = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    plan = next(e for e in events if e["event"] == "plan")
    assert (plan["workers"], plan["slots"]) == (2, 2)
    done = [e for e in events if e["event"] == "done"]
    assert sorted(e["module"] for e in done) == sorted(edges)
    assert all(e["status"] == "built" for e in done), done
    return events, wall, log


@pytest.mark.slow
def test_a_warm_builds_modules_at_once_within_its_compile_slots(
    probe: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """One scheduler for the compiles of a warm: modules are built together on 2 slots (a
    jobserver every ninja joins), never more than 2 commands at once across all of them, and
    the module left last gets both slots for its own compiles."""
    edges = {"a": [0.6], "b": [0.6], "c": [0.6], "topk": [0.6] * 4}  # topk: built first
    _, wall, log = warm_sleepers(probe, monkeypatch, tmp_path, capsys, edges)
    assert most_at_once(log) == 2  # 7 commands, never more than the 2 slots together
    # 7 commands of 0.6 s on 2 slots: 2.4 s at best, 4.2 s one at a time.
    assert wall < 3.9, wall


@pytest.mark.slow
def test_the_longest_module_gets_its_slots_first_and_lends_one_it_holds_idle(
    probe: Any,
    jobs: Any,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """topk's long file is its second (as csrc/cub_topk.cu is in FlashInfer's topk): the
    lead module's ninja starts both of its first commands at once, before any other module
    takes a slot, and once its short files are done, the slot it holds idle behind the long
    one (ninja's first command ran on its implicit slot and its last runs on a token it read)
    builds the other modules meanwhile. Before: the others took the second slot at the start,
    so the long file waited for the first, and the last two files waited for the long one."""
    edges = {"a": [0.6], "b": [0.6], "c": [0.6], "topk": [1.0, 8.0, 1.0, 1.0]}
    # Shorter looks and grace than the warm's (0.5 s each, for compiles of minutes): the
    # same steps, with room on a loaded box between the last of the others and the long end.
    monkeypatch.setattr(jobs, "GRACE", 0.1)
    monkeypatch.setattr(jobs, "PERIOD", 0.1)
    _, wall, log = warm_sleepers(probe, monkeypatch, tmp_path, capsys, edges)
    ran = spans(log)
    assert most_at_once(log) == 2
    first, long = ran["topk.o0"], ran["topk.o1"]
    assert long[0] - first[0] < 0.6, ran  # both of the lead's slots at its start (not 1 s)
    others = [span for out, span in ran.items() if not out.startswith("topk.")]
    assert all(end < long[1] for _, end in others), ran  # built beside the long file
    # The long file is the bound: 8 s; 10 s when it starts behind the first and the last
    # two behind it.
    assert wall < 9.5, wall


@pytest.fixture(params=["children lists", "process table"])
def lookups(request: pytest.FixtureRequest, jobs: Any, monkeypatch: pytest.MonkeyPatch) -> Any:
    """The jobserver module, its census reading the kernel's children lists or (a kernel without them)
    every process's stat."""
    if request.param == "process table":

        def none(me: int) -> Any:
            raise FileNotFoundError(f"/proc/{me}/task/{me}/children")

        monkeypatch.setattr(jobs, "_children_lists", none)
    return jobs


@contextlib.contextmanager
def sleeping_ninja(argv: list[str], where: Path) -> Iterator[int]:
    """A ninja (``argv`` starts it) running two 3 s commands, in a session of its own: its
    pid while it runs; it and everything it started killed after."""
    (where / "build.ninja").write_text(
        SLEEPER.format(log=where / "log")
        + "".join(f"build o{i}: s\n  pause = 3\n" for i in range(2))
    )
    child = subprocess.Popen(
        [*argv, "-j2", "-C", str(where)], stdout=subprocess.DEVNULL, start_new_session=True
    )
    try:
        yield child.pid
    finally:
        os.killpg(child.pid, signal.SIGKILL)
        child.wait()


def counted(jobs: Any, want: dict[int, int]) -> dict[int, int]:
    """The census of this process once it says ``want``, or its last answer after 2.5 s."""
    deadline = time.monotonic() + 2.5
    seen: dict[int, int] = jobs.census(os.getpid())
    while time.monotonic() < deadline and seen != want:
        time.sleep(0.05)
        seen = jobs.census(os.getpid())
    return seen


def test_census_counts_this_process_ninjas_and_their_commands(lookups: Any, tmp_path: Path) -> None:
    """What the warm's slots are counted from: a ninja this process started, with each
    command it runs, and nothing of another process's ninja."""
    ninja = shutil.which("ninja") or pytest.skip("no ninja on PATH")
    assert lookups.census(os.getpid()) == {}
    with sleeping_ninja([ninja], tmp_path) as pid:
        assert counted(lookups, {pid: 2}) == {pid: 2}
        assert lookups.census(pid) == {}  # its commands are sh, not ninja


def never(waited: float) -> None:
    raise AssertionError(f"waited {waited} s for a token that was there")


@pytest.fixture
def pool(jobs: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A warm's slots (2) that no look but the test's own changes, closed after."""
    monkeypatch.setattr(jobs, "PERIOD", 1000.0)
    slots = jobs.Jobserver(2)
    try:
        yield slots
    finally:
        slots.close()


def test_a_slot_held_idle_is_lent_and_taken_back_when_it_returns(pool: Any) -> None:
    """The accounting of the warm's slots, each look given (ninja pid: its commands) and
    the FIFO's count: a ninja whose one compile runs on a token it read holds its worker's
    slot idle; on the second look running, one token is lent; once that compile ends and
    the token comes back, the loan is taken back and 2 slots are in circulation again."""
    lead = pool.take(never)
    assert os.read(pool.fd, 1) == b"+"  # the lead's ninja reads the second
    with pool.lock:
        assert pool.idle({101: 1}, pool.free()) == (1, 0)  # once: maybe a moment's gap
        pool.settle(*pool.idle({101: 1}, pool.free()))
    assert (pool.lent, pool.free()) == (1, 1)
    other = pool.take(never)  # the other module builds on the loan
    with pool.lock:
        assert pool.idle({101: 1, 102: 1}, pool.free()) == (1, 1)  # no second loan
        pool.settle(1, 1)
    assert (pool.lent, pool.free()) == (1, 0)
    os.write(pool.fd, b"+")  # the long compile ends: its ninja's token back, it exits
    pool.give(lead)
    with pool.lock:
        pool.settle(*pool.idle({102: 1}, pool.free()))
    assert (pool.lent, pool.owed, pool.free(), pool.held) == (0, 0, 1, 1)
    pool.give(other)
    assert pool.free() == 2


def test_a_loan_not_free_to_take_back_is_taken_by_the_next_worker_that_reads_it(
    pool: Any, jobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A loan owed while every token is in use is kept out of the FIFO by the next read."""
    monkeypatch.setattr(jobs, "GRACE", 0.0)
    first = pool.take(never)
    assert os.read(pool.fd, 1) == b"+"  # its ninja's second compile
    with pool.lock:
        pool.settle(1, 1)  # lent
    second = pool.take(never)
    with pool.lock:
        pool.settle(0, 0)  # no slot idle any more, and nothing in the FIFO to read
    assert (pool.lent, pool.owed, pool.free()) == (1, 1, 0)
    os.write(pool.fd, b"+")  # the ninja's token back
    pool.give(first)
    third = pool.take(never)  # reads the loan, keeps it out, returns the next
    assert (pool.lent, pool.owed, pool.free(), pool.held) == (0, 0, 0, 2)
    pool.give(second)
    pool.give(third)
    assert pool.free() == 2


def test_the_others_wait_for_the_lead_at_most_lead_start(
    jobs: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A lead whose ninja never runs a command (its key's lock held elsewhere, a pull) keeps
    the other workers waiting no longer than LEAD_START; a look that fails opens the way and
    lends nothing after."""
    monkeypatch.setattr(jobs, "PERIOD", 0.05)
    monkeypatch.setattr(jobs, "GRACE", 0.0)
    monkeypatch.setattr(jobs, "LEAD_START", 0.4)
    pool = jobs.Jobserver(2)
    try:
        pool.lead(True)
        lead = pool.take(never)
        started = time.monotonic()
        other = pool.take(never, behind_lead=True)
        assert 0.3 < time.monotonic() - started < 2.0
        pool.give(other)
        pool.give(lead)
    finally:
        pool.close()

    def broken(me: int) -> dict[int, int]:
        raise RuntimeError("an odd /proc")

    monkeypatch.setattr(jobs, "census", broken)
    monkeypatch.setattr(jobs, "LEAD_START", 1000.0)
    pool = jobs.Jobserver(2)
    try:
        pool.lead(True)
        assert pool.opened.wait(2.0)
        assert pool.lending is False
    finally:
        pool.close()


@pytest.mark.slow
def test_the_slots_a_killed_ninja_held_come_back(
    jobs: Any, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A module's ninja, joined to the warm's 2 slots, runs its first compile on its worker's
    slot and its second on a token it read from the FIFO, and is SIGKILLed (an out-of-memory
    kill): the token it read is gone with it. Once its worker gives its own back, both slots
    can be taken again within a few looks, not never."""
    ninja = jobserver_ninja()
    monkeypatch.setattr(jobs, "PERIOD", 0.05)
    monkeypatch.setattr(jobs, "GRACE", 0.0)
    pool = jobs.Jobserver(2)
    try:
        worker = pool.take(never)
        (tmp_path / "build.ninja").write_text(
            SLEEPER.format(log=tmp_path / "log")
            + "".join(f"build o{i}: s\n  pause = 30\n" for i in range(3))
        )
        child = subprocess.Popen(
            [ninja, "-C", str(tmp_path)],
            env={**os.environ, "MAKEFLAGS": pool.makeflags()},
            stdout=subprocess.DEVNULL,
            start_new_session=True,
        )
        try:
            assert counted(jobs, {child.pid: 2}) == {child.pid: 2}  # the token read
            assert pool.free() == 0
        finally:
            os.killpg(child.pid, signal.SIGKILL)
            child.wait()
        pool.give(worker)
        taken: list[bytes] = []
        both = threading.Thread(
            target=lambda: taken.extend(pool.take(never) for _ in "ab"), daemon=True
        )
        both.start()
        both.join(timeout=10)
        assert len(taken) == 2, "a slot the killed ninja held never came back"
        for token in taken:
            pool.give(token)
        time.sleep(0.3)  # looks enough to have written anything more
        assert pool.free() == 2  # each slot once, never a slot too many
    finally:
        pool.close()


def test_census_counts_the_commands_of_a_ninja_a_wrapper_starts(
    lookups: Any, tmp_path: Path
) -> None:
    """A ``ninja`` on PATH that is a script starting the real one: the real one's commands
    count, not the real ninja as one command."""
    ninja = shutil.which("ninja") or pytest.skip("no ninja on PATH")
    wrapper = tmp_path / "bin" / "ninja"
    wrapper.parent.mkdir()
    wrapper.write_text(f'#!/bin/sh\n"{ninja}" "$@"\n')  # no exec: the script stays
    wrapper.chmod(0o755)
    with sleeping_ninja([str(wrapper)], tmp_path) as pid:
        assert counted(lookups, {pid: 2}) == {pid: 2}
