"""An OCI registry as the remote tier of the JIT store: one entry is one artifact.

Clusters already run a container registry (distribution, Harbor, Artifactory, a cloud's own),
with its auth, quotas, replication and garbage collection; machines that build the same envs
can share compiled JIT results through it instead of through a new service. An entry of the
local store (a JSON content doc plus named files) travels as an OCI artifact: the doc is the
config blob, each file a layer titled with its name, the whole tagged with the entry's key.
What is fetched is checked to be what the manifest says: every blob is hashed while it
streams to disk and checked against its descriptor's digest and size, names are checked to be
plain file names, and the total is bounded, so a corrupt registry, or one that changes a blob,
yields a RemoteError; the local store checks each file again against the doc when it places
it. What these checks cannot tell is who made an entry: a self-consistent entry (a doc whose
records match its files) pushed by anyone with push rights to the repository passes them
all. So the trust boundary is the repository's push rights, or, on nodes that require them,
signatures by a key the node trusts (``builder/jit/signing.py``). The registry protocol
itself, with its timeouts, credentials and errors, is ``builder/jit/oci.py``'s.

Manifests are built here byte for byte (canonical JSON, layers sorted by name, no time or
host in them), so two machines that publish the same entry produce the same manifest digest:
a tag that already holds it is left alone ("present"), and one that holds anything else is
never overwritten (RemoteConflict).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Callable, Iterable, Mapping
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder.jit.oci import (
    CHUNK,
    DIGEST,
    MANIFEST_MEDIA_TYPE,
    TITLE,
    Client,
    Descriptor,
    Remote,
    RemoteBadContent,
    RemoteConflict,
    RemoteError,
    remote_errors,
    sha256_digest,
)

ENTRY_MEDIA_TYPE = "application/vnd.cudaenv.jit-entry.v1+json"
INDEX_MEDIA_TYPE = "application/vnd.cudaenv.jit-index.v1+json"
SIGNATURES_MEDIA_TYPE = "application/vnd.cudaenv.jit-signatures.v1+json"
PLAN_MEDIA_TYPE = "application/vnd.cudaenv.jit-plan.v1+json"
FILE_MEDIA_TYPE = "application/octet-stream"

# A config is a JSON document; one larger than this is not ours.
MAX_CONFIG_BYTES = 64 << 20

# The distribution spec's grammar: a tag is at most 128 characters of a restricted set.
_TAG = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_KEY = re.compile(r"[0-9a-f]{64}")


# --------------------------------------------------------------------------- tags


def tag_for(key: str) -> str:
    """The tag of the entry ``key`` (a sha256 in 64 lower-case hex digits): the key itself,
    which the tag grammar admits, so a registry's tag list reads as the store's keys."""
    if not _KEY.fullmatch(key):
        raise ValueError(f"{key!r} is not an entry key (64 lower-case hex digits)")
    return key


# --------------------------------------------------------------------------- manifests


def _canonical(doc: Any) -> bytes:
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def _manifest(config: Descriptor, layers: list[Descriptor]) -> bytes:
    """The manifest, byte for byte the same for the same config and layers on any machine."""
    return _canonical(
        {
            "schemaVersion": 2,
            "mediaType": MANIFEST_MEDIA_TYPE,
            "artifactType": config.media_type,
            "config": config.to_json(),
            "layers": [layer.to_json() for layer in sorted(layers, key=lambda d: d.title or "")],
        }
    )


def safe_name(name: object) -> bool:
    """Whether ``name`` can be a file of an entry: one plain path component."""
    return (
        isinstance(name, str)
        and name != ""
        and not name.startswith(".")
        and "/" not in name
        and "\\" not in name
        and "\0" not in name
        and len(name.encode("utf-8", "surrogatepass")) <= 255
    )


def _parse_manifest(
    remote: Remote, raw: bytes, tag: str, config_type: str
) -> tuple[Descriptor, list[Descriptor]]:
    def bad(why: str) -> RemoteBadContent:
        return RemoteBadContent(f"{remote.url}: manifest {tag}: {why}")

    try:
        doc = json.loads(raw)
    except ValueError:
        raise bad("not JSON") from None
    if not isinstance(doc, dict) or doc.get("schemaVersion") != 2:
        raise bad("not an OCI image manifest (schemaVersion 2)")
    if doc.get("mediaType", MANIFEST_MEDIA_TYPE) != MANIFEST_MEDIA_TYPE:
        raise bad(f"media type {doc.get('mediaType')!r}, not an OCI image manifest")
    config = _descriptor(doc.get("config"), bad)
    if config.media_type != config_type:
        raise bad(f"holds a {config.media_type!r} artifact, not {config_type!r}")
    layers_doc = doc.get("layers")
    if not isinstance(layers_doc, list):
        raise bad("no layer list")
    layers = []
    names: set[str] = set()
    for item in layers_doc:
        layer = _descriptor(item, bad)
        if layer.media_type != FILE_MEDIA_TYPE:
            raise bad(f"layer {layer.digest} has media type {layer.media_type!r}")
        if not safe_name(layer.title):
            raise bad(f"layer {layer.digest} is titled {layer.title!r}, not a plain file name")
        assert layer.title is not None
        if layer.title in names:
            raise bad(f"two layers are titled {layer.title!r}")
        names.add(layer.title)
        layers.append(layer)
    return config, layers


def _descriptor(item: object, bad: Callable[[str], RemoteBadContent]) -> Descriptor:
    if not isinstance(item, dict):
        raise bad("a descriptor is not a JSON object")
    media_type, digest, size = item.get("mediaType"), item.get("digest"), item.get("size")
    if not isinstance(media_type, str):
        raise bad("a descriptor has no media type")
    if not isinstance(digest, str) or not DIGEST.fullmatch(digest):
        raise bad(f"digest {digest!r} is not a sha256 digest")
    if isinstance(size, bool) or not isinstance(size, int) or size < 0:
        raise bad(f"blob {digest} has size {size!r}")
    annotations = item.get("annotations") or {}
    title = annotations.get(TITLE) if isinstance(annotations, dict) else None
    return Descriptor(media_type, digest, size, title if isinstance(title, str) else None)


def _check_tag(tag: str) -> None:
    if not _TAG.fullmatch(tag):
        raise ValueError(f"{tag!r} is not an OCI tag")


def _fetch_config(
    client: Client, remote: Remote, tag: str, config_type: str, budget: list[int]
) -> tuple[Any, list[Descriptor]] | None:
    """The tag's config (parsed JSON) and its layers; None when there is no such tag."""
    raw = client.manifest(tag)
    if raw is None:
        return None
    config, layers = _parse_manifest(remote, raw, tag, config_type)
    if config.size > MAX_CONFIG_BYTES:
        raise RemoteBadContent(f"{remote.url}: manifest {tag}: the config is {config.size} bytes")
    if config.size + sum(layer.size for layer in layers) > budget[0]:
        raise RemoteBadContent(f"{remote.url}: {tag} is larger than the limit of {budget[0]} bytes")
    sink = _Buffer()
    client.download(config, sink, budget)
    try:
        return json.loads(bytes(sink.data)), layers
    except ValueError:
        raise RemoteBadContent(f"{remote.url}: the config of {tag} is not JSON") from None


