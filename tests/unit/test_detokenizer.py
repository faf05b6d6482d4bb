"""IncrementalDetokenizer with the real SmolLM2 tokenizer: streamed text equals a one-shot
decode, stop strings cut the text at the right place and never leak while streaming.

The text tests run twice: on the Rust fast path (`tokenizers`' DecodeStream) and on the
Python loop, reached by hiding the tokenizer's Rust backend (`PythonDecodeOnly`)."""

from __future__ import annotations

import functools
from types import SimpleNamespace

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer, decoders, pre_tokenizers
from tokenizers.models import WordPiece
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from octavo.engine.detokenizer import MAX_HELD_TOKENS, IncrementalDetokenizer, rust_backend

TEXTS = [
    "Hello, world!",
    " leading space and trailing space ",
    "  two leading spaces",
    "你好，世界！今天天气很好。",
    "日本語のテキスト：ひらがな、カタカナ、漢字。",
    "emoji 👍 👍🏽 👩🏿‍💻 👨‍👩‍👧‍👦 🏳️‍🌈 🇫🇷 ❤️",
    "👍🏻👍🏼👍🏽👍🏾👍🏿",
    "café naïve façade Ærøskøbing São Paulo Łódź",
    "def f(x):\n\tif x:\n\t\treturn [x,\n            x]  # odd   spacing\r\n\n\n",
    "    indented\n\t\ttabs\t and\u00a0nbsp\u3000ideographic space",
    "mixed: English, Русский, Ελληνικά, עברית, العربية, हिन्दी, 한국어, ไทย",
    "math ∑∫∂√∞ ≠ ≤ ≥ and 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝟘𝟙𝟚",
    "<|im_start|>assistant\nA reply.<|im_end|>\n<|endoftext|>",
    "\ufffd literal replacement char, then text",
]


class PythonDecodeOnly:
    """The tokenizer with its Rust backend hidden: the detokenizer's Python loop decodes."""

    def __init__(self, tok) -> None:
        self.tok = tok

    def __getattr__(self, name: str):
        if name == "_tokenizer":
            raise AttributeError(name)
        return getattr(self.tok, name)

    def __len__(self) -> int:
        return len(self.tok)


@pytest.fixture(scope="module", params=["rust", "python"])
def any_path_tokenizer(request, smollm2_tokenizer):
    """The SmolLM2 tokenizer, once as it is and once with only Python's decode."""
    if request.param == "rust":
        return smollm2_tokenizer
    return PythonDecodeOnly(smollm2_tokenizer)


def params(**overrides) -> SimpleNamespace:
    base = {
        "stop": [],
        "include_stop_str_in_output": False,
        "skip_special_tokens": True,
        "min_tokens": 0,
    }
    return SimpleNamespace(**(base | overrides))


def stream(tok, ids: list[int], prompt_ids: list[int] | None = None, **overrides):
    """Feeds ids one at a time, collecting streamed deltas; returns (detok, deltas, stop)."""
    detok = IncrementalDetokenizer(tok, prompt_ids or [], params(**overrides))
    deltas, stop = [], None
    for token_id in ids:
        stop = detok.update([token_id])
        deltas.append(detok.get_next_output_text(finished=stop is not None, delta=True))
        if stop is not None:
            break
    deltas.append(detok.get_next_output_text(finished=True, delta=True))
    return detok, deltas, stop


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


# ---- streamed text equals the one-shot decode ---------------------------------------


@pytest.mark.parametrize("skip_special_tokens", [True, False])
@pytest.mark.parametrize("text", TEXTS)
def test_streamed_text_equals_one_shot_decode(any_path_tokenizer, text, skip_special_tokens):
    tok = any_path_tokenizer
    ids = encode(tok, text)
    detok, deltas, stop = stream(tok, ids, skip_special_tokens=skip_special_tokens)
    expected = tok.decode(ids, skip_special_tokens=skip_special_tokens)
    assert stop is None
    assert "".join(deltas) == expected
    assert detok.output_text == expected
    assert detok.output_token_ids == ids


def test_multi_byte_characters_span_tokens_in_these_texts(smollm2_tokenizer):
    """Guards the test data: the texts above must really split characters across tokens."""
    tok = smollm2_tokenizer
    ids = encode(tok, "你好 👨‍👩‍👧‍👦")
    assert any(tok.decode([i]).endswith("\ufffd") for i in ids)


