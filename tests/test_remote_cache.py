"""Triton's and Inductor's shared Redis cache: the URL and its refusals, the spec key, the
setting, what the start-up hook and every shell's activation wire, doctor's PING against a
real redis-server (answers, wrong password, down, slow, not Redis), and the env's own client
(real redis-py) against servers that trickle, announce huge replies or nest them. The two-node
runs of the real tools are in tests/test_remote_cache_e2e.py."""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from builder.core import proc, remote_cache, settings, variables
from builder.core.errors import SpecError, UsageError
from builder.core.remote_cache import Answer, RemoteCacheError, parse
from builder.doctor import diagnose as doctor
from builder.doctor.facts import Facts
from builder.doctor.rules import rule_remote_cache
from builder.env import hooks, toolchain
from builder.machine import archs
from builder.spec import envspec as spec
from tests.conftest import Redis
from tests.helpers import index_view, loopback_server, write

BARE = {"PATH": "/usr/bin:/bin", "PYTHONCOERCECLOCALE": "0"}


# --------------------------------------------------------------------------- the URL


def test_a_url_names_host_port_db_user_password_and_tls() -> None:
    found = parse("rediss://ci:p%40ss@cache.internal:6380/3")
    assert (found.tls, found.host, found.port, found.db) == (True, "cache.internal", 6380, 3)
    assert (found.username, found.password) == ("ci", "p@ss")
    assert found.shown == "rediss://ci:***@cache.internal:6380/3"
    assert "p@ss" not in repr(found)
    plain = parse("redis://127.0.0.1")
    assert (plain.port, plain.db, plain.password, plain.loopback) == (6379, 0, None, True)
    assert parse("redis://[::1]:7000/1").netloc == "[::1]:7000"


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://cache:6379", "expected redis://[USER[:PASSWORD]@]HOST[:PORT][/DB] or "
         "rediss://... (TLS), got a http URL"),
        ("cache:6379", "expected redis://[USER[:PASSWORD]@]HOST[:PORT][/DB] or rediss://... "
         "(TLS), got a cache URL"),
        ("redis://", "the URL names no host"),
        ("redis://cache:99999", "not a redis:// URL (Port out of range 0-65535)"),
        ("redis://cache:0", "port 0 is not a port"),
        ("redis://cache/db", "the path must be a database number like /0, got '/db'"),
        ("redis://cache/0?ssl=1", "a query or fragment is not taken (?... or #...)"),
        # A password with "/" unquoted: no part of it echoed.
        ("redis://u:se/cret@cache/0", "not a redis:// URL (a / in a password is %2F)"),
        ("redis://u@cache/se/cret@x", "the path must be a database number like /0 (a / in a "
         "password is %2F)"),
    ],
)  # fmt: skip
def test_a_bad_url_says_why(url: str, why: str) -> None:
    with pytest.raises(RemoteCacheError) as raised:
        parse(url)
    assert str(raised.value) == why


def test_a_server_off_loopback_is_wired_only_with_a_password() -> None:
    why = remote_cache.refusal(parse("redis://cache.internal:6379/0"))
    assert why is not None
    assert why.startswith("redis://cache.internal:6379/0 is not on loopback and no password")
    assert "runs code on every node" in why and "Inductor's FX-graph entries are Python" in why
    assert remote_cache.refusal(parse("redis://:pw@cache.internal")) is None
    assert remote_cache.refusal(parse("redis://cache.internal").with_password("pw")) is None
    for local in ("redis://localhost", "redis://127.0.0.2:7000", "redis://[::1]"):
        assert remote_cache.refusal(parse(local)) is None, local


def test_the_wiring_bounds_every_wait_and_carries_the_password_only_in_the_url() -> None:
    wired = dict(remote_cache.wiring(parse("rediss://ci:a%20b@cache:6380/2")))
    assert wired["TRITON_CACHE_MANAGER"] == "triton.runtime.cache:RemoteCacheManager"
    assert wired["TRITON_REMOTE_CACHE_BACKEND"] == "_cudaenv_remote_cache:RedisBackend"
    assert wired["TORCHINDUCTOR_REDIS_URL"] == (
        "rediss://ci:a%20b@cache:6380/2?socket_timeout=3&socket_connect_timeout=3"
    )
    assert [k for k, v in wired.items() if "a b" in v or "a%20b" in v] == [
        "TORCHINDUCTOR_REDIS_URL"
    ]
    assert wired[remote_cache.WIRING_VAR] == "wired rediss://ci:***@cache:6380/2"
    assert tuple(wired) == remote_cache.WIRED
    # Inductor's FX graphs and autotuning results from Redis (the hook guards the latter).
    assert wired["TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE"] == "1"
    assert wired["TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE"] == "1"


