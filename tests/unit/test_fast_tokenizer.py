"""FastTokenizer against transformers' tokenizer read from the same saved files: the same ids,
text, special tokens and rendered chats."""

from __future__ import annotations

import datetime
import json
import os
import shutil

import jinja2
import numpy as np
import pytest
from transformers import AutoTokenizer

from octavo.tokenizer import tokenizer as tokenizer_module
from octavo.tokenizer.fast_tokenizer import FastTokenizer

TEXTS = [
    "Hello, world!",
    "def f(x):\n\treturn x  # 你好 🌍",
    "  leading and trailing spaces  ",
    "<|im_start|>user\nhi<|im_end|>\n<|endoftext|>",
    "",
    "e\u0301 \U0001f600 x",
]


@pytest.fixture(scope="module")
def saved(smollm2_path):
    """The embedded model's converted tokenizer as saved in the cache."""
    tokenizer_module.load_tokenizer(smollm2_path)
    path = tokenizer_module.gguf_tokenizer_cache_dir(os.path.realpath(smollm2_path))
    return path


@pytest.fixture(scope="module")
def pair(saved):
    fast = FastTokenizer.from_directory(saved)
    assert fast is not None
    return fast, AutoTokenizer.from_pretrained(saved)


def test_the_embedded_model_gets_a_fast_tokenizer(smollm2_tokenizer):
    assert isinstance(smollm2_tokenizer, FastTokenizer)


def test_ids_and_text_match_transformers(pair):
    fast, hf = pair
    for text in TEXTS:
        for special in (True, False):
            ids = hf.encode(text, add_special_tokens=special)
            assert fast.encode(text, add_special_tokens=special) == ids, text
        for skip in (True, False):
            assert fast.decode(ids, skip_special_tokens=skip) == hf.decode(
                ids, skip_special_tokens=skip
            )
    every = list(range(len(hf)))
    assert [fast.decode([i]) for i in every] == [hf.decode([i]) for i in every]
    assert fast.convert_ids_to_tokens(every) == hf.convert_ids_to_tokens(every)
    assert fast.batch_decode([[1, 2], [3]]) == hf.batch_decode([[1, 2], [3]])
    assert fast.convert_tokens_to_ids("<|im_end|>") == hf.convert_tokens_to_ids("<|im_end|>")
    assert fast.get_vocab() == hf.get_vocab()


def test_special_tokens_match_transformers(pair):
    fast, hf = pair
    assert (len(fast), fast.vocab_size) == (len(hf), hf.vocab_size)
    assert fast.special_tokens_map == hf.special_tokens_map
    assert fast.all_special_tokens == hf.all_special_tokens
    assert fast.all_special_ids == hf.all_special_ids
    for name in ("bos", "eos", "unk", "pad"):
        assert getattr(fast, f"{name}_token") == getattr(hf, f"{name}_token")
        assert getattr(fast, f"{name}_token_id") == getattr(hf, f"{name}_token_id")


CHATS = [
    [{"role": "user", "content": "What is 2 + 2?"}],
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "Hello! "},
    ],
    [{"role": "user", "content": "x", "name": None}, {"role": "assistant", "content": "a\n"}],
]

# Templates that use what transformers' sandbox adds to jinja2's: loop controls, `tojson`
# with its options, the generation tag, namespaces, special tokens as variables,
# raise_exception, reasoning under another name, and whitespace control.
TEMPLATES = {
    "features": (
        "{{ bos_token }}{% set ns = namespace(n=0) %}"
        "{% for m in messages %}{% if m.role == 'system' %}{% continue %}{% endif %}"
        "{% set ns.n = ns.n + 1 %}"
        "{{ {'r': m.role, 'i': loop.index, 'é': 1} | tojson(indent=1, sort_keys=true) }}"
        "  {{ m.role }}: {{ m.content }}\n"
        "{% if m.role == 'assistant' %}{% generation %}[{{ loop.index }}]{% endgeneration %}"
        "{% endif %}{% if m.reasoning_content is defined %}<think>{{ m.reasoning_content }}"
        "</think>{% endif %}{% endfor %}{{ ns.n }}"
        "{% if add_generation_prompt %}assistant:{% endif %}{{ eos_token }}"
        "{% if tools is none and documents is none %}.{% endif %}"
    ),
    "blocks": (
        "{% for m in messages %}\n"
        "    {% if m.name is defined %}name={{ m.name }}{% endif %}\n"
        "{{ m.role }}: {{ m.content }}\n"
        "{% endfor %}\n"
    ),
    "trims": (
        "{% for m in messages %}<{{ m.role }}>{{ m.content | trim }}</{{ m.role }}>"
        "{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
    ),
}


@pytest.mark.parametrize("name", sorted(TEMPLATES))
def test_chats_render_as_transformers_renders_them(pair, name):
    fast, hf = pair
    template = TEMPLATES[name]
    for chat in CHATS:
        for prompt in (True, False):
            got = fast.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt, chat_template=template
            )
            want = hf.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=prompt, chat_template=template
            )
            assert got == want, (name, chat)
        got = fast.apply_chat_template(chat, chat_template=template, continue_final_message=True)
        want = hf.apply_chat_template(
            chat, tokenize=False, chat_template=template, continue_final_message=True
        )
        assert got == hf.encode(want, add_special_tokens=False), (name, chat)
    for thinking in (
        [{"role": "assistant", "content": "4", "reasoning": "2 + 2"}],
        [{"role": "assistant", "content": "4", "thinking": "a", "reasoning_content": "b"}],
    ):
        got = fast.apply_chat_template(thinking, tokenize=False, chat_template=template)
        assert got == hf.apply_chat_template(thinking, tokenize=False, chat_template=template)


