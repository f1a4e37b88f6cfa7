"""cudaenv: a matched CUDA toolchain next to torch, FlashInfer and sglang in an isolated venv."""

__version__ = "0.1.0"

# The packages, bottom first: a module imports only from packages before its own, and inside
# its package only the modules its MODULES tuple lists before it (tests/test_layers.py); the
# architecture reference page is generated from these (python -m builder.cli.docgen).
PACKAGES = (
    "store",
    "probe",
    "kernels",
    "core",
    "formats",
    "machine",
    "spec",
    "jit",
    "env",
    "adopt",
    "audit",
    "verify",
    "doctor",
    "commands",
    "cli",
)
