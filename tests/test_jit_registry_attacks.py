"""The store's registry tier under attack: each case a red team tried against it, as a test.

A registry that trickles one byte every 0.2 s (a slow loris), one that sends the client to
plain http on another machine (a redirect, a token realm) with credentials in hand, and one
that serves a self-consistent entry it made itself (a shell script where a kernel belongs, or
a real kernel no trusted warmer built). The first two must end fast with a RemoteError, the
third must never be placed, or, where nodes require signatures, never be taken at all.

Real registries (Debian's docker-registry on loopback, tiny HTTP servers written here), real
ssh-keygen signatures; the compiler is the stand-in nvcc of test_kernel_compile.
"""

from __future__ import annotations

import base64
import hashlib
import json
import shutil
import subprocess
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest

from builder import store as jit_store
from builder.jit import oci
from builder.jit import remote as jit_remote
from builder.jit.oci import Remote, RemoteInsecure, RemoteTimeout
from builder.jit.remote import fetch, publish, tag_for
from builder.machine import archs
from builder.verify import kernel_compile
from tests.conftest import Registry
from tests.helpers import write
from tests.test_kernel_compile import env_with, make_toolkit

ARCH = archs.Arch.parse("12.0f")
KEY = tag_for(hashlib.sha256(b"an entry").hexdigest())
FIXTURES = Path(__file__).parent / "data" / "fatbin"
# A real nvcc object holding an sm_120 cubin: a kernel, but not the one asked for.
FOREIGN_KERNEL = FIXTURES / "family.o"
TEST_NET = "203.0.113.1"  # RFC 5737: never routed; any attempt to reach it would hang


@pytest.fixture(autouse=True)
def no_docker_login(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """No test reads the developer's docker credentials or signing settings."""
    home = tmp_path / "home"
    home.mkdir()
    monkeypatch.setenv("HOME", str(home))
    for var in ("DOCKER_CONFIG", "CUDAENV_JIT_REMOTE_TIMEOUT", "CUDAENV_JIT_REMOTE_INSECURE",
                "CUDAENV_JIT_SIGNING_KEY", "CUDAENV_JIT_ALLOWED_SIGNERS",
                "CUDAENV_JIT_REQUIRE_SIGNED"):  # fmt: skip
        monkeypatch.delenv(var, raising=False)


def node(
    tmp_path: Path, name: str, remote: str, *, push: bool = False
) -> kernel_compile.KernelBuild:
    """One machine: its own store (CUDAENV_JIT_STORE must name it) and env, the remote."""
    env = env_with(tmp_path, "gcc 12.2.0", CUDAENV_JIT_REMOTE=remote)
    if push:
        env["CUDAENV_JIT_PUSH"] = "1"
    home = make_toolkit(tmp_path / name / "cuda-home")
    return kernel_compile.build_kernel(
        home / "bin" / "nvcc", ARCH, tmp_path / name / "work", env=env, owner=name
    )


def compiled(tmp_path: Path, name: str) -> bool:
    return (tmp_path / name / "cuda-home" / "bin" / "calls").exists()


def on_node(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, name: str) -> jit_store.Store:
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / f"store-{name}"))
    return jit_store.Store(tmp_path / f"store-{name}")


def honest_entry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> jit_store.Entry:
    """What the kernel's entry is (its key, its inputs) on any node of this toolchain: an
    attacker can compute it as well as a node can."""
    store = on_node(monkeypatch, tmp_path, "attacker")
    assert node(tmp_path, "attacker", "off").error is None
    ((key, variant),) = store.all()
    return store.load(key, variant)