# --------------------------------------------------------------------------- spec, setting

SPEC = 'name: rc\npython: "3.12"\ncuda: "13.0"\n'


def test_the_spec_key_is_read_and_a_bad_one_is_located(in_tmp: Path) -> None:
    tmp_path = Path()
    good = spec.load(write(tmp_path / "good.yaml", SPEC + "remote-cache: redis://127.0.0.1/1\n"))
    assert good.remote_cache == "redis://127.0.0.1/1"
    plain = spec.load(write(tmp_path / "plain.yaml", SPEC))
    assert plain.remote_cache is None
    # The lock gains the Redis client: a spec that names a cache is locked anew.
    assert good.fingerprint() != plain.fingerprint()
    bad = write(tmp_path / "bad.yaml", SPEC + "remote-cache: http://cache\n")
    with pytest.raises(SpecError) as raised:
        spec.load(bad)
    assert str(raised.value).startswith("bad.yaml:4:15: remote-cache: expected redis://")
    secret = write(tmp_path / "secret.yaml", SPEC + "remote-cache: redis://:pw@cache:6379\n")
    with pytest.raises(SpecError) as raised:
        spec.load(secret)
    assert str(raised.value) == (
        "secret.yaml:4:15: remote-cache: a password in a spec is shared with the spec and "
        "written into the env's activation scripts: leave it out and give it at run time in "
        "CUDAENV_REMOTE_CACHE_PASSWORD"
    )


def test_the_variable_is_a_setting_and_debug_never_shows_a_password() -> None:
    found = settings.resolve({"CUDAENV_REMOTE_CACHE": "redis://u:hunter2@cache:6379/0",
                              "CUDAENV_REMOTE_CACHE_PASSWORD": "other"})  # fmt: skip
    assert found.remote_cache == "redis://u:hunter2@cache:6379/0"
    assert found.remote_cache_password == "other"  # noqa: S105 (the value the test set)
    text = "\n".join(settings.describe(found))
    assert "hunter2" not in text and "other" not in text
    assert "CUDAENV_REMOTE_CACHE = redis://u:***@cache:6379/0  (CUDAENV_REMOTE_CACHE)" in text
    assert settings.resolve({"CUDAENV_REMOTE_CACHE": "off"}).remote_cache is None
    # A password holding "@" or "/" (urlsplit reads up to the last "@"): none of it shown.
    for url in ("redis://u:hun@ter2@cache:6379/0", "redis://:hun/ter2@cache/0"):
        text = "\n".join(settings.describe(settings.resolve({"CUDAENV_REMOTE_CACHE": url})))
        assert "ter2" not in text and "hun" not in text, text


# --------------------------------------------------------------------------- hook, activation


def make_env(tmp_path: Path, url: str | None, *, client: bool = True, name: str = "env") -> Path:
    """A venv wired as a build wires it from a spec naming ``url``; ``client``: a stand-in
    ``redis`` package, which is all the hook asks of the env (the real client is in the e2e)."""
    path = tmp_path / name
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(path)])
    site = toolchain.site_packages(path)
    if client:
        write(site / "redis" / "__init__.py", "")
    text = SPEC + (f"remote-cache: {url}\n" if url else "")
    s = spec.load(write(tmp_path / f"{name}.yaml", text))
    hooks.write_hooks(path, s, archs.DEFAULT_ARCHS)
    return path


def hook_env(env: Path, **extra: str) -> dict[str, str]:
    """The remote-cache variables a bare process of ``env`` has after its hook."""
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    done = subprocess.run([env / "bin" / "python", "-c", code], env={**BARE, **extra},
                          capture_output=True, text=True, check=True)  # fmt: skip
    after: dict[str, str] = json.loads(done.stdout)
    return {k: v for k, v in after.items() if k in remote_cache.WIRED}


@pytest.fixture
def env(tmp_path: Path) -> Path:
    return make_env(tmp_path, "redis://127.0.0.1:6390/2")