def test_the_models_own_chat_template_renders_as_transformers(pair):
    fast, hf = pair
    assert fast.chat_template == hf.chat_template
    for chat in CHATS:
        kwargs = {"add_generation_prompt": True}
        assert fast.apply_chat_template(chat, **kwargs) == hf.apply_chat_template(
            chat, return_dict=False, **kwargs
        )


def test_template_errors_and_bad_requests(pair):
    fast, _ = pair
    with pytest.raises(jinja2.TemplateError, match="no system"):
        fast.apply_chat_template(CHATS[0], chat_template="{{ raise_exception('no system') }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CHATS[0], chat_template="{{ messages.__class__.__mro__ }}")
    with pytest.raises(jinja2.exceptions.SecurityError):
        fast.apply_chat_template(CHATS[0], chat_template="{% set ns = namespace(_x=1) %}")
    meta = {"k": 1}
    chat = [{"role": "user", "content": "hi", "meta": meta, "when": datetime.date(2000, 1, 2)}]
    with pytest.raises(jinja2.TemplateError):  # dict() is callable, dict.update is not there
        fast.apply_chat_template(
            chat, chat_template="{{ dict.update(messages[0].meta, {'k': 2}) }}"
        )
    assert meta == {"k": 1}
    shown = "{{ dict(a=1) }} {{ messages[0].when }}"
    assert fast.apply_chat_template(chat, tokenize=False, chat_template=shown) == "{'a': 1} <date>"
    with pytest.raises(ValueError, match="empty"):
        fast.apply_chat_template([])
    with pytest.raises(ValueError, match="cannot both"):
        fast.apply_chat_template(CHATS[0], add_generation_prompt=True, continue_final_message=True)
    with pytest.raises(ValueError, match="nothing to continue"):
        fast.apply_chat_template(
            CHATS[0],
            continue_final_message=True,
            chat_template="{% for m in messages %}x{% endfor %}",
        )
    bare = FastTokenizer(fast.backend_tokenizer, {})
    with pytest.raises(ValueError, match="no chat template"):
        bare.apply_chat_template(CHATS[0])
    assert bare.eos_token_id is None and bare.all_special_ids == []


def test_from_directory_declines_what_it_does_not_read(saved, tmp_path):
    """Another tokenizer class, or settings beyond tokenizer.json: transformers reads those."""
    with open(os.path.join(saved, "tokenizer_config.json")) as f:
        config = json.load(f)
    assert FastTokenizer.from_directory(str(tmp_path)) is None  # no files
    for change in (
        {"tokenizer_class": "LlamaTokenizer"},
        {"add_bos_token": True},
        {"clean_up_tokenization_spaces": True},
        {"split_special_tokens": True},
        {"chat_template": [{"name": "default", "template": "x"}]},
        {"extra_special_tokens": {"image_token": "<|im_start|>"}},
        {"pad_token": "<pad>"},  # not in tokenizer.json: transformers would add it
        {"added_tokens_decoder": {"49152": {"content": "<new>", "special": True}}},
    ):
        shutil.copyfile(os.path.join(saved, "tokenizer.json"), tmp_path / "tokenizer.json")
        (tmp_path / "tokenizer_config.json").write_text(json.dumps(config | change))
        assert FastTokenizer.from_directory(str(tmp_path)) is None, change
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(config))
    assert FastTokenizer.from_directory(str(tmp_path)) is not None


def test_truncation_set_in_tokenizer_json_is_not_applied(saved, tmp_path):
    """transformers truncates only when asked to, whatever tokenizer.json says."""
    with open(os.path.join(saved, "tokenizer.json")) as f:
        data = json.load(f)
    data["truncation"] = {"direction": "Right", "max_length": 3, "strategy": "LongestFirst",
                          "stride": 0}  # fmt: skip
    (tmp_path / "tokenizer.json").write_text(json.dumps(data))
    shutil.copyfile(
        os.path.join(saved, "tokenizer_config.json"), tmp_path / "tokenizer_config.json"
    )
    fast, hf = FastTokenizer.from_directory(str(tmp_path)), AutoTokenizer.from_pretrained(tmp_path)
    assert fast.encode(TEXTS[1]) == hf.encode(TEXTS[1])
    assert len(fast.encode(TEXTS[1])) > 3


def test_calls_as_transformers_takes_them(pair):
    fast, hf = pair
    assert fast("hi there") == dict(hf("hi there"))
    ids = hf.encode(TEXTS[0])
    assert fast.decode(np.array(ids)) == fast.decode(ids) == hf.decode(ids)
    assert fast.decode(np.int64(ids[0])) == hf.decode(ids[0])
    assert fast.model_max_length == hf.model_max_length


def test_a_saved_fast_tokenizer_reads_back_in_transformers(pair, tmp_path):
    fast, hf = pair
    fast.save_pretrained(str(tmp_path))
    again = AutoTokenizer.from_pretrained(str(tmp_path))
    assert again.special_tokens_map == hf.special_tokens_map
    assert again.chat_template == hf.chat_template
    assert again.encode(TEXTS[1]) == hf.encode(TEXTS[1])
    assert FastTokenizer.from_directory(str(tmp_path)).encode(TEXTS[1]) == hf.encode(TEXTS[1])
