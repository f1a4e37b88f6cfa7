"""Where the JIT store's registry is and how it is spoken to: the remote's address
(``oci://HOST[:PORT]/REPOSITORY``), the errors a registry's failures become, and the HTTP
transport under the OCI client: a requests session whose every request has a timeout and
every transfer a deadline, which sends nothing in plain http to another machine than this
one unless the remote allows it, and turns transport failures into one-line RemoteErrors.
The distribution protocol itself (manifests, blobs, credentials) is ``oci``'s.
"""

from __future__ import annotations

import ipaddress
import logging
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.cookiejar import DefaultCookiePolicy
from typing import Any, ClassVar
from urllib.parse import urljoin, urlsplit

import requests
import urllib3
import urllib3.connection
import urllib3.connectionpool
from requests.adapters import HTTPAdapter

from builder.core.errors import CudaenvError

# The distribution spec's grammar: a repository name is lower-case path components joined
# by separators.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_HOSTNAME = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
_ERRNO = re.compile(r"\[Errno -?\d+\] ([^'\")\]]+)")


# --------------------------------------------------------------------------- errors


class RemoteError(CudaenvError):
    """The JIT remote could not be used. ``cause`` says why, as one of: ``invalid`` (the URL),
    ``unreachable``, ``refused`` (401/403), ``timeout``, ``bad-content`` (a blob or manifest
    that is not what it should be), ``conflict``, ``insecure`` (a redirect or a token realm
    in plain http to another machine), ``protocol`` (any other unexpected answer).
    The caller warns with the message and goes on without the remote."""

    cause: ClassVar[str] = "protocol"


class RemoteUnreachable(RemoteError):
    cause = "unreachable"


class RemoteRefused(RemoteError):
    cause = "refused"

    def __init__(self, message: str, *, status: int) -> None:
        self.status = status
        super().__init__(message)


class RemoteTimeout(RemoteError):
    cause = "timeout"


class RemoteBadContent(RemoteError):
    cause = "bad-content"


class RemoteConflict(RemoteError):
    """The tag already holds other content; an existing tag is never overwritten."""

    cause = "conflict"


class _InvalidRemote(RemoteError):
    cause = "invalid"


class RemoteInsecure(RemoteError):
    """The registry sent the client to plain http on another machine (a redirect, a token
    realm): the credentials and the request would cross the network in clear."""

    cause = "insecure"


# --------------------------------------------------------------------------- the remote


@dataclass(frozen=True)
class Remote:
    """Where entries go: ``oci://HOST[:PORT]/REPOSITORY``."""

    url: str
    host: str
    repository: str
    insecure: bool  # the registry itself is spoken to in plain http (loopback, or allow_http)
    # CUDAENV_JIT_REMOTE_INSECURE=1: plain http to any host, wherever the registry sends us.
    allow_http: bool = False

    @classmethod
    def parse(cls, url: str, *, allow_http: bool = False) -> Remote:
        """The remote of ``url`` (the value of CUDAENV_JIT_REMOTE). Plain http is used only
        for a loopback host (a registry on this machine cannot be spied on in between) or when
        ``allow_http`` (CUDAENV_JIT_REMOTE_INSECURE=1); anything else speaks https."""

        shown = url

        def bad(why: str) -> RemoteError:
            return _InvalidRemote(f"CUDAENV_JIT_REMOTE={shown}: {why}")

        scheme, sep, rest = url.partition("://")
        if not sep or scheme != "oci":
            raise bad("not an oci://HOST[:PORT]/REPOSITORY URL")
        host, slash, repository = rest.partition("/")
        if "@" in host:
            # Never echo a password: credentials come from the docker config.
            shown = f"oci://***@{host.rpartition('@')[2]}/{repository}"
            raise bad("credentials do not belong in the URL (log in with `docker login HOST`)")
        if not slash or not repository:
            raise bad("no repository after the host (oci://HOST[:PORT]/REPOSITORY)")
        name, port = _split_port(host)
        if name is None or port is None:
            raise bad(f"{host!r} is not a HOST[:PORT]")
        if not _REPOSITORY.fullmatch(repository):
            raise bad(
                f"{repository!r} is not a repository name (lower-case letters, digits and "
                "._- separated path components, no tag)"
            )
        if len(host) + 1 + len(repository) > 255:
            raise bad("the name is longer than 255 characters")
        return cls(url, host, repository, _is_loopback(name) or allow_http, allow_http)