class _Buffer:
    def __init__(self) -> None:
        self.data = bytearray()

    def write(self, chunk: bytes) -> int:
        self.data += chunk
        return len(chunk)


# --------------------------------------------------------------------------- entries


def fetch(
    remote: Remote,
    tag: str,
    dest: Path,
    *,
    timeout: float = 30.0,
    max_bytes: int = 4 << 30,
    check: Callable[[dict[str, Any]], None] | None = None,
) -> tuple[dict[str, Any], dict[str, Path]] | None:
    """The entry tagged ``tag``: its content doc, and its files downloaded into ``dest`` (a
    fresh private directory the caller made), by name. None when the registry has no such
    tag. Every blob is streamed to disk while hashed, and checked against its descriptor's
    digest and size; the config and layers together are bounded by ``max_bytes``; each file
    name (a layer's title) must be one plain path component, and unique. Anything else is a
    RemoteError, after the files written so far are removed (an OSError writing into
    ``dest`` is raised as it is). ``timeout`` bounds each wait on the registry (connecting,
    and each read); each transfer must be over after ``timeout`` plus 1 s per MiB. ``check``
    reads what the entry claims (its content doc) before any of its files is downloaded, and
    raises to refuse it: a junk entry costs its small config, not its blobs."""
    _check_tag(tag)
    written: list[Path] = []
    try:
        with remote_errors(remote, timeout):
            client = Client(remote, timeout)
            budget = [max_bytes]
            found = _fetch_config(client, remote, tag, ENTRY_MEDIA_TYPE, budget)
            if found is None:
                return None
            doc, layers = found
            if not isinstance(doc, dict):
                raise RemoteBadContent(f"{remote.url}: the config of {tag} is not a JSON object")
            if check is not None:
                check(doc)
            files: dict[str, Path] = {}
            for layer in layers:
                assert layer.title is not None  # _parse_manifest checked it
                path = dest / layer.title
                # "x": a name already there (or a link planted there) is never written through.
                with path.open("xb") as sink:
                    written.append(path)
                    client.download(layer, sink, budget)
                files[layer.title] = path
            return doc, files
    except BaseException:
        for path in written:
            with suppress(OSError):
                path.unlink()
        raise