def test_the_hook_wires_both_tools_as_the_module_says(env: Path) -> None:
    """The hook (standard library, in the env) and builder/core/remote_cache.py are two spellings
    of one rule: they agree on every variable, for the spec's URL and for the variable's."""
    assert hook_env(env) == dict(remote_cache.wiring(parse("redis://127.0.0.1:6390/2")))
    for url in ("rediss://ci:p%40ss@cache.internal:6380/3", "redis://:x@[::1]:7000",
                "redis://localhost"):  # fmt: skip
        assert hook_env(env, CUDAENV_REMOTE_CACHE=url) == dict(remote_cache.wiring(parse(url))), url
    given = {"CUDAENV_REMOTE_CACHE": "redis://cache.internal/1",
             "CUDAENV_REMOTE_CACHE_PASSWORD": "pw"}  # fmt: skip
    with_password = hook_env(env, **given)
    assert with_password == dict(
        remote_cache.wiring(parse("redis://cache.internal/1").with_password("pw"))
    )


def test_the_hook_refuses_an_unauthenticated_server_off_loopback(env: Path) -> None:
    stray = {"TRITON_CACHE_MANAGER": "triton.runtime.cache:RemoteCacheManager",
             "TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE": "1"}  # fmt: skip
    found = hook_env(env, CUDAENV_REMOTE_CACHE="redis://cache.internal:6379/0", **stray)
    # Not wired, and a shell's stray wiring is taken away with it.
    assert list(found) == [remote_cache.WIRING_VAR]
    assert found[remote_cache.WIRING_VAR].startswith(
        "not wired: redis://cache.internal:6379/0 is not on loopback and no password is given"
    )
    assert hook_env(env, CUDAENV_REMOTE_CACHE="off", **stray) == {}
    bad = hook_env(env, CUDAENV_REMOTE_CACHE="http://cache")
    assert bad == {remote_cache.WIRING_VAR: "not wired: not a redis://[USER[:PASSWORD]@]HOST"
                   "[:PORT][/DB] URL"}  # fmt: skip
    # CUDAENV_NO_HOOK: the interpreter as it is, with whatever the shell had.
    assert hook_env(env, CUDAENV_NO_HOOK="1", **stray) == stray


@pytest.mark.parametrize("url", ["redis://127.0.0.1:0/0", "redis://127.0.0.1//0",
                                 "redis://127.0.0.1/\N{SUPERSCRIPT TWO}"])  # fmt: skip
def test_the_hook_refuses_what_the_module_refuses(env: Path, url: str) -> None:
    """Port 0, two slashes, a digit int() cannot read: not wired by either spelling of the rule
    (the hook once wired the first two to port 6379 and database 0, and died on the third)."""
    with pytest.raises(RemoteCacheError):
        parse(url)
    assert hook_env(env, CUDAENV_REMOTE_CACHE=url) == {
        remote_cache.WIRING_VAR: "not wired: not a redis://[USER[:PASSWORD]@]HOST[:PORT][/DB] URL"
    }


def test_no_activation_exports_a_server_off_loopback(tmp_path: Path) -> None:
    """A spec holds no password, so a server off loopback is wired only by the hook, with the
    password of the process: a shell that skips the hook (CUDAENV_NO_HOOK=1) is not wired."""
    off = make_env(tmp_path, "redis://cache.internal:6379/0", name="off")
    for script, _, _ in hooks.ACTIVATIONS:
        path = off / "bin" / script
        if path.exists():
            assert remote_cache.BACKEND not in path.read_text(), script
    code = "import json, os; print(json.dumps(dict(os.environ)))"
    done = subprocess.run(["bash", "-c", f". {off}/bin/activate; python -c {code!r}"],
                          env={**BARE, "CUDAENV_NO_HOOK": "1"}, capture_output=True,
                          text=True, check=True)  # fmt: skip
    after = json.loads(done.stdout)
    assert [k for k in remote_cache.WIRED if k in after] == []


def test_an_env_without_the_client_is_not_wired_and_says_so(tmp_path: Path) -> None:
    bare = make_env(tmp_path, None, client=False)
    assert hook_env(bare) == {}
    assert hook_env(bare, CUDAENV_REMOTE_CACHE="redis://127.0.0.1/0") == {
        remote_cache.WIRING_VAR: "not wired: this env has no Redis client (`redis` is not in "
        "its lock)"
    }
    site = toolchain.site_packages(bare)
    assert not (site / f"{remote_cache.BACKEND_MODULE}.py").exists()


def test_the_env_holds_no_password(tmp_path: Path, env: Path) -> None:
    hook_env(env, CUDAENV_REMOTE_CACHE="redis://:hunter2@127.0.0.1/0")
    assert [p for p in env.rglob("*") if p.is_file() and b"hunter2" in p.read_bytes()] == []


