"""Sharing compiled JIT results beyond one machine: the registry's address, errors and
bounded HTTP transport (``ocihttp``), the OCI registry client (``oci``), the registry tier of
the JIT store (``remote``), signatures (``signing``), the pull/push helper a build's probe
calls (``share``) and the prefetch of warmed modules into a new env. The store itself is
``builder.store``. Imports ``core`` and ``store``.

Entry: ``builder.jit.prefetch.prefetch`` and ``python -m builder.jit.share``.
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "signing",
    "ocihttp",
    "oci",
    "remote",
    "share",
    "prefetch",
)
