"""The OCI distribution protocol, as the JIT store's remote tier speaks it: which registry
and repository (``oci://HOST[:PORT]/REPOSITORY``), the client that gets and puts manifests and
blobs, and the errors a registry's failures become.

The protocol and the credentials come from the ``oras`` library (``oras.provider.Registry``,
its token auth and its reading of the docker config), with these changes: every request
carries a timeout and every transfer a deadline; nothing goes in plain http to a machine
other than this one (a redirect, a token realm) unless the remote allows plain http; nothing
is retried (oras's ``do_request`` retries five times with growing sleeps, over two minutes
against a dead registry); and a Basic challenge is answered from the docker config as
``docker`` does. Every blob downloaded is hashed while it streams and checked against its
descriptor's digest and size. Failures are RemoteError with a one-line message naming the
remote and the cause; no credential is ever put in one. What an artifact holds (the store's
entries, indexes and signatures) is ``builder/jit/remote.py``'s.
"""

from __future__ import annotations

import hashlib
import ipaddress
import json
import logging
import re
import socket
import threading
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from http.client import responses as http_reasons
from http.cookiejar import DefaultCookiePolicy
from typing import IO, Any, ClassVar, Protocol
from urllib.parse import urljoin, urlsplit

import oras.auth.token
import oras.auth.utils
import oras.container
import oras.defaults
import oras.provider
import oras.utils
import requests
import urllib3
import urllib3.connection
import urllib3.connectionpool
from requests.adapters import HTTPAdapter

from builder.core import proc, settings
from builder.core.errors import CudaenvError

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
TITLE = "org.opencontainers.image.title"

# A manifest is a small JSON document; one larger than this is not ours.
MAX_MANIFEST_BYTES = 4 << 20
CHUNK = 1 << 20

# The distribution spec's grammar: a repository name is lower-case path components joined
# by separators.
_COMPONENT = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_HOSTNAME = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
)
DIGEST = re.compile(r"sha256:[0-9a-f]{64}")
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


class _Sink(Protocol):
    def write(self, chunk: bytes, /) -> int: ...


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


class _TokenAuth(oras.auth.token.TokenAuth):  # type: ignore[misc]
    """oras's token auth, with a docker credential helper that is bounded and quiet."""

    timeout: float = 30.0

    def _get_auth_from_creds_store(self, suffix: str, hostname: str) -> str | None:
        try:
            done = proc.run(
                [f"docker-credential-{suffix}", "get"],
                input_text=hostname,
                check=True,
                timeout=self.timeout,
            )
            payload = json.loads(done.stdout)
            return str(oras.auth.utils.get_basic_auth(payload["Username"], payload["Secret"]))
        except (OSError, CudaenvError, ValueError, KeyError, TypeError):
            # No credential is no error: the registry may allow anonymous use, and says
            # 401 when it does not.
            return None