SHELLS = {
    # shell: argv and a script printing the backend and the URL, deactivating, printing again.
    "bash": ["bash", "-c", '. {env}/bin/activate; printf "%s\\n" "$TRITON_REMOTE_CACHE_BACKEND" '
             '"$TORCHINDUCTOR_REDIS_URL"; deactivate; printf "%s\\n" "${{TRITON_REMOTE_CACHE_BACKEND-unset}}" '
             '"${{TORCHINDUCTOR_REDIS_URL-unset}}"'],
    "zsh": ["zsh", "-f", "-c", '. {env}/bin/activate; printf "%s\\n" "$TRITON_REMOTE_CACHE_BACKEND" '
            '"$TORCHINDUCTOR_REDIS_URL"; deactivate; printf "%s\\n" "${{TRITON_REMOTE_CACHE_BACKEND-unset}}" '
            '"${{TORCHINDUCTOR_REDIS_URL-unset}}"'],
    "fish": ["fish", "--no-config", "-c", "source {env}/bin/activate.fish; printf '%s\\n' "
             "$TRITON_REMOTE_CACHE_BACKEND $TORCHINDUCTOR_REDIS_URL; deactivate; "
             "set -q TRITON_REMOTE_CACHE_BACKEND; or echo unset; set -q TORCHINDUCTOR_REDIS_URL; or echo unset"],
}  # fmt: skip


@pytest.mark.parametrize("shell", sorted(SHELLS))
def test_every_shells_activation_wires_the_spec_and_deactivate_takes_it_back(
    env: Path, shell: str
) -> None:
    argv = SHELLS[shell]
    if shutil.which(argv[0]) is None:
        pytest.skip(f"{argv[0]} is not installed on this machine")
    script = argv[-1].format(env=env)
    done = subprocess.run([*argv[:-1], script], capture_output=True, text=True, check=True,
                          env=BARE, timeout=60)  # fmt: skip
    wired = dict(remote_cache.wiring(parse("redis://127.0.0.1:6390/2")))
    assert done.stdout.splitlines()[-4:] == [
        remote_cache.BACKEND,
        wired["TORCHINDUCTOR_REDIS_URL"],
        "unset",
        "unset",
    ], done.stdout + done.stderr


def test_every_activation_script_names_every_wired_variable(env: Path) -> None:
    """The shells without an interpreter here (tcsh, nu, pwsh, xonsh) are checked by text:
    each script of the env sets every variable of the wiring."""
    for script, _, _ in hooks.ACTIVATIONS:
        path = env / "bin" / script
        if path.exists():
            text = path.read_text()
            assert [v for v in remote_cache.WIRED if v not in text] == [], script


# --------------------------------------------------------------------------- ping


def test_ping_a_real_server(redis_server: Redis) -> None:
    answer = remote_cache.ping(parse(redis_server.url))
    assert answer.status == "answers" and answer.detail.startswith("PONG in ")


