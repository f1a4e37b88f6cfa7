"""The platforms an env is locked for, and this machine's.

A platform is spelt ``linux-x86_64`` / ``linux-aarch64`` in specs, locks and output. The
Blackwell family is half aarch64 (GB200/GB300, DGX Spark = GB10, GH200), so a spec is locked
for both unless it narrows ``platforms:``. uv resolves one platform at a time
(``--python-platform``); markers are evaluated for a platform with :func:`marker_environment`,
the environment an installer on that platform would see.

The glibc floor is ``manylinux_2_34`` on both: what torch's CUDA pins were measured with, and
the only tag sglang 0.5.23 ships on aarch64 (``aarch64-manylinux_2_28`` does not resolve).
"""

from __future__ import annotations

import platform as _platform
from dataclasses import dataclass

GLIBC_TAG = "manylinux_2_34"


@dataclass(frozen=True)
class Platform:
    name: str  # linux-x86_64
    machine: str  # platform_machine as Python reports it there
    elf_machine: int  # e_machine of its executables (EM_X86_64, EM_AARCH64)

    @property
    def uv_tag(self) -> str:
        """What ``uv pip compile/install --python-platform`` takes."""
        return f"{self.machine}-{GLIBC_TAG}"

    @property
    def marker(self) -> str:
        """The PEP 508 marker that holds exactly on this platform."""
        return f"sys_platform == 'linux' and platform_machine == '{self.machine}'"

    def marker_environment(self, python: str) -> dict[str, str]:
        """The marker variables an installer of Python ``python`` (``3.12``) sees here."""
        return {
            "implementation_name": "cpython",
            "implementation_version": f"{python}.0",
            "os_name": "posix",
            "platform_machine": self.machine,
            "platform_python_implementation": "CPython",
            "platform_release": "",
            "platform_system": "Linux",
            "platform_version": "",
            "python_full_version": f"{python}.0",
            "python_version": python,
            "sys_platform": "linux",
        }


KNOWN: dict[str, Platform] = {
    p.name: p
    for p in (
        Platform("linux-x86_64", "x86_64", 62),
        Platform("linux-aarch64", "aarch64", 183),
    )
}
DEFAULT = tuple(KNOWN)
# How Python spells the machine elsewhere (macOS and some distributions say arm64).
_MACHINE_ALIASES = {"amd64": "x86_64", "arm64": "aarch64"}


def get(name: str) -> Platform:
    """The platform called ``name``; KeyError for an unknown one (callers word the error)."""
    return KNOWN[name]


def of_machine(machine: str) -> Platform | None:
    machine = _MACHINE_ALIASES.get(machine.lower(), machine.lower())
    return next((p for p in KNOWN.values() if p.machine == machine), None)


def host_name() -> str:
    """This machine's platform name (``linux-<machine>`` even where cudaenv has no support)."""
    machine = _platform.machine() or "x86_64"
    found = of_machine(machine)
    return found.name if found else f"linux-{machine.lower()}"


def from_uv_tag(tag: str) -> str:
    """``x86_64-manylinux_2_34`` (a lock written before ``platforms:``) -> ``linux-x86_64``."""
    found = of_machine(tag.split("-", 1)[0])
    return found.name if found else tag
