"""POST /tokenize and /detokenize, as vLLM's server has them: a prompt or a conversation to
the token ids the engine would run on, and token ids back to text.

    {"prompt": "Hello"}                          -> {"count": 1, "max_model_len": 8192,
    {"messages": [{"role": "user", ...}]}            "tokens": [19556], "token_strs": null}
    {"tokens": [19556]}  (to /detokenize)        -> {"prompt": "Hello"}
"""

from __future__ import annotations

from octavo.entrypoints.openai.limits import MAX_CHARS_PER_TOKEN
from octavo.entrypoints.openai.protocol import (
    DetokenizeRequest,
    DetokenizeResponse,
    TokenizeChatRequest,
    TokenizeCompletionRequest,
    TokenizeResponse,
)
from octavo.entrypoints.openai.serving import OpenAIError, ServingContext
from octavo.entrypoints.openai.serving_chat import render_conversation
from octavo.tokenizer.tokenizer import encode_text


def tokenize(
    ctx: ServingContext, req: TokenizeCompletionRequest | TokenizeChatRequest
) -> TokenizeResponse:
    """The ids of a prompt (with the tokenizer's special tokens unless told otherwise, as a
    completion gets them) or of a conversation rendered by the chat template."""
    ctx.check_model(req.model)
    tokenizer = _tokenizer(ctx)
    if isinstance(req, TokenizeChatRequest):
        ids = render_conversation(ctx, req, add_special_tokens=req.add_special_tokens)
    else:
        ctx.check_prompt_chars(len(req.prompt))
        try:
            ids = encode_text(tokenizer, req.prompt, add_special_tokens=req.add_special_tokens)
        except ValueError as e:
            raise OpenAIError(str(e), param="prompt") from e
    return TokenizeResponse(
        count=len(ids),
        max_model_len=ctx.max_model_len,
        tokens=ids,
        token_strs=tokenizer.convert_ids_to_tokens(ids) if req.return_token_strs else None,
    )


def detokenize(ctx: ServingContext, req: DetokenizeRequest) -> DetokenizeResponse:
    """The text of token ids, special tokens included, as vLLM gives it; at most as many ids
    as a prompt may have characters (MAX_CHARS_PER_TOKEN x max_model_len)."""
    ctx.check_model(req.model)
    tokenizer = _tokenizer(ctx)
    limit = MAX_CHARS_PER_TOKEN * ctx.max_model_len
    if len(req.tokens) > limit:
        message = f"`tokens` holds {len(req.tokens)} ids, more than this server's limit of {limit}"
        raise OpenAIError(message, param="tokens")
    bad = next((t for t in req.tokens if not 0 <= t < len(tokenizer)), None)
    if bad is not None:
        message = f"token id {bad} is outside the tokenizer's vocabulary [0, {len(tokenizer)})"
        raise OpenAIError(message, param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(req.tokens))


def _tokenizer(ctx: ServingContext):
    if ctx.tokenizer is None:
        raise OpenAIError("this model has no tokenizer (it takes prompts as token ids)")
    return ctx.tokenizer