def _split_port(host: str) -> tuple[str | None, str | None]:
    """(name, port) of ``HOST[:PORT]`` (port "" when absent); (None, None) when malformed."""
    if host.startswith("["):
        end = host.find("]")
        if end < 0:
            return None, None
        name, rest = host[1:end], host[end + 1 :]
        try:
            ipaddress.IPv6Address(name)
        except ValueError:
            return None, None
    else:
        name, _, port = host.partition(":")
        rest = host[len(name) :]
        if not _HOSTNAME.fullmatch(name):
            return None, None
    if not rest:
        return name, ""
    port = rest[1:]
    if rest[0] != ":" or not port.isdigit() or not 0 < int(port) < 65536:
        return None, None
    return name, port


def _is_loopback(name: str) -> bool:
    if name.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# --------------------------------------------------------------------------- transport

# A transfer may take the timeout plus this long per MiB it carries (at least 1 MiB/s).
SECONDS_PER_MIB = 1.0


class _TimeoutSession(requests.Session):
    """A session whose every request is bounded twice: each wait on the registry by
    ``timeout`` (requests waits forever by default, and oras issues its requests, auth tokens
    included, without one), and each whole transfer by :meth:`bounded`, since a registry that
    sends one byte a second never lets a read wait long. It also refuses to send anything in
    plain http to another machine than this one, wherever the registry points it (a redirect,
    a token realm), unless the remote allows plain http."""

    def __init__(self, timeout: float, remote: Remote) -> None:
        super().__init__()
        self.default_timeout = timeout
        self.remote = remote
        # As oras does: registries that set cookies take it for a browser (CSRF dances).
        self.cookies.set_policy(DefaultCookiePolicy(allowed_domains=[]))
        self._sockets: set[socket.socket] = set()
        self._sockets_lock = threading.Lock()
        adapter = _WatchedAdapter(self)
        self.mount("http://", adapter)
        self.mount("https://", adapter)

    def request(
        self, method: str, url: str | bytes, *args: Any, **kwargs: Any
    ) -> requests.Response:
        self._check_url(url if isinstance(url, str) else url.decode(), "a request")
        if kwargs.get("timeout") is None:
            kwargs["timeout"] = self.default_timeout
        return super().request(method, url, *args, **kwargs)

    def get_redirect_target(self, resp: requests.Response) -> str | None:
        """Where a redirect leads, checked before requests follows it."""
        target = super().get_redirect_target(resp)
        if target:
            self._check_url(urljoin(resp.url, target), "a redirect")
        return target

    def _check_url(self, url: str, what: str) -> None:
        parts = urlsplit(url)
        if parts.scheme == "https" or self.remote.allow_http:
            return
        if parts.scheme == "http" and _is_loopback(parts.hostname or ""):
            return
        raise RemoteInsecure(
            f"{self.remote.url}: the registry sent {what} to {parts.scheme}://{parts.netloc} in "
            "plain http, which would carry the credentials in clear; refused (set "
            "CUDAENV_JIT_REMOTE_INSECURE=1 on a network where plain http is intended)"
        )

    def track(self, sock: socket.socket) -> None:
        with self._sockets_lock:
            self._sockets = {s for s in self._sockets if s.fileno() >= 0}
            self._sockets.add(sock)

    def _cut(self, fired: threading.Event) -> None:
        """The deadline passed: shut every connection down, which ends a read blocked in
        another thread (closing the socket would not)."""
        fired.set()
        with self._sockets_lock:
            sockets = list(self._sockets)
        for sock in sockets:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    @contextmanager
    def bounded(self, size: int) -> Iterator[None]:
        """One transfer of about ``size`` bytes, request and body: RemoteTimeout when it
        is not over after the timeout plus 1 s per MiB."""
        seconds = self.default_timeout + SECONDS_PER_MIB * size / (1 << 20)
        fired = threading.Event()
        timer = threading.Timer(seconds, self._cut, args=(fired,))
        timer.daemon = True
        timer.start()
        try:
            yield
        except Exception:
            if fired.is_set():
                raise self._timed_out(seconds) from None
            raise
        finally:
            timer.cancel()
        if fired.is_set():
            raise self._timed_out(seconds)

    def _timed_out(self, seconds: float) -> RemoteTimeout:
        return RemoteTimeout(
            f"{self.remote.url}: a transfer was not over after {seconds:g}s (at least 1 MiB/s "
            f"after the first {self.default_timeout:g}s, CUDAENV_JIT_REMOTE_TIMEOUT)"
        )


