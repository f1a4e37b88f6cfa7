"""cudaenv: a matched CUDA toolchain next to torch, FlashInfer and sglang in an isolated venv."""

__version__ = "0.1.0"
