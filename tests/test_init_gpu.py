"""`cudaenv init --gpu`: a capability no GPU has is refused before anything is resolved."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.commands import init
from builder.core.errors import UsageError
from builder.machine import archs
from tests.helpers import cudaenv


@pytest.mark.parametrize("given", ["99.9", "12.9f", "9.1a", "8.5"])
def test_a_capability_no_gpu_has_is_refused(given: str) -> None:
    with pytest.raises(UsageError) as info:
        init.make_request(gpu=[given])
    cc = given.rstrip("af")
    assert str(info.value).startswith(
        f"--gpu {given!r}: no NVIDIA GPU has compute capability {cc} (known: 5.0, "
    )


def test_every_known_capability_is_taken() -> None:
    for major, minor in archs.CAPABILITIES:
        request = init.make_request(gpu=[f"{major}.{minor}"])
        assert request.gpus[0].capability == (major, minor)


def test_the_cli_says_it_in_one_line_and_writes_nothing(tmp_path: Path) -> None:
    done = cudaenv("init", "--gpu", "12.0,99.9", "--out", "s.yaml", cwd=tmp_path, check=False)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        "error: --gpu '12.0,99.9': no NVIDIA GPU has compute capability 99.9 (known: "
        + ", ".join(f"{a}.{b}" for a, b in archs.CAPABILITIES)
        + ")"
    ]
    assert not (tmp_path / "s.yaml").exists()
