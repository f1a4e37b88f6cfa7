"""What the store raises: the store cannot be used now, or one entry is bad."""

from __future__ import annotations


class StoreError(Exception):
    """The store cannot be used now (a directory others can write, a lock held too long, a
    read-only or full disk): the caller compiles without it and says why once."""


class EntryError(ValueError):
    """One entry is malformed, or a file differs from its record: it is discarded and the
    result compiled (and published) again."""
