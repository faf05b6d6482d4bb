"""What a request brings, checked before the engine takes it: its prompt as token ids, and
the ids an abort names."""

from __future__ import annotations

from collections.abc import Iterable

from octavo.tokenizer.tokenizer import encode_text


def request_id_list(request_ids: object) -> list[str]:
    """The ids of an abort: one str or an iterable of them; ValueError for anything else."""
    ids = [request_ids] if isinstance(request_ids, str) else request_ids
    if isinstance(ids, Iterable):
        ids = list(ids)
    if not isinstance(ids, list) or not all(isinstance(r, str) for r in ids):
        raise ValueError("request_ids must be a str or an iterable of str")
    return ids


def tokenize_prompt(
    tokenizer, prompt: str | list[int], keep_last: int | None = None
) -> tuple[str | None, list[int]]:
    """The prompt's text (None for ids) and ids, at most `keep_last` of them."""
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("this model has no tokenizer: pass prompt_token_ids instead")
        ids = encode_text(tokenizer, prompt, add_special_tokens=True, keep_last=keep_last)
        return prompt, ids
    # NOTE: set(map(type, ...)) walks the list in C: prompts are 100k+ tokens at times.
    if isinstance(prompt, (list, tuple)) and set(map(type, prompt)) <= {int}:
        return None, list(prompt if keep_last is None else prompt[-keep_last:])
    raise ValueError("a prompt must be a str or a list of int token ids")


def check_prompt_ids(token_ids: list[int], max_model_len: int, vocab_size: int) -> None:
    """ValueError unless the prompt has 1 to max_model_len ids, all in the vocabulary."""
    if not token_ids:
        raise ValueError("the prompt is empty")
    if len(token_ids) > max_model_len:
        raise ValueError(
            f"the prompt has {len(token_ids)} tokens, more than max_model_len={max_model_len}"
        )
    if min(token_ids) < 0 or max(token_ids) >= vocab_size:
        bad = next(t for t in token_ids if not 0 <= t < vocab_size)
        raise ValueError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size})")
