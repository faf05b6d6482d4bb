"""A saved tokenizer read with the `tokenizers` library alone: tokenizer.json, the special
tokens of tokenizer_config.json and the chat template, with the methods the engine calls,
named and behaving as transformers' do.

transformers takes about a second to import, most of a small model's start-up; this class
imports only `tokenizers` (and jinja2 when a chat is rendered). It reads what transformers'
generic tokenizer class saves (`TokenizersBackend`, `PreTrainedTokenizerFast`) and nothing
else: `from_directory` returns None for a directory that asks for more, and the caller
then loads it with transformers.
"""

from __future__ import annotations

import functools
import json
import operator
import os
from collections.abc import Iterable, Mapping, Sequence
from datetime import datetime
from typing import Any

from tokenizers import Tokenizer as RustTokenizer

# The classes whose saved form is all in tokenizer.json plus the special tokens named here.
GENERIC_CLASSES = ("TokenizersBackend", "PreTrainedTokenizerFast")
# transformers' order of the named special tokens (all_special_tokens follows it).
SPECIAL_TOKEN_NAMES = (
    "bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token"
)  # fmt: skip
# Config keys that change encoding or decoding beyond tokenizer.json.
_UNSUPPORTED_KEYS = (
    "add_bos_token", "add_eos_token", "clean_up_tokenization_spaces", "split_special_tokens"
)  # fmt: skip
# Names a message's reasoning may come under, the first taken; templates read the first.
_REASONING_KEYS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "OCTAVO_CONTINUE_FINAL_MESSAGE "


