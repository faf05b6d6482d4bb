"""Tokenizers: load one for a model path, collect its EOS ids, render chat conversations.

A model is a `.gguf` file (the tokenizer, its special tokens and the chat template come from
the GGUF metadata, converted by transformers) or an HF directory (tokenizer files next to
config.json, loaded by transformers; a dummy-weights config directory has none, and then
there is no tokenizer).

Converting a GGUF tokenizer costs more than reading the saved result, so the converted
tokenizer is saved once, in HF's own format, under `$OCTAVO_CACHE_DIR` (default
`$XDG_CACHE_HOME/octavo`, else `~/.cache/octavo`; an empty value turns the cache off), keyed
by the file's path, size and modification time and by the transformers version. The saved
form is read back as a FastTokenizer (tokenizer/fast_tokenizer.py), without importing
transformers, wherever that class reads it.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from collections.abc import Sequence
from importlib.metadata import version
from typing import TYPE_CHECKING

from octavo.cache import cache_root
from octavo.tokenizer.fast_tokenizer import FastTokenizer

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

    # What load_tokenizer gives; the engine calls only what both have.
    AnyTokenizer = FastTokenizer | PreTrainedTokenizerBase

logger = logging.getLogger(__name__)

GGUF_CHAT_TEMPLATE_KEY = "tokenizer.chat_template"
# GGUF `general.architecture` -> HF model type, for the architectures octavo runs.
GGUF_TOKENIZER_MODEL_TYPES = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}
# Any one of these in a directory means "this directory has a tokenizer".
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "spiece.model",
)


def load_tokenizer(model: str) -> AnyTokenizer | None:
    """Loads the tokenizer of a model, cached per path for the life of the process (found
    the same way for real and dummy weights).

    Args:
        model: a path to a `.gguf` file or to an HF model directory.

    Returns:
        The tokenizer, with `chat_template` set when the model has one (a FastTokenizer for
        a GGUF file where that class reads the converted form, else transformers'); None
        for a directory without tokenizer files (prompts must then be given as token ids).

    Raises:
        ValueError: a path that is neither a `.gguf` file nor a directory.
    """
    path = os.path.realpath(os.path.expanduser(model))
    if os.path.isdir(path) or (os.path.isfile(path) and path.endswith(".gguf")):
        return _load_cached(path)
    raise ValueError(
        f"cannot load a tokenizer from {model!r}: expected a .gguf file or an HF model directory"
    )


@functools.lru_cache(maxsize=8)
def _load_cached(path: str) -> AnyTokenizer | None:
    # NOTE: the cache hands the same object to every caller; nobody may mutate it.
    if os.path.isdir(path):
        if not any(os.path.exists(os.path.join(path, f)) for f in TOKENIZER_FILES):
            return None
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(path)
    cache = gguf_tokenizer_cache_dir(path)
    if cache is not None and os.path.isfile(os.path.join(cache, "tokenizer.json")):
        try:
            return _load_saved(cache)
        except Exception as e:  # noqa: BLE001 - a damaged entry: convert and save again
            logger.warning("replacing the cached tokenizer in %s: %r", cache, e)
            shutil.rmtree(cache, ignore_errors=True)
    tokenizer = _convert_gguf_tokenizer(path)
    if not tokenizer.chat_template:
        tokenizer.chat_template = read_gguf_chat_template(path) or tokenizer.chat_template
    if cache is not None and _save(tokenizer, cache):
        return FastTokenizer.from_directory(cache) or tokenizer
    with tempfile.TemporaryDirectory(prefix="octavo-tokenizer-") as staging:
        tokenizer.save_pretrained(staging)
        return FastTokenizer.from_directory(staging) or tokenizer


def _load_saved(directory: str) -> AnyTokenizer:
    """A tokenizer saved by transformers: as a FastTokenizer where that class reads it."""
    fast = FastTokenizer.from_directory(directory)
    if fast is not None:
        return fast
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)


def _convert_gguf_tokenizer(path: str) -> PreTrainedTokenizerBase:
    """Builds the tokenizer a GGUF file's metadata describes, of the class AutoTokenizer
    would pick. For the architectures octavo runs, the class is found from the architecture:
    AutoTokenizer would first build the model's config with transformers' slower GGUF reader."""
    from transformers import AutoTokenizer

    directory, filename = os.path.split(path)
    cls = _gguf_tokenizer_class(path) or AutoTokenizer
    return cls.from_pretrained(directory, gguf_file=filename)


def _gguf_tokenizer_class(path: str) -> type[PreTrainedTokenizerBase] | None:
    """AutoTokenizer's class for the model type of a GGUF file beside no tokenizer_config.json
    (which AutoTokenizer would read); None where it is not known here."""
    from transformers.models.auto import tokenization_auto

    from octavo.checkpoint.gguf import open_gguf

    if os.path.exists(os.path.join(os.path.dirname(path), "tokenizer_config.json")):
        return None
    arch = open_gguf(path).metadata.get("general.architecture")
    if arch not in GGUF_TOKENIZER_MODEL_TYPES:
        return None
    name = tokenization_auto.TOKENIZER_MAPPING_NAMES.get(GGUF_TOKENIZER_MODEL_TYPES[arch])
    if not isinstance(name, str | None):  # transformers 4's (slow, fast) pairs: not mapped here
        return None
    # A model type that names no class gets TokenizersBackend (None before transformers 5).
    return tokenization_auto.tokenizer_class_from_name(name or "TokenizersBackend")


def gguf_tokenizer_cache_dir(path: str) -> str | None:
    """Where the tokenizer converted from the GGUF file at `path` is kept; None when the
    cache is off."""
    root = cache_root()
    if root is None:
        return None
    stat = os.stat(path)
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}|{version('transformers')}"
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return os.path.join(root, "tokenizers", f"{os.path.basename(path)}-{digest}")


def _save(tokenizer: PreTrainedTokenizerBase, cache: str) -> bool:
    """Saves into a new directory, then renames it into place: a reader sees all of it or
    none, and of two processes saving at once, one wins. False where nothing is saved."""
    staging = None
    try:
        os.makedirs(os.path.dirname(cache), exist_ok=True)
        staging = tempfile.mkdtemp(dir=os.path.dirname(cache), prefix=".saving-")
        tokenizer.save_pretrained(staging)
        os.rename(staging, cache)  # fails if another process saved it first
    except Exception as e:  # noqa: BLE001 - a read-only home, say: no cache, no harm
        logger.info("did not cache the converted tokenizer in %s: %r", cache, e)
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return os.path.isfile(os.path.join(cache, "tokenizer.json"))


def read_gguf_chat_template(path: str) -> str | None:
    """Returns the `tokenizer.chat_template` string of a GGUF file, or None if it has none."""
    from octavo.checkpoint.gguf import open_gguf

    template = open_gguf(path).metadata.get(GGUF_CHAT_TEMPLATE_KEY)
    return template if isinstance(template, str) and template else None


def eos_token_ids(
    tokenizer: AnyTokenizer | None, hf_config_eos: int | Sequence[int] | None
) -> list[int]:
    """The ids that end generation: the tokenizer's EOS, then the model config's
    `eos_token_id` (an int or a list of ints; None when absent), without duplicates."""
    candidates = [] if tokenizer is None else [tokenizer.eos_token_id]
    candidates += hf_config_eos if isinstance(hf_config_eos, Sequence) else [hf_config_eos]
    given = [t for t in candidates if t is not None]
    bad = [t for t in given if not isinstance(t, int) or isinstance(t, bool)]
    if bad:
        raise ValueError(f"eos_token_id must be an int or a list of ints, got {bad[0]!r}")
    return list(dict.fromkeys(given))


def encode_text(
    tokenizer: AnyTokenizer,
    text: str,
    what: str = "the prompt",
    add_special_tokens: bool = False,
    keep_last: int | None = None,
) -> list[int]:
    """`text`'s token ids. A plain prompt takes the special tokens the tokenizer adds (a
    BOS, for Llama 3) with `add_special_tokens`, as vLLM and HF do; text a chat template
    rendered already has them. With `keep_last` (vLLM's truncate_prompt_tokens), at most
    that many: the text's last tokens, still inside the special tokens, as a tokenizer
    truncating on the left gives them.

    Raises:
        ValueError: `text` is not valid Unicode: a lone surrogate such as "\\ud800", which
            a JSON string may carry as an escape and which the tokenizer cannot take.
    """
    problem = _unicode_problem(text)
    if problem is not None:
        raise ValueError(f"{what}{problem}")
    ids = tokenizer.encode(text, add_special_tokens=add_special_tokens)
    if keep_last is None or len(ids) <= keep_last:
        return ids
    plain = tokenizer.encode(text, add_special_tokens=False) if add_special_tokens else ids
    extra = len(ids) - len(plain)  # special tokens around the text
    start = next((p for p in range(extra + 1) if ids[p : p + len(plain)] == plain), None)
    if start is None or keep_last <= extra:
        return ids[-keep_last:]
    kept = plain[len(plain) - (keep_last - extra) :]
    return ids[:start] + kept + ids[start + len(plain) :]


def _unicode_problem(text: str) -> str | None:
    """The tail of an error message (' is not valid Unicode: ...') for a str that UTF-8
    cannot encode, i.e. one with a lone surrogate; None for any other str."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f" is not valid Unicode: a lone surrogate at character {e.start}"
    return None


def apply_chat_template(
    tokenizer: AnyTokenizer | None,
    messages: list[dict],
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    add_special_tokens: bool = False,
    tools: list[dict] | None = None,
    template_kwargs: dict | None = None,
    chat_template: str | None = None,
) -> list[int]:
    """Renders one conversation with the model's chat template and tokenizes it.

    Args:
        tokenizer: the model's tokenizer (None when the model has none).
        messages: `[{"role": "user", "content": "..."}, ...]`; other keys are passed on to
            the template.
        add_generation_prompt: end with the header of an assistant turn, so that the model
            writes the reply.
        continue_final_message: leave the last message open (no end-of-turn token), so that
            the model continues it, e.g. a partly written assistant reply. Not together with
            add_generation_prompt.
        add_special_tokens: the tokenizer's special tokens (a BOS, say) on top of those the
            template writes, as vLLM's /tokenize offers; off for generation.
        tools: OpenAI's tool definitions, for a template that writes them into the prompt.
        template_kwargs: more variables for the template (vLLM's chat_template_kwargs,
            e.g. {"enable_thinking": False}).
        chat_template: a template to use instead of the model's.

    Raises:
        ValueError: no tokenizer or no chat template, malformed messages, or a template
            that rejects the conversation (e.g. roles that must alternate).
    """
    import jinja2

    if add_generation_prompt and continue_final_message:
        raise ValueError(
            "continue_final_message and add_generation_prompt cannot both be true: the one "
            "continues the last message, the other starts a new assistant turn"
        )
    if tokenizer is None or not (chat_template or tokenizer.chat_template):
        raise ValueError(
            "this model has no chat template: use generate() with a plain prompt instead"
        )
    _check_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            tools=tools,
            **({"chat_template": chat_template} if chat_template else {}),
            **(template_kwargs or {}),
        )
    except (jinja2.TemplateError, TypeError) as e:  # TypeError: a kwarg the call names itself
        raise ValueError(f"the chat template rejected the conversation: {e}") from e
    what = "the rendered conversation"  # its problem comes from other keys, say
    return encode_text(tokenizer, text, what, add_special_tokens=add_special_tokens)


def _check_messages(messages: object) -> None:
    if not isinstance(messages, list) or not messages:
        raise ValueError(
            "messages must be a non-empty list of {'role': str, 'content': str} dicts, "
            f"got {type(messages).__name__}"
        )
    for i, message in enumerate(messages):
        problem = _message_problem(message)
        if problem is not None:
            raise ValueError(f"messages[{i}]{problem}")


def _message_problem(message: object) -> str | None:
    if not isinstance(message, dict):
        return f" must be a dict, got {type(message).__name__}"
    for key in ("role", "content"):
        if key not in message:
            return f" has no {key!r} key"
        if not isinstance(message[key], str):
            return f"[{key!r}] must be a str, got {type(message[key]).__name__}"
        problem = _unicode_problem(message[key])
        if problem is not None:
            return f"[{key!r}]{problem}"
    return None