def test_special_tokens_are_skipped_or_kept(any_path_tokenizer):
    tok = any_path_tokenizer
    ids = encode(tok, "Hi<|im_end|>")
    assert stream(tok, ids)[0].output_text == "Hi"
    assert stream(tok, ids, skip_special_tokens=False)[0].output_text == "Hi<|im_end|>"


def test_leading_space_token_after_prompt_decodes_as_output_alone(smollm2_tokenizer):
    tok = smollm2_tokenizer
    prompt = encode(tok, "<|im_start|>user\nCapital of France?<|im_end|>\nThe capital is")
    output = encode(tok, " Paris, of course.")
    detok, deltas, _ = stream(tok, output, prompt_ids=prompt)
    assert deltas[0] == " Paris"
    assert detok.output_text == tok.decode(output, skip_special_tokens=True)


def test_output_finishing_a_character_the_prompt_began(any_path_tokenizer):
    """The prompt ends mid-character: the output's first bytes are decoded as the output's
    own one-shot decode has them, not merged with the prompt."""
    tok = any_path_tokenizer
    ids = encode(tok, "你好 world")
    split = next(i for i in range(1, len(ids)) if tok.decode(ids[:i]).endswith("\ufffd"))
    detok, _, _ = stream(tok, ids[split:], prompt_ids=ids[:split])
    assert detok.output_text == tok.decode(ids[split:])
    assert detok.output_text.startswith("\ufffd")


def test_many_tokens_per_update_equals_one_at_a_time(any_path_tokenizer):
    tok = any_path_tokenizer
    ids = encode(tok, TEXTS[5] + TEXTS[3])
    detok = IncrementalDetokenizer(tok, [], params())
    for start in range(0, len(ids), 3):
        detok.update(ids[start : start + 3])
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(ids)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=st.text(max_size=60))
def test_random_unicode_text_streams_like_one_shot(any_path_tokenizer, text):
    tok = any_path_tokenizer
    ids = encode(tok, text)
    detok, deltas, _ = stream(tok, ids)
    assert "".join(deltas) == detok.output_text == tok.decode(ids, skip_special_tokens=True)


@functools.cache
def short_tokens(tok) -> list[int]:
    """Ids of tokens of one or two bytes: mostly pieces of multi-byte characters."""
    return [i for i in range(len(tok)) if len(tok.convert_ids_to_tokens(i)) <= 2]


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_random_token_ids_stream_like_one_shot(any_path_tokenizer, data):
    """Arbitrary ids, as a random-weights model emits: stray UTF-8 bytes, specials."""
    tok = any_path_tokenizer
    token = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(short_tokens(tok)))
    ids = data.draw(st.lists(token, max_size=40))
    skip = data.draw(st.booleans())
    _, deltas, _ = stream(tok, ids, skip_special_tokens=skip)
    assert "".join(deltas) == tok.decode(ids, skip_special_tokens=skip)


# ---- bounded work per token ---------------------------------------------------------


