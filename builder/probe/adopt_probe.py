"""Run INSIDE the interpreter `cudaenv adopt` is asked to repair; prints one JSON object.

Standard library only, and torch is never imported: its CUDA is read from its own files
(``torch/version.py``) and its pins from its metadata (``Requires-Dist``).
"""

from __future__ import annotations

import json
import os
import re
import sys
import sysconfig
from importlib import metadata


def torch_facts() -> dict[str, object]:
    try:
        dist = metadata.distribution("torch")
    except metadata.PackageNotFoundError:
        return {"installed": False}
    cuda = None
    for f in dist.files or ():
        if str(f).replace("\\", "/") == "torch/version.py":
            try:
                with open(f.locate(), encoding="utf-8", errors="replace") as fh:
                    text = fh.read()
            except OSError:
                break
            m = re.search(r"^cuda\s*(?::[^=]*)?=\s*['\"]([^'\"]+)['\"]", text, re.M)
            cuda = m.group(1) if m else None
            break
    return {
        "installed": True,
        "version": dist.version,
        "cuda": cuda,
        "requires": dist.requires or [],
    }


def main() -> int:
    dists = {}
    for dist in metadata.distributions():
        name = dist.metadata["Name"]
        if name:
            dists[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    prefix = sys.prefix
    print(
        json.dumps(
            {
                "executable": sys.executable,
                "version": "%d.%d" % sys.version_info[:2],
                "prefix": prefix,
                "base_prefix": getattr(sys, "base_prefix", prefix),
                "conda": os.path.isdir(os.path.join(prefix, "conda-meta")),
                "purelib": sysconfig.get_paths()["purelib"],
                "distributions": dists,
                "torch": torch_facts(),
                "cuda_home": os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
