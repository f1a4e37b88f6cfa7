"""Run INSIDE any target interpreter (Python 3.9+) by ``cudaenv doctor``; prints one JSON object.

Standard library only. Static facts need no ``import torch`` (torch/version.py is read as
text: ~10 s saved); ``--deep`` imports FlashInfer and torch too. Every probe step
is guarded: a broken install or an nvcc that hangs (bounded by a timeout) becomes a fact
with an "error", never a traceback.
"""

from __future__ import annotations

import glob
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time

from flashinfer_light import cuda_facts

# Bounds every nvcc/compiler call: an nvcc that hangs (a dead NFS mount, a wrapper waiting on a
# license server) becomes a fact, not a hung doctor.
NVCC_TIMEOUT = float(os.environ.get("CUDAENV_PROBE_TIMEOUT", "10"))


def run(argv: list[str], timeout: float = NVCC_TIMEOUT) -> dict[str, object]:
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout, check=False)
    except subprocess.TimeoutExpired:
        return {"error": "timed out after %g s" % timeout}
    except OSError as exc:
        return {"error": "%s: %s" % (type(exc).__name__, exc)}
    return {"rc": done.returncode, "out": (done.stdout + done.stderr)[-4000:]}


def nvcc_info(cuda_home: str) -> dict[str, object]:
    nvcc = os.path.join(cuda_home, "bin", "nvcc")
    info: dict[str, object] = {"nvcc": nvcc, "exists": os.path.exists(nvcc)}
    if not info["exists"]:
        return info
    res = run([nvcc, "--version"])
    if "error" in res:
        info["error"] = res["error"]
        return info
    m = re.search(r"release (\d+\.\d+),", str(res.get("out", "")))
    if m:
        info["release"] = m.group(1)
    else:
        info["error"] = "no 'release X.Y' in nvcc --version: %r" % str(res.get("out", ""))[:200]
    host_config = os.path.join(cuda_home, "include", "crt", "host_config.h")
    try:
        with open(host_config, encoding="utf-8", errors="replace") as fh:
            text = fh.read()
        # The toolkit's own bound: "#if __GNUC__ > 15 ... #error -- unsupported GNU version!"
        m = re.search(r"#if __GNUC__ > (\d+)", text)
        if m:
            info["max_gcc"] = int(m.group(1))
    except OSError:
        pass
    return info


def which(name: str) -> str | None:
    for d in os.environ.get("PATH", "").split(os.pathsep):
        p = os.path.join(d, name)
        if d and os.path.isfile(p) and os.access(p, os.X_OK):
            return p
    return None


def cuda_home_order() -> list[tuple[str, str]]:
    """(where, path) of each toolkit FlashInfer's get_cuda_path() and torch's
    _find_cuda_home() would take, in their order: $CUDA_HOME, $CUDA_PATH, the parent of
    `which nvcc` (no realpath), /usr/local/cuda. The first is the one they use; doctor and
    verify's probe both read it from here, so they never disagree on it."""
    out: list[tuple[str, str]] = []
    for var in ("CUDA_HOME", "CUDA_PATH"):
        value = os.environ.get(var)
        if value:
            out.append(("$" + var, value))
    nvcc = which("nvcc")
    if nvcc:
        out.append(("which nvcc (%s)" % nvcc, os.path.dirname(os.path.dirname(nvcc))))
    if os.path.exists("/usr/local/cuda"):
        out.append(("/usr/local/cuda", "/usr/local/cuda"))
    return out


def cuda_home_candidates() -> list[dict[str, object]]:
    """Each toolkit of :func:`cuda_home_order` once, with its nvcc's version."""
    out: list[dict[str, object]] = [
        {"source": source, "path": path} for source, path in cuda_home_order()
    ]
    seen = set()
    unique = []
    for cand in out:
        key = cand["path"]
        if key in seen:
            continue
        seen.add(key)
        cand.update(nvcc_info(str(cand["path"])))
        unique.append(cand)
    return unique


def toolkits() -> list[dict[str, object]]:
    """Toolkits installed on the machine but not necessarily looked up: candidates for a fix."""
    out: list[dict[str, object]] = []
    for d in sorted(set(glob.glob("/usr/local/cuda-*") + glob.glob("/opt/cuda*"))):
        if os.path.exists(os.path.join(d, "bin", "nvcc")):
            cand: dict[str, object] = {"source": "installed", "path": d}
            cand.update(nvcc_info(d))
            out.append(cand)
    return out


def read_torch_version() -> dict[str, object]:
    import importlib.util

    try:
        spec = importlib.util.find_spec("torch")
    except (ImportError, ValueError) as exc:
        return {"installed": False, "error": str(exc)}
    if spec is None or not spec.submodule_search_locations:
        return {"installed": False}
    root = next(iter(spec.submodule_search_locations))
    path = os.path.join(root, "version.py")
    try:
        with open(path, encoding="utf-8") as fh:
            text = fh.read()
    except OSError as exc:
        return {"installed": True, "error": "cannot read %s: %s" % (path, exc)}
    version = re.search(r"^__version__\s*=\s*['\"]([^'\"]+)['\"]", text, re.M)
    cuda = re.search(r"^cuda\s*(?::[^=]*)?=\s*(None|['\"]([^'\"]*)['\"])", text, re.M)
    out: dict[str, object] = {"installed": True, "path": root}
    if version:
        out["version"] = version.group(1)
    else:
        out["error"] = "no __version__ in %s" % path
    if cuda:
        out["cuda"] = cuda.group(2) if cuda.group(2) is not None else None
    return out