class _WatchedAdapter(HTTPAdapter):
    """requests' adapter whose connections hand their sockets to the session, so that
    :meth:`_TimeoutSession.bounded` can end a transfer that runs past its deadline (through
    an http(s) proxy too; a SOCKS proxy's connections are its own, and only timed out)."""

    def __init__(self, session: _TimeoutSession) -> None:
        def watched(base: type[urllib3.connection.HTTPConnection]) -> Any:
            class Watched(base):  # type: ignore[misc,valid-type]
                def _new_conn(self) -> socket.socket:
                    sock: socket.socket = super()._new_conn()
                    session.track(sock)
                    return sock

            return Watched

        class HTTPPool(urllib3.connectionpool.HTTPConnectionPool):
            ConnectionCls = watched(urllib3.connection.HTTPConnection)

        class HTTPSPool(urllib3.connectionpool.HTTPSConnectionPool):
            ConnectionCls = watched(urllib3.connection.HTTPSConnection)

        self._pools = {"http": HTTPPool, "https": HTTPSPool}
        super().__init__(max_retries=0)

    def init_poolmanager(self, *args: Any, **kwargs: Any) -> None:
        super().init_poolmanager(*args, **kwargs)
        self.poolmanager.pool_classes_by_scheme = self._pools

    def proxy_manager_for(self, proxy: str, **kwargs: Any) -> urllib3.PoolManager:
        manager: urllib3.PoolManager = super().proxy_manager_for(proxy, **kwargs)
        if isinstance(manager, urllib3.ProxyManager):
            manager.pool_classes_by_scheme = self._pools
        return manager


def _reason(exc: BaseException) -> str:
    """The OS's words for a connection failure ("Connection refused"), not requests' page."""
    found = _ERRNO.search(str(exc))
    return found.group(1).strip() if found else type(exc).__name__


def _is_timeout(exc: BaseException) -> bool:
    # A read that times out while a body streams surfaces as a ConnectionError wrapping
    # urllib3's ReadTimeoutError.
    if isinstance(exc, requests.Timeout):
        return True
    return any("Timeout" in type(arg).__name__ for arg in exc.args)


_QUIET_LOGGERS = ("oras.logger", "urllib3.connectionpool", "urllib3.connection", "urllib3.response")


@contextmanager
def remote_errors(remote: Remote, timeout: float) -> Iterator[None]:
    """Transport failures as RemoteError, and oras and urllib3 kept quiet: cudaenv's logging
    prints warnings (urllib3 warns of headers a transfer cut at its deadline left half-read),
    and the caller warns once with the error."""
    quiet = [logging.getLogger(name) for name in _QUIET_LOGGERS]
    was = [log.disabled for log in quiet]
    for log in quiet:
        log.disabled = True
    try:
        yield
    except RemoteError:
        raise
    except requests.exceptions.SSLError as exc:
        raise RemoteUnreachable(f"{remote.url}: TLS failed ({_reason(exc)})") from None
    except requests.RequestException as exc:
        if _is_timeout(exc):
            raise RemoteTimeout(f"{remote.url}: timed out after {timeout:g}s") from None
        if isinstance(exc, requests.ConnectionError):
            raise RemoteUnreachable(f"{remote.url}: unreachable ({_reason(exc)})") from None
        raise RemoteError(f"{remote.url}: {type(exc).__name__}") from None
    finally:
        for log, disabled in zip(quiet, was, strict=True):
            log.disabled = disabled
