"""The server's limits on what a request may hold, checked before any costly work (reading a
huge body, tokenizing a huge prompt, compiling a huge schema). Plain Python: the CLI imports
it without a web framework."""

from __future__ import annotations

DEFAULT_MAX_REQUEST_BYTES = 4 << 20  # far above the text any model's context can hold
