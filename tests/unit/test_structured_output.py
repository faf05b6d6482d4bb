"""The structured-output grammars (llguidance) on a small BPE tokenizer trained here: masks
filled in parallel equal masks filled one by one, a fork goes its own way, and what does not
compile is a ValueError at once."""

from __future__ import annotations

import pytest
import torch

from octavo.engine.structured_output import GrammarCompiler, bitmask_width, fill_bitmasks
from octavo.sampling_params import StructuredOutputsParams as Spec

pytest.importorskip("llguidance")


@pytest.fixture(scope="module")
def compiler():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())  # fmt: skip
    bpe.train_from_iterator(['{"a": 1, "b": [true, false]}', "yes no 0123456789 abc"] * 10,
                            trainer)  # fmt: skip
    tok = PreTrainedTokenizerFast(tokenizer_object=bpe, eos_token="<eos>")
    # The model's vocabulary may be larger than the tokenizer's, and name an EOS it lacks.
    return GrammarCompiler(tok, vocab_size=len(tok) + 40, eos_token_ids=[0, len(tok) + 5])


def masks(compiler, grammars):
    bitmask = torch.zeros(len(grammars), bitmask_width(compiler.vocab_size), dtype=torch.int32)
    fill_bitmasks(grammars, bitmask)
    return bitmask


def one_mask(compiler, grammar):
    row = torch.zeros(bitmask_width(compiler.vocab_size), dtype=torch.int32)
    grammar.fill_bitmask(row)
    return row


def test_parallel_masks_equal_single_ones_and_forks_go_their_own_way(compiler):
    tok = compiler.tokenizer
    json_g = compiler.compile(Spec(json={"type": "object"}))
    choice = compiler.compile(Spec(choice=["yes", "no"]))
    digits = compiler.compile(Spec(regex="[0-9]+"))
    grammars = [json_g, choice, json_g, digits]
    found = masks(compiler, grammars)
    for row, g in zip(found, grammars, strict=True):
        assert torch.equal(row, one_mask(compiler, g))
    assert not torch.equal(found[0], found[1])
    fork = choice.fork()
    assert choice.accept(tok.convert_tokens_to_ids("y")) and not choice.is_complete
    assert torch.equal(one_mask(compiler, fork), found[1])  # the fork did not move
    for t in tok.encode("es", add_special_tokens=False):
        assert choice.accept(t)
    assert choice.is_complete
    assert not fork.accept(tok.convert_tokens_to_ids("a"))  # refused, and logged
    assert fork.error is not None


@pytest.mark.parametrize(
    ("spec", "match"),
    [
        (Spec(regex="("), "unclosed group"),
        (Spec(json="[1"), "not valid JSON"),
        (Spec(grammar="start: nothing_defined"), "unknown name"),
    ],
)
def test_what_does_not_compile_is_a_value_error_at_once(compiler, spec, match):
    with pytest.raises(ValueError, match=f"(?s)^structured_outputs does not compile: .*{match}"):
        compiler.compile(spec)
