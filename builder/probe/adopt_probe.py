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


def broken_dists(dirs: list[str]) -> list[str]:
    """Each ``*.dist-info`` directory without a METADATA naming its package: what an uninstall
    killed midway leaves (it deletes METADATA before the directory). importlib.metadata skips
    these, so they would pass for gone while their files stay."""
    found = []
    for d in dict.fromkeys(os.path.realpath(d) for d in dirs):
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            continue
        for entry in entries:
            if not entry.name.endswith(".dist-info") or not entry.is_dir(follow_symlinks=False):
                continue
            try:
                with open(
                    os.path.join(entry.path, "METADATA"), encoding="utf-8", errors="replace"
                ) as fh:
                    named = any(line.startswith("Name:") for line in fh)
            except OSError:
                named = False
            if not named:
                found.append(entry.path)
    return found


def main() -> int:
    dists = {}
    for dist in metadata.distributions():
        try:
            name = dist.metadata["Name"]
        except (TypeError, KeyError, OSError):  # no METADATA at all: broken_dists reports it
            name = None
        if name:
            dists[re.sub(r"[-_.]+", "-", name).lower()] = dist.version
    prefix = sys.prefix
    paths = sysconfig.get_paths()
    print(
        json.dumps(
            {
                "executable": sys.executable,
                "version": "%d.%d" % sys.version_info[:2],
                "prefix": prefix,
                "base_prefix": getattr(sys, "base_prefix", prefix),
                "conda": os.path.isdir(os.path.join(prefix, "conda-meta")),
                "purelib": paths["purelib"],
                "distributions": dists,
                "broken": broken_dists([paths["purelib"], paths["platlib"]]),
                "torch": torch_facts(),
                "cuda_home": os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH") or "",
            }
        )
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
