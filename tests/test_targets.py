"""Fleet targets: the fleet file and a spec's `targets:`, every problem located; the arch list
that covers every target; a node's own class (`cudaenv target`)."""

from __future__ import annotations

from pathlib import Path

import pytest

from builder.core import platforms
from builder.core.cudaversion import CudaVersion
from builder.core.errors import SpecError, UsageError
from builder.machine import targets
from builder.machine.archs import Arch
from builder.spec import envspec as spec
from tests.helpers import cudaenv, write

FLEET = """\
targets:
  - {name: h100, cc: "9.0", platform: linux-x86_64, driver: "580.95.05"}
  - {name: spark, cc: "12.1", platform: linux-aarch64, driver: "580", required: true}
"""
SPEC = 'name: s\npython: "3.12"\ncuda: "13.0"\n'
CU130 = CudaVersion(major=13, minor=0)
CU128 = CudaVersion(major=12, minor=8)


def t(name: str, cc: str, platform: str = "linux-x86_64", driver: str = "580") -> targets.Target:
    return targets.Target(name=name, cc=Arch.parse(cc), platform=platform, driver=driver)


def problems(path: Path) -> list[str]:
    with pytest.raises(SpecError) as err:
        targets.load_file(path)
    return err.value.problems


def test_a_fleet_file_reads_as_targets(tmp_path: Path) -> None:
    found = targets.load_file(write(tmp_path / "fleet.yaml", FLEET))
    assert [x.label for x in found] == [
        "h100 (9.0, linux-x86_64, driver 580.95.05)",
        "spark (12.1, linux-aarch64, driver 580)",
    ]
    assert [x.required for x in found] == [False, True]
    # Unquoted numbers are what the user meant, not a YAML float's repr.
    found = targets.load_file(
        write(
            tmp_path / "f2.yaml",
            "targets: [{name: a, cc: 8.6, platform: linux-x86_64, driver: 570}]\n",
        )
    )
    assert (found[0].cc_text, found[0].driver) == ("8.6", "570")


def test_every_problem_of_a_fleet_file_is_located_at_once(in_tmp: Path) -> None:
    tmp_path = in_tmp
    path = write(
        tmp_path / "fleet.yaml",
        "targets:\n"
        '  - {name: a, cc: "99.9", platform: linux-x86_64, driver: "580"}\n'
        '  - {name: b, cc: "12.1f", platform: linux-arm64, driver: "abc"}\n'
        '  - {name: c, cc: "9.0", platfrom: linux-x86_64, driver: "580"}\n'
        '  - {name: a, cc: "9.0", platform: linux-x86_64, driver: "580", required: "yes"}\n',
    )
    got = problems(path)
    assert got[0].startswith(
        "fleet.yaml:2:19: targets[0].cc: no NVIDIA GPU has compute capability 99.9"
    )
    assert got[1:] == [
        "fleet.yaml:3:19: targets[1].cc: '12.1f' is an arch spelling, not a GPU's compute "
        'capability: write "12.1" (the arch list follows from the targets)',
        "fleet.yaml:3:38: targets[1].platform: unknown platform 'linux-arm64'; did you mean "
        "'linux-aarch64'?",
        'fleet.yaml:3:59: targets[1].driver: expected a driver version like "580.95.05" or a '
        "branch like \"580\", got 'abc'",
        "fleet.yaml:4:5: targets[2].platform: required key is missing",
        "fleet.yaml:4:26: targets[2].platfrom: unknown key; did you mean 'platform'?",
        "fleet.yaml:5:75: targets[3].required: expected true or false, got the string 'yes'",
    ]
    # A mistyped `targets` gets its "did you mean"; a file none of whose keys is close to a
    # fleet file's is said to be none, its keys unshown (a secret's names are its text too).
    assert problems(write(tmp_path / "x.yaml", "target: []\n")) == [
        "x.yaml:1:1: target: unknown key; did you mean 'targets'?",
        "x.yaml:1:1: targets: required key is missing",
    ]
    assert problems(write(tmp_path / "y.yaml", "fleet: []\ntoken: x\n")) == [
        "y.yaml:1:1: y.yaml is not a fleet file: none of its 2 key(s) is a fleet file's (the "
        "first at y.yaml:1:1; its text is not shown)",
    ]


def test_a_name_twice_is_refused(in_tmp: Path) -> None:
    tmp_path = in_tmp
    path = write(
        tmp_path / "f.yaml",
        "targets:\n"
        '  - {name: a, cc: "9.0", platform: linux-x86_64, driver: "580"}\n'
        '  - {name: a, cc: "8.0", platform: linux-x86_64, driver: "580"}\n',
    )
    assert problems(path) == ["f.yaml:3:5: targets[1].name: 'a' is listed twice"]


@pytest.mark.parametrize(
    ("ccs", "cuda", "want"),
    [
        (["9.0"], CU130, ["9.0a"]),
        (["12.0", "12.1"], CU130, ["12.0f"]),
        # 10.0a runs on 10.0 only: beside a 10.3 target the family covers both (vllm#56548).
        (["10.0", "10.3"], CU130, ["10.0f"]),
        # Before CUDA 12.9 there are no families: each minor its own a.
        (["10.0", "10.3"], CU128, ["10.0a", "10.3a"]),
        # Plain SASS of the lowest minor runs on the higher ones of its major.
        (["8.0", "8.6", "8.9"], CU130, ["8.0"]),
        (["7.5", "9.0", "12.1"], CU130, ["7.5", "9.0a", "12.1f"]),
    ],
)
def test_the_arch_list_covers_every_target(
    ccs: list[str], cuda: CudaVersion, want: list[str]
) -> None:
    fleet = [t(f"t{i}", cc) for i, cc in enumerate(ccs)]
    got = targets.archs_for(fleet, cuda)
    assert [str(a) for a in got] == want
    assert all(any(a.runs_on(x.capability) for a in got) for x in fleet)


