"""What this machine has and is: the NVIDIA driver, GPU archs and arch lists, the fleet's
target classes, the device code an ELF file holds (``fatbin``), the Python interpreters, the CUDA toolkits installed and the nvcc release of
any toolkit. Read, never changed. Imports ``builder.core`` and ``builder.formats``.

Entry: ``builder.machine.box.detect_box`` (everything `cudaenv init` chooses from).
"""

# This package's modules, bottom first: each imports only those before it (tests/test_layers.py).
MODULES = (
    "driver",
    "archs",
    "fatbin",
    "targets",
    "toolkits",
    "interpreters",
    "box",
)
