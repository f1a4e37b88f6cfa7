"""The store's limits: the largest input and entry document it reads, its size cap
(``CUDAENV_JIT_STORE_MAX``) and how long a builder waits for a key's lock
(``CUDAENV_JIT_LOCK_TIMEOUT``)."""

from __future__ import annotations

import os
from collections.abc import Mapping

from .errors import StoreError

# A file a compile read is a header or a source: one larger than this is not, and a compile
# that read it is not kept (a recorded input of /dev/zero or a huge file cannot stall a build).
MAX_INPUT = 64 << 20
MAX_DOC = 16 << 20  # an entry.json
# The store's size cap (CUDAENV_JIT_STORE_MAX): past it the least recently used entries go.
DEFAULT_MAX = 10 << 30
# How long a builder waits for another builder of the same key (CUDAENV_JIT_LOCK_TIMEOUT):
# FlashInfer's sampling module takes ~2 minutes on two cores.
DEFAULT_LOCK_TIMEOUT = 900.0


def parse_size(text: str) -> int:
    """``10G``, ``500M``, ``2048K`` or bytes (powers of 1024)."""
    units = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}
    raw = text.strip().upper().removesuffix("IB").removesuffix("B")
    unit = raw[-1:] if raw[-1:] in units else ""
    number = raw[: len(raw) - len(unit)]
    try:
        value = float(number)
    except ValueError:
        raise ValueError(f"{text!r} is not a size (like 10G, 500M or 1048576)") from None
    # "nan" and "inf" pass float(): neither is a size.
    if not (0 <= value < 1 << 60):
        raise ValueError(f"{text!r} is not a size (like 10G, 500M or 1048576)")
    return int(value * units[unit])


def store_max(environ: Mapping[str, str] | None = None) -> int:
    text = (environ if environ is not None else os.environ).get("CUDAENV_JIT_STORE_MAX", "")
    try:
        return parse_size(text) if text else DEFAULT_MAX
    except ValueError as exc:
        raise StoreError(f"CUDAENV_JIT_STORE_MAX: {exc}") from None


def lock_timeout(environ: Mapping[str, str] | None = None) -> float:
    text = (environ if environ is not None else os.environ).get("CUDAENV_JIT_LOCK_TIMEOUT", "")
    try:
        value = float(text) if text else DEFAULT_LOCK_TIMEOUT
    except ValueError:
        value = -1.0
    # nan compares false with every deadline: a wait of nan seconds would never end.
    if not 0 <= value <= 1e6:
        raise StoreError(f"CUDAENV_JIT_LOCK_TIMEOUT={text}: not a number of seconds (0 to 1000000)")
    return value
