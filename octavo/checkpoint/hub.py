"""Models named by their Hugging Face hub id, as vLLM takes them: `Qwen/Qwen3-0.6B`, or a GGUF
repository's file by quantization (`org/name-GGUF:Q4_K_M`) or by name
(`org/name-GGUF/model-q8_0.gguf`).

huggingface_hub downloads the config, tokenizer and weight files once into its cache
(`HF_HOME`, `HF_HUB_CACHE`; `HF_TOKEN` for gated repos; a progress bar per file) and answers
from the cache afterwards; with `HF_HUB_OFFLINE=1`, or without a network, only from the cache.
"""

from __future__ import annotations

import os
import re

# Files a model needs: config, tokenizer, chat template, weights (safetensors, or one GGUF).
_MODEL_FILES = [
    "*.json", "*.safetensors", "*.jinja", "tokenizer.model", "*.tiktoken", "merges.txt",
    "vocab.txt", "vocab.json",
]  # fmt: skip
_HUB_ID = re.compile(r"[\w.-]+/[\w.-]+")


def looks_like_hub_id(model: str) -> bool:
    """`org/name`, optionally with `:QUANT` or `/file.gguf`, and not a path that exists."""
    repo = _split(model)[0]
    return bool(_HUB_ID.fullmatch(repo)) and not os.path.exists(model)


def _split(model: str) -> tuple[str, str | None]:
    """(repo id, a GGUF file's name or quantization, or None)."""
    if model.count("/") >= 2 and model.endswith(".gguf"):
        org, name, file = model.split("/", 2)
        return f"{org}/{name}", file
    if ":" in model:
        repo, _, quant = model.partition(":")
        return repo, quant
    return model, None


def download(model: str, revision: str | None = None) -> str:
    """The local path of a hub model: its snapshot directory, or its GGUF file. ValueError
    in one line, naming the cache tried, when it is neither cached nor downloadable."""
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import HfHubHTTPError, LocalEntryNotFoundError

    repo, gguf = _split(model)
    cache = os.environ.get("HF_HUB_CACHE") or os.path.join(
        os.environ.get("HF_HOME") or os.path.expanduser("~/.cache/huggingface"), "hub"
    )
    offline = os.environ.get("HF_HUB_OFFLINE", "").lower() in ("1", "true", "yes", "on")
    patterns = _MODEL_FILES + ([f"*{gguf}*"] if gguf else [])
    try:
        path = snapshot_download(
            repo, revision=revision, cache_dir=cache, local_files_only=offline,
            allow_patterns=patterns, token=os.environ.get("HF_TOKEN") or None,
        )  # fmt: skip
    except (LocalEntryNotFoundError, HfHubHTTPError, OSError) as e:
        reason = "HF_HUB_OFFLINE is set" if offline else type(e).__name__
        raise ValueError(
            f"model {model!r} is not in the Hugging Face cache at {cache} and could not be "
            f"downloaded ({reason})"
        ) from None
    if gguf is None:
        if not any(name.endswith(".gguf") for name in os.listdir(path)):
            return path
        gguf = ""
    return _pick_gguf(model, path, gguf)


def _pick_gguf(model: str, path: str, wanted: str) -> str:
    """The snapshot's GGUF file whose name is `wanted` or holds it (a quantization, any
    case); the only one if `wanted` is empty."""
    files = sorted(f for f in os.listdir(path) if f.endswith(".gguf"))
    matches = [f for f in files if f == wanted or wanted.lower() in f.lower()]
    if len(matches) == 1:
        return os.path.join(path, matches[0])
    what = "names none of" if not matches else "matches several of"
    raise ValueError(
        f"model {model!r}: {wanted or 'no file or quantization'} {what} the repo's GGUF files "
        f"{files}; name one as org/name:QUANT or org/name/file.gguf"
    )
