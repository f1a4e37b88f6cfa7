"""A machine-wide store of compiled JIT results: a compile done once per toolchain.

Standard library only, and written for Python 3.9 and later: the env probe
(``builder/probe/env_facts.py``) imports this package from its directory inside a target env's
own interpreter for FlashInfer's ninja build, which must import nothing else of cudaenv;
cudaenv imports it as ``builder.store`` (its own kernel). The modules import one another
relatively, so the package works under either name.

An entry is found in two steps, like ccache's direct mode. The *key* hashes what the build
is asked to do with which tools: the build description with the env's own path replaced by
``@ENV@`` (flags, gencode, include order, sources), the content of each compiler binary
(nvcc, cicc, ptxas, ... and the host compiler nvcc drives), the NVCC_* variables and the
ninja version. Under a key, each *variant* records every file the compile read (the depfile:
headers of CUDA, CCCL, FlashInfer, the C library) with its sha256; a variant is used only if
every one of those files has the same content in the new env. So a changed nvcc, CCCL, arch or
host compiler misses, and nothing is ever reused stale.

Concurrent builders of one key wait for each other (``flock`` on the key), so two matrix
cells of one toolchain compile once. Entries are written beside their final place and renamed
into it whole.

The modules, bottom first: ``errors``, ``limits``, ``trust`` (what the store reads and how),
``ninja_files`` (ninja's logs), ``entries`` (the entry format), ``hashing`` (what a key is made
of), ``locking``, ``store`` (the store on disk), ``ninja_build`` (a ninja build through it).
"""

from __future__ import annotations

from .entries import (
    KINDS,
    PROVENANCE,
    VERSION,
    Entry,
    FileRecord,
    is_key,
    is_variant,
    parse_entry,
    split_entry,
    variant_of,
)
from .errors import EntryError, StoreError
from .hashing import (
    ENV,
    NVCC_ENV,
    TOOLKIT_TOOLS,
    Hasher,
    Recorded,
    RecordedTools,
    env_roots,
    key_of,
    localise,
    normalise,
    tool_identities,
)
from .limits import (
    DEFAULT_LOCK_TIMEOUT,
    DEFAULT_MAX,
    MAX_DOC,
    MAX_INPUT,
    lock_timeout,
    parse_size,
    store_max,
)
from .locking import Holder, Lock, Waiting, flock_within
from .ninja_build import ninja_material, place_ninja, publish_ninja
from .ninja_files import (
    LOG_HASHES,
    command_hash,
    commands_run,
    compdb,
    log_records,
    murmur64a,
    ninja_version,
    rapidhash,
    read_deps,
    write_deps,
    write_log,
)
from .store import USED, Listed, Store, note_use, used_entries
from .trust import (
    MAX_NAME_BYTES,
    check_ancestors,
    check_dir,
    copy_checked,
    is_file_name,
    open_regular,
    read_doc,
    remove_tree,
    sha256_file,
    stored_identity,
)

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "errors",
    "limits",
    "trust",
    "ninja_files",
    "entries",
    "hashing",
    "locking",
    "store",
    "ninja_build",
    "plans",
)

__all__ = [
    "DEFAULT_LOCK_TIMEOUT",
    "DEFAULT_MAX",
    "ENV",
    "KINDS",
    "LOG_HASHES",
    "MAX_DOC",
    "MAX_INPUT",
    "MAX_NAME_BYTES",
    "NVCC_ENV",
    "PROVENANCE",
    "TOOLKIT_TOOLS",
    "USED",
    "VERSION",
    "Entry",
    "EntryError",
    "FileRecord",
    "Hasher",
    "Holder",
    "Listed",
    "Lock",
    "Recorded",
    "RecordedTools",
    "Store",
    "StoreError",
    "Waiting",
    "check_ancestors",
    "check_dir",
    "command_hash",
    "commands_run",
    "compdb",
    "copy_checked",
    "env_roots",
    "flock_within",
    "is_file_name",
    "is_key",
    "is_variant",
    "key_of",
    "localise",
    "lock_timeout",
    "log_records",
    "murmur64a",
    "ninja_material",
    "ninja_version",
    "normalise",
    "note_use",
    "open_regular",
    "parse_entry",
    "parse_size",
    "place_ninja",
    "publish_ninja",
    "rapidhash",
    "read_deps",
    "read_doc",
    "remove_tree",
    "sha256_file",
    "split_entry",
    "store_max",
    "stored_identity",
    "tool_identities",
    "used_entries",
    "variant_of",
    "write_deps",
    "write_log",
]