class CountingTokenizer:
    """Wraps a tokenizer and records the longest id list it was asked to decode."""

    def __init__(self, tok) -> None:
        self.tok = tok
        self.longest = 0

    def decode(self, ids, skip_special_tokens=False):
        self.longest = max(self.longest, len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


def test_decode_window_stays_small_on_long_text(smollm2_tokenizer):
    tok = CountingTokenizer(smollm2_tokenizer)
    ids = encode(smollm2_tokenizer, " ".join(TEXTS) * 4)
    detok, _, _ = stream(tok, ids)
    assert len(ids) > 500
    assert tok.longest <= 8
    assert detok.output_text == smollm2_tokenizer.decode(ids, skip_special_tokens=True)


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_decode_window_stays_bounded_on_stray_bytes_and_specials(
    smollm2_tokenizer, skip_special_tokens
):
    """A degenerate stream (a half emoji over and over, special tokens) never finishes a
    character; the window must still slide, and the text must still match in the end,
    including an emoji finished after the long run."""
    tok = CountingTokenizer(smollm2_tokenizer)
    half_emoji = smollm2_tokenizer.convert_tokens_to_ids("ðŁ")  # bytes F0 9F
    finish = smollm2_tokenizer.convert_tokens_to_ids(["ĳ", "į"])  # bytes 91 8D -> 👍
    ids = [half_emoji] * 100 + [2] * 50 + [half_emoji] * 30 + finish
    detok, _, _ = stream(tok, ids, skip_special_tokens=skip_special_tokens)
    assert tok.longest <= 3 * MAX_HELD_TOKENS
    expected = smollm2_tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
    assert expected.endswith("\ufffd👍")
    assert detok.output_text == expected


def test_rust_path_hands_a_long_unfinished_run_to_the_bounded_python_loop(smollm2_tokenizer):
    """The DecodeStream has no bound on its window: past MAX_HELD_TOKENS held tokens the
    detokenizer drops it, and the Python loop, which finalizes at safe splits, goes on."""
    tok = smollm2_tokenizer
    half_emoji = tok.convert_tokens_to_ids("ðŁ")
    finish = tok.convert_tokens_to_ids(["ĳ", "į"])
    detok = IncrementalDetokenizer(tok, [], params())
    detok.update(encode(tok, "ok "))
    assert detok._stream is not None
    detok.update([half_emoji] * MAX_HELD_TOKENS)
    assert detok._stream is not None
    detok.update([half_emoji] * 60 + finish)
    assert detok._stream is None
    ids = encode(tok, "ok ") + [half_emoji] * (MAX_HELD_TOKENS + 60) + finish
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(ids)


@settings(max_examples=50, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=st.data())
def test_rust_and_python_paths_stream_the_same_deltas(smollm2_tokenizer, data):
    """Both paths move the same window: token by token, they emit the same text."""
    tok = smollm2_tokenizer
    text = data.draw(st.sampled_from(TEXTS))
    token = st.one_of(st.integers(0, len(tok) - 1), st.sampled_from(short_tokens(tok)))
    ids = encode(tok, text) + data.draw(st.lists(token, max_size=20))
    skip = data.draw(st.booleans())
    rust = stream(tok, ids, skip_special_tokens=skip)[1]
    python = stream(PythonDecodeOnly(tok), ids, skip_special_tokens=skip)[1]
    assert rust == python


def test_rust_backend_only_where_it_decodes_as_transformers_does(smollm2_tokenizer, tmp_path):
    """The fast path decodes with the Rust backend alone: it may be taken only where
    transformers' decode gives the same text, its clean-up of spaces included."""
    assert rust_backend(smollm2_tokenizer) is smollm2_tokenizer.backend_tokenizer
    assert rust_backend(PythonDecodeOnly(smollm2_tokenizer)) is None
    smollm2_tokenizer.save_pretrained(tmp_path)
    hf = AutoTokenizer.from_pretrained(tmp_path)
    assert rust_backend(hf) is hf._tokenizer
    bpe_cleaned = AutoTokenizer.from_pretrained(tmp_path, clean_up_tokenization_spaces=True)
    wordpiece = Tokenizer(WordPiece({"[UNK]": 0, "a": 1, ",": 2, ".": 3}, unk_token="[UNK]"))
    wordpiece.pre_tokenizer = pre_tokenizers.Whitespace()
    wordpiece.decoder = decoders.WordPiece(cleanup=False)  # the clean-up is transformers' alone
    wp_cleaned = PreTrainedTokenizerFast(tokenizer_object=wordpiece, unk_token="[UNK]",
                                         clean_up_tokenization_spaces=True)  # fmt: skip
    for tok in (hf, bpe_cleaned, wp_cleaned):
        ids = tok.encode("a , a . a", add_special_tokens=False)
        same = tok.decode(ids) == tok._tokenizer.decode(ids)
        assert same or rust_backend(tok) is None
    ids = wp_cleaned.encode("a , a .", add_special_tokens=False)
    assert wp_cleaned.decode(ids) != wp_cleaned._tokenizer.decode(ids)  # the case is real

    class OwnDecode(PreTrainedTokenizerFast):
        def _decode(self, token_ids, **kwargs) -> str:
            return "its own text"

    assert rust_backend(OwnDecode(tokenizer_object=wordpiece, unk_token="[UNK]")) is None


def test_rust_path_decodes_real_text_without_the_python_loop(smollm2_tokenizer, monkeypatch):
    """On real text the DecodeStream is never dropped: the speed-up is not lost silently."""

    def python_loop(self):
        raise AssertionError("the Python loop ran")

    monkeypatch.setattr(IncrementalDetokenizer, "_detokenize_step", python_loop)
    for text in TEXTS[:-2]:  # the last two end in text held back or decoded as specials
        ids = encode(smollm2_tokenizer, text)
        detok = IncrementalDetokenizer(smollm2_tokenizer, [], params())
        detok.update(ids)
        assert detok._stream is not None


def test_text_held_for_an_unfinished_character_is_flushed_at_the_end(any_path_tokenizer):
    tok = any_path_tokenizer
    ids = encode(tok, "ok 👍")[:-1]
    detok = IncrementalDetokenizer(tok, [], params())
    detok.update(ids)
    assert detok.output_text == "ok"
    assert detok.get_next_output_text(finished=True, delta=False) == tok.decode(ids)


# ---- stop strings -------------------------------------------------------------------

STORY = "The cat sat on the mat. Then the cat slept on the mat all day."


def test_stop_string_of_one_token(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    assert " Then" in [tok.decode([i]) for i in ids]
    detok, deltas, stop = stream(tok, ids, stop=[" Then"])
    assert stop == " Then"
    assert detok.output_text == "The cat sat on the mat."
    assert "".join(deltas) == detok.output_text
    assert detok.stop_reason == " Then"


def test_stop_string_spanning_tokens(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    assert "at. Th" not in [tok.decode([i]) for i in ids]
    detok, _, stop = stream(tok, ids, stop=["at. Th"])
    assert stop == "at. Th"
    assert detok.output_text == "The cat sat on the m"


def test_stop_string_inside_multi_byte_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    detok, _, stop = stream(tok, encode(tok, "你好，世界！今天天气很好。"), stop=["天气"])
    assert stop == "天气"
    assert detok.output_text == "你好，世界！今天"


def test_earliest_stop_string_wins(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    detok, _, stop = stream(tok, ids, stop=["mat"])
    assert detok.output_text == "The cat sat on the "
    # Both arrive in the same token; the listed-second one starts earlier.
    detok, _, stop = stream(tok, ids, stop=["at.", "mat."])
    assert (stop, detok.output_text) == ("mat.", "The cat sat on the ")


def test_include_stop_str_in_output(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    detok, deltas, stop = stream(tok, ids, stop=["at. Th"], include_stop_str_in_output=True)
    assert stop == "at. Th"
    assert detok.output_text == "The cat sat on the mat. Th"
    assert "".join(deltas) == detok.output_text


def test_min_tokens_delays_stop_checks(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    first_mat = next(i for i in range(len(ids)) if "mat" in tok.decode(ids[: i + 1]))
    for min_tokens in (first_mat + 1, first_mat + 2):  # its token is one of the first ones
        detok, _, stop = stream(tok, ids, stop=["mat"], min_tokens=min_tokens)
        assert stop == "mat"
        assert detok.output_text == "The cat sat on the mat. Then the cat slept on the "
    detok, _, stop = stream(tok, ids, stop=["mat"], min_tokens=first_mat)  # the next one
    assert detok.output_text == "The cat sat on the "
    detok, _, stop = stream(tok, ids, stop=["mat"], min_tokens=len(ids) + 1)
    assert stop is None and detok.output_text == STORY


def test_update_after_stop_adds_ids_but_no_text(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = encode(tok, STORY)
    detok = IncrementalDetokenizer(tok, [], params(stop=["sat"]))
    assert detok.update(ids[:5]) == "sat"
    assert detok.output_token_ids == ids[:5]
    assert detok.update(ids[5:]) is None
    assert detok.output_text == "The cat "
    assert detok.output_token_ids == ids


@pytest.mark.parametrize("stop", [["at. Th"], ["mat. Then the dog"], ["天气很", "y."]])
@pytest.mark.parametrize("include", [False, True])
def test_streaming_never_exposes_a_partial_stop_string(smollm2_tokenizer, stop, include):
    tok = smollm2_tokenizer
    text = STORY + " 今天天气很好。"
    detok = IncrementalDetokenizer(tok, [], params(stop=stop, include_stop_str_in_output=include))
    shown = ""
    for token_id in encode(tok, text):
        matched = detok.update([token_id])
        shown += detok.get_next_output_text(finished=matched is not None, delta=True)
        full = detok.get_next_output_text(finished=matched is not None, delta=False)
        assert full == shown
        if matched is not None:
            break
    shown += detok.get_next_output_text(finished=True, delta=True)
    # Deltas are only ever appended: nothing shown was later cut away.
    assert shown == detok.output_text
    assert text.startswith(shown)
    if detok.stop_reason is None:
        assert shown == text
    elif include:
        assert shown.endswith(detok.stop_reason)
    else:
        assert not any(s in shown for s in stop)


def test_bad_stop_strings_are_rejected(smollm2_tokenizer):
    with pytest.raises(ValueError, match="non-empty strings"):
        IncrementalDetokenizer(smollm2_tokenizer, [], params(stop=[""]))
