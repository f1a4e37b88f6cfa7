"""The one exception tree. Library code raises these; only ``cli.py`` prints and exits."""

from __future__ import annotations


class CudaenvError(Exception):
    """Base of every error the CLI turns into one ``error:`` line."""

    exit_code = 1


class SpecError(CudaenvError):
    """A spec file is unreadable or invalid. Carries every problem found, each located."""

    exit_code = 2

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class ResolveError(CudaenvError):
    """The resolver failed, or the resolved set breaks the matching policy."""

    exit_code = 3


class BuildError(CudaenvError):
    """Creating the venv, installing the lock or wiring the toolchain failed."""

    exit_code = 4


class VerifyFailed(CudaenvError):
    """A verification check failed."""

    exit_code = 5


class ToolMissing(CudaenvError):
    """A tool the builder needs (uv, a Python, a C compiler, nvcc) is not on this machine."""

    exit_code = 6
