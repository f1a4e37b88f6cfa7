"""Import FlashInfer's own JIT modules without running the flashinfer package __init__.

Imported by the probes (run by path inside a target interpreter; standard library only).
`import flashinfer` loads every kernel wrapper and the CuTe DSL: ~4.7 s on top of torch's
~3 s on the project's machines. get_cuda_path(), get_cuda_version() and the sampling JitSpec
need only flashinfer/jit/cpp_ext.py, sampling.py and their few imports, so `flashinfer` and
`flashinfer.jit` are registered as bare packages and those modules run unchanged. If this
layout ever stops working, the full import is used instead (and reported).
"""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
import types
from typing import Any


def import_flashinfer_jit(module: str) -> tuple[Any, str]:
    """``flashinfer.jit.<module>`` and how it was imported."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("No module named 'flashinfer'")
    root = next(iter(spec.submodule_search_locations))
    if "flashinfer" in sys.modules and hasattr(sys.modules["flashinfer"], "__file__"):
        return importlib.import_module(f"flashinfer.jit.{module}"), "import flashinfer"
    saved = {k: sys.modules.get(k) for k in ("flashinfer", "flashinfer.jit")}
    try:
        for name, path in (("flashinfer", root), ("flashinfer.jit", os.path.join(root, "jit"))):
            if name in sys.modules:
                continue
            stub = types.ModuleType(name)
            stub.__path__ = [path]
            stub.__package__ = name
            stub.__spec__ = importlib.machinery.ModuleSpec(name, None, is_package=True)
            stub.__spec__.submodule_search_locations = [path]
            sys.modules[name] = stub
        return importlib.import_module(f"flashinfer.jit.{module}"), "flashinfer.jit only"
    except Exception:
        for name in [k for k in sys.modules if k == "flashinfer" or k.startswith("flashinfer.")]:
            del sys.modules[name]
        for name, previous in saved.items():
            if previous is not None:
                sys.modules[name] = previous
        return importlib.import_module(f"flashinfer.jit.{module}"), "import flashinfer"


def installed(name: str) -> bool:
    """Whether a top-level package ``name`` is installed (found), whether or not it imports."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def cuda_facts() -> dict[str, object]:
    """FlashInfer's own get_cuda_path() / get_cuda_version(), or why they could not be asked."""
    try:
        cpp_ext, how = import_flashinfer_jit("cpp_ext")
        from flashinfer.version import __version__ as version
    except Exception as exc:  # a broken install is a fact, not a crash
        # Installed is a question for the import system, not for the exception: an
        # ImportError from inside FlashInfer (a missing tvm_ffi) is a broken install.
        return {"installed": installed("flashinfer"), "error": "%s: %s" % (type(exc).__name__, exc)}
    out: dict[str, object] = {"installed": True, "version": version, "import": how}
    try:
        out["cuda_path"] = str(cpp_ext.get_cuda_path())
        out["cuda_version"] = str(cpp_ext.get_cuda_version())
    except Exception as exc:
        out["error"] = "%s: %s" % (type(exc).__name__, exc)
    return out