def test_a_spec_takes_targets_inline_or_from_a_fleet_file(tmp_path: Path) -> None:
    write(tmp_path / "envspecs" / "fleet.yaml", FLEET)
    s = spec.load(write(tmp_path / "envspecs" / "a.yaml", SPEC + "targets: fleet.yaml\n"))
    assert [x.name for x in s.targets] == ["h100", "spark"]
    assert [str(a) for a in s.archs] == ["9.0a", "12.1f"]  # follows from the targets
    inline = SPEC + 'archs: ["12.0f"]\n' + FLEET
    s = spec.load(write(tmp_path / "envspecs" / "b.yaml", inline))
    assert [str(a) for a in s.archs] == ["12.0f"]  # the spec's own list wins
    assert s.fingerprint() == spec.load(write(tmp_path / "c.yaml", SPEC)).fingerprint()


def test_a_specs_bad_targets_are_located_in_their_file(in_tmp: Path) -> None:
    tmp_path = in_tmp
    write(
        tmp_path / "bad.yaml",
        'targets: [{name: a, cc: "3.0", platform: linux-x86_64, driver: "580"}]\n',
    )
    with pytest.raises(SpecError) as err:
        spec.load(write(tmp_path / "s.yaml", SPEC + "targets: bad.yaml\n"))
    assert err.value.problems[0].startswith("bad.yaml:1:25: targets[0].cc: no NVIDIA GPU")
    with pytest.raises(SpecError) as err:
        spec.load(write(tmp_path / "s.yaml", SPEC + "targets: nope.yaml\n"))
    assert "nope.yaml" in err.value.problems[0]


@pytest.mark.slow
def test_a_node_writes_its_own_class(tmp_path: Path) -> None:
    out = tmp_path / "fleet.yaml"
    done = cudaenv(
        "target", "--name", "rtx", "--cc", "12.0", "--driver", "580.95.05", "--out", str(out),
        cwd=tmp_path,
    )  # fmt: skip
    assert "added rtx (12.0, " in done.stderr
    (found,) = targets.load_file(out)
    assert (found.name, found.cc_text, found.driver) == ("rtx", "12.0", "580.95.05")
    again = cudaenv("target", "--name", "rtx", "--cc", "12.0", "--driver", "580.95.05",
                    "--out", str(out), cwd=tmp_path)  # fmt: skip
    assert "is in " in again.stderr and len(targets.load_file(out)) == 1
    clash = cudaenv("target", "--name", "rtx", "--cc", "9.0", "--driver", "580.95.05",
                    "--out", str(out), cwd=tmp_path, check=False)  # fmt: skip
    assert clash.returncode == 2
    assert "a target named 'rtx' is already there" in clash.stderr
    bad = cudaenv("target", "--cc", "12.0f", "--driver", "580", cwd=tmp_path, check=False)
    assert bad.returncode == 2 and "--cc '12.0f'" in bad.stderr
    printed = cudaenv("target", "--cc", "9.0", "--driver", "570.86.15", cwd=tmp_path)
    assert printed.stdout.splitlines()[1] == "targets:"
    assert 'cc: "9.0"' in printed.stdout and 'driver: "570.86.15"' in printed.stdout


def test_another_platforms_class_is_written_from_this_box() -> None:
    """A DGX Spark's class (linux-aarch64) written from an x86_64 box: --platform, with the
    GPU and driver given, since they cannot be read here."""
    other = "linux-aarch64" if platforms.host_name() == "linux-x86_64" else "linux-x86_64"
    (spark,) = targets.this_node(cc="12.1", driver_version="580.95.05", platform=other)
    assert (spark.platform, spark.cc_text, spark.driver) == (other, "12.1", "580.95.05")
    assert spark.name == f"sm121-{other.removeprefix('linux-')}"
    with pytest.raises(UsageError, match="give --cc and --driver too"):
        targets.this_node(cc="12.1", platform=other)
    with pytest.raises(UsageError, match="--platform 'win-amd64': fleet targets are"):
        targets.this_node(cc="12.1", driver_version="580", platform="win-amd64")


SHADOW = "root:$6$saltsalt$hashhashhash:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"


def test_a_file_of_another_kind_named_as_a_fleet_file_is_never_echoed(tmp_path: Path) -> None:
    """A 0600 shadow-shaped file named with --targets (or a spec's `targets:`) printed its
    lines as problems: it is "not a fleet file", its text never shown."""
    secret = write(tmp_path / "shadow", SHADOW)
    secret.chmod(0o600)
    with pytest.raises(SpecError) as err:
        targets.load_file(secret)
    said = "\n".join(err.value.problems)
    assert "is not a fleet file: none of its 2 key(s) is a fleet file's" in said
    assert "saltsalt" not in said and "daemon" not in said


def test_target_out_never_follows_a_link(tmp_path: Path) -> None:
    """`target --out` followed a link to /etc/shadow, read it, and would replace it."""
    secret = write(tmp_path / "shadow", SHADOW)
    link = tmp_path / "fleet.yaml"
    link.symlink_to(secret)
    (t,) = targets.this_node(cc="9.0", driver_version="580.95.05")
    with pytest.raises(UsageError, match="a symbolic link; name the fleet file itself"):
        targets.add_to_file(link, [t])
    assert secret.read_text() == SHADOW
