"""Start-up: one read of a GGUF file serves the config, the tokenizer and the weights; the
fast dequantizers and the tokenizer class octavo picks match what the slower paths give; the
engine is built without the heavy modules it does not need, one rotary table serves every
layer, and the CPU KV cache is not written at start-up."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import gguf
import numpy as np
import pytest
import torch
from gguf.quants import dequantize, quantize
from model_utils import TINY
from transformers import AutoTokenizer, LlamaConfig

from octavo.checkpoint import gguf as gguf_loader
from octavo.checkpoint import gguf_blocks
from octavo.model.llama import LlamaForCausalLM
from octavo.model.rotary import RotaryEmbedding
from octavo.runner.kv_setup import zeroed_kv_cache
from octavo.tokenizer import tokenizer as tokenizer_module

Q = gguf.GGMLQuantizationType


def test_llm_reads_the_gguf_once_and_never_builds_a_gguf_reader(
    smollm2_path, tmp_path, monkeypatch
):
    """Config, tokenizer (converted: no cache entry for this path yet) and weights share one
    memory-mapped read; the `gguf` package's reader, slow on a large vocabulary, is not used."""
    from octavo import LLM

    path = str(tmp_path / "model.gguf")  # a path no cache has seen
    shutil.copyfile(smollm2_path, path)
    monkeypatch.setenv("OCTAVO_CACHE_DIR", str(tmp_path / "cache"))
    reads, readers = [], []
    real_read, real_init = gguf_loader.read_gguf, gguf.GGUFReader.__init__
    monkeypatch.setattr(gguf_loader, "read_gguf", lambda p: reads.append(p) or real_read(p))
    monkeypatch.setattr(
        gguf.GGUFReader,
        "__init__",
        lambda self, *a, **k: readers.append(a) or real_init(self, *a, **k),
    )
    llm = LLM(path, num_kv_blocks=8, max_model_len=64)
    assert reads == [os.path.realpath(path)]
    assert readers == []
    assert llm.get_tokenizer().chat_template  # the template came through the same read


