"""builder/jit/remote.py and builder/jit/oci.py against a real OCI registry (Debian's
docker-registry on loopback), and against servers that misbehave: one that never answers, ones
that refuse."""

from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
import requests

from builder.jit import oci
from builder.jit import remote as jit_remote
from builder.jit.oci import (
    Remote,
    RemoteBadContent,
    RemoteConflict,
    RemoteError,
    RemoteRefused,
    RemoteTimeout,
    RemoteUnreachable,
)
from builder.jit.remote import fetch, fetch_index, publish, publish_index, tag_for
from tests.helpers import loopback_server

if TYPE_CHECKING:
    from tests.conftest import Registry

KEY = tag_for(hashlib.sha256(b"an entry").hexdigest())
OTHER_KEY = tag_for(hashlib.sha256(b"another entry").hexdigest())
DOC: dict[str, Any] = {"schema": 1, "files": {"kernel": "x"}, "name": "sampling", "n": [1, 2]}


@pytest.fixture(autouse=True)
def no_docker_login(
    tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No test reads the developer's docker credentials."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("DOCKER_CONFIG", raising=False)


def entry_files(where: Path, big: bytes = b"\x7fELF" + bytes(range(256)) * 4096) -> dict[str, Path]:
    where.mkdir(parents=True, exist_ok=True)
    (where / "kernel.so").write_bytes(big)  # ~1 MB
    (where / "0-sampling.o").write_bytes(b"small\n")
    return {"kernel.so": where / "kernel.so", "0-sampling.o": where / "0-sampling.o"}


def manifest_of(registry: Registry, tag: str) -> tuple[str, dict[str, Any]]:
    """The digest the registry reports for ``tag`` and the manifest it serves."""
    url = f"{registry.base}/v2/cudaenv/jit/manifests/{tag}"
    accept = {"Accept": oci.MANIFEST_MEDIA_TYPE}
    head = requests.head(url, headers=accept, timeout=5)
    got = requests.get(url, headers=accept, timeout=5)
    assert head.status_code == got.status_code == 200
    digest = head.headers["Docker-Content-Digest"]
    assert digest == "sha256:" + hashlib.sha256(got.content).hexdigest()
    return digest, got.json()


def blob_data(registry: Registry, digest: str) -> Path:
    hexdigest = digest.removeprefix("sha256:")
    return registry.root / "docker/registry/v2/blobs/sha256" / hexdigest[:2] / hexdigest / "data"


def push_raw(
    registry: Registry,
    tag: str,
    config: bytes,
    layers: list[tuple[str, bytes]],
    config_type: str = jit_remote.ENTRY_MEDIA_TYPE,
) -> None:
    """Push a manifest built by hand (what another, or a hostile, client could push)."""

    def blob(data: bytes) -> dict[str, Any]:
        digest = "sha256:" + hashlib.sha256(data).hexdigest()
        start = requests.post(f"{registry.base}/v2/cudaenv/jit/blobs/uploads/", timeout=5)
        assert start.status_code == 202
        location = start.headers["Location"]
        if location.startswith("/"):
            location = registry.base + location
        put = requests.put(location, params={"digest": digest}, data=data, timeout=5)
        assert put.status_code == 201, put.text
        return {"mediaType": jit_remote.FILE_MEDIA_TYPE, "digest": digest, "size": len(data)}

    descriptors = []
    for title, data in layers:
        descriptors.append({**blob(data), "annotations": {oci.TITLE: title}})
    manifest = {
        "schemaVersion": 2,
        "mediaType": oci.MANIFEST_MEDIA_TYPE,
        "config": {**blob(config), "mediaType": config_type},
        "layers": descriptors,
    }
    put = requests.put(
        f"{registry.base}/v2/cudaenv/jit/manifests/{tag}",
        data=json.dumps(manifest),
        headers={"Content-Type": oci.MANIFEST_MEDIA_TYPE},
        timeout=5,
    )
    assert put.status_code == 201, put.text


# --------------------------------------------------------------------------- entries


def test_publish_then_fetch_gives_back_the_doc_and_the_bytes(
    registry: Registry, tmp_path: Path
) -> None:
    remote = Remote.parse(registry.url)
    files = entry_files(tmp_path / "src")
    assert publish(remote, KEY, DOC, files) == "pushed"

    dest = tmp_path / "dest"
    dest.mkdir()
    got = fetch(remote, KEY, dest)
    assert got is not None
    doc, fetched = got
    assert doc == DOC
    assert sorted(fetched) == ["0-sampling.o", "kernel.so"]
    for name, path in fetched.items():
        assert path == dest / name
        assert path.read_bytes() == files[name].read_bytes()
    assert sorted(p.name for p in dest.iterdir()) == ["0-sampling.o", "kernel.so"]


def test_the_manifest_is_the_same_bytes_from_any_machine(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    remote = Remote.parse(registry.url)
    one = entry_files(tmp_path / "one")
    two = entry_files(tmp_path / "two")
    for path in two.values():
        os.utime(path, (1_000_000, 1_000_000))
    assert publish(remote, KEY, DOC, one) == "pushed"
    first, manifest = manifest_of(registry, KEY)
    # Another tag from other copies, the doc's keys in another order: the same manifest.
    reordered = dict(reversed(list(DOC.items())))
    assert publish(remote, OTHER_KEY, reordered, dict(reversed(list(two.items())))) == "pushed"
    assert manifest_of(registry, OTHER_KEY)[0] == first
    assert publish(remote, KEY, reordered, two) == "present"
    assert manifest_of(registry, KEY)[0] == first

    # Nothing in it varies: no annotations but each layer's title, layers by name.
    assert "annotations" not in manifest
    assert manifest["config"]["mediaType"] == jit_remote.ENTRY_MEDIA_TYPE
    assert [layer["annotations"] for layer in manifest["layers"]] == [
        {oci.TITLE: "0-sampling.o"},
        {oci.TITLE: "kernel.so"},
    ]

    # A third entry with the same files uploads only its config blob.
    sent: list[str] = []
    real = oci._TimeoutSession.request

    def spy(self: Any, method: str, url: Any, *args: Any, **kwargs: Any) -> requests.Response:
        sent.append(method)
        return real(self, method, url, *args, **kwargs)

    monkeypatch.setattr(oci._TimeoutSession, "request", spy)
    third = tag_for(hashlib.sha256(b"third").hexdigest())
    assert publish(remote, third, {**DOC, "n": 3}, two) == "pushed"
    assert sent.count("POST") == 1
    assert sent.count("PUT") == 2  # the config blob, the manifest


def test_a_tag_holding_other_content_is_never_overwritten(
    registry: Registry, tmp_path: Path
) -> None:
    remote = Remote.parse(registry.url)
    files = entry_files(tmp_path / "src")
    assert publish(remote, KEY, DOC, files) == "pushed"
    before = manifest_of(registry, KEY)[0]

    with pytest.raises(RemoteConflict) as caught:
        publish(remote, KEY, {**DOC, "n": 2}, files)
    assert caught.value.cause == "conflict"
    assert KEY in str(caught.value) and before in str(caught.value)
    changed = entry_files(tmp_path / "changed", big=b"other bytes")
    with pytest.raises(RemoteConflict):
        publish(remote, KEY, DOC, changed)

    assert manifest_of(registry, KEY)[0] == before
    dest = tmp_path / "dest"
    dest.mkdir()
    got = fetch(remote, KEY, dest)
    assert got is not None
    assert got[0] == DOC
    assert got[1]["kernel.so"].read_bytes() == files["kernel.so"].read_bytes()


def test_an_absent_tag_is_none(registry: Registry, tmp_path: Path) -> None:
    remote = Remote.parse(registry.url)
    # The repository does not exist yet (NAME_UNKNOWN), then it does but not the tag.
    assert fetch(remote, KEY, tmp_path) is None
    assert fetch_index(remote, "env-0") is None
    publish(remote, KEY, DOC, entry_files(tmp_path / "src"))
    dest = tmp_path / "dest"
    dest.mkdir()
    assert fetch(remote, OTHER_KEY, dest) is None
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize("change", ["same length", "shorter", "longer"])
def test_a_blob_changed_in_the_registry_is_refused(
    registry: Registry, tmp_path: Path, change: str
) -> None:
    remote = Remote.parse(registry.url)
    files = entry_files(tmp_path / "src")
    publish(remote, KEY, DOC, files)
    _, manifest = manifest_of(registry, KEY)
    layer = next(x for x in manifest["layers"] if x["annotations"][oci.TITLE] == "kernel.so")
    data = blob_data(registry, layer["digest"])
    original = data.read_bytes()
    edited = {
        "same length": original[:-1] + b"!",
        "shorter": original[:1000],
        "longer": original + b"tail",
    }[change]
    data.write_bytes(edited)

    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(RemoteBadContent) as caught:
        fetch(remote, KEY, dest)
    assert caught.value.cause == "bad-content"
    assert f"blob {layer['digest']} served other content" in str(caught.value)
    assert list(dest.iterdir()) == []  # nothing of the entry is left behind


def test_an_entry_over_the_size_limit_is_not_downloaded(registry: Registry, tmp_path: Path) -> None:
    remote = Remote.parse(registry.url)
    publish(remote, KEY, DOC, entry_files(tmp_path / "src"))
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(RemoteBadContent, match="larger than the limit of 100000 bytes"):
        fetch(remote, KEY, dest, max_bytes=100_000)
    assert list(dest.iterdir()) == []


@pytest.mark.parametrize(
    "titles",
    [["../x"], ["a/b"], ["."], [".."], [".hidden"], [""], ["dup", "dup"], ["nul\0byte"]],
)
def test_a_layer_title_that_is_not_a_plain_name_is_refused(
    registry: Registry, tmp_path: Path, titles: list[str]
) -> None:
    push_raw(
        registry, KEY, b"{}", [(title, f"data {i}".encode()) for i, title in enumerate(titles)]
    )
    dest = tmp_path / "dest"
    dest.mkdir()
    with pytest.raises(RemoteBadContent, match=f"manifest {KEY}:"):
        fetch(Remote.parse(registry.url), KEY, dest)
    assert list(dest.iterdir()) == []
    assert not (tmp_path / "x").exists()


def test_a_tag_holding_another_kind_of_artifact_is_refused(
    registry: Registry, tmp_path: Path
) -> None:
    push_raw(registry, KEY, b"{}", [], config_type="application/vnd.oci.image.config.v1+json")
    with pytest.raises(
        RemoteBadContent, match=re.escape("not 'application/vnd.cudaenv.jit-entry.v1+json'")
    ):
        fetch(Remote.parse(registry.url), KEY, tmp_path)
    push_raw(registry, OTHER_KEY, b"[1, 2]", [])
    with pytest.raises(RemoteBadContent, match="not a JSON object"):
        fetch(Remote.parse(registry.url), OTHER_KEY, tmp_path)


def test_a_tag_holding_an_image_index_is_seen_and_kept(registry: Registry, tmp_path: Path) -> None:
    remote = Remote.parse(registry.url)
    publish(remote, KEY, DOC, entry_files(tmp_path / "src"))
    raw = requests.get(
        f"{registry.base}/v2/cudaenv/jit/manifests/{KEY}",
        headers={"Accept": oci.MANIFEST_MEDIA_TYPE},
        timeout=5,
    ).content
    entry = {
        "mediaType": oci.MANIFEST_MEDIA_TYPE,
        "digest": "sha256:" + hashlib.sha256(raw).hexdigest(),
        "size": len(raw),
    }
    index = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.index.v1+json",
        "manifests": [entry],
    }
    put = requests.put(
        f"{registry.base}/v2/cudaenv/jit/manifests/{OTHER_KEY}",
        data=json.dumps(index),
        headers={"Content-Type": "application/vnd.oci.image.index.v1+json"},
        timeout=5,
    )
    assert put.status_code == 201, put.text
    with pytest.raises(RemoteBadContent, match="not an OCI image manifest"):
        fetch(remote, OTHER_KEY, tmp_path)
    with pytest.raises(RemoteConflict):
        publish(remote, OTHER_KEY, DOC, entry_files(tmp_path / "src"))


# --------------------------------------------------------------------------- indexes


def test_an_index_only_grows(registry: Registry) -> None:
    remote = Remote.parse(registry.url)
    keys = [hashlib.sha256(bytes([i])).hexdigest() for i in range(4)]
    assert publish_index(remote, "env-abc", [keys[2], keys[0]]) == "pushed"
    assert fetch_index(remote, "env-abc") == sorted([keys[0], keys[2]])
    assert publish_index(remote, "env-abc", [keys[0]]) == "present"
    assert publish_index(remote, "env-abc", [keys[1], keys[3]]) == "pushed"
    assert fetch_index(remote, "env-abc") == sorted(keys)
    assert publish_index(remote, "env-abc", reversed(keys)) == "present"
    # The same set from scratch under another tag: the same manifest.
    assert publish_index(remote, "env-def", keys) == "pushed"
    assert manifest_of(registry, "env-abc")[0] == manifest_of(registry, "env-def")[0]
    with pytest.raises(ValueError, match="not an entry key"):
        publish_index(remote, "env-abc", ["not-a-key"])


@pytest.mark.parametrize(
    "config",
    [b'{"keys": "abc"}', b'{"keys": ["ABC"]}', b'{"other": []}', b"[]", b"not json"],
)
def test_a_malformed_index_is_refused_and_kept(registry: Registry, config: bytes) -> None:
    remote = Remote.parse(registry.url)
    push_raw(registry, "env-bad", config, [], config_type=jit_remote.INDEX_MEDIA_TYPE)
    before = manifest_of(registry, "env-bad")[0]
    with pytest.raises(RemoteBadContent, match="env-bad"):
        fetch_index(remote, "env-bad")
    with pytest.raises(RemoteBadContent):
        publish_index(remote, "env-bad", [KEY])
    assert manifest_of(registry, "env-bad")[0] == before


def test_an_entry_is_not_an_index(registry: Registry, tmp_path: Path) -> None:
    remote = Remote.parse(registry.url)
    publish(remote, KEY, DOC, entry_files(tmp_path / "src"))
    with pytest.raises(RemoteBadContent, match="jit-entry"):
        fetch_index(remote, KEY)
    with pytest.raises(RemoteBadContent):
        publish_index(remote, KEY, [OTHER_KEY])


# --------------------------------------------------------------------------- failures


def test_a_stopped_registry_is_unreachable_at_once(registry: Registry, tmp_path: Path) -> None:
    remote = Remote.parse(registry.url)
    registry.stop()
    started = time.monotonic()
    with pytest.raises(RemoteUnreachable) as caught:
        fetch(remote, KEY, tmp_path, timeout=5)
    assert time.monotonic() - started < 2
    assert caught.value.cause == "unreachable"
    assert str(caught.value) == f"{registry.url}: unreachable (Connection refused)"
    with pytest.raises(RemoteUnreachable):
        publish(remote, KEY, DOC, entry_files(tmp_path / "src"), timeout=5)


@pytest.fixture
def silent_server() -> Iterator[int]:
    """A port that accepts connections and never answers."""
    with loopback_server(None) as port:
        yield port


@pytest.mark.slow
def test_a_registry_that_never_answers_times_out(silent_server: int, tmp_path: Path) -> None:
    remote = Remote.parse(f"oci://127.0.0.1:{silent_server}/cudaenv/jit")
    for call in (
        lambda: fetch(remote, KEY, tmp_path, timeout=1),
        lambda: publish(remote, KEY, DOC, entry_files(tmp_path / "src"), timeout=1),
        lambda: publish_index(remote, "env-1", [KEY], timeout=1),
    ):
        started = time.monotonic()
        with pytest.raises(RemoteTimeout) as caught:
            call()
        assert time.monotonic() - started < 2
        assert str(caught.value) == f"{remote.url}: timed out after 1s"


class Refusing(BaseHTTPRequestHandler):
    """Answers every request with ``status``; with ``challenge_first``, a request without
    credentials gets 401 and a Basic challenge first."""

    status = 401
    challenge_first = False
    seen: list[str | None]

    def answer(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        status = self.status
        if self.challenge_first and self.headers.get("Authorization") is None:
            status = 401
        self.send_response(status)
        self.send_header("WWW-Authenticate", "Basic realm=x")
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_GET = do_HEAD = do_POST = do_PUT = answer

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def refusing() -> Iterator[type[Refusing]]:
    handler = type("Handler", (Refusing,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    handler.port = server.server_address[1]  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("status", [401, 403])
def test_a_refusing_registry_says_so(refusing: type[Refusing], tmp_path: Path, status: int) -> None:
    refusing.status = status
    port = refusing.port  # type: ignore[attr-defined]
    remote = Remote.parse(f"oci://127.0.0.1:{port}/cudaenv/jit")
    for call in (
        lambda: fetch(remote, KEY, tmp_path, timeout=5),
        lambda: publish(remote, KEY, DOC, entry_files(tmp_path / "src"), timeout=5),
    ):
        with pytest.raises(RemoteRefused) as caught:
            call()
        assert caught.value.cause == "refused"
        assert caught.value.status == status
        message = str(caught.value)
        assert message.startswith(f"{remote.url}: refused: {status} ")
        assert ("docker login 127.0.0.1:" in message) == (status == 401)
        assert "\n" not in message
    assert all(seen is None for seen in refusing.seen)  # no credential, none sent


def test_credentials_come_from_the_docker_config_and_stay_out_of_messages(
    refusing: type[Refusing], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    refusing.status, refusing.challenge_first = 403, True
    port = refusing.port  # type: ignore[attr-defined]
    secret = base64.b64encode(b"builder:s3cret-pw").decode()
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(
        json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": secret}}})
    )
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    remote = Remote.parse(f"oci://127.0.0.1:{port}/cudaenv/jit")
    with pytest.raises(RemoteRefused) as caught:
        fetch(remote, KEY, tmp_path, timeout=5)
    assert caught.value.status == 403
    assert refusing.seen == [None, f"Basic {secret}"]
    assert secret not in str(caught.value) and "s3cret" not in str(caught.value)


def test_a_credential_helper_runs_through_proc(
    refusing: type[Refusing], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """docker's credsStore: ``docker-credential-NAME get`` is given the host on stdin and
    answers JSON. It is started through builder/core/proc.py (logged, bounded, die-with-parent),
    as every subprocess of cudaenv is."""
    from builder.core import proc

    refusing.status, refusing.challenge_first = 403, True
    port = refusing.port  # type: ignore[attr-defined]
    helpers = tmp_path / "bin"
    helper = helpers / "docker-credential-cudaenvtest"
    helpers.mkdir()
    helper.write_text(
        "#!/bin/sh\nread host\n"
        'echo "{\\"Username\\": \\"warmer\\", \\"Secret\\": \\"pw-for-$host\\"}"\n'
    )
    helper.chmod(0o755)
    monkeypatch.setenv("PATH", f"{helpers}:{os.environ['PATH']}")
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"credsStore": "cudaenvtest"}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    started: list[tuple[str, ...]] = []
    real_run = proc.run

    def recording(argv: Any, **kwargs: Any) -> proc.Completed:
        done = real_run(argv, **kwargs)
        started.append(done.argv)
        return done

    monkeypatch.setattr(proc, "run", recording)
    with pytest.raises(RemoteRefused):
        fetch(Remote.parse(f"oci://127.0.0.1:{port}/cudaenv/jit"), KEY, tmp_path, timeout=5)
    assert started == [("docker-credential-cudaenvtest", "get")]
    basic = base64.b64encode(f"warmer:pw-for-127.0.0.1:{port}".encode()).decode()
    assert refusing.seen == [None, f"Basic {basic}"]


class TokenRegistry(BaseHTTPRequestHandler):
    """A registry that wants a bearer token from its token endpoint (as Harbor, GHCR and
    Docker Hub do) and knows no tag."""

    seen: list[str]

    def do_GET(self) -> None:
        host = self.headers.get("Host")  # 127.0.0.1:PORT, as the client was told
        self.seen.append(f"{self.path} {self.headers.get('Authorization')}")
        if self.path.startswith("/token?"):
            body = json.dumps({"token": "tok-1"}).encode()
            self.send_response(200)
            self.send_header("Content-Type", "application/json")
        elif self.headers.get("Authorization") != "Bearer tok-1":
            body = b""
            self.send_response(401)
            self.send_header(
                "WWW-Authenticate",
                f'Bearer realm="http://{host}/token",service="reg",'
                'scope="repository:cudaenv/jit:pull"',
            )
        else:
            body = b'{"errors": [{"code": "MANIFEST_UNKNOWN"}]}'
            self.send_response(404)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_a_bearer_challenge_is_answered_with_a_token(tmp_path: Path) -> None:
    seen: list[str] = []
    handler = type("Handler", (TokenRegistry,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        remote = Remote.parse(f"oci://127.0.0.1:{server.server_address[1]}/cudaenv/jit")
        assert fetch(remote, KEY, tmp_path, timeout=5) is None
        assert fetch_index(remote, "env-1", timeout=5) is None
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [
        f"/v2/cudaenv/jit/manifests/{KEY} None",
        "/token?service=reg&scope=repository%3Acudaenv%2Fjit%3Apull None",
        f"/v2/cudaenv/jit/manifests/{KEY} Bearer tok-1",
        "/v2/cudaenv/jit/manifests/env-1 None",
        "/token?service=reg&scope=repository%3Acudaenv%2Fjit%3Apull None",
        "/v2/cudaenv/jit/manifests/env-1 Bearer tok-1",
    ]


def test_an_unreadable_docker_config_is_a_remote_error(registry: Registry, tmp_path: Path) -> None:
    (Path.home() / ".docker").mkdir()
    (Path.home() / ".docker" / "config.json").write_text('{"auths": {"x": {"auth": "c2VjcmV0"')
    with pytest.raises(RemoteError) as caught:
        fetch(Remote.parse(registry.url), KEY, tmp_path)
    assert str(caught.value) == (
        f"{registry.url}: the docker config cannot be read (JSONDecodeError)"
    )


def test_nothing_is_printed_or_logged(
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capfd: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    # A credential helper that is not installed: oras itself would warn about it.
    config = tmp_path / "docker"
    config.mkdir()
    (config / "config.json").write_text(json.dumps({"credsStore": "cudaenv-test-absent"}))
    monkeypatch.setenv("DOCKER_CONFIG", str(config))
    caplog.set_level(logging.DEBUG)
    remote = Remote.parse(registry.url)
    publish(remote, KEY, DOC, entry_files(tmp_path / "src"))
    dest = tmp_path / "dest"
    dest.mkdir()
    assert fetch(remote, KEY, dest) is not None
    registry.stop()
    with pytest.raises(RemoteError):
        fetch(remote, KEY, tmp_path / "none")
    assert capfd.readouterr() == ("", "")
    assert [r.name for r in caplog.records if r.name.startswith("oras")] == []


# --------------------------------------------------------------------------- the URL


@pytest.mark.parametrize(
    ("url", "host", "repository", "insecure"),
    [
        ("oci://127.0.0.1:5000/cudaenv/jit", "127.0.0.1:5000", "cudaenv/jit", True),
        ("oci://localhost/jit", "localhost", "jit", True),
        ("oci://127.8.9.10:80/a/b/c", "127.8.9.10:80", "a/b/c", True),
        ("oci://[::1]:5000/jit", "[::1]:5000", "jit", True),
        (
            "oci://registry.example.com/team.a/cudaenv-jit",
            "registry.example.com",
            "team.a/cudaenv-jit",
            False,
        ),
        (
            "oci://registry.example.com:5443/jit__x/y-z",
            "registry.example.com:5443",
            "jit__x/y-z",
            False,
        ),
        ("oci://10.0.0.1:5000/jit", "10.0.0.1:5000", "jit", False),
    ],
)
def test_remote_urls(url: str, host: str, repository: str, insecure: bool) -> None:
    remote = Remote.parse(url)
    assert (remote.url, remote.host, remote.repository, remote.insecure) == (
        url,
        host,
        repository,
        insecure,
    )


def test_plain_http_elsewhere_only_when_allowed() -> None:
    assert Remote.parse("oci://registry.lan:5000/jit", allow_http=True).insecure
    assert not Remote.parse("oci://registry.lan:5000/jit").insecure
    assert not Remote.parse("oci://localhost.example.com/jit").insecure


@pytest.mark.parametrize(
    ("url", "why"),
    [
        ("http://127.0.0.1:5000/jit", "not an oci://HOST[:PORT]/REPOSITORY URL"),
        ("127.0.0.1:5000/jit", "not an oci://HOST[:PORT]/REPOSITORY URL"),
        ("oci://127.0.0.1:5000", "no repository after the host"),
        ("oci://127.0.0.1:5000/", "no repository after the host"),
        ("oci://host/CudaEnv", "'CudaEnv' is not a repository name"),
        ("oci://host/cuda env", "'cuda env' is not a repository name"),
        ("oci://host/jit:latest", "'jit:latest' is not a repository name"),
        ("oci://host/jit/", "'jit/' is not a repository name"),
        ("oci://host//jit", "'/jit' is not a repository name"),
        ("oci://ho st/jit", "'ho st' is not a HOST[:PORT]"),
        ("oci://host:0/jit", "'host:0' is not a HOST[:PORT]"),
        ("oci://host:99999/jit", "'host:99999' is not a HOST[:PORT]"),
        ("oci://[::1/jit", "'[::1' is not a HOST[:PORT]"),
        ("oci://[nothost]:5000/jit", "'[nothost]:5000' is not a HOST[:PORT]"),
    ],
)
def test_bad_remote_urls(url: str, why: str) -> None:
    with pytest.raises(RemoteError) as caught:
        Remote.parse(url)
    assert str(caught.value).startswith(f"CUDAENV_JIT_REMOTE={url}: {why}")
    assert caught.value.cause == "invalid"


def test_a_password_in_the_url_is_not_repeated() -> None:
    with pytest.raises(RemoteError) as caught:
        Remote.parse("oci://user:s3cret@host:5000/jit")
    assert str(caught.value) == (
        "CUDAENV_JIT_REMOTE=oci://***@host:5000/jit: credentials do not belong in the URL "
        "(log in with `docker login HOST`)"
    )


def test_tags() -> None:
    key = hashlib.sha256(b"k").hexdigest()
    assert tag_for(key) == key
    for bad in (key.upper(), key[:-1], key + "0", "", "../" + key[3:]):
        with pytest.raises(ValueError, match="not an entry key"):
            tag_for(bad)
    with pytest.raises(ValueError, match="not an OCI tag"):
        fetch_index(Remote.parse("oci://127.0.0.1:9/jit"), "-bad")


class PathOnlyLocation(BaseHTTPRequestHandler):
    """A registry that answers a blob upload with a Location of a path alone (no scheme or
    host), which the distribution spec allows."""

    seen: list[str]

    def do_HEAD(self) -> None:
        self.seen.append(f"HEAD {self.path}")
        self.send_response(404)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_POST(self) -> None:
        self.seen.append(f"POST {self.path}")
        self.send_response(202)
        self.send_header("Location", "/v2/cudaenv/jit/blobs/uploads/u-1?state=s")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_PUT(self) -> None:
        length = int(self.headers.get("Content-Length", "0"))
        self.seen.append(f"PUT {self.path} {self.rfile.read(length)!r}")
        self.send_response(201)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, format: str, *args: Any) -> None:
        pass


def test_an_upload_location_of_a_path_alone_is_on_the_same_registry() -> None:
    seen: list[str] = []
    handler = type("Handler", (PathOnlyLocation,), {"seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    data = b"blob"
    digest = oci.sha256_digest(data)
    try:
        remote = Remote.parse(f"oci://127.0.0.1:{server.server_address[1]}/cudaenv/jit")
        oci.Client(remote, timeout=5).upload(digest, len(data), data)
    finally:
        server.shutdown()
        server.server_close()
    assert seen == [
        f"HEAD /v2/cudaenv/jit/blobs/{digest}",
        "POST /v2/cudaenv/jit/blobs/uploads/",
        f"PUT /v2/cudaenv/jit/blobs/uploads/u-1?state=s&digest={digest.replace(':', '%3A')} b'blob'",
    ]


def test_the_client_does_not_import_oras_provider() -> None:
    """The client's import is paid by a node's build while uv installs beside it: oras's
    provider module is not needed and pulls in jsonschema (~40% of that import)."""
    import subprocess
    import sys

    code = "import sys, builder.jit.oci; print(sorted({'oras.provider', 'jsonschema'} & set(sys.modules)))"
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