def test_ping_with_and_without_the_password(redis_with_password: Redis) -> None:
    cache = parse(redis_with_password.url)
    assert redis_with_password.password is not None
    right = remote_cache.ping(cache.with_password(redis_with_password.password))
    assert right.status == "answers", right
    wrong = remote_cache.ping(cache.with_password("nope"))
    assert wrong.status == "auth-refused"
    assert wrong.detail.startswith("AUTH refused: WRONGPASS")
    none = remote_cache.ping(cache)
    assert (none.status, none.detail.split()[0]) == ("auth-refused", "NOAUTH")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
    return port


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A socket that accepts and never answers (a hung server)."""
    with loopback_server(None) as port:
        yield port


@pytest.fixture
def garbage_server() -> Iterator[int]:
    """A socket that answers everything with an HTTP error (not Redis)."""
    with loopback_server(b"HTTP/1.1 400 Bad Request\r\n\r\n") as port:
        yield port


def test_ping_a_server_that_is_down_slow_or_not_redis(
    silent_server: int, garbage_server: int
) -> None:
    down = remote_cache.ping(parse(f"redis://127.0.0.1:{free_port()}/0"))
    assert down.status == "down" and "no connection to 127.0.0.1:" in down.detail
    started = time.monotonic()
    slow = remote_cache.ping(parse(f"redis://127.0.0.1:{silent_server}/0"), timeout=0.5)
    assert (slow.status, slow.detail.split(": ")[-1]) == ("down", "no answer in time")
    assert time.monotonic() - started < 3
    other = remote_cache.ping(parse(f"redis://127.0.0.1:{garbage_server}/0"))
    assert other == Answer(status="down", detail="not a Redis answer to PING: HTTP/1.1 400 Bad "
                           "Request", seconds=other.seconds)  # fmt: skip


# --------------------------------------------------------------------------- doctor


def facts_of(env: dict[str, str], dists: dict[str, str], url: str | None,
             answer: Answer | None) -> Facts:  # fmt: skip
    doc = {"python": {"executable": "/e/bin/python", "prefix": "/e"}, "env": env,
           "distributions": dists}  # fmt: skip
    facts = Facts.from_json(doc, None)
    from dataclasses import replace

    return replace(facts, remote_cache=url, remote_answer=answer)


def test_doctor_rule_says_each_state() -> None:
    url = "redis://127.0.0.1:6379/0"
    wired = {remote_cache.WIRING_VAR: f"wired {url}"}
    ok = Answer(status="answers", detail="PONG in 1 ms", seconds=0.001)
    assert [f.code for f in rule_remote_cache(facts_of(wired, {"redis": "8.1.0"}, url, ok))] == [
        "remote-cache"
    ]
    refused = Answer(status="auth-refused", detail="AUTH refused: WRONGPASS", seconds=0.0)
    found = rule_remote_cache(facts_of(wired, {"redis": "8.1.0"}, url, refused))
    assert [(f.code, f.severity) for f in found] == [("remote-cache-auth", "error")]
    down = Answer(status="down", detail="no connection", seconds=0.0)
    found = rule_remote_cache(facts_of(wired, {"redis": "8.1.0"}, url, down))
    assert [(f.code, f.severity) for f in found] == [("remote-cache-down", "warning")]
    no_client = rule_remote_cache(facts_of({}, {}, url, None))
    assert [f.code for f in no_client] == ["remote-cache-unwired"]
    assert "has no Redis client (`redis` is not installed)" in no_client[0].cause
    why = {remote_cache.WIRING_VAR: "not wired: redis://c:6379/0 is not on loopback and no "
           "password is given: ..."}  # fmt: skip
    refusal = rule_remote_cache(facts_of(why, {"redis": "8.1.0"}, "redis://c:6379/0", None))
    assert "CUDAENV_REMOTE_CACHE_PASSWORD" in refusal[0].fix[0]
    assert rule_remote_cache(facts_of({}, {}, None, None)) == []


def codes(python: Path) -> dict[str, str]:
    facts, findings, _ = doctor.probe(python, deep=False)
    assert facts is not None
    return {f.code: f.cause for f in findings if f.code.startswith("remote-cache")}


def test_doctor_pings_the_wired_cache(
    tmp_path: Path, redis_with_password: Redis, monkeypatch: pytest.MonkeyPatch
) -> None:
    """doctor against a real redis-server with requirepass: the right password answers, a
    wrong one is refused, a server that is gone is down."""
    python = make_env(tmp_path, None) / "bin" / "python"
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE", redis_with_password.url)
    assert redis_with_password.password is not None
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE_PASSWORD", redis_with_password.password)
    assert list(codes(python)) == ["remote-cache"]
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE_PASSWORD", "wrong")
    assert list(codes(python)) == ["remote-cache-auth"]
    redis_with_password.stop()
    assert list(codes(python)) == ["remote-cache-down"]
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE", "off")
    assert codes(python) == {}


def test_the_table_knows_every_wired_variable() -> None:
    rows = {v.name: v for v in variables.TABLE}
    assert [n for n in remote_cache.WIRED if n not in rows] == []
    # The one holding the password is never reported by doctor's probe.
    assert [n for n in remote_cache.WIRED if rows[n].doctor] == [
        n for n in remote_cache.WIRED if n != "TORCHINDUCTOR_REDIS_URL"
    ]


def test_a_build_warns_when_the_variable_names_a_cache_the_env_cannot_use(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bare = make_env(tmp_path, None, client=False)
    s = spec.load(tmp_path / "env.yaml")
    assert hooks.remote_cache_note(bare, s) is None
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE", "redis://127.0.0.1:6379/0")
    note = hooks.remote_cache_note(bare, s)
    assert note is not None
    assert note.startswith("warning: CUDAENV_REMOTE_CACHE names a Redis cache but rc's lock has no")
    assert "add `remote-cache:` to" in note
    with_client = make_env(tmp_path, None, name="client")
    assert hooks.remote_cache_note(with_client, spec.load(tmp_path / "client.yaml")) is None
    # A server off loopback is wired only with a password: the build says so before any compile.
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE", "redis://cache.example.internal:6379/0")
    refused = hooks.remote_cache_note(with_client, spec.load(tmp_path / "client.yaml"))
    assert refused is not None and "is not on loopback and no password is given" in refused
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE_PASSWORD", "s3cret")
    assert hooks.remote_cache_note(with_client, spec.load(tmp_path / "client.yaml")) is None
    # A malformed variable is refused at start-up (exit 2), never echoing a password.
    with pytest.raises(
        UsageError,
        match=r"^CUDAENV_REMOTE_CACHE=http://cache\.example\.internal/: expected redis://",
    ):
        settings.resolve({"CUDAENV_REMOTE_CACHE": "http://cache.example.internal/"}, strict=True)
    with pytest.raises(UsageError) as refused_url:
        settings.resolve({"CUDAENV_REMOTE_CACHE": "redis://u:hun@ter2@host/x"}, strict=True)
    assert "hun" not in str(refused_url.value) and "ter2" not in str(refused_url.value)
    assert settings.resolve({"CUDAENV_REMOTE_CACHE": "off"}, strict=True).remote_cache is None
    # `off` over a spec's server that would be refused: nothing is wired, so nothing to say.
    monkeypatch.delenv("CUDAENV_REMOTE_CACHE_PASSWORD")
    off = make_env(tmp_path, "redis://cache.example.internal:6379/0", name="off")
    monkeypatch.delenv("CUDAENV_REMOTE_CACHE")
    assert hooks.remote_cache_note(off, spec.load(tmp_path / "off.yaml")) is not None
    monkeypatch.setenv("CUDAENV_REMOTE_CACHE", "off")
    assert hooks.remote_cache_note(off, spec.load(tmp_path / "off.yaml")) is None


def test_ping_bounds_the_name_lookup_too(monkeypatch: pytest.MonkeyPatch) -> None:
    """A resolver that never answers: create_connection's timeout does not cover the lookup."""
    release = threading.Event()

    def stuck(*args: object, **kwargs: object) -> list[object]:
        release.wait(30)
        raise OSError("released")

    monkeypatch.setattr(socket, "getaddrinfo", stuck)
    started = time.monotonic()
    try:
        said = remote_cache.ping(parse("redis://cache.example.internal:6379/0"), timeout=0.3)
    finally:
        release.set()
    assert time.monotonic() - started < 2
    assert said.status == "down" and "lookup of cache.example.internal" in said.detail