def forge(registry: Registry, entry: jit_store.Entry, kernel: Path) -> None:
    """Push, with push rights, a self-consistent entry for ``entry``'s key whose kernel is
    ``kernel``: its record gives that file's true size and sha256."""
    data = kernel.read_bytes()
    content = {**entry.content, "files": {"kernel": {
        "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}  # fmt: skip
    assert publish(Remote.parse(registry.url), entry.key, content, {"kernel": kernel}) == "pushed"


# --------------------------------------------------------------------------- servers


class Scripted(BaseHTTPRequestHandler):
    """Serves an entry (``manifest`` for every tag, ``blobs`` by digest) the way ``slow``
    says: "headers" trickles the status line and headers of the manifest, "manifest" its
    body, "blob" the body of each layer; one byte every 0.2 s, until the client leaves."""

    protocol_version = "HTTP/1.1"
    slow = ""
    manifest = b""
    blobs: dict[str, bytes]
    stop: threading.Event

    def trickle(self, data: bytes) -> None:
        for i in range(len(data)):
            if self.stop.wait(0.2):
                return
            try:
                self.wfile.write(data[i : i + 1])
                self.wfile.flush()
            except OSError:
                return

    def do_GET(self) -> None:
        if "/manifests/" in self.path:
            body, slow_head, slow_body = (
                self.manifest,
                self.slow == "headers",
                self.slow == "manifest",
            )
            kind = oci.MANIFEST_MEDIA_TYPE
        elif "/blobs/" in self.path and self.path.rsplit("/", 1)[1] in self.blobs:
            digest = self.path.rsplit("/", 1)[1]
            body, slow_head = self.blobs[digest], False
            slow_body = self.slow == "blob" and len(body) > 100
            kind = "application/octet-stream"
        else:
            self.send_response(404)
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        head = (
            f"HTTP/1.1 200 OK\r\nContent-Type: {kind}\r\nX-Padding: {'p' * 400}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        if slow_head:
            self.trickle(head)
            return
        self.wfile.write(head)
        self.wfile.flush()
        if slow_body:
            self.trickle(body)
        else:
            self.wfile.write(body)

    def log_message(self, format: str, *args: Any) -> None:
        pass


def blob(data: bytes) -> dict[str, Any]:
    return {"mediaType": jit_remote.FILE_MEDIA_TYPE, "size": len(data),
            "digest": "sha256:" + hashlib.sha256(data).hexdigest()}  # fmt: skip


@pytest.fixture
def scripted() -> Iterator[tuple[type[Scripted], str]]:
    """A registry serving one entry (a doc and a 4 KiB kernel) for any tag, as scripted."""
    doc = json.dumps({"files": {}}).encode()
    kernel = b"\x7fELF" + bytes(4092)
    config = {**blob(doc), "mediaType": jit_remote.ENTRY_MEDIA_TYPE}
    layer = {**blob(kernel), "annotations": {oci.TITLE: "kernel"}}
    manifest = {"schemaVersion": 2, "mediaType": oci.MANIFEST_MEDIA_TYPE,
                "config": config, "layers": [layer]}  # fmt: skip
    handler: type[Scripted] = type("Handler", (Scripted,), {
        "manifest": json.dumps(manifest).encode() + b" " * 200, "stop": threading.Event(),
        "blobs": {config["digest"]: doc, layer["digest"]: kernel}})  # fmt: skip
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield handler, f"oci://127.0.0.1:{server.server_address[1]}/cudaenv/jit"
    finally:
        handler.stop.set()
        server.shutdown()
        server.server_close()


# --------------------------------------------------------------------------- a slow loris


@pytest.mark.slow
@pytest.mark.parametrize(("slow", "bound"), [("headers", 6.5), ("manifest", 6.5), ("blob", 2.5)])
def test_a_slow_loris_registry_is_cut_off_at_the_transfer_deadline(
    scripted: tuple[type[Scripted], str], tmp_path: Path, slow: str, bound: float
) -> None:
    """Each read gets a byte within 0.2 s, far inside the 1 s timeout: only a deadline on the
    whole transfer (1 s, plus 1 s per MiB it may carry: 4 MiB for a manifest) ends it."""
    handler, url = scripted
    handler.slow = slow
    dest = tmp_path / "dest"
    dest.mkdir()
    started = time.monotonic()
    with pytest.raises(RemoteTimeout) as caught:
        fetch(Remote.parse(url), KEY, dest, timeout=1)
    assert time.monotonic() - started < bound
    assert "was not over after" in str(caught.value)
    assert list(dest.iterdir()) == []  # the partial kernel is gone


@pytest.mark.slow
def test_a_slow_loris_proxy_is_cut_off_too(
    scripted: tuple[type[Scripted], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The connection to an http proxy (HTTP_PROXY) is the one that trickles."""
    handler, url = scripted
    handler.slow = "manifest"
    for var in ("NO_PROXY", "no_proxy", "HTTPS_PROXY", "https_proxy", "ALL_PROXY", "all_proxy"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HTTP_PROXY", "http://" + url.removeprefix("oci://").split("/")[0])
    started = time.monotonic()
    with pytest.raises(RemoteTimeout):
        fetch(Remote.parse("oci://127.0.0.2:9/cudaenv/jit"), KEY, tmp_path, timeout=1)
    assert time.monotonic() - started < 6.5


@pytest.mark.slow
def test_a_slow_loris_costs_a_verify_seconds_and_the_key_lock_is_free(
    scripted: tuple[type[Scripted], str], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    handler, url = scripted
    handler.slow = "blob"
    monkeypatch.setenv("CUDAENV_JIT_REMOTE_TIMEOUT", "1")
    store = on_node(monkeypatch, tmp_path, "B")
    started = time.monotonic()
    b = node(tmp_path, "B", url)
    assert time.monotonic() - started < 5
    assert b.error is None and compiled(tmp_path, "B")
    assert len(b.notes) == 1 and "was not over after" in b.notes[0]
    ((key, _),) = store.all()
    store.acquire(key, timeout=0).release()


# --------------------------------------------------------------------------- plain http


class Sending(BaseHTTPRequestHandler):
    """Sends every request elsewhere: a redirect (``redirect``) or a Bearer challenge whose
    token realm is ``realm``; records the Authorization header of each request."""

    redirect = ""
    realm = ""
    seen: list[str | None]

    def do_GET(self) -> None:
        self.seen.append(self.headers.get("Authorization"))
        if self.redirect:
            self.send_response(307)
            self.send_header("Location", self.redirect)
        else:
            self.send_response(401)
            self.send_header("WWW-Authenticate", f'Bearer realm="{self.realm}",service="reg"')
        self.send_header("Content-Length", "0")
        self.end_headers()

    do_HEAD = do_GET

    def log_message(self, format: str, *args: Any) -> None:
        pass


@pytest.fixture
def sending(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[type[Sending]]:
    """The server, and docker credentials for it in $DOCKER_CONFIG."""
    handler = type("Handler", (Sending,), {"seen": []})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    port = server.server_address[1]
    handler.url = f"oci://127.0.0.1:{port}/cudaenv/jit"  # type: ignore[attr-defined]
    secret = base64.b64encode(b"warmer:s3cret-pw").decode()
    config = write(tmp_path / "docker" / "config.json",
                   json.dumps({"auths": {f"127.0.0.1:{port}": {"auth": secret}}}))  # fmt: skip
    monkeypatch.setenv("DOCKER_CONFIG", str(config.parent))
    thread = threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield handler
    finally:
        server.shutdown()
        server.server_close()


@pytest.mark.parametrize("how", ["redirect", "realm"])
def test_plain_http_to_another_machine_is_refused_before_connecting(
    sending: type[Sending], tmp_path: Path, how: str
) -> None:
    """The loopback registry may speak plain http; where it sends the client may not. Were
    the request made, connecting to TEST-NET would hang until the 5 s timeout."""
    elsewhere = f"http://{TEST_NET}/v2/token"
    if how == "redirect":
        sending.redirect = elsewhere
    else:
        sending.realm = elsewhere
    remote = Remote.parse(sending.url)  # type: ignore[attr-defined]
    assert remote.insecure and not remote.allow_http
    started = time.monotonic()
    with pytest.raises(RemoteInsecure) as caught:
        fetch(remote, KEY, tmp_path, timeout=5)
    assert time.monotonic() - started < 2
    assert caught.value.cause == "insecure"
    assert f"http://{TEST_NET}" in str(caught.value) and "in clear" in str(caught.value)
    assert "s3cret" not in str(caught.value)
    assert sending.seen == [None]  # one request, to the loopback registry, without credentials


def test_plain_http_on_this_machine_is_followed(sending: type[Sending], tmp_path: Path) -> None:
    """The control: a redirect to another port of loopback is followed (a registry and its
    blob store on one machine)."""
    with socket_port() as port:
        sending.redirect = f"http://localhost:{port}/v2/blob"
        with pytest.raises(oci.RemoteUnreachable):
            fetch(Remote.parse(sending.url), KEY, tmp_path, timeout=5)  # type: ignore[attr-defined]


class socket_port:
    """A loopback port nothing listens on."""

    def __enter__(self) -> int:
        import socket

        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            return int(probe.getsockname()[1])

    def __exit__(self, *exc: object) -> None:
        pass


# --------------------------------------------------------------------------- a forged entry


def test_a_forged_entry_that_is_no_kernel_is_discarded_not_placed(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 39-byte shell script, self-consistent (its record gives its true size and sha256),
    pushed under the kernel's key: it is imported, fails the placed kernel's own check,
    is discarded, and the kernel is compiled; nothing of it stays on the node."""
    entry = honest_entry(tmp_path, monkeypatch)
    script = write(tmp_path / "evil", "#!/bin/sh\necho owned > /tmp/owned-by-x\n")
    script.chmod(0o755)
    assert script.stat().st_size == 39
    forge(registry, entry, script)
    store = on_node(monkeypatch, tmp_path, "B")
    b = node(tmp_path, "B", registry.url)
    assert b.error is None and not b.reused and compiled(tmp_path, "B")
    assert b.path.read_bytes() != script.read_bytes()
    assert any("its kernel is not an ELF file" in n for n in b.notes), b.notes
    # What the node keeps is its own compile, which a run with the remote off reuses.
    ((key, variant),) = store.all()
    assert store.load(key, variant).files["kernel"].size != 39
    c = node(tmp_path, "C", "off")
    assert c.reused and c.path.read_bytes() == b.path.read_bytes()


def test_store_verify_finds_a_forged_entry_store_pull_took(
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """`store pull` adds entries without placing them; `store verify` said the forged one
    was "as recorded". It checks a kernel entry's kernel too, and removes it."""
    from builder.cli import main as cli
    from builder.jit import share as jit_share

    entry = honest_entry(tmp_path, monkeypatch)
    script = write(tmp_path / "evil", "#!/bin/sh\necho owned > /tmp/owned-by-x\n")
    forge(registry, entry, script)
    remote = jit_share.parse(registry.url)
    assert jit_remote.publish_index(remote, "env-x", [entry.key]) == "pushed"
    store = on_node(monkeypatch, tmp_path, "B")
    assert jit_share.pull_env(store, remote, "env-x") == (1, [])
    capsys.readouterr()
    assert cli.main(["store", "verify"]) == 5
    out = capsys.readouterr().out
    assert "its kernel is not an ELF file" in out and "discarded the store entry" in out
    assert store.all() == []
    # The honest one passes.
    monkeypatch.setenv("CUDAENV_JIT_STORE", str(tmp_path / "store-attacker"))
    assert cli.main(["store", "verify"]) == 0


# --------------------------------------------------------------------------- signatures


@pytest.fixture
def keys(tmp_path: Path) -> dict[str, Path]:
    """A warmer's key and an attacker's, and an allowed-signers file naming the warmer."""
    if shutil.which("ssh-keygen") is None:
        pytest.skip("ssh-keygen is not installed (apt install openssh-client)")
    made = {}
    for who in ("warmer", "attacker"):
        key = tmp_path / "keys" / who
        key.parent.mkdir(exist_ok=True)
        subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-C", who, "-f", key],
                       check=True)  # fmt: skip
        made[who] = key
    public = (tmp_path / "keys" / "warmer.pub").read_text().strip()
    made["allowed"] = write(
        tmp_path / "keys" / "allowed_signers", f'warmer@ci namespaces="cudaenv-jit" {public}\n'
    )
    return made


def test_a_node_takes_what_a_trusted_warmer_signed(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, Path]
) -> None:
    on_node(monkeypatch, tmp_path, "A")
    monkeypatch.setenv("CUDAENV_JIT_SIGNING_KEY", str(keys["warmer"]))
    a = node(tmp_path, "A", registry.url, push=True)
    assert a.error is None and not a.notes, a.notes
    monkeypatch.delenv("CUDAENV_JIT_SIGNING_KEY")
    on_node(monkeypatch, tmp_path, "B")
    monkeypatch.setenv("CUDAENV_JIT_ALLOWED_SIGNERS", str(keys["allowed"]))
    b = node(tmp_path, "B", registry.url)
    assert b.reused and not compiled(tmp_path, "B") and not b.notes, b.notes
    assert b.path.read_bytes() == a.path.read_bytes()


@pytest.mark.parametrize("signer", [None, "attacker"])
def test_a_real_kernel_no_trusted_warmer_signed_is_refused(
    registry: Registry,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    keys: dict[str, Path],
    signer: str | None,
) -> None:
    """A kernel that passes every check of its content (an ELF file holding an sm_120 cubin,
    self-consistent) but was not built by a trusted warmer: unsigned, or signed by a key the
    node does not trust. Refused with the reason; the node compiles its own."""
    entry = honest_entry(tmp_path, monkeypatch)
    forge(registry, entry, FOREIGN_KERNEL)
    if signer is not None:
        monkeypatch.setenv("CUDAENV_JIT_SIGNING_KEY", str(keys[signer]))
        store = on_node(monkeypatch, tmp_path, "attacker")
        ((key, variant),) = store.all()
        forged = store.load(key, variant)
        # The attacker signs the forged statement with its own key.
        from builder.jit import signing as jit_signing

        data = FOREIGN_KERNEL.read_bytes()
        content = {**forged.content, "files": {"kernel": {
            "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}}}  # fmt: skip
        signature = jit_signing.sign(keys[signer], jit_signing.statement(key, content))
        jit_remote.publish_signature(Remote.parse(registry.url), key, signature)
        monkeypatch.delenv("CUDAENV_JIT_SIGNING_KEY")
    # Without a signature policy the forged kernel is taken: push rights are the boundary.
    on_node(monkeypatch, tmp_path, "open")
    assert node(tmp_path, "open", registry.url).reused
    store = on_node(monkeypatch, tmp_path, "B")
    monkeypatch.setenv("CUDAENV_JIT_ALLOWED_SIGNERS", str(keys["allowed"]))
    b = node(tmp_path, "B", registry.url)
    assert b.error is None and not b.reused and compiled(tmp_path, "B")
    assert b.path.read_bytes() != FOREIGN_KERNEL.read_bytes()
    (note,) = b.notes
    why = (
        "it is not signed"
        if signer is None
        else f"none of its 1 signature(s) is by a signer {keys['allowed']} allows for cudaenv-jit"
    )
    assert "CUDAENV_JIT_ALLOWED_SIGNERS requires a trusted signature and " + why in note
    assert all(
        store.load(k, v).files["kernel"].size != FOREIGN_KERNEL.stat().st_size
        for k, v in store.all()
    )


def test_signatures_required_without_a_signers_file_take_nothing(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    on_node(monkeypatch, tmp_path, "A")
    assert node(tmp_path, "A", registry.url, push=True).error is None
    on_node(monkeypatch, tmp_path, "B")
    monkeypatch.setenv("CUDAENV_JIT_REQUIRE_SIGNED", "1")
    b = node(tmp_path, "B", registry.url)
    assert not b.reused and compiled(tmp_path, "B")
    (note,) = b.notes
    assert "CUDAENV_JIT_REQUIRE_SIGNED=1 and no CUDAENV_JIT_ALLOWED_SIGNERS" in note


def test_a_signers_file_others_can_write_is_not_read(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, Path]
) -> None:
    on_node(monkeypatch, tmp_path, "A")
    monkeypatch.setenv("CUDAENV_JIT_SIGNING_KEY", str(keys["warmer"]))
    assert node(tmp_path, "A", registry.url, push=True).error is None
    monkeypatch.delenv("CUDAENV_JIT_SIGNING_KEY")
    keys["allowed"].chmod(0o666)
    on_node(monkeypatch, tmp_path, "B")
    monkeypatch.setenv("CUDAENV_JIT_ALLOWED_SIGNERS", str(keys["allowed"]))
    b = node(tmp_path, "B", registry.url)
    assert not b.reused and compiled(tmp_path, "B")
    (note,) = b.notes
    assert "can be written by other users (mode 0666)" in note


def test_a_warmer_that_cannot_sign_pushes_nothing(
    registry: Registry, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys: dict[str, Path]
) -> None:
    store = on_node(monkeypatch, tmp_path, "A")
    monkeypatch.setenv("CUDAENV_JIT_SIGNING_KEY", str(tmp_path / "no-such-key"))
    a = node(tmp_path, "A", registry.url, push=True)
    assert a.error is None
    (note,) = a.notes
    assert "CUDAENV_JIT_SIGNING_KEY=" in note and "could not sign" in note
    ((key, _),) = store.all()
    assert fetch(Remote.parse(registry.url), key, tmp_path) is None
