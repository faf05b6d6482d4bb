"""Where a kernel test module runs: on CUDA, or through Triton's interpreter on the CPU
(OCTAVO_TRITON_INTERPRET=1, see conftest.py), with a smaller parameter list there."""

from __future__ import annotations

import os

import pytest
import torch

INTERPRET = os.environ.get("OCTAVO_TRITON_INTERPRET") == "1"
DEVICE = "cpu" if INTERPRET else "cuda"


def require_kernels() -> None:
    """Skips the calling module without triton, or without CUDA unless interpreting."""
    pytest.importorskip("triton")
    if not INTERPRET and not torch.cuda.is_available():
        pytest.skip("needs CUDA (or OCTAVO_TRITON_INTERPRET=1)", allow_module_level=True)


def pick(full: list, small: list) -> list:
    """The GPU's parameter list, or its small subset under the interpreter."""
    return small if INTERPRET else full
