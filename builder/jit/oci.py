"""The OCI distribution protocol, as the JIT store's remote tier speaks it: the client that
gets and puts manifests and blobs, the descriptors that name the blobs, and the registry's
credentials. Which registry and repository (``oci://HOST[:PORT]/REPOSITORY``), the bounded
transport and the errors a registry's failures become are ``builder/jit/ocihttp.py``'s, and
are importable from here.

The credentials come from the ``oras`` library (its token auth and its reading of the
docker config) and the repository's URLs from its container names; the requests themselves
are this module's, after ``oras.provider.Registry``'s, with these changes: every request
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
import json
import re
from contextlib import suppress
from dataclasses import dataclass
from http.client import responses as http_reasons
from typing import IO, Any, Protocol

import oras.auth.token
import oras.auth.utils
import oras.container
import oras.defaults
import oras.utils
import requests

from builder.core import proc, settings
from builder.core.errors import CudaenvError
from builder.jit.ocihttp import SECONDS_PER_MIB as SECONDS_PER_MIB
from builder.jit.ocihttp import Remote as Remote
from builder.jit.ocihttp import RemoteBadContent as RemoteBadContent
from builder.jit.ocihttp import RemoteConflict as RemoteConflict
from builder.jit.ocihttp import RemoteError as RemoteError
from builder.jit.ocihttp import RemoteInsecure as RemoteInsecure
from builder.jit.ocihttp import RemoteRefused as RemoteRefused
from builder.jit.ocihttp import RemoteTimeout as RemoteTimeout
from builder.jit.ocihttp import RemoteUnreachable as RemoteUnreachable
from builder.jit.ocihttp import _TimeoutSession as _TimeoutSession
from builder.jit.ocihttp import remote_errors as remote_errors

MANIFEST_MEDIA_TYPE = "application/vnd.oci.image.manifest.v1+json"
TITLE = "org.opencontainers.image.title"

# A manifest is a small JSON document; one larger than this is not ours.
MAX_MANIFEST_BYTES = 4 << 20
CHUNK = 1 << 20

DIGEST = re.compile(r"sha256:[0-9a-f]{64}")


# --------------------------------------------------------------------------- the client


class _Sink(Protocol):
    def write(self, chunk: bytes, /) -> int: ...


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


class Client:
    """One remote's repository, spoken to through oras's token auth and URL helpers, bounded
    and without retries. Not oras's ``provider.Registry``: this client uses none of its
    protocol, and importing it imports jsonschema, ~40% of the client's import time, paid on
    a node's build while uv installs beside it."""

    def __init__(self, remote: Remote, timeout: float) -> None:
        self.prefix = "http" if remote.insecure else "https"
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
            location = r.headers.get("location", "")
        if location and not location.startswith("http"):
            # A registry may answer with a path alone: the same host (oras-py#78).
            location = f"{self.prefix}://{self.remote.host}{location}"
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