def publish(
    remote: Remote,
    tag: str,
    doc: Mapping[str, Any],
    files: Mapping[str, Path],
    *,
    timeout: float = 30.0,
) -> str:
    """Push the entry under ``tag``: "pushed", or "present" when the tag already holds
    exactly this manifest. RemoteConflict when it holds another: an existing tag is never
    overwritten. The manifest is deterministic (the config is the canonical JSON of ``doc``,
    layers sorted by name with only their title, no time in it), so two machines publishing
    the same doc and file bytes make the same manifest digest. Blobs the registry already has
    are not uploaded again. The check and the push are two requests, not one atomic step: two
    machines pushing different content for one key at the same moment can both succeed, the
    later one's tag standing (the key names the inputs, so only a compile that is not
    reproducible can do that, and every fetch checks content against the manifest anyway)."""
    _check_tag(tag)
    for name in files:
        if not safe_name(name):
            raise ValueError(f"{name!r} is not a plain file name")
    config_raw = _canonical(dict(doc))
    config = Descriptor(ENTRY_MEDIA_TYPE, sha256_digest(config_raw), len(config_raw))
    layers = [
        Descriptor(FILE_MEDIA_TYPE, *_hash_file(files[name]), title=name) for name in sorted(files)
    ]
    raw = _manifest(config, layers)
    with remote_errors(remote, timeout):
        client = Client(remote, timeout)
        existing = client.manifest(tag)
        if existing is not None:
            if sha256_digest(existing) == sha256_digest(raw):
                return "present"
            raise RemoteConflict(
                f"{remote.url}: tag {tag} already holds other content ({sha256_digest(existing)}, "
                f"not {sha256_digest(raw)}); it is left as it is"
            )
        client.upload(config.digest, config.size, config_raw)
        for layer in layers:
            assert layer.title is not None
            with files[layer.title].open("rb") as fh:
                client.upload(layer.digest, layer.size, fh)
        client.put_manifest(tag, raw)
        return "pushed"


def _hash_file(path: Path) -> tuple[str, int]:
    digest = hashlib.sha256()
    size = 0
    with path.open("rb") as fh:
        while chunk := fh.read(CHUNK):
            digest.update(chunk)
            size += len(chunk)
    return f"sha256:{digest.hexdigest()}", size


# --------------------------------------------------------------------------- lists
#
# An index (the keys one env used) and a key's signatures are both a list that only grows,
# kept as a config-only artifact: ``{FIELD: [...]}`` in canonical JSON, no layers.

