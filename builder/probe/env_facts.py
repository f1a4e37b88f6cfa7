"""Run INSIDE a target interpreter by ``cudaenv verify``; prints one JSON object.

Standard library only at the top: torch and FlashInfer are imported inside try blocks, so a
toolkit-only env or a broken install becomes a fact ("error": ...) instead of a traceback.
With ``--jit sampling`` it also JIT-builds FlashInfer's sampling module in the same process
(FlashInfer's import alone takes ~7 s; one import serves both the facts and the build).
"""

from __future__ import annotations

import ctypes
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any

from doctor_probe import cuda_home_order, nvcc_info, requested_variables, which
from flashinfer_light import cuda_facts, import_flashinfer_jit, installed

# The name the store takes in this interpreter: its own, not builder.store, so that importing
# it runs nothing else of cudaenv (builder/__init__.py and its siblings need cudaenv's own
# dependencies, and the env's site-packages is not cudaenv's).
STORE_MODULE = "cudaenv_store"


def import_store() -> ModuleType:
    """cudaenv's JIT store (``builder/store``, standard library only), imported from its
    directory beside this one. Its modules import one another relatively, so it works under
    any package name."""
    if STORE_MODULE in sys.modules:
        return sys.modules[STORE_MODULE]
    where = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "store")
    spec = importlib.util.spec_from_file_location(
        STORE_MODULE, os.path.join(where, "__init__.py"), submodule_search_locations=[where]
    )
    if spec is None or spec.loader is None:
        raise ImportError("%s: not cudaenv's JIT store" % where)
    module = importlib.util.module_from_spec(spec)
    sys.modules[STORE_MODULE] = module
    try:
        spec.loader.exec_module(module)
    except BaseException:
        del sys.modules[STORE_MODULE]
        raise
    return module


if TYPE_CHECKING:
    from builder import store as jit_store
else:
    jit_store = import_store()


def nvcc_release(cuda_home: str) -> dict[str, object]:
    info = nvcc_info(cuda_home)
    out: dict[str, object] = {"path": info["nvcc"]}
    if not info["exists"]:
        out["error"] = "no bin/nvcc"
    for key in ("release", "error"):
        if key in info:
            out[key] = info[key]
    return out


def cudart(cuda_home: str) -> dict[str, object]:
    """cudaRuntimeGetVersion of the libcudart in CUDA_HOME (works without a driver)."""
    out: dict[str, object] = {}
    for sub in ("lib64", "lib"):
        d = os.path.join(cuda_home, sub)
        if not os.path.isdir(d):
            continue
        names = sorted(n for n in os.listdir(d) if re.match(r"^libcudart\.so(\.\d+)*$", n))
        if not names:
            continue
        path = os.path.join(d, names[-1])
        out["path"] = path
        try:
            lib = ctypes.CDLL(path)
            version = ctypes.c_int(0)
            rc = lib.cudaRuntimeGetVersion(ctypes.byref(version))
            if rc == 0:
                v = version.value
                out["version"] = f"{v // 1000}.{(v % 1000) // 10}"
            else:
                out["error"] = f"cudaRuntimeGetVersion returned {rc}"
        except OSError as exc:
            out["error"] = str(exc)
        return out
    out["error"] = f"no libcudart.so in {cuda_home}/lib64 or lib"
    return out


def torch_facts() -> dict[str, object]:
    try:
        import torch

        # Read inside the try: a torch without __version__ or torch.version (a damaged or
        # stub install) is a fact to report, not the probe's traceback.
        version, cuda = str(torch.__version__), torch.version.cuda
    except Exception as exc:  # a broken install is a fact, not a crash
        return {"installed": installed("torch"), "error": f"{type(exc).__name__}: {exc}"}
    return {"installed": True, "version": version, "cuda": None if cuda is None else str(cuda)}


def flashinfer_facts(jit: bool) -> dict[str, object]:
    out: dict[str, object] = cuda_facts()
    if jit and "version" in out:  # imported; the JIT runs even if get_cuda_* failed
        out["jit"] = jit_sampling()
    return out


def build_seen(spec: Any) -> list[str]:
    """FlashInfer's build of ``spec`` (its ninja run); the outputs ninja ran a command for,
    read from ninja's own log (every command it runs is recorded there): [] when nothing
    compiled, whatever files existed before."""
    log = Path(str(getattr(spec, "ninja_path", "") or "build.ninja")).parent / ".ninja_log"
    before = jit_store.log_records(log) if hasattr(spec, "ninja_path") else None
    spec.build(verbose=False)
    if not hasattr(spec, "ninja_path"):
        return ["(a FlashInfer without ninja_path: no log to read)"]
    return jit_store.commands_run(before, jit_store.log_records(log))


