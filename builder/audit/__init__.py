"""Which GPUs an env's binaries run on (their ELF and fatbin headers read by
builder/machine/fatbin.py): the CUDA majors
of an env's libraries, distributions and import probe (``majors``), the scan of an env or a
lock's wheels (``scan``) and the fleet's verdicts per GPU class and platform (``fleet``).
Imports the layers up to ``env``.

Entry: ``builder.audit.scan.judge`` (an env) and ``builder.audit.fleet.judge`` (a lock, no env built).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "majors",
    "scan",
    "fleet",
)