# --------------------------------------------------------------------------- a hostile server

# A bulk reply of 2 GiB announced (over any bound an entry has), and one of 1 MiB (under it),
# either then trickled at 1 KiB every 0.5 s: 2 KiB/s, so the 1 MiB takes over 8 minutes, and
# each byte renews a timeout that bounds one read of the socket.
HUGE = b"$2147483648\r\n"
SLOW = b"$1048576\r\n"
# An array in an array, 5000 deep: past the recursion of redis-py's parser.
DEEP = b"*1\r\n" * 5000


@dataclass
class Trickle:
    """What a trickle_server saw: connections accepted, requests answered."""

    port: int
    connections: int = 0
    requests: int = 0

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"


@contextlib.contextmanager
def trickle_server(head: bytes, *, every: float = 0.5, size: int = 1024) -> Iterator[Trickle]:
    """A TCP port on 127.0.0.1 that answers the first request of each connection with ``head``
    and then ``size`` bytes every ``every`` seconds, for 60 s at most a connection (a server
    that is slow on purpose). Yields what it saw; every connection is closed at the end."""
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(16)
    listener.settimeout(0.1)
    seen = Trickle(port=listener.getsockname()[1])
    stop = threading.Event()
    threads: list[threading.Thread] = []

    def serve(conn: socket.socket) -> None:
        with conn:
            try:
                conn.settimeout(5)
                if not conn.recv(65536):
                    return
                seen.requests += 1
                conn.sendall(head)
                ends = time.monotonic() + 60
                while not stop.wait(every) and time.monotonic() < ends:
                    conn.sendall(b"x" * size)
            except OSError:  # the client hung up: what a bounded client does
                pass

    def accept() -> None:
        while not stop.is_set():
            try:
                conn = listener.accept()[0]
            except OSError:
                continue
            seen.connections += 1
            thread = threading.Thread(target=serve, args=(conn,), daemon=True)
            thread.start()
            threads.append(thread)

    acceptor = threading.Thread(target=accept, daemon=True)
    acceptor.start()
    try:
        yield seen
    finally:
        stop.set()
        acceptor.join(timeout=5)
        for thread in threads:
            thread.join(timeout=5)
        listener.close()


