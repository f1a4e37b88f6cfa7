"""A CUDA version, ``13.0``: the one place its text is read.

A spec's ``cuda:``, torch's ``torch.version.cuda``, nvcc's release and the leading
``major.minor`` of an NVIDIA wheel's version are all read here. Files keep the text ("13.0");
code past the edge compares :class:`CudaVersion` values, so 12.10 sorts after 12.9 and a
version that names no CUDA is an error where it is read, never a silent default.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

# No leading zeros, so that str(parse(text)) == text: the text is what files hold and what
# other strings (a lock's torch_cuda, nvcc's release) are compared with.
_EXACT_RE = re.compile(r"(0|[1-9]\d?)\.(0|[1-9]\d?)")
# A longer version starts with one: 13.0.96 (nvidia-cuda-runtime), 13.0.3.0 (cuda-toolkit).
_LEADING_RE = re.compile(r"^(\d+)\.(\d+)")


@dataclass(frozen=True, kw_only=True, order=True)
class CudaVersion:
    """CUDA ``major.minor``. Ordered by (major, minor); compared only with its own kind (a
    tuple or a string never equals one)."""

    major: int
    minor: int

    def __post_init__(self) -> None:
        for part in (self.major, self.minor):
            if isinstance(part, bool) or not isinstance(part, int) or part < 0:
                raise ValueError(
                    f"a CUDA version is two whole numbers, got {self.major!r}.{self.minor!r}"
                )

    @classmethod
    def parse(cls, text: str) -> CudaVersion:
        """Exactly ``major.minor`` (``"13.0"``); anything else raises ValueError naming it."""
        m = _EXACT_RE.fullmatch(text)
        if not m:
            raise ValueError(f'expected a CUDA version major.minor like "13.0", got {text!r}')
        return cls(major=int(m.group(1)), minor=int(m.group(2)))

    @classmethod
    def of_version(cls, version: str) -> CudaVersion:
        """The CUDA a longer version starts with: ``13.0.96`` -> 13.0, for the packages whose
        version is their CUDA's (``channels.CUDA_VERSIONED``, ``cuda-toolkit``). Raises
        ValueError when it starts with no ``major.minor``."""
        m = _LEADING_RE.match(version)
        if not m:
            raise ValueError(
                f"expected a version starting with a CUDA major.minor, got {version!r}"
            )
        return cls(major=int(m.group(1)), minor=int(m.group(2)))

    @classmethod
    def read(cls, version: str | None) -> CudaVersion | None:
        """:meth:`of_version` for what another program reported (a wheel's version, torch's
        ``torch.version.cuda``, nvcc's release), where not knowing is itself the answer: None
        when there is no version or it starts with no ``major.minor``. Never for input a user
        gave: that is refused with :meth:`parse`."""
        if version is None:
            return None
        try:
            return cls.of_version(version)
        except ValueError:
            return None

    def next_minor(self) -> CudaVersion:
        """The upper bound of this minor's releases: ``>=13.0,<13.1``."""
        return CudaVersion(major=self.major, minor=self.minor + 1)

    def __str__(self) -> str:
        return f"{self.major}.{self.minor}"
