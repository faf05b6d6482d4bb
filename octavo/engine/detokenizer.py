"""Incremental detokenization: one request's new token ids in, finalized text out, stop strings.

Decoding token by token is wrong twice over: a character may be split across tokens (UTF-8
bytes of "你" or of an emoji), and some decoders look at neighbours (a SentencePiece "▁" is
a space except at the start). So each step decodes a small window of recent tokens and emits
only the text that the newest tokens added, once it is complete:

    output ids:  ... | t5 t6 | t7 t8      prefix_offset = 5, read_offset = 7
    prefix_text = decode(t5 t6)           (already emitted)
    new_text    = decode(t5 t6 t7 t8)     -> emit new_text[len(prefix_text):]
                                             unless it ends with "\\ufffd" (an unfinished
                                             character): then wait for more tokens

After an emission the window slides (prefix_offset = read_offset, read_offset = end), so
each step decodes a few tokens, never the whole output. Plain Python, no torch.

For a Rust-backed HF tokenizer, `tokenizers`' `DecodeStream` runs the same window rule in one
call a token, much cheaper than two `tokenizer.decode` calls from Python. The Python loop
takes over for good where the stream cannot follow (an unbounded window, a rewritten prefix).
"""

from __future__ import annotations

from typing import Protocol

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from octavo.tokenizer.fast_tokenizer import FastTokenizer

REPLACEMENT_CHAR = "\ufffd"
# Past this many held-back tokens, finalize at a safe split (see _finalize_held_tokens);
# a UTF-8 character has at most 4 bytes, and each token that decodes to text adds at least 1.
MAX_HELD_TOKENS = 8
_SPLIT_CANDIDATES = 4
# Where transformers defines its own decode path (4.x: "fast" tokenizers; 5.x: "backend").
_HF_DECODE = frozenset({
    "transformers.tokenization_utils_base",
    "transformers.tokenization_utils_fast",
    "transformers.tokenization_utils_tokenizers",
})  # fmt: skip
_BPE_CLEANUP_FLAG = "clean_up_tokenization_spaces_for_bpe_even_though_it_will_corrupt_output"


class Tokenizer(Protocol):
    def decode(self, token_ids: list[int], skip_special_tokens: bool = ...) -> str: ...


def rust_backend(tokenizer: object) -> RustTokenizer | None:
    """The `tokenizers.Tokenizer` under an HF tokenizer, where decoding with it gives what
    `tokenizer.decode` gives; else None.

    transformers' own `decode` runs the Rust decode and then, where the tokenizer asks for
    it, `clean_up_tokenization_spaces`; transformers 5.7 and later skip that clean-up for BPE
    models unless told otherwise. A subclass that overrides `decode` or `_decode` (Whisper's
    tokenizer, for one) may do more, and gets no fast path. A FastTokenizer decodes with its
    backend alone.
    """
    if isinstance(tokenizer, FastTokenizer):
        return tokenizer.backend_tokenizer
    backend = getattr(tokenizer, "_tokenizer", None)
    if not isinstance(backend, RustTokenizer):
        return None
    for name in ("decode", "_decode"):
        if getattr(getattr(type(tokenizer), name, None), "__module__", None) not in _HF_DECODE:
            return None
    if not getattr(tokenizer, "clean_up_tokenization_spaces", False):
        return backend
    # Before 5.7 the flag below does not exist, and the clean-up always runs.
    skips_cleanup = (
        type(backend.model).__name__ == "BPE"
        and getattr(tokenizer, _BPE_CLEANUP_FLAG, None) is False
    )
    return backend if skips_cleanup else None


