"""The structured-output grammars (llguidance) on a small BPE tokenizer trained here: masks
filled in parallel equal masks filled one by one, and so do tokens taken in parallel; a fork
goes its own way; the runner's mask buffer gives each step its own masks; and what does not
compile is a ValueError at once."""

from __future__ import annotations

import pytest
import torch

from octavo.config import SchedulerConfig
from octavo.core.kv_cache_manager import KVCacheManager
from octavo.core.request import Request, RequestStatus
from octavo.core.scheduler import Scheduler
from octavo.engine.structured_output import (
    PARALLEL_ACCEPT_MIN,
    GrammarBitmaskBuilder,
    GrammarCompiler,
    accept_tokens,
    bitmask_width,
    fill_bitmasks,
)
from octavo.runner.sampling_metadata import GrammarMasks
from octavo.sampling_params import SamplingParams
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


def test_tokens_taken_in_parallel_move_each_grammar_as_one_by_one(compiler):
    """accept_tokens (llguidance's threads) against Grammar.accept on copies: the same
    answers, refusals included, and the same masks after."""
    tok = compiler.tokenizer
    specs = [Spec(json={"type": "object"}), Spec(choice=["yes", "no"]), Spec(regex="[0-9]+")]
    texts = ['{"a": 1}', "yes", "42", '{"b"', "no", "x1", "{}", "xno", "a7"]  # x, x, a: refused
    texts *= PARALLEL_ACCEPT_MIN // len(texts) + 1  # enough grammars for the threads
    tokens = [tok.encode(text, add_special_tokens=False) for text in texts]
    grammars = [compiler.compile(specs[i % 3]) for i in range(len(texts))]
    serial = [g.fork() for g in grammars]
    refused = 0
    for step in range(max(map(len, tokens))):
        live = [i for i, ids in enumerate(tokens) if step < len(ids) and grammars[i].error is None]
        got = accept_tokens([grammars[i] for i in live], [tokens[i][step] for i in live])
        assert got == [serial[i].accept(tokens[i][step]) for i in live]
        refused += got.count(False)
        for i in live:
            if grammars[i].error is None:
                assert torch.equal(one_mask(compiler, grammars[i]), one_mask(compiler, serial[i]))
    assert refused == 3 * len(texts) // 9


def test_the_mask_buffer_gives_each_step_the_masks_of_its_rows(compiler):
    """The engine's bitmask buffer is kept from step to step, and the runner's GrammarMasks
    keeps its row index: each step's bitmasks are those of that step's grammars, in its
    rows, and stay so after later steps."""
    brace = compiler.tokenizer.encode("{", add_special_tokens=False)[0]
    builder = GrammarBitmaskBuilder(compiler.vocab_size, pin_memory=False)
    runner_masks = GrammarMasks(torch.device("cpu"))
    json_g = compiler.compile(Spec(json={"type": "object"}))
    digits = compiler.compile(Spec(regex="[0-9]+"))
    steps = [[json_g, None, digits], [None, digits, None, json_g], [json_g]]
    kept = []
    for grammars in steps:
        constrained = [(f"r{i}", g) for i, g in enumerate(grammars) if g is not None]
        step_mask = builder.build([r for r, _ in constrained], [g for _, g in constrained])
        sampling_rows = [(f"r{i}", None, 0) for i in range(len(grammars))]
        rows, bitmask = runner_masks.bans(sampling_rows, step_mask)
        expected = masks(compiler, [g for g in grammars if g is not None])
        assert rows.tolist() == [i for i, g in enumerate(grammars) if g is not None]
        assert torch.equal(bitmask, expected)
        kept.append((bitmask, expected))
        if json_g.is_complete is False and len(kept) == 1:
            assert json_g.accept(brace)  # the next step's mask differs
    assert not torch.equal(kept[0][0][0], kept[2][0][0])
    for bitmask, expected in kept:
        assert torch.equal(bitmask, expected)


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


@pytest.mark.parametrize("num_requests", [3, PARALLEL_ACCEPT_MIN + 4], ids=["serial", "threads"])
def test_a_refused_token_aborts_its_request_alone_and_frees_its_blocks(compiler, num_requests):
    """The scheduler feeds every grammar its token (on llguidance's threads for a large
    batch): a refused token aborts that request and frees its blocks, a completed grammar
    stops its request, and the others run on."""
    tok = compiler.tokenizer
    kv = KVCacheManager(4 * num_requests, 4, enable_prefix_caching=False)
    config = SchedulerConfig(num_requests, 16 * num_requests, 64)
    scheduler = Scheduler(config, kv, [0], accept_tokens)
    requests = []
    for i in range(num_requests):
        request = Request(f"r{i}", [10, 11, 12, 13, 14], SamplingParams(max_tokens=20))
        request.grammar = compiler.compile(Spec(choice=["yes", "no"]) if i else Spec(regex="[0-9]"))
        scheduler.add_request(request)
        requests.append(request)
    out = scheduler.schedule()
    first = {text: tok.encode(text, add_special_tokens=False)[0] for text in ("y", "4", "x")}
    tokens = {s.request_id: [first["y"]] for s in out.scheduled}
    tokens["r0"] = [first["4"]]  # completes [0-9]
    tokens["r1"] = [first["x"]]  # refused
    free = kv.num_free_blocks
    updated = scheduler.update(out, tokens)
    for request, status in zip(updated, scheduler.stops.check_tokens(updated), strict=True):
        if status is not None:
            scheduler.finish_request(request.request_id, status)
    status = [r.status for r in requests]
    assert status[:2] == [RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_ABORTED]
    assert set(status[2:]) == {RequestStatus.RUNNING}
    assert kv.num_free_blocks == free + 2 * 2  # each: 6 tokens in blocks of 4
    assert [r.request_id for r in scheduler.running] == [f"r{i}" for i in range(2, num_requests)]