class FastTokenizer:
    """tokenizer.json's tokenizer, its special tokens and its chat template."""

    def __init__(
        self,
        backend: RustTokenizer,
        special_tokens: dict[str, str],
        chat_template: str | None = None,
        additional_special_tokens: Sequence[str] = (),
        name_or_path: str = "",
        model_max_length: int = int(1e30),
    ) -> None:
        backend.no_truncation()  # as transformers: only when asked for
        backend.no_padding()
        self.backend_tokenizer = backend
        self.special_tokens_map = dict(special_tokens)
        self.additional_special_tokens = list(additional_special_tokens)
        self.chat_template = chat_template
        self.name_or_path = name_or_path
        self.model_max_length = model_max_length

    @classmethod
    def from_directory(cls, path: str) -> FastTokenizer | None:
        """The tokenizer saved in `path`; None where its tokenizer_config.json names another
        class, asks for behaviour beyond tokenizer.json, or names a token tokenizer.json
        lacks (transformers would add it): see the module docstring."""
        config_path = os.path.join(path, "tokenizer_config.json")
        json_path = os.path.join(path, "tokenizer.json")
        if not (os.path.isfile(config_path) and os.path.isfile(json_path)):
            return None
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
        if config.get("tokenizer_class") not in GENERIC_CLASSES:
            return None
        if any(config.get(key) for key in _UNSUPPORTED_KEYS):
            return None
        extra = config.get("extra_special_tokens") or config.get("additional_special_tokens") or []
        template = config.get("chat_template")
        template_path = os.path.join(path, "chat_template.jinja")
        if os.path.isfile(template_path):
            with open(template_path, encoding="utf-8") as f:
                template = f.read()
        if not isinstance(extra, list) or not isinstance(template, str | None):
            return None  # named extra tokens, or named templates
        special = {name: _content(config[name]) for name in SPECIAL_TOKEN_NAMES if config.get(name)}
        extra = [_content(t) for t in extra]
        added = [_content(t) for t in (config.get("added_tokens_decoder") or {}).values()]
        backend = RustTokenizer.from_file(json_path)
        if any(backend.token_to_id(t) is None for t in [*special.values(), *extra, *added]):
            return None
        max_length = config.get("model_max_length", int(1e30))
        return cls(backend, special, template, extra, path, max_length)

    def save_pretrained(self, directory: str) -> None:
        """Writes the files `from_directory` (and transformers) read back."""
        os.makedirs(directory, exist_ok=True)
        self.backend_tokenizer.save(os.path.join(directory, "tokenizer.json"))
        config = {"tokenizer_class": GENERIC_CLASSES[0], **self.special_tokens_map}
        if self.additional_special_tokens:
            config["extra_special_tokens"] = self.additional_special_tokens
        with open(os.path.join(directory, "tokenizer_config.json"), "w", encoding="utf-8") as f:
            json.dump(config, f, indent=2, ensure_ascii=False)
        if self.chat_template:
            with open(os.path.join(directory, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(self.chat_template)

    # --- tokens and ids -----------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """`text`'s token ids, with the special tokens the post-processor adds (a BOS, say)
        when `add_special_tokens`."""
        # NOTE: a batch of one, as transformers encodes: the batch call releases the GIL (and
        # skips the offsets), so a long prompt does not stall a server's event loop meanwhile.
        batch = self.backend_tokenizer.encode_batch_fast(
            [text], add_special_tokens=add_special_tokens
        )
        return batch[0].ids

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        """transformers' `tokenizer(text)` for one text: its input_ids and attention_mask."""
        ids = self.encode(text, add_special_tokens)
        return {"input_ids": ids, "attention_mask": [1] * len(ids)}

    def decode(self, token_ids: int | Iterable[int], skip_special_tokens: bool = False) -> str:
        """The text of one id or a sequence of ids."""
        if not isinstance(token_ids, Iterable):  # an int, a numpy integer, a 0-d tensor
            token_ids = [token_ids]
        ids = [operator.index(i) for i in token_ids]
        return self.backend_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def batch_decode(
        self, sequences: Iterable[Iterable[int]], skip_special_tokens: bool = False
    ) -> list[str]:
        """decode of each sequence."""
        return [self.decode(ids, skip_special_tokens) for ids in sequences]

    def convert_ids_to_tokens(self, ids: int | Iterable[int]) -> str | None | list[str | None]:
        if isinstance(ids, int):
            return self.backend_tokenizer.id_to_token(ids)
        return [self.backend_tokenizer.id_to_token(i) for i in ids]

    def convert_tokens_to_ids(self, tokens: str | Iterable[str]) -> int | None | list[int | None]:
        if isinstance(tokens, str):
            return self.backend_tokenizer.token_to_id(tokens)
        return [self.backend_tokenizer.token_to_id(t) for t in tokens]

    def get_vocab(self) -> dict[str, int]:
        return self.backend_tokenizer.get_vocab(with_added_tokens=True)

    @property
    def vocab_size(self) -> int:
        """The base vocabulary, without added tokens (transformers' meaning)."""
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=False)

    def __len__(self) -> int:
        return self.backend_tokenizer.get_vocab_size(with_added_tokens=True)

    # --- special tokens -----------------------------------------------------------------

    def _special_id(self, name: str) -> int | None:
        token = self.special_tokens_map.get(name)
        return None if token is None else self.backend_tokenizer.token_to_id(token)

    bos_token = property(lambda self: self.special_tokens_map.get("bos_token"))
    eos_token = property(lambda self: self.special_tokens_map.get("eos_token"))
    unk_token = property(lambda self: self.special_tokens_map.get("unk_token"))
    pad_token = property(lambda self: self.special_tokens_map.get("pad_token"))
    bos_token_id = property(lambda self: self._special_id("bos_token"))
    eos_token_id = property(lambda self: self._special_id("eos_token"))
    unk_token_id = property(lambda self: self._special_id("unk_token"))
    pad_token_id = property(lambda self: self._special_id("pad_token"))

    @property
    def all_special_tokens(self) -> list[str]:
        named = [self.special_tokens_map.get(n) for n in SPECIAL_TOKEN_NAMES]
        return list(dict.fromkeys(t for t in [*named, *self.additional_special_tokens] if t))

    @property
    def all_special_ids(self) -> list[int]:
        ids = (self.backend_tokenizer.token_to_id(t) for t in self.all_special_tokens)
        return [i for i in ids if i is not None]

    # --- chats --------------------------------------------------------------------------

    def apply_chat_template(
        self,
        conversation: list[dict[str, Any]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        continue_final_message: bool = False,
        chat_template: str | None = None,
        **kwargs: Any,
    ) -> str | list[int]:
        """Renders one conversation as transformers does: the same jinja2 sandbox and helpers,
        the special tokens and `kwargs` as template variables, keys whose value is None left
        out, a message's reasoning under each of its usual names. `continue_final_message`
        ends the text where the last message's content ends. Tokenized without adding
        special tokens (the template writes them).

        Raises:
            ValueError: no chat template, or a template that drops the message to continue.
            jinja2.TemplateError: the template rejects the conversation.
        """
        template = chat_template or self.chat_template
        if not template:
            raise ValueError("this tokenizer has no chat template")
        if continue_final_message and add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both be set")
        if not conversation:
            raise ValueError("cannot render an empty conversation")
        messages = [_template_message(m) for m in _plain(list(conversation))]
        final = None
        if continue_final_message:
            final = messages[-1].get("content") if messages else None
            if not isinstance(final, str):
                raise ValueError("continue_final_message needs a last message with str content")
            messages[-1]["content"] = final + _CONTINUE_TAG
        variables = {"tools": None, "documents": None} | self.special_tokens_map | _plain(kwargs)
        text = _compile(template).render(
            messages=messages, add_generation_prompt=add_generation_prompt, **variables
        )
        if final is not None:
            text = _cut_at_tag(text, final)
        return self.encode(text, add_special_tokens=False) if tokenize else text


def _content(token: str | dict) -> str:
    """A special token as tokenizer_config.json stores it: a string, or an AddedToken dict."""
    return token["content"] if isinstance(token, dict) else token


def _plain(value: Any) -> Any:
    """What a template sees of `value`: JSON's types rebuilt (str, int, float, bool, None,
    dicts, lists, tuples), anything else as the placeholder "<TypeName>", so that no object
    with methods of its own reaches the sandbox."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    for kind in (bool, str, int, float):
        if isinstance(value, kind):  # a subclass (an enum, say): its plain value
            return kind(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return type(value)(_plain(v) for v in value)
    return f"<{type(value).__name__}>"


def _template_message(message: dict[str, Any]) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise ValueError(f"a chat message must be a dict, got {type(message).__name__}")
    message = {k: v for k, v in message.items() if v is not None}
    reasoning = next((message[k] for k in _REASONING_KEYS if k in message), None)
    if reasoning is not None:
        message = {"thinking": reasoning, **message, "reasoning_content": reasoning}
    return message


def _cut_at_tag(text: str, final: str) -> str:
    """The rendered text up to where the final message's content ended (the tag after it);
    a template that trimmed the content's trailing space trimmed the tag's too."""
    tag = _CONTINUE_TAG.strip()
    at = text.rfind(tag)
    if at < 0 or final.strip() not in text:
        raise ValueError(
            "continue_final_message: the chat template does not render the final message's "
            "content, so there is nothing to continue"
        )
    return text[:at] if text.startswith(_CONTINUE_TAG, at) else text[:at].rstrip()


@functools.lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationTag(jinja2.ext.Extension):
        """`{% generation %}...{% endgeneration %}` marks an assistant's text for training
        masks; rendering keeps the text as it is."""

        tags = {"generation"}  # noqa: RUF012 - jinja2 reads it from the class

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return jinja2.nodes.Scope(body).set_lineno(lineno)

    def raise_exception(message: str):
        raise jinja2.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
        # Unlike jinja2's own filter: no HTML escaping, and json.dumps' options.
        return json.dumps(
            x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
        )

    env = ImmutableSandboxedEnvironment(
        trim_blocks=True,
        lstrip_blocks=True,
        extensions=[GenerationTag, jinja2.ext.loopcontrols],
    )

    class Namespace(jinja2.utils.Namespace):
        """jinja2's namespace without underscore-named attributes, which could reach
        Python's internals."""

        def __init__(*args, **kwargs):  # jinja2's signature, so that namespace(self=1) works
            self, attributes = args[0], dict(*args[1:], **kwargs)
            for name in attributes:
                Namespace._check(name)
            jinja2.utils.Namespace.__init__(self, attributes)

        def __setitem__(self, name, value):
            Namespace._check(name)
            jinja2.utils.Namespace.__setitem__(self, name, value)

        @staticmethod
        def _check(name) -> None:
            if isinstance(name, str) and name.startswith("_"):
                raise jinja2.exceptions.SecurityError(f"namespace attribute {name!r} refused")

    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    # dict() and dict.fromkeys() only: the class itself would hand out dict.update.
    env.globals["dict"] = type("TemplateDict", (), {
        "__call__": lambda self, *a, **k: dict(*a, **k),
        "fromkeys": lambda self, *a, **k: dict.fromkeys(*a, **k),
    })()  # fmt: skip
    env.globals["namespace"] = Namespace
    return env.from_string(template)
