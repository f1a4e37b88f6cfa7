"""Signed entries of the JIT store's registry tier: who made an entry, not only what it is.

Every entry a node pulls is checked to be self-consistent (each blob against its digest, each
file against the size and sha256 its record gives), but a self-consistent entry can be made
by anyone who may push to the repository. Where push rights are not enough of a boundary,
warmers sign what they push and nodes place only entries signed by a key they trust, with
OpenSSH's own signatures (``ssh-keygen -Y sign`` / ``-Y verify``, OpenSSH 8.1+): offline, on
every machine, with keys and an allowed-signers file (``man ssh-keygen``, "ALLOWED SIGNERS")
a fleet already knows how to deploy.

What is signed is the entry's *statement*: canonical JSON of its key and its content doc,
which records the size and sha256 of every file and what it was compiled from. A signature
therefore vouches for the exact bytes of every file under that key, and for nothing else.
The signatures of a key travel in the registry next to its entry (``jit_remote``'s
``KEY.sig`` tag), several warmers' signatures side by side.

Off by default. ``CUDAENV_JIT_SIGNING_KEY`` (a warmer) signs each entry it pushes;
``CUDAENV_JIT_ALLOWED_SIGNERS`` (a node) requires a signature by one of the file's
principals on every entry pulled; ``CUDAENV_JIT_REQUIRE_SIGNED=1`` refuses every pull where
no allowed-signers file is named (a node whose file did not arrive never falls back to push
rights). A refused entry costs a local compile and one warning saying why.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from builder import store as jit_store
from builder.core import proc, settings
from builder.core.errors import CudaenvError

# The signature namespace (ssh-keygen -n): a signature made for anything else (a git
# commit, a file) is never one of an entry.
NAMESPACE = "cudaenv-jit"
KEY_VAR = "CUDAENV_JIT_SIGNING_KEY"
SIGNERS_VAR = "CUDAENV_JIT_ALLOWED_SIGNERS"
REQUIRE_VAR = "CUDAENV_JIT_REQUIRE_SIGNED"
# A key's signatures read at most: one per warmer of a fleet, and an attacker with push
# rights cannot make a node check more.
MAX_SIGNATURES = 16
MAX_SIGNATURE_BYTES = 16 << 10
MAX_SIGNERS_BYTES = 1 << 20
TIMEOUT = 30.0


class SigningError(CudaenvError):
    """An entry could not be signed, or its signatures vouch for nothing this node trusts."""


@dataclass(frozen=True)
class Policy:
    """What this machine does with signatures: ``key`` signs what it pushes; ``allowed``
    (an allowed-signers file) is required of what it pulls; ``refusal`` is why every pull
    is refused (signatures required and no file to check them against)."""

    key: Path | None = None
    allowed: Path | None = None
    refusal: str | None = None

    @property
    def checks(self) -> bool:
        return self.allowed is not None or self.refusal is not None


def policy(environ: Mapping[str, str] | None = None) -> Policy:
    found = settings.of(environ)
    key, allowed = found.jit_signing_key, found.jit_allowed_signers
    refusal = None
    if allowed is None and found.jit_require_signed:
        refusal = (
            f"{REQUIRE_VAR}=1 and no {SIGNERS_VAR}: no signature can be checked, so no "
            "entry is taken from the remote"
        )
    return Policy(key=key, allowed=allowed, refusal=refusal)


def statement(key: str, content: Mapping[str, Any]) -> bytes:
    """What is signed for the entry ``key``: its content doc (every file's size and sha256,
    its inputs, its kind) and the key, in canonical JSON."""
    if not jit_store.is_key(key):
        raise ValueError(f"{key!r} is not an entry key")
    doc = {"cudaenv-jit-entry": 1, "key": key, "entry": dict(content)}
    return json.dumps(doc, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode()


def sign(key_file: Path, data: bytes) -> str:
    """The armored SSH signature of ``data`` by ``key_file`` (a private key without a
    passphrase, or a public key whose private half ssh-agent holds)."""
    try:
        done = proc.run(
            ["ssh-keygen", "-q", "-Y", "sign", "-f", key_file, "-n", NAMESPACE],
            input_text=data.decode("ascii"),
            check=False,
            timeout=TIMEOUT,
        )
    except CudaenvError as exc:
        raise SigningError(f"{KEY_VAR}={key_file}: ssh-keygen could not sign ({exc})") from None
    signature = done.stdout.strip()
    if done.returncode != 0 or not signature.startswith("-----BEGIN SSH SIGNATURE-----"):
        why = (done.stderr.strip().splitlines() or [f"exit {done.returncode}"])[-1]
        raise SigningError(f"{KEY_VAR}={key_file}: ssh-keygen could not sign ({why})")
    return signature + "\n"


def verify(allowed: Path, data: bytes, signatures: Iterable[str]) -> str:
    """The principal of ``allowed`` (an allowed-signers file) whose signature among
    ``signatures`` is good for ``data``; SigningError saying why when there is none."""
    tried = 0
    with tempfile.TemporaryDirectory(prefix="cudaenv-sig-") as tmp:
        copy = _copy_signers_file(allowed, Path(tmp) / "allowed_signers")
        for n, signature in enumerate(signatures):
            if n >= MAX_SIGNATURES:
                break
            if not isinstance(signature, str) or len(signature) > MAX_SIGNATURE_BYTES:
                continue
            tried += 1
            sig = Path(tmp) / f"{n}.sig"
            sig.write_text(signature)
            for principal in _principals(copy, sig):
                done = _keygen(
                    ["-Y", "verify", "-f", copy, "-I", principal, "-n", NAMESPACE, "-s", sig],
                    data.decode("ascii"),
                )
                if done is not None and done.returncode == 0:
                    return principal
    if not tried:
        raise SigningError("it is not signed")
    raise SigningError(
        f"none of its {tried} signature(s) is by a signer {allowed} allows for {NAMESPACE}"
    )


def _principals(allowed: Path, sig: Path) -> list[str]:
    """The principals of ``allowed`` whose key made ``sig`` (not yet checked against data)."""
    done = _keygen(["-Y", "find-principals", "-f", allowed, "-n", NAMESPACE, "-s", sig], None)
    if done is None or done.returncode != 0:
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()][:8]


def _keygen(args: list[str | Path], data: str | None) -> proc.Completed | None:
    try:
        return proc.run(["ssh-keygen", *args], input_text=data, check=False, timeout=TIMEOUT)
    except proc.CommandFailed:
        return None  # a timeout: as good as a bad signature
    except CudaenvError as exc:  # no ssh-keygen
        raise SigningError(f"signatures cannot be checked: {exc}") from None


def _copy_signers_file(allowed: Path, copy: Path) -> Path:
    """The allowed-signers file decides what a root process runs: read only one that no
    other user could have written (as the store's own files), and hand ssh-keygen a private
    copy of what was read, so that the file checked is the file used."""
    try:
        fd, _ = jit_store.open_regular(allowed, trusted=True)
    except jit_store.EntryError as exc:
        raise SigningError(f"{SIGNERS_VAR}: {exc}") from None
    with os.fdopen(fd, "rb") as fh:
        text = fh.read(MAX_SIGNERS_BYTES + 1)
    if len(text) > MAX_SIGNERS_BYTES:
        raise SigningError(f"{SIGNERS_VAR}: {allowed} is larger than {MAX_SIGNERS_BYTES} bytes")
    copy.write_bytes(text)
    return copy
