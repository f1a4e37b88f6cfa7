"""``cudaenv doctor``: the facts of any env (``facts``), the rules that name a cause and its
fix (``toolkit_rules``: nvcc and the host compiler; ``wheel_rules``: the CUDA wheels and
binaries; ``extension_rules``: the compiled torch extensions and the CUDA that built them;
``env_rules``: the machine and the env's own state; ``rules``: all of them, root
cause first), the diagnosis and its rendering (``diagnose``), and ``cudaenv fingerprint``.
Imports the layers up to ``audit``; never ``verify`` or ``commands``.

Entry: ``builder.doctor.diagnose.probe`` (the facts), ``builder.doctor.rules.diagnose`` (the findings).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "facts",
    "toolkit_rules",
    "wheel_rules",
    "extension_rules",
    "env_rules",
    "rules",
    "diagnose",
    "fingerprint",
)
