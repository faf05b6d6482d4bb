"""GPU tests: every test here is marked `gpu` and needs CUDA, except that
OCTAVO_TRITON_INTERPRET=1 runs the kernel tests' small subset on the CPU through Triton's
interpreter (slow; for checking kernels on a machine without a GPU):

    OCTAVO_TRITON_INTERPRET=1 PYTHONPATH=. pytest tests/gpu -q
"""

from __future__ import annotations

import os
import sys

import pytest

INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"

if INTERPRET:
    # Must precede the first import of a module that defines @triton.jit kernels.
    os.environ["TRITON_INTERPRET"] = "1"
    sys.path.insert(0, os.path.dirname(__file__))
    import interpreter_compat

    interpreter_compat.apply()


def pytest_collection_modifyitems(config, items) -> None:
    """Marks everything under tests/gpu as `gpu`."""
    here = os.path.dirname(__file__)
    for item in items:
        if str(item.fspath).startswith(here):
            item.add_marker(pytest.mark.gpu)