def jit_sampling() -> dict[str, object]:
    started = time.monotonic()
    try:
        sampling, _ = import_flashinfer_jit("sampling")
        spec = sampling.gen_sampling_module()
        compiled = bool(spec.is_compiled)
        store = os.environ.get("CUDAENV_JIT_STORE", "")
        stored: dict[str, object] | None = None
        if store and store != "off":
            stored = build_through_store(spec, Path(store), compiled=compiled)
            told = stored.get("ran")
            ran = [str(r) for r in told] if isinstance(told, list) else None
        else:
            ran = build_seen(spec)
        out: dict[str, object] = {
            "library": str(spec.get_library_path()),
            # What ninja did, not what existed: "reused" only when it ran no command.
            "reused": ran == [],
            "ran": ran if ran is not None else ["(unknown: the store gave no account)"],
            "seconds": time.monotonic() - started,
        }
        if stored is not None:
            out["store"] = stored
        return out
    except Exception as exc:
        text = f"{type(exc).__name__}: {exc}"
        return {"error": text[-6000:], "seconds": time.monotonic() - started}


def module_meta(spec: Any, recipe: list[object] | None) -> dict[str, object]:
    """What an entry records of the FlashInfer module it holds (its content, so it travels
    with the entry to a registry): the module's name, how to generate it again (``recipe``,
    the generator of builder/probe/jit_warm.py), the arch list, FlashInfer's version, the
    toolkit's nvcc release and the machine. ``cudaenv store list SPEC`` and the prefetch at
    build read it; an entry is placed only where the key computed in the env is equal."""
    import platform

    try:  # its own module: the package may be imported without its __init__ (light)
        from flashinfer.version import __version__ as version
    except Exception:
        try:
            from flashinfer import __version__ as version
        except Exception:  # a FlashInfer without it: the entry still records the rest
            version = ""
    cuda_home = os.environ.get("CUDA_HOME", "")
    release = nvcc_info(cuda_home).get("release") if cuda_home else None
    return {
        "name": str(getattr(spec, "name", "")),
        "recipe": recipe,
        "archs": os.environ.get("FLASHINFER_CUDA_ARCH_LIST", ""),
        "flashinfer": str(version),
        "cuda": str(release or ""),
        "machine": platform.machine(),
    }


def store_key(spec: Any, store: Any, ninja: str) -> tuple[str, Path]:
    """The store key of ``spec`` in this env (its ``build.ninja`` written first: the key is
    made of it, normalised, and of the tools' identities) and its build directory."""
    spec.write_ninja()
    build_dir = Path(spec.ninja_path).parent
    key = jit_store.key_of(
        jit_store.ninja_material(store, build_dir, sys.prefix, ninja, os.environ)
    )
    return key, build_dir


def build_through_store(
    spec: Any,
    root: Path,
    *,
    compiled: bool,
    recipe: list[object] | None = None,
    waiting: Any = None,
) -> dict[str, object]:
    """FlashInfer's build of ``spec`` through cudaenv's store (builder/store/): a result some
    env of the same toolchain built is placed with ninja logs for this env, so ninja has
    nothing to do; a miss is pulled from the store's remote tier where one is set, else built
    here and kept for the next env; with a ``recipe`` (a warm's module) the entry records
    which module it is (:func:`module_meta`), so that prefetch can place it in another env.
    ``waiting`` hears of the process that builds the same key while this one waits for it.
    An env that has the result already (``compiled``) only offers it to the store. Whatever
    fails in the store costs a compile, never the build."""
    ninja = shutil.which("ninja")  # what FlashInfer's run_ninja runs
    if ninja is None or not hasattr(spec, "write_ninja") or not hasattr(spec, "ninja_path"):
        ran = build_seen(spec)
        why = "no ninja on PATH or a FlashInfer without write_ninja"
        return {"used": False, "why": why, "ran": ran}
    store = jit_store.Store(root)
    try:
        key, build_dir = store_key(spec, store, ninja)
        what = f"{getattr(spec, 'name', '?')} ({os.environ.get('FLASHINFER_CUDA_ARCH_LIST', '')})"
        lock = store.acquire(key, note=what, waiting=waiting)
    except (jit_store.StoreError, OSError) as exc:
        ran = build_seen(spec)
        return {"used": False, "warnings": [f"the JIT store was not used: {exc}"], "ran": ran}
    notes: list[str] = []
    entry = None
    usable = True
    marked = False  # a hit on an entry made without its module: recorded now (mark_warm)
    try:
        if not compiled:
            try:
                entry = jit_store.place_ninja(store, key, build_dir, sys.prefix, ninja)
                if entry is None and share("pull", key, sys.prefix, notes):
                    entry = jit_store.place_ninja(store, key, build_dir, sys.prefix, ninja)
            except (jit_store.StoreError, OSError) as exc:
                notes.append(f"the JIT store was not used: {exc}")
                usable = False
        ran = build_seen(spec)
        # A hit is an entry placed and nothing compiled after it: ninja's log says so.
        hit = entry is not None and not ran
        if hit and entry is not None and recipe is not None:
            marked = mark_warm(store, entry, module_meta(spec, recipe), notes)
        kept = None
        if not hit and usable:
            try:
                meta: dict[str, object] = {"env": sys.prefix}
                if recipe is not None:  # a module a warm chose: what prefetch generates again
                    meta["module"] = module_meta(spec, recipe)
                kept = jit_store.publish_ninja(store, key, build_dir, sys.prefix, ninja, meta)
            except (jit_store.StoreError, jit_store.EntryError, OSError) as exc:
                notes.append(f"the module was not kept in the JIT store: {exc}")
        # Pushing (a warmer's) is cudaenv's own, after this probe answered: it has the
        # registry client loaded already, where a push from here started an interpreter for it.
        used = entry.path if hit and entry is not None else kept
    finally:
        lock.release()
        store.hasher.save()
    out: dict[str, object] = {
        "used": True,
        "key": key[:16],
        # What a placement plan records of the module (builder/store/plans.py).
        "planned": {"key": key, "name": str(getattr(spec, "name", "")), "dir": str(build_dir)},
        "hit": hit,
        "marked": marked,
        "ran": ran,
        "warnings": [*store.notes, *notes],
    }
    if hit and entry is not None:
        out["first_built"] = entry.provenance.get("first_built")
        out["env"] = entry.provenance.get("env") or entry.provenance.get("origin")
    else:
        out["kept"] = kept is not None
    if used is not None:
        out["entry"] = str(used.relative_to(store.root))
    return out