def distributions() -> dict[str, str]:
    from importlib import metadata

    out: dict[str, str] = {}
    for dist in metadata.distributions():
        try:
            name = re.sub(r"[-_.]+", "-", dist.metadata["Name"] or "").lower()
        except Exception:  # noqa: S112 - one broken dist-info must not hide the rest
            continue
        # All of them: cudaenv compares a built env with its lock (drift) and fingerprints
        # every distribution; the rules pick the NVIDIA / torch / FlashInfer ones themselves.
        if name:
            out[name] = dist.version
    return out


def jit_cache() -> dict[str, object]:
    base = os.environ.get("FLASHINFER_WORKSPACE_BASE") or os.path.expanduser("~")
    root = os.path.join(base, ".cache", "flashinfer")
    entries = []
    for ninja in sorted(glob.glob(os.path.join(root, "*", "*", "cached_ops", "*", "build.ninja")))[
        :200
    ]:
        parts = ninja[len(root) + 1 :].split(os.sep)
        entry: dict[str, object] = {"version": parts[0], "archs": parts[1], "op": parts[3]}
        try:
            with open(ninja, encoding="utf-8", errors="replace") as fh:
                m = re.search(r"^cuda_home\s*=\s*(.+)$", fh.read(), re.M)
            if m:
                entry["cuda_home"] = m.group(1).strip()
        except OSError:
            pass
        entries.append(entry)
    return {"root": root, "exists": os.path.isdir(root), "entries": entries}


def host_compiler() -> dict[str, object]:
    cxx = os.environ.get("CXX") or which("c++") or which("g++")
    if not cxx:
        return {"error": "CXX is unset and neither c++ nor g++ is on PATH"}
    res = run([cxx, "--version"])
    out = str(res.get("out", ""))
    info: dict[str, object] = {"path": cxx, "banner": out.splitlines()[0] if out else ""}
    first = out.splitlines()[0] if out else ""
    # GCC's banner ends with its version: "c++ (Debian 12.2.0-14+deb12u1) 12.2.0".
    m = re.search(r"(\d+)\.(\d+)(?:\.\d+)?\s*$", first)
    if m and "clang" not in first.lower():
        info["gcc_major"] = int(m.group(1))
    if "error" in res:
        info["error"] = res["error"]
    return info


def deep() -> dict[str, object]:
    out: dict[str, object] = {}
    started = time.monotonic()
    try:
        import torch

        t: dict[str, object] = {"version": torch.__version__, "cuda": torch.version.cuda}
        try:
            t["available"] = bool(torch.cuda.is_available())
            if t["available"]:
                t["capabilities"] = [
                    "%d.%d" % torch.cuda.get_device_capability(i)
                    for i in range(torch.cuda.device_count())
                ]
        except Exception as exc:
            t["cuda_error"] = "%s: %s" % (type(exc).__name__, exc)
        out["torch"] = t
    except ImportError as exc:
        out["torch"] = {"installed": False, "error": str(exc)}
    except Exception as exc:
        out["torch"] = {"error": "%s: %s" % (type(exc).__name__, exc)}
    out["flashinfer"] = cuda_facts()
    # The stack's prebuilt extensions, where installed: a wheel built for another CUDA major
    # than torch's fails here ("libcudart.so.13: cannot open shared object file").
    imports: dict[str, str | None] = {}
    for module in DEEP_IMPORTS:
        top = module.split(".")[0]
        try:
            found = importlib.util.find_spec(top)
        except (ImportError, ValueError):
            found = None
        if found is None:
            continue
        try:
            importlib.import_module(module)
            imports[module] = None
        except BaseException as exc:  # a failing import is the fact reported
            imports[module] = ("%s: %s" % (type(exc).__name__, exc))[:1000]
    out["imports"] = imports
    out["seconds"] = time.monotonic() - started
    return out


# What --deep imports after torch and FlashInfer: the extensions that link CUDA libraries.
DEEP_IMPORTS = ("sgl_kernel", "vllm._C")


def glibc() -> str:
    try:
        value = os.confstr("CS_GNU_LIBC_VERSION") or ""
        return value.split()[-1] if value else ""
    except (ValueError, OSError, AttributeError):
        return platform.libc_ver()[1]


def requested_variables() -> list[str]:
    """The names of ``--env=A,B`` (several such arguments add up)."""
    return [
        name
        for arg in sys.argv[1:]
        if arg.startswith("--env=")
        for name in arg[len("--env=") :].split(",")
        if name
    ]


def main() -> int:
    started = time.monotonic()
    facts: dict[str, object] = {
        "python": {
            "executable": sys.executable,
            "version": platform.python_version(),
            "prefix": sys.prefix,
        },
        "platform": {"system": platform.system(), "machine": platform.machine(), "glibc": glibc()},
        # The variables cudaenv names (builder/core/variables.py, given as --env=A,B): this
        # script runs in a foreign interpreter and imports nothing of cudaenv.
        "env": {k: os.environ.get(k) for k in requested_variables()},
    }
    steps = (
        ("torch", read_torch_version),
        ("distributions", distributions),
        ("cuda_homes", cuda_home_candidates),
        ("toolkits", toolkits),
        ("jit_cache", jit_cache),
        ("host_compiler", host_compiler),
    )
    errors = {}
    for key, step in steps:
        try:
            facts[key] = step()
        except Exception as exc:  # one broken step never hides the others
            errors[key] = "%s: %s" % (type(exc).__name__, exc)
    if "--deep" in sys.argv:
        facts["deep"] = deep()
    facts["errors"] = errors
    facts["seconds"] = time.monotonic() - started
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