class Client(oras.provider.Registry):  # type: ignore[misc]
    """oras's Registry bound to one remote's repository, bounded and without retries."""

    def __init__(self, remote: Remote, timeout: float) -> None:
        super().__init__(hostname=remote.host, insecure=remote.insecure)
        self.remote = remote
        self.session = _TimeoutSession(timeout, remote)
        auth = _TokenAuth()
        auth.timeout = timeout
        auth.session, auth.prefix, auth._tls_verify = self.session, self.prefix, True
        self.auth = auth
        # The name is set, not parsed: oras's parser would take a first repository component
        # with a dot in it ("team.a/jit") for a registry host.
        container = oras.container.Container("cudaenv", registry=remote.host)
        container.namespace, container.repository = None, remote.repository
        self.container = container
        # oras reads ~/.docker/config.json; docker's own $DOCKER_CONFIG is added here.
        configs = []
        docker_config = settings.current().docker_config
        if docker_config is not None:
            config = docker_config / "config.json"
            if config.is_file():
                configs.append(str(config))
        try:
            auth.load_configs(container, configs=configs)
        except (OSError, ValueError, AttributeError) as exc:
            # Not the text: a config holds secrets.
            raise RemoteError(
                f"{remote.url}: the docker config cannot be read ({type(exc).__name__})"
            ) from None
        self._authorization: dict[str, str] = {}

    def do_request(
        self,
        url: str,
        method: str = "GET",
        data: Any = None,
        headers: dict[str, str] | None = None,
        json: Any = None,
        stream: bool = False,
    ) -> requests.Response:
        """One request, answering one auth challenge; 401/403 after that is RemoteRefused."""
        headers = {**(headers or {}), **self._authorization}
        response = self._send(method, url, data, headers, json, stream)
        if response.status_code == 401:
            answer = self._answer(response)
            if answer is not None:
                response.close()
                if hasattr(data, "seek"):
                    data.seek(0)
                self._authorization = answer
                response = self._send(method, url, data, {**headers, **answer}, json, stream)
        if response.status_code in (401, 403):
            response.close()
            raise _refused(self.remote, response.status_code)
        return response

    def _send(
        self, method: str, url: str, data: Any, headers: dict[str, str], json: Any, stream: bool
    ) -> requests.Response:
        return self.session.request(
            method, url, data=data, json=json, headers=headers, stream=stream, verify=True
        )

    def _answer(self, response: requests.Response) -> dict[str, str] | None:
        """The Authorization header that answers ``response``'s challenge, if any can."""
        challenge = response.headers.get("WWW-Authenticate", "")
        scheme = challenge.split(" ", 1)[0].lower()
        basic = getattr(self.auth, "_basic_auth", None)
        if scheme == "basic":
            return {"Authorization": f"Basic {basic}"} if basic else None
        if scheme != "bearer":
            return None
        parsed = oras.auth.utils.parse_auth_header(challenge)
        if not parsed.realm:
            return None
        # With docker-config credentials this asks for a token with them; without, for an
        # anonymous one (a public repository).
        token = self.auth.request_token(parsed)
        return {"Authorization": f"Bearer {token}"} if token else None

    # ---- the repository

    def manifest(self, reference: str) -> bytes | None:
        """The manifest's bytes, None when the registry knows no such tag."""
        url = f"{self.prefix}://{self.container.manifest_url(reference)}"
        # Every kind is accepted, so that a tag holding an image index or a docker manifest is
        # seen (and refused), where a registry would answer 404 to "OCI manifest only".
        accept = ", ".join(oras.defaults.default_manifest_accepted_media_types)
        with (
            self.session.bounded(MAX_MANIFEST_BYTES),
            self.do_request(url, "GET", headers={"Accept": accept}, stream=True) as r,
        ):
            if r.status_code == 404:
                return None
            _expect(self.remote, r, (200,), f"manifest {reference}")
            raw = _read_bounded(self.remote, r, MAX_MANIFEST_BYTES, f"the manifest of {reference}")
            served = r.headers.get("Docker-Content-Digest")
        if served and DIGEST.fullmatch(served) and served != sha256_digest(raw):
            raise RemoteBadContent(
                f"{self.remote.url}: the manifest of {reference} does not match its digest {served}"
            )
        return raw

    def has_blob(self, digest: str) -> bool:
        url = f"{self.prefix}://{self.container.get_blob_url(digest)}"
        with self.session.bounded(0), self.do_request(url, "HEAD") as r:
            if r.status_code == 404:
                return False
            _expect(self.remote, r, (200,), f"blob {digest}")
            return True

    def upload(self, digest: str, size: int, data: bytes | IO[bytes]) -> None:
        """Upload one blob monolithically (POST a session, PUT the bytes), streamed from a
        file; the registry checks the digest itself."""
        if self.has_blob(digest):
            return
        url = f"{self.prefix}://{self.container.upload_blob_url()}"
        with (
            self.session.bounded(0),
            self.do_request(url, "POST", headers={"Content-Length": "0"}) as r,
        ):
            _expect(self.remote, r, (202,), "a blob upload")
            location = self._get_location(r, self.container)
        if not location:
            raise RemoteError(f"{self.remote.url}: the registry gave no upload location")
        url = oras.utils.append_url_params(location, {"digest": digest})
        headers = {"Content-Length": str(size), "Content-Type": "application/octet-stream"}
        with (
            self.session.bounded(size),
            self.do_request(url, "PUT", data=data, headers=headers) as r,
        ):
            _expect(self.remote, r, (201,), f"blob {digest}")

    def put_manifest(self, tag: str, raw: bytes) -> None:
        url = f"{self.prefix}://{self.container.manifest_url(tag)}"
        headers = {"Content-Type": MANIFEST_MEDIA_TYPE}
        with (
            self.session.bounded(len(raw)),
            self.do_request(url, "PUT", data=raw, headers=headers) as r,
        ):
            _expect(self.remote, r, (201,), f"manifest {tag}")
            stored = r.headers.get("Docker-Content-Digest")
        if stored and stored != sha256_digest(raw):
            raise RemoteBadContent(
                f"{self.remote.url}: the registry stored manifest {tag} as {stored}, "
                f"not {sha256_digest(raw)}"
            )

    def download(self, descriptor: Descriptor, sink: _Sink, budget: list[int]) -> None:
        """Stream one blob into ``sink``, hashing it; RemoteBadContent unless it is exactly
        the descriptor's bytes. ``budget`` (one int, bytes left) bounds all blobs together."""
        url = f"{self.prefix}://{self.container.get_blob_url(descriptor.digest)}"
        digest = hashlib.sha256()
        got = 0
        with (
            self.session.bounded(descriptor.size),
            self.do_request(url, "GET", stream=True) as r,
        ):
            if r.status_code == 404:
                raise RemoteBadContent(
                    f"{self.remote.url}: blob {descriptor.digest} is missing from the registry"
                )
            _expect(self.remote, r, (200,), f"blob {descriptor.digest}")
            for chunk in r.iter_content(CHUNK):
                got += len(chunk)
                if got > descriptor.size:
                    break
                budget[0] -= len(chunk)
                if budget[0] < 0:
                    raise RemoteBadContent(f"{self.remote.url}: the entry is over its size limit")
                digest.update(chunk)
                sink.write(chunk)
        if got != descriptor.size:
            served = f"more than {descriptor.size}" if got > descriptor.size else str(got)
            raise RemoteBadContent(
                f"{self.remote.url}: blob {descriptor.digest} served other content "
                f"({served} bytes where its descriptor says {descriptor.size})"
            )
        if f"sha256:{digest.hexdigest()}" != descriptor.digest:
            raise RemoteBadContent(
                f"{self.remote.url}: blob {descriptor.digest} served other content "
                f"(sha256:{digest.hexdigest()})"
            )