def mark_warm(store: Any, entry: Any, module: dict[str, object], notes: list[str]) -> bool:
    """A warm's module found in an entry another command made (verify, a server's first
    start) recorded in it, so that it is warm for `store list`, prefetch and push too; True
    when it was recorded now. A store that cannot record it (read-only) costs a note: it is
    still a hit here."""
    try:
        return bool(store.mark(entry, module))
    except (jit_store.StoreError, jit_store.EntryError, OSError) as exc:
        notes.append(f"the module was not marked as warm in the JIT store: {exc}")
        return False


def share(action: str, key: str, arg: str, notes: list[str]) -> bool:
    """Ask cudaenv (``CUDAENV_JIT_SHARE``: its interpreter and ``-m builder.jit.share``) to
    pull ``key`` from the store's remote tier; True when it pulled. This script runs in the
    env's interpreter, which has no registry client."""
    try:
        argv = json.loads(os.environ.get("CUDAENV_JIT_SHARE") or "null")
    except ValueError:
        argv = None
    if not (isinstance(argv, list) and argv and all(isinstance(a, str) for a in argv)):
        return False
    try:
        done = subprocess.run(
            [*argv, action, key, arg], capture_output=True, text=True, timeout=900, check=False
        )
        answer = json.loads(done.stdout.strip().splitlines()[-1])
    except (OSError, subprocess.TimeoutExpired, ValueError, IndexError):
        notes.append(f"the JIT remote was not used: `{' '.join(argv)} {action}` gave no answer")
        return False
    if isinstance(answer, dict) and answer.get("warning"):
        notes.append(str(answer["warning"]))
    return isinstance(answer, dict) and answer.get("pulled") is True


def main() -> int:
    jit = "--jit" in sys.argv
    # The toolkit the JIT compilers would take (doctor reads the same order).
    source, cuda_home = (cuda_home_order() or [("", "")])[0]
    none = "no CUDA toolkit: CUDA_HOME and CUDA_PATH unset, no nvcc on PATH, no /usr/local/cuda"
    facts: dict[str, object] = {
        "python": sys.executable,
        "python_version": "%d.%d.%d" % sys.version_info[:3],
        "prefix": sys.prefix,
        # The variables cudaenv names (builder/core/variables.py, given as --env=A,B): this
        # script runs in the env's interpreter and imports nothing of cudaenv.
        "env": {k: os.environ.get(k) for k in requested_variables()},
        "path_nvcc": which("nvcc"),
        "cuda_home": cuda_home,
        "cuda_home_source": source,
        "nvcc": nvcc_release(cuda_home) if cuda_home else {"error": none},
        "cudart": cudart(cuda_home) if cuda_home else {"error": none},
        "torch": torch_facts(),
        # Everything, as the start-up hook left it: the checks run their commands with it.
        "environ": dict(os.environ),
    }
    facts["flashinfer"] = flashinfer_facts(jit)
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