def write_tensors(path, tensors: dict[str, tuple[np.ndarray, Q]]) -> None:
    writer = gguf.GGUFWriter(str(path), "llama")
    for name, (data, qtype) in tensors.items():
        writer.add_tensor(name, quantize(data, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


FAST_TYPES = [Q.F16, Q.BF16, Q.Q4_0, Q.Q4_1, Q.Q8_0]


def test_fast_dequantizers_give_the_gguf_packages_floats(tmp_path):
    rng = np.random.default_rng(0)
    tensors = {
        f"t{i}": (rng.standard_normal((6, 64), np.float32), q) for i, q in enumerate(FAST_TYPES)
    }
    path = tmp_path / "q.gguf"
    write_tensors(path, tensors)
    read = gguf_loader.read_gguf(str(path))
    for name, (data, qtype) in tensors.items():
        expected = dequantize(quantize(data, qtype), qtype).astype(np.float32)
        got = gguf_blocks.dequantize_tensor(read.tensors[name])
        assert got.dtype == torch.float32 and got.shape == (6, 64), qtype.name
        assert torch.equal(got, torch.from_numpy(expected)), qtype.name


def test_a_gguf_rewritten_in_place_is_read_again(tmp_path):
    path = tmp_path / "m.gguf"
    write_tensors(path, {"a": (np.ones((2, 32), np.float32), Q.F32)})
    assert set(gguf_loader.open_gguf(str(path)).tensors) == {"a"}
    assert gguf_loader.open_gguf(str(path)) is gguf_loader.open_gguf(str(path))
    write_tensors(path, {"b": (np.ones((4, 32), np.float32), Q.F32)})
    os.utime(path, ns=(0, 10**18))  # the same size would do as well: the mtime differs
    assert set(gguf_loader.open_gguf(str(path)).tensors) == {"b"}


@pytest.mark.parametrize("content", [b"", b"GGUF", b"not a gguf file at all"])
def test_a_broken_gguf_is_a_one_line_value_error(tmp_path, content):
    path = tmp_path / "broken.gguf"
    path.write_bytes(content)
    with pytest.raises(ValueError, match="broken.gguf") as info:
        gguf_loader.read_gguf(str(path))
    assert "\n" not in str(info.value)


def write_tokenizer_gguf(path, arch: str) -> None:
    """A GGUF holding only a byte-level BPE tokenizer: 256 byte tokens, "hi", BOS and EOS."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    byte_chars = bytes_to_unicode()
    tokens = [byte_chars[b] for b in range(256)] + ["hi", "<|begin_of_text|>", "<|end_of_text|>"]
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2" if arch.startswith("qwen") else "llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types([1] * 257 + [3, 3])
    writer.add_token_merges(["h i"])
    writer.add_bos_token_id(257)
    writer.add_eos_token_id(258)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


@pytest.mark.parametrize("arch", sorted(tokenizer_module.GGUF_TOKENIZER_MODEL_TYPES))
def test_a_gguf_tokenizer_is_the_one_autotokenizer_builds(tmp_path, arch):
    path = tmp_path / f"{arch}.gguf"
    write_tokenizer_gguf(path, arch)
    ours = tokenizer_module._convert_gguf_tokenizer(str(path))
    auto = AutoTokenizer.from_pretrained(str(tmp_path), gguf_file=path.name)
    assert type(ours) is type(auto)
    assert ours.backend_tokenizer.to_str() == auto.backend_tokenizer.to_str()
    assert ours.special_tokens_map == auto.special_tokens_map
    assert ours.encode("hi hi", add_special_tokens=True) == auto.encode("hi hi")


# Modules that building an engine for a GGUF model on the CPU must not import, once its
# converted tokenizer is cached: transformers (about a second; its config classes pull in
# torch.distributed.tensor, sympy and accelerate, over another second), and the server and
# structured outputs' libraries load only when used.
LAZY_MODULES = (
    "transformers",
    "jinja2",
    "torch.distributed.tensor",
    "sympy",
    "accelerate",
    "fastapi",
    "llguidance",
)


@pytest.mark.slow
def test_building_an_engine_leaves_the_heavy_modules_unimported(smollm2_path):
    code = (
        "import sys\n"
        "from octavo import LLM\n"
        f"LLM({smollm2_path!r}, num_kv_blocks=8, max_model_len=64)\n"
        f"print([m for m in {LAZY_MODULES!r} if m in sys.modules])\n"
    )
    tokenizer_module.load_tokenizer(smollm2_path)  # cached on disk
    run = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=300, check=False
    )
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip().splitlines()[-1] == "[]"


def test_every_layer_shares_one_rotary_table():
    """The layers' tables are one tensor; other frequencies get a table of their own."""
    model = LlamaForCausalLM(LlamaConfig(**TINY, architectures=["LlamaForCausalLM"]))
    tables = [m.cos_sin_cache for m in model.modules() if isinstance(m, RotaryEmbedding)]
    assert len(tables) == TINY["num_hidden_layers"] >= 2
    assert all(t is tables[0] for t in tables)
    other = RotaryEmbedding(16, TINY["max_position_embeddings"], 500.0)
    assert other.cos_sin_cache is not tables[0]
    assert not torch.equal(other.cos_sin_cache, tables[0])


def _resident_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="needs Linux's /proc")
def test_the_cpu_kv_cache_is_zeros_that_take_memory_only_when_touched():
    before = _resident_bytes()
    cache = zeroed_kv_cache((2, 8192, 16, 4, 64), torch.float32, torch.device("cpu"))  # 256 MiB
    assert _resident_bytes() - before < 32 << 20  # torch.zeros would write all 256 MiB
    assert cache.shape == (2, 8192, 16, 4, 64) and cache.dtype == torch.float32
    cache[1, 7] = 1.0
    assert cache[1, 7].sum().item() == torch.count_nonzero(cache).item() == 16 * 4 * 64