@pytest.fixture
def redis_env(tmp_path: Path) -> Path:
    """A venv with the real Redis client (redis-py, fetched from the index at the committed
    locks' view where uv's cache lacks it: the tests that use it are marked network) and the
    hook and Triton backend a build writes into an env that has it; wired at each start from
    CUDAENV_REMOTE_CACHE."""
    path = tmp_path / "env"
    proc.run([proc.uv_bin(), "venv", "--quiet", "--python", sys.executable, str(path)])
    proc.run([proc.uv_bin(), "pip", "install", "--quiet", "--exclude-newer", index_view(),
              "--python", str(path / "bin" / "python"), remote_cache.CLIENT])  # fmt: skip
    s = spec.load(write(tmp_path / "env.yaml", SPEC))
    hooks.write_hooks(path, s, archs.DEFAULT_ARCHS)
    assert (toolchain.site_packages(path) / f"{remote_cache.BACKEND_MODULE}.py").is_file()
    return path


def run_in(env: Path, code: str, url: str) -> tuple[dict[str, object], str]:
    """``code`` in a process of ``env`` wired to ``url`` by its hook: its last line of output
    as JSON, and its stderr."""
    done = subprocess.run([env / "bin" / "python", "-c", code],
                          env={**BARE, "CUDAENV_REMOTE_CACHE": url}, capture_output=True,
                          text=True, timeout=90)  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    found: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return found, done.stderr


# Triton's manager as it asks the env's backend: a group of files of one kernel, twice, then a
# file written.
TRITON_GETS = r"""
import json, time
import _cudaenv_remote_cache as backend
cache = backend.RedisBackend("k")
got, seconds = [], []
for _ in range(2):
    started = time.monotonic()
    got.append(sorted(cache.get(["add.cubin", "add.json"])))
    seconds.append(time.monotonic() - started)
cache.put("add.json", b"{}")
print(json.dumps({"got": got, "seconds": seconds}))
"""

# Inductor's backend as the hook's guard leaves it: the env's client, asked as Inductor's
# RedisRemoteCacheBackend._get asks (torch is not needed for the client; the guard with a
# real torch is in the e2e tests).
INDUCTOR_GET = r"""
import json, os, time
import redis
import _cudaenv_remote_cache as backend
client = backend.client(os.environ["TORCHINDUCTOR_REDIS_URL"])
started = time.monotonic()
try:
    client.get("pt2:fx-graph-v1::k:c1")
    said = None
except redis.exceptions.RedisError as exc:
    said = "%s: %s" % (type(exc).__name__, exc)
print(json.dumps({"said": said, "seconds": time.monotonic() - started}))
"""


def spans(found: dict[str, object]) -> list[float]:
    """The seconds each get of TRITON_GETS took."""
    seconds = found["seconds"]
    assert isinstance(seconds, list)
    return [float(s) for s in seconds]


def warnings_of(err: str, tool: str) -> list[str]:
    return [line for line in err.splitlines() if f"{tool}'s remote cache is not used" in line]


@pytest.mark.network
@pytest.mark.slow
def test_a_trickled_reply_costs_triton_one_warning_at_the_deadline(redis_env: Path) -> None:
    """A reply under the size bound, trickled: redis-py's socket_timeout bounds each read and
    every trickle renews it; the env's client has one deadline for the whole request
    (TIMEOUT, the URL's socket_timeout). Then the process asks nothing more."""
    with trickle_server(SLOW) as server:
        found, err = run_in(redis_env, TRITON_GETS, server.url)
    assert found["got"] == [[], []]
    first = spans(found)[0]
    assert remote_cache.TIMEOUT * 0.9 <= first < remote_cache.TIMEOUT + 2, found
    # Given up: the second get, and the put, ask the server nothing.
    assert (server.connections, server.requests) == (1, 1)
    assert warnings_of(err, "Triton") == [
        "cudaenv: Triton's remote cache is not used by this process (TooSlow: no whole answer "
        f"in {remote_cache.TIMEOUT:g}s); compiling locally"
    ], err


@pytest.mark.network
@pytest.mark.slow
def test_a_trickled_reply_costs_inductors_client_one_error_at_the_deadline(
    redis_env: Path,
) -> None:
    with trickle_server(SLOW) as server:
        found, _ = run_in(redis_env, INDUCTOR_GET, server.url)
    assert found["said"] == f"TooSlow: no whole answer in {remote_cache.TIMEOUT:g}s"
    seconds = float(str(found["seconds"]))
    assert remote_cache.TIMEOUT * 0.9 <= seconds < remote_cache.TIMEOUT + 2, found