# An env uses tens to hundreds of entries; an index that lists more than this is not one
# (pulling 20,000 keys one by one took minutes), and a list is read with a bounded budget.
MAX_INDEX_KEYS = 4096
MAX_LIST_BYTES = 4 << 20
MAX_SIGNATURES = 16
MAX_SIGNATURE_BYTES = 16 << 10
SIGNATURE_PREFIX = "-----BEGIN SSH SIGNATURE-----"


@dataclass(frozen=True)
class _ListKind:
    media_type: str
    field: str
    what: str  # "index", "signatures"
    items: str  # what each item is, for messages
    limit: int
    valid: Callable[[object], bool]


_INDEX = _ListKind(
    INDEX_MEDIA_TYPE,
    "keys",
    "index",
    "entry keys",
    MAX_INDEX_KEYS,
    lambda k: isinstance(k, str) and _KEY.fullmatch(k) is not None,
)
_SIGNATURES = _ListKind(
    SIGNATURES_MEDIA_TYPE,
    "signatures",
    "signatures",
    "SSH signatures",
    MAX_SIGNATURES,
    lambda s: (
        isinstance(s, str) and s.startswith(SIGNATURE_PREFIX) and len(s) <= MAX_SIGNATURE_BYTES
    ),
)


def _read_list(client: Client, remote: Remote, tag: str, kind: _ListKind) -> list[str] | None:
    found = _fetch_config(client, remote, tag, kind.media_type, [MAX_LIST_BYTES])
    if found is None:
        return None
    doc, layers = found
    items = doc.get(kind.field) if isinstance(doc, dict) else None
    if layers or not isinstance(items, list) or not all(kind.valid(i) for i in items):
        raise RemoteBadContent(f"{remote.url}: {kind.what} {tag} is not a list of {kind.items}")
    unique = sorted(set(items))
    if len(unique) > kind.limit:
        raise RemoteBadContent(
            f"{remote.url}: {kind.what} {tag} lists {len(unique)} {kind.items}, more than the "
            f"{kind.limit} it may hold; it is not read"
        )
    return unique


def _publish_list(
    remote: Remote, tag: str, items: Iterable[str], kind: _ListKind, timeout: float
) -> str:
    """Add ``items`` to the list tagged ``tag``: "pushed", or "present" when it holds them
    all already. When the tag holds a list, the sorted union of both is pushed, so machines
    that share a tag add to each other's lists and never drop an item; a tag holding
    anything else is left alone (RemoteBadContent). The read and the write are not one
    atomic step, so after writing the list is read again, and merged again (up to three
    times) when another machine's write replaced this one's in between."""
    wanted = set(items)
    result = "present"
    with remote_errors(remote, timeout):
        client = Client(remote, timeout)
        for _ in range(3):
            existing = _read_list(client, remote, tag, kind)
            have = set(existing or [])
            if existing is not None and wanted <= have:
                return result
            union = sorted(wanted | have)
            if len(union) > kind.limit:
                raise RemoteError(
                    f"{remote.url}: {kind.what} {tag} would list {len(union)} {kind.items}, "
                    f"more than the {kind.limit} it may hold; it is left as it is"
                )
            config_raw = _canonical({kind.field: union})
            config = Descriptor(kind.media_type, sha256_digest(config_raw), len(config_raw))
            client.upload(config.digest, config.size, config_raw)
            client.put_manifest(tag, _manifest(config, []))
            result = "pushed"
        return result


# --------------------------------------------------------------------------- indexes


def fetch_index(remote: Remote, tag: str, *, timeout: float = 30.0) -> list[str] | None:
    """The entry keys of the index tagged ``tag`` (sorted), None when there is no such tag;
    RemoteBadContent for one that lists more than :data:`MAX_INDEX_KEYS`."""
    _check_tag(tag)
    with remote_errors(remote, timeout):
        return _read_list(Client(remote, timeout), remote, tag, _INDEX)