class IncrementalDetokenizer:
    """Turns one request's generated token ids into text as they arrive, and finds stop strings.

    `params` is read by duck typing (a SamplingParams, or any object) for `stop`,
    `include_stop_str_in_output`, `skip_special_tokens` and `min_tokens`; missing attributes
    default to no stop strings, False, True and 0.

    Invariant: with no stop string matched, the finished `output_text` equals
    `tokenizer.decode(output_token_ids, skip_special_tokens=...)` in one shot.

    NOTE: vLLM seeds the window with the prompt's last tokens, which breaks that invariant (a
    SentencePiece word after the prompt gains a leading space; output bytes that finish a
    character the prompt began vanish). So the window starts at the first output token, and
    `prompt_token_ids` is accepted for the engine's convenience and not used.
    """

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: object) -> None:
        self.tokenizer = tokenizer
        stop = getattr(params, "stop", None) or []
        self.stop: list[str] = [stop] if isinstance(stop, str) else list(stop)
        if any(not isinstance(s, str) or not s for s in self.stop):
            raise ValueError(f"stop must be a list of non-empty strings, got {self.stop!r}")
        self.include_stop_str_in_output = bool(getattr(params, "include_stop_str_in_output", False))
        self.skip_special_tokens = bool(getattr(params, "skip_special_tokens", True))
        self.min_tokens = int(getattr(params, "min_tokens", 0) or 0)

        self.output_token_ids: list[int] = []
        self.output_text = ""
        # The stop string that ended the text, once one has matched.
        self.stop_reason: str | None = None
        # Streaming holds back this many trailing characters: they may start a stop string.
        self.stop_buffer_length = max((len(s) for s in self.stop), default=1) - 1
        self._prefix_offset = 0
        self._read_offset = 0
        self._num_chars_returned = 0
        # The Rust fast path, while it lasts (see the module docstring); it moves the same
        # offsets as _detokenize_step, so the Python loop can take over at any token.
        self._backend = rust_backend(tokenizer)
        skip = self.skip_special_tokens
        self._stream = None if self._backend is None else DecodeStream(skip_special_tokens=skip)

    def update(self, new_token_ids: list[int]) -> str | None:
        """Appends generated tokens, extends `output_text` with the text they finalize, and
        looks for stop strings in it.

        Returns:
            The stop string that matched (the earliest one in the text), or None. On a match
            `output_text` is cut right before the stop string (right after it with
            `include_stop_str_in_output`) and later calls add ids but no text.
        """
        for i, token_id in enumerate(new_token_ids):
            self.output_token_ids.append(token_id)
            if self.stop_reason is not None:
                continue
            text = self._stream_step(token_id) if self._stream is not None else None
            if text is None:
                text = self._detokenize_step()
            stop = self._append_text(text)
            if stop is not None:
                self.output_token_ids.extend(new_token_ids[i + 1 :])
                return stop
        return None

    def get_next_output_text(self, finished: bool, delta: bool) -> str:
        """The text to show the caller now, for streaming.

        Args:
            finished: the request is over. Text held back for an unfinished character is
                flushed, and the stop-string hold-back below is released.
            delta: return only the text not returned by an earlier delta call; else all of
                it (so far).

        While not finished, the last `max(len(stop)) - 1` characters are held back: they may
        be the start of a stop string, which must never reach the caller.
        """
        if finished:
            self._stream = None
            self._flush()
        final = finished or self.stop_reason is not None
        length = max(len(self.output_text) - (0 if final else self.stop_buffer_length), 0)
        if not delta:
            return self.output_text[:length]
        start = self._num_chars_returned
        self._num_chars_returned = max(start, length)
        return self.output_text[start:length]

    # ---- decoding ---------------------------------------------------------------------

    def _decode(self, token_ids: list[int]) -> str:
        if not token_ids:
            return ""
        decoder = self.tokenizer if self._backend is None else self._backend
        return decoder.decode(token_ids, skip_special_tokens=self.skip_special_tokens)

    def _stream_step(self, token_id: int) -> str | None:
        """The newest token's text by the `DecodeStream` ("" while a character is
        unfinished); None once the stream is dropped, and the Python loop decodes this token
        and every later one. The stream is dropped where its window would pass
        MAX_HELD_TOKENS (it has no bound of its own) and where it raises (a decoder that
        rewrote the text before the window's end: the stream's "invalid prefix")."""
        ids = self.output_token_ids
        try:
            text = self._stream.step(self._backend, token_id)
        except Exception:  # noqa: BLE001 - the stream's errors: the Python loop knows better
            self._stream = None
            return None
        if text is not None:
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            return text
        if len(ids) - self._read_offset > MAX_HELD_TOKENS:
            self._stream = None
            return None
        return ""

    def _detokenize_step(self) -> str:
        """The text finalized by the newest token ("" while a character is unfinished)."""
        ids = self.output_token_ids
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        if len(new_text) > len(prefix_text) and not new_text.endswith(REPLACEMENT_CHAR):
            self._prefix_offset, self._read_offset = self._read_offset, len(ids)
            return new_text[len(prefix_text) :]
        if len(ids) - self._read_offset > MAX_HELD_TOKENS:
            return self._finalize_held_tokens(prefix_text, new_text)
        return ""

    def _finalize_held_tokens(self, prefix_text: str, new_text: str) -> str:
        """Bounds the window when many tokens in a row leave the text unfinished (a model
        spewing stray UTF-8 bytes, or special tokens that decode to nothing).

        Finalizes up to the latest split point `s` among the last few tokens where decoding
        the two sides apart gives the same text as decoding them together: no character
        straddles `s`, so the text before it can never change. None found: keep waiting.
        """
        ids = self.output_token_ids
        start = self._prefix_offset
        lowest = max(self._read_offset + 1, len(ids) - _SPLIT_CANDIDATES)
        for split in range(len(ids) - 1, lowest - 1, -1):
            head = self._decode(ids[start:split])
            if head + self._decode(ids[split:]) == new_text and len(head) >= len(prefix_text):
                self._prefix_offset, self._read_offset = self._read_offset, split
                return head[len(prefix_text) :]
        return ""

    def _flush(self) -> None:
        """Emits the text held back at the end (an unfinished or invalid last character)."""
        ids = self.output_token_ids
        if self.stop_reason is not None or self._read_offset == len(ids):
            return
        prefix_text = self._decode(ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(ids)
        self._append_text(new_text[len(prefix_text) :])

    # ---- stop strings -----------------------------------------------------------------

    def _append_text(self, text: str) -> str | None:
        """Appends finalized text; returns the stop string it completed, if any."""
        if not text:
            return None
        old_length = len(self.output_text)
        self.output_text += text
        if not self.stop or len(self.output_token_ids) <= self.min_tokens:  # as stop ids, vLLM
            return None
        return self._find_stop(old_length)

    def _find_stop(self, old_length: int) -> str | None:
        """Searches the new text, plus the `len(stop) - 1` characters before it where a stop
        string could have begun; the earliest match wins (ties: the first in `stop`)."""
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.output_text.find(stop, max(0, old_length - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.include_stop_str_in_output else index
        self.output_text = self.output_text[:end]
        self.stop_reason = stop
        return stop
