"""Triton's and Inductor's remote caches on a shared Redis: which server, and whether it answers.

Both tools already speak Redis: Triton through ``RemoteCacheManager`` and a backend class
(``TRITON_CACHE_MANAGER``, ``TRITON_REMOTE_CACHE_BACKEND``), Inductor through
``TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE`` / ``TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE`` and
``TORCHINDUCTOR_REDIS_URL``. A spec's ``remote-cache:`` or ``CUDAENV_REMOTE_CACHE`` (which
wins; ``off``: none) names the server as ``redis://[USER[:PASSWORD]@]HOST[:PORT][/DB]``, or
``rediss://`` for TLS; the env's start-up hook wires both tools to it at every interpreter
start (``templates/hook.py.j2`` holds the same rules in the standard library, as the hook
imports nothing of cudaenv).

Trust: whoever can write the cache runs code on every node that reads it (Inductor's FX-graph
entries are pickled Python, Triton's are the binaries a kernel launch loads), so a server that
is not on loopback is wired only with a password (in the URL, or
``CUDAENV_REMOTE_CACHE_PASSWORD`` at run time: a password is never written into the env).

:func:`ping` asks a server ``PING`` (after ``AUTH`` where a password is given) over a plain
socket speaking RESP, every step bounded by a timeout, for ``cudaenv doctor``: cudaenv itself
needs no Redis client; the env gets one in its lock (``redis`` on PyPI).
"""

from __future__ import annotations

import ipaddress
import re
import socket
import ssl
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Literal
from urllib.parse import unquote, urlsplit

SCHEMES = ("redis", "rediss")
DEFAULT_PORT = 6379
# The PyPI distribution the env needs for either tool to reach the server.
CLIENT = "redis"
# Seconds one whole request may take, in the env's tools and in `doctor`: the connect, and the
# command with all of its answer, under one deadline, never a timeout per read of the socket
# (redis-py's socket_timeout is one, and a server that trickles its reply renews it at each
# byte). A server that accepts and never answers, or answers too slowly, costs each process
# this once (both tools then give up for the process), never a hang. The env's client reads it
# from TORCHINDUCTOR_REDIS_URL's socket_timeout (templates/remote_cache.py.j2, which also bounds
# each reply's size: MAX_REPLY). Triton's own RedisRemoteCacheBackend sets no timeout at all.
TIMEOUT = 3.0
# What the hook points Triton at: its own manager, and the env's backend module (written
# beside the hook by hooks.write_hooks), which reads TORCHINDUCTOR_REDIS_URL.
MANAGER = "triton.runtime.cache:RemoteCacheManager"
BACKEND_MODULE = "_cudaenv_remote_cache"
BACKEND = f"{BACKEND_MODULE}:RedisBackend"
# The variable the hook records its decision in ("wired URL" without the password, or "not
# wired: WHY"), for doctor.
WIRING_VAR = "CUDAENV_REMOTE_CACHE_WIRING"

# The URL's path: no database (0) or one number. The hook matches the same pattern.
DB_PATTERN = r"^/?(\d{1,5})?$"
_DB_RE = re.compile(DB_PATTERN)


class RemoteCacheError(ValueError):
    """A remote cache URL that cannot be used as written; the message says why."""


