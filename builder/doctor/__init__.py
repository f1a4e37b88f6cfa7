"""``cudaenv doctor``: the facts of any env (``facts``), the rules that name a cause and its
fix (``rules``), the diagnosis and its rendering (``diagnose``), and ``cudaenv fingerprint``.
Imports the layers up to ``audit``; never ``verify`` or ``commands``.

Entry: ``builder.doctor.diagnose.probe`` (the facts), ``builder.doctor.rules.diagnose`` (the findings).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "facts",
    "rules",
    "diagnose",
    "fingerprint",
)