def publish_index(remote: Remote, tag: str, keys: Iterable[str], *, timeout: float = 30.0) -> str:
    """Record ``keys`` in the index tagged ``tag``: "pushed", or "present" when it already
    lists them all. An index only grows (:func:`_publish_list`), so envs that share a tag
    (one spec built on several machines) add to each other's lists and never drop an entry.
    Deterministic as entries are: the config is ``{"keys": [...]}`` in canonical JSON."""
    _check_tag(tag)
    wanted = set(keys)
    for key in wanted:
        tag_for(key)
    return _publish_list(remote, tag, wanted, _INDEX, timeout)


# --------------------------------------------------------------------------- signatures


def signature_tag(key: str) -> str:
    """The tag of the signatures of the entry ``key``: ``KEY.sig``, beside the entry."""
    return f"{tag_for(key)}.sig"


def fetch_signatures(remote: Remote, key: str, *, timeout: float = 30.0) -> list[str]:
    """The SSH signatures pushed for the entry ``key`` (none when there are none)."""
    with remote_errors(remote, timeout):
        found = _read_list(Client(remote, timeout), remote, signature_tag(key), _SIGNATURES)
    return found or []


def publish_signature(remote: Remote, key: str, signature: str, *, timeout: float = 30.0) -> str:
    """Add ``signature`` to the signatures of the entry ``key``: "pushed" or "present".
    Several warmers' signatures stand side by side; a node needs one it trusts."""
    if not _SIGNATURES.valid(signature):
        raise ValueError("not an armored SSH signature")
    return _publish_list(remote, signature_tag(key), [signature], _SIGNATURES, timeout)


# --------------------------------------------------------------------------- plans
#
# A placement plan (builder/store/plans.py: what a prefetch writes to place a stored module
# without importing FlashInfer) travels as a config-only artifact tagged by the env signature
# it is for. It is a hint: a node keeps only what the entries it pulled vouch for, and places
# nothing its own checks do not pass.

# The store writes no plan larger than this (plans.record_plan), so none larger is read.
MAX_PLAN_BYTES = 15 << 20


def plan_tag(signature: str) -> str:
    """The tag of the plan of the env signature ``signature`` (64 hex digits)."""
    return f"plan-{tag_for(signature)}"


def fetch_plan(remote: Remote, signature: str, *, timeout: float = 30.0) -> Any | None:
    """The plan document pushed for ``signature`` (parsed JSON, not yet judged), None when
    there is none; RemoteBadContent for an artifact that is not a plan or is too large."""
    tag = plan_tag(signature)
    with remote_errors(remote, timeout):
        found = _fetch_config(Client(remote, timeout), remote, tag, PLAN_MEDIA_TYPE,
                              [MAX_PLAN_BYTES])  # fmt: skip
    if found is None:
        return None
    doc, layers = found
    if layers:
        raise RemoteBadContent(f"{remote.url}: plan {tag} has layers; a plan is its config alone")
    return doc


def publish_plan(
    remote: Remote, signature: str, doc: Mapping[str, Any], *, timeout: float = 30.0
) -> str:
    """Push the plan ``doc`` for ``signature``: "pushed", or "present" when the tag holds
    exactly it. The caller merges what the tag held first (plans only grow: several warmers
    of one env add modules to it); two pushes at one moment can drop one's modules, which
    costs a node the FlashInfer import they would have saved, nothing else."""
    tag = plan_tag(signature)
    config_raw = _canonical(dict(doc))
    if len(config_raw) > MAX_PLAN_BYTES:
        raise RemoteError(f"{remote.url}: the plan for {tag} is larger than {MAX_PLAN_BYTES} bytes")
    config = Descriptor(PLAN_MEDIA_TYPE, sha256_digest(config_raw), len(config_raw))
    raw = _manifest(config, [])
    with remote_errors(remote, timeout):
        client = Client(remote, timeout)
        existing = client.manifest(tag)
        if existing is not None and sha256_digest(existing) == sha256_digest(raw):
            return "present"
        client.upload(config.digest, config.size, config_raw)
        client.put_manifest(tag, raw)
    return "pushed"