@dataclass(frozen=True, kw_only=True)
class RemoteCache:
    """One Redis server as a URL names it; ``password`` never appears in :attr:`shown`."""

    tls: bool
    host: str
    port: int = DEFAULT_PORT
    db: int = 0
    username: str | None = None
    password: str | None = field(default=None, repr=False)

    @property
    def scheme(self) -> str:
        return "rediss" if self.tls else "redis"

    @property
    def netloc(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def shown(self) -> str:
        """The URL without its password (``***`` in its place where one is given)."""
        user = self.username or ""
        secret = ":***" if self.password else ""
        auth = f"{user}{secret}@" if user or secret else ""
        return f"{self.scheme}://{auth}{self.netloc}/{self.db}"

    @property
    def loopback(self) -> bool:
        return is_loopback(self.host)

    def with_password(self, password: str | None) -> RemoteCache:
        """This server with ``password`` where the URL named none."""
        if self.password or not password:
            return self
        return RemoteCache(tls=self.tls, host=self.host, port=self.port, db=self.db,
                           username=self.username, password=password)  # fmt: skip


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def parse(text: str) -> RemoteCache:
    """``redis://[USER[:PASSWORD]@]HOST[:PORT][/DB]`` or ``rediss://...``; RemoteCacheError
    saying what is wrong. Nothing is refused here for want of a password: see :func:`refusal`."""
    # An "@" after the first "/": a password with "/" unquoted ended the host early, and what
    # urlsplit read as port or path holds part of it, so neither is echoed.
    early = "@" in text.partition("://")[2].partition("/")[2]
    hint = " (a / in a password is %2F)"
    try:
        parts = urlsplit(text)
        port = parts.port
    except ValueError as exc:
        raise RemoteCacheError(f"not a redis:// URL ({hint[2:-1] if early else exc})") from None
    if parts.scheme not in SCHEMES:
        raise RemoteCacheError(
            "expected redis://[USER[:PASSWORD]@]HOST[:PORT][/DB] or rediss://... (TLS), "
            f"got a {parts.scheme or 'scheme-less'} URL"
        )
    if not parts.hostname:
        raise RemoteCacheError("the URL names no host")
    if parts.query or parts.fragment:
        raise RemoteCacheError("a query or fragment is not taken (?... or #...)")
    if any(c.isspace() for c in text):
        raise RemoteCacheError("the URL holds white space")
    found = _DB_RE.match(parts.path)
    if found is None:
        got = hint if early else f", got {parts.path!r}"
        raise RemoteCacheError(f"the path must be a database number like /0{got}")
    if port == 0:
        raise RemoteCacheError("port 0 is not a port")
    return RemoteCache(
        tls=parts.scheme == "rediss",
        host=parts.hostname,
        port=port or DEFAULT_PORT,
        db=int(found.group(1) or 0),
        username=unquote(parts.username) if parts.username else None,
        password=unquote(parts.password) if parts.password else None,
    )


def refusal(cache: RemoteCache) -> str | None:
    """Why ``cache`` is not wired, or None: a server not on loopback must ask for a password."""
    if cache.loopback or cache.password:
        return None
    return (
        f"{cache.shown} is not on loopback and no password is given: whoever can write the "
        "cache runs code on every node that reads it (Inductor's FX-graph entries are Python), "
        "so cudaenv wires only a server that asks for one (in the URL, or "
        "CUDAENV_REMOTE_CACHE_PASSWORD at run time)"
    )


def tool_url(cache: RemoteCache) -> str:
    """The URL redis-py's ``Redis.from_url`` reads (Inductor's TORCHINDUCTOR_REDIS_URL, and the
    env's Triton backend), password included, every wait bounded: Inductor's backend takes
    no timeout of its own (torch/_inductor/remote_cache.py)."""
    auth = ""
    if cache.username or cache.password:
        from urllib.parse import quote

        auth = quote(cache.username or "", safe="")
        if cache.password:
            auth += ":" + quote(cache.password, safe="")
        auth += "@"
    bound = f"socket_timeout={TIMEOUT:g}&socket_connect_timeout={TIMEOUT:g}"
    return f"{cache.scheme}://{auth}{cache.netloc}/{cache.db}?{bound}"


def wiring(cache: RemoteCache) -> tuple[tuple[str, str], ...]:
    """Every variable Triton and Inductor read for ``cache``, in the order the hook and the
    activation scripts set them. The password, where there is one, is in the last
    (TORCHINDUCTOR_REDIS_URL)."""
    return (
        ("TRITON_CACHE_MANAGER", MANAGER),
        ("TRITON_REMOTE_CACHE_BACKEND", BACKEND),
        ("TRITON_REDIS_HOST", cache.host),
        ("TRITON_REDIS_PORT", str(cache.port)),
        ("TORCHINDUCTOR_FX_GRAPH_REMOTE_CACHE", "1"),
        # Inductor reads its autotuning results from Redis unguarded
        # (torch/_inductor/runtime/autotune_cache.py, read_best), and its Redis backend turns
        # only a ConnectionError into a miss: the hook makes every error of redis one there
        # (templates/hook.py.j2, _CudaenvInductorGuard), so a late answer costs a local compile.
        ("TORCHINDUCTOR_AUTOTUNE_REMOTE_CACHE", "1"),
        ("TORCHINDUCTOR_REDIS_HOST", cache.host),
        ("TORCHINDUCTOR_REDIS_PORT", str(cache.port)),
        (WIRING_VAR, f"wired {cache.shown}"),
        ("TORCHINDUCTOR_REDIS_URL", tool_url(cache)),
    )


WIRED = tuple(name for name, _ in wiring(RemoteCache(tls=False, host="localhost")))


# --------------------------------------------------------------------------- ping

Status = Literal["answers", "auth-refused", "down"]


@dataclass(frozen=True, kw_only=True)
class Answer:
    """What a server said to PING: ``answers`` (PONG), ``auth-refused`` (it wants another or
    a first password), ``down`` (no connection, no answer in time, or not Redis)."""

    status: Status
    detail: str
    seconds: float


# The longest answer `ping` reads: a status line (+PONG, +OK, -ERR ...). Nothing longer is read,
# and a bulk reply ($LEN) is only its header line here, reported as not an answer to PING: its
# body is never read, whatever length it announces.
_MAX_LINE = 4096


def _command(*words: str) -> bytes:
    out = [f"*{len(words)}\r\n".encode()]
    for word in words:
        data = word.encode()
        out.append(b"$%d\r\n%s\r\n" % (len(data), data))
    return b"".join(out)


def _left(deadline: float) -> float:
    """Seconds to ``deadline``, for the next wait on the socket; TimeoutError past it."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("no answer in time")
    return left


def _reply(sock: socket.socket | ssl.SSLSocket, deadline: float) -> bytes:
    """One RESP simple reply line (``+OK``, ``-ERR ...``), read before ``deadline``: each wait
    is what is left of it, so a server that trickles bytes gains nothing by it."""
    got = b""
    while b"\r\n" not in got:
        sock.settimeout(_left(deadline))
        chunk = sock.recv(256)
        if not chunk:
            raise ConnectionError("the server closed the connection")
        got += chunk
        if len(got) > _MAX_LINE:
            raise ValueError("an answer longer than any Redis status line")
    return got.partition(b"\r\n")[0]


def ping(cache: RemoteCache, *, timeout: float = TIMEOUT) -> Answer:
    """PING ``cache`` (AUTH first where it has a password): connect, every reply and the whole
    exchange bounded by ``timeout``."""
    started = time.monotonic()
    deadline = started + timeout

    def answer(status: Status, detail: str) -> Answer:
        return Answer(status=status, detail=detail, seconds=time.monotonic() - started)

    try:
        raw = _connect(cache.host, cache.port, deadline)
    except OSError as exc:
        return answer("down", f"no connection to {cache.netloc}: {exc.strerror or exc}")
    try:
        sock: socket.socket | ssl.SSLSocket = raw
        # The TLS handshake and each send wait at most what is left of the deadline too (the
        # socket's timeout bounds the whole of either call), not the time the connect had.
        if cache.tls:
            raw.settimeout(_left(deadline))
            sock = ssl.create_default_context().wrap_socket(raw, server_hostname=cache.host)
        if cache.password:
            words = [cache.username, cache.password] if cache.username else [cache.password]
            sock.settimeout(_left(deadline))
            sock.sendall(_command("AUTH", *words))
            said = _reply(sock, deadline)
            if said.startswith(b"-"):
                return answer("auth-refused", f"AUTH refused: {_text(said[1:])}")
            if said != b"+OK":
                return answer("down", f"not a Redis answer to AUTH: {_text(said)}")
        sock.settimeout(_left(deadline))
        sock.sendall(_command("PING"))
        said = _reply(sock, deadline)
    except (OSError, ValueError) as exc:
        why = "no answer in time" if isinstance(exc, TimeoutError) else str(exc) or repr(exc)
        return answer("down", f"{cache.netloc}: {why}")
    finally:
        raw.close()
    if said == b"+PONG":
        return answer("answers", f"PONG in {(time.monotonic() - started) * 1000:.0f} ms")
    if said.startswith((b"-NOAUTH", b"-WRONGPASS", b"-NOPERM")):
        return answer("auth-refused", _text(said[1:]))
    return answer("down", f"not a Redis answer to PING: {_text(said)}")


def _connect(host: str, port: int, deadline: float) -> socket.socket:
    """A connection to ``host``, made before ``deadline``: the name lookup too, which
    ``socket.create_connection``'s timeout does not bound (a resolver that never answers)."""
    found: list[list[Any] | OSError] = []

    def lookup() -> None:
        try:
            found.append(socket.getaddrinfo(host, port, type=socket.SOCK_STREAM))
        except OSError as exc:
            found.append(exc)

    thread = threading.Thread(target=lookup, daemon=True)
    thread.start()
    thread.join(max(0.0, deadline - time.monotonic()))
    if not found:
        raise TimeoutError(f"no answer in time to the lookup of {host}")
    if isinstance(found[0], OSError):
        raise found[0]
    last: OSError = OSError(f"{host} has no address")
    for family, kind, proto, _, address in found[0]:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError("no connection in time")
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(left)
            sock.connect(address)
        except OSError as exc:
            sock.close()
            last = exc
            continue
        return sock
    raise last


def _text(data: bytes) -> str:
    """A server's line, printable and short: it is shown to the user as evidence."""
    shown = data.decode("ascii", "replace")
    shown = "".join(c if c.isprintable() else "?" for c in shown)
    return shown[:200]
