"""The on-disk cache of what octavo computes once and reuses across runs: tokenizers converted
from GGUF files (tokenizer/tokenizer.py) and the GEMM algorithms measured at start-up on a GPU
(runner/gemm_tuning.py).

Its root is `$OCTAVO_CACHE_DIR`, by default `$XDG_CACHE_HOME/octavo`, else `~/.cache/octavo`;
an empty `OCTAVO_CACHE_DIR` turns the cache off.
"""

from __future__ import annotations

import os


def cache_root() -> str | None:
    """The cache's root directory (not created here), or None when the cache is off."""
    root = os.environ.get("OCTAVO_CACHE_DIR")
    if root is None:
        home = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
        root = os.path.join(home, "octavo")
    return root or None