def _refused(remote: Remote, status: int) -> RemoteRefused:
    reason = http_reasons.get(status, "")
    if status == 401:
        hint = (
            f"log in with `docker login {remote.host}` (credentials are read from "
            "~/.docker/config.json or $DOCKER_CONFIG/config.json)"
        )
    else:
        hint = f"these credentials may not use {remote.repository}"
    return RemoteRefused(f"{remote.url}: refused: {status} {reason}; {hint}", status=status)


def _expect(remote: Remote, r: requests.Response, ok: tuple[int, ...], what: str) -> None:
    if r.status_code in ok:
        return
    # The registry's error code (MANIFEST_INVALID, DIGEST_INVALID) says more than the status.
    detail = ""
    with suppress(
        ValueError, TypeError, KeyError, IndexError, RemoteError, requests.RequestException
    ):
        errors = json.loads(_read_bounded(remote, r, 64 << 10, "an error"))
        detail = f": {errors['errors'][0]['code']}"
    raise RemoteError(
        f"{remote.url}: {what}: the registry answered {r.status_code} "
        f"{http_reasons.get(r.status_code, r.reason or '')}{detail}"
    )


def _read_bounded(remote: Remote, r: requests.Response, limit: int, what: str) -> bytes:
    out = bytearray()
    for chunk in r.iter_content(CHUNK):
        out += chunk
        if len(out) > limit:
            raise RemoteBadContent(f"{remote.url}: {what} is larger than {limit} bytes")
    return bytes(out)


def sha256_digest(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


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


# --------------------------------------------------------------------------- descriptors


@dataclass(frozen=True)
class Descriptor:
    """A blob as a manifest names it: media type, digest, size and, for a file, its title."""

    media_type: str
    digest: str
    size: int
    title: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "mediaType": self.media_type,
            "digest": self.digest,
            "size": self.size,
        }
        if self.title is not None:
            out["annotations"] = {TITLE: self.title}
        return out