@pytest.mark.network
def test_a_huge_announced_reply_is_refused_unread(redis_env: Path) -> None:
    """2 GiB announced: refused at its header, long before the deadline, by both tools'
    client, whatever the server would send after it."""
    why = ("TooLarge: a reply of 2147483648 bytes announced, over the 64 MiB any entry "
           "may be")  # fmt: skip
    with trickle_server(HUGE) as server:
        found, err = run_in(redis_env, TRITON_GETS, server.url)
        inductor, _ = run_in(redis_env, INDUCTOR_GET, server.url)
    assert found["got"] == [[], []]
    assert max(spans(found)) < remote_cache.TIMEOUT / 3, found
    assert warnings_of(err, "Triton") == [
        f"cudaenv: Triton's remote cache is not used by this process ({why}); compiling locally"
    ], err
    assert inductor["said"] == why
    assert float(str(inductor["seconds"])) < remote_cache.TIMEOUT / 3, inductor


@pytest.mark.network
def test_a_reply_nested_past_the_parsers_recursion_is_an_error_of_redis(redis_env: Path) -> None:
    """redis-py's parser recurses once a level: "*1\\r\\n" 5000 times is a RecursionError,
    which the hook's Inductor guard (it catches redis' errors) would let fail the compile."""
    with trickle_server(DEEP) as server:
        found, err = run_in(redis_env, TRITON_GETS, server.url)
        inductor, _ = run_in(redis_env, INDUCTOR_GET, server.url)
    why = "TooDeep: a reply nested deeper than any answer to "
    assert inductor["said"] == why + "GET", inductor
    assert warnings_of(err, "Triton") == [
        f"cudaenv: Triton's remote cache is not used by this process ({why}MGET); compiling locally"
    ], err
    assert max(spans(found)) < remote_cache.TIMEOUT / 3, found


# Entries at and over the size bound on a real server: one at it is a hit, one over it (as
# another client could write) is refused at its header, and the backend writes none over it.
BOUNDS = r"""
import json, os
import redis
import _cudaenv_remote_cache as backend
plain = redis.Redis.from_url(os.environ["TORCHINDUCTOR_REDIS_URL"])
cache = backend.RedisBackend("k")
at = os.urandom(backend.MAX_REPLY - len(backend._seal(b"")))
cache.put("at.cubin", at)
cache.put("over.cubin", at + b"!")
hit = cache.get(["at.cubin"]).get("at.cubin") == at
plain.set(cache._name("big.cubin"), b"x" * (backend.MAX_REPLY + 1))
print(json.dumps({"hit": hit, "over": plain.exists(cache._name("over.cubin")),
                  "big": sorted(cache.get(["big.cubin"])), "after": sorted(cache.get(["at.cubin"]))}))
"""


@pytest.mark.network
@pytest.mark.slow
def test_an_entry_over_the_bound_is_neither_written_nor_read(
    redis_env: Path, redis_server: Redis
) -> None:
    found, err = run_in(redis_env, BOUNDS, redis_server.url)
    assert found == {"hit": True, "over": 0, "big": [], "after": []}, found
    assert warnings_of(err, "Triton") == [
        "cudaenv: Triton's remote cache is not used by this process (TooLarge: a reply of "
        "67108865 bytes announced, over the 64 MiB any entry may be); compiling locally"
    ], err


@pytest.mark.slow
def test_ping_reads_no_bulk_reply_and_no_trickle_past_its_deadline() -> None:
    """doctor's own client reads one status line: a bulk header is not an answer to PING (its
    body is never read), and a line trickled without end stops at the deadline or at the
    longest status line, whichever comes first."""
    with trickle_server(HUGE) as server:
        started = time.monotonic()
        huge = remote_cache.ping(parse(server.url), timeout=2)
    assert (huge.status, huge.detail) == ("down", "not a Redis answer to PING: $2147483648")
    assert time.monotonic() - started < 1
    with trickle_server(b"+", every=0.2, size=16) as server:
        slow = remote_cache.ping(parse(server.url), timeout=1)
    assert (slow.status, slow.detail.split(": ")[-1]) == ("down", "no answer in time")
    assert 0.9 <= slow.seconds < 2
    with trickle_server(b"+", every=0.05) as server:
        long = remote_cache.ping(parse(server.url), timeout=5)
    assert long.status == "down" and long.detail.endswith("longer than any Redis status line")
    assert long.seconds < 5
