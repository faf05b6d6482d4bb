"""Test helpers: run an octavo model over a paged KV cache without the engine, and compare."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from octavo.attention.backend import build_metadata
from octavo.attention.layer import bind_kv_caches
from octavo.attention.torch_backend import TorchAttentionBackend
from octavo.model.config import get_head_dim

# Dimensions of a tiny random decoder, for tests against HF on the same weights.
TINY = {
    "vocab_size": 256,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b||, in float64."""
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm()).item()


class PagedRunner:
    """Drives a model step by step like the model runner does, with its own block tables.

    Blocks are handed out from the end of the pool backwards, so a sequence's blocks are
    neither contiguous nor in order of block id: paging bugs show up as wrong logits.
    """

    def __init__(self, model: nn.Module, config, num_blocks: int = 128, block_size: int = 4):
        self.model = model
        self.block_size = block_size
        num_kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        dtype = next(model.parameters()).dtype
        device = next(model.parameters()).device
        shape = (2, num_blocks, block_size, num_kv_heads, get_head_dim(config))
        self.kv_caches = [
            torch.zeros(shape, dtype=dtype, device=device) for _ in range(config.num_hidden_layers)
        ]
        bind_kv_caches(model, self.kv_caches, TorchAttentionBackend())
        self.free_blocks = list(range(num_blocks))
        self.block_tables: dict[int, list[int]] = {}
        self.seq_lens: dict[int, int] = {}
        self.device = device

    def _grow(self, seq_id: int, new_len: int) -> list[int]:
        table = self.block_tables.setdefault(seq_id, [])
        while len(table) * self.block_size < new_len:
            table.append(self.free_blocks.pop())
        return table

    @torch.inference_mode()
    def step(self, chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        """Runs one flat batch; `chunks` are (sequence id, its new token ids).

        Returns each chunk's float32 logits, [len(new tokens), vocab].
        """
        input_ids, positions, query_lens, seq_lens, tables = [], [], [], [], []
        for seq_id, new_ids in chunks:
            start = self.seq_lens.get(seq_id, 0)
            end = start + len(new_ids)
            tables.append(list(self._grow(seq_id, end)))
            self.seq_lens[seq_id] = end
            input_ids += new_ids
            positions += range(start, end)
            query_lens.append(len(new_ids))
            seq_lens.append(end)
        md = build_metadata(query_lens, seq_lens, tables, self.block_size, self.device)
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        hidden = self.model(ids, pos, md)  # [T, hidden]
        logits = self.model.compute_logits(hidden)  # [T, vocab]
        return list(logits.split(query_lens))

    def greedy(
        self, seq_id: int, prompt: list[int], num_tokens: int, banned: Sequence[int] = ()
    ) -> list[int]:
        """Prefills `prompt`, then decodes `num_tokens` greedy tokens one step at a time,
        never picking a `banned` id (HF's min_new_tokens bans EOS the same way)."""
        new_ids = prompt
        out: list[int] = []
        while len(out) < num_tokens:
            last = self.step([(seq_id, new_ids)])[0][-1].clone()  # [vocab]
            last[list(banned)] = float("-inf")
            out.append(int(last.argmax()))
            new_ids = [out[-1]]
        return out


@torch.inference_mode()
def hf_logits(hf_model: nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits over a full sequence, [len(ids), vocab]."""
    return hf_model(torch.tensor([ids])).logits[0].float()


def eos_ids(hf_model: nn.Module) -> list[int]:
    """The EOS ids HF's generate bans while min_new_tokens is not reached."""
    eos = hf_model.generation_config.eos_token_id
    return [] if eos is None else [eos] if isinstance(eos, int) else list(eos)


@torch.inference_mode()
def hf_greedy(hf_model: nn.Module, ids: list[int], num_tokens: int) -> list[int]:
    """HF `generate(do_sample=False)` of exactly `num_tokens` new tokens (EOS banned)."""
    out = hf_model.generate(
        torch.tensor([ids]),
        attention_mask=torch.ones(1, len(ids), dtype=torch.long),
        max_new_tokens=num_tokens,
        min_new_tokens=num_tokens,
        do_sample=False,
        pad_token_id=0,
    )
    return out[0, len(ids) :].tolist()


@torch.inference_mode()
def hf_greedy_choices(
    hf_model: nn.Module, prompt: list[int], tokens: list[int], banned: Sequence[int] = ()
) -> list[int]:
    """HF's greedy choice after the prompt and each prefix of `tokens`, never a `banned` id,
    from one forward pass: equal to `tokens` exactly when `tokens` are HF's greedy tokens
    (the first token that differs is the first place HF would have chosen another)."""
    logits = hf_logits(hf_model, prompt + tokens)[len(prompt) - 1 : -1]  # [len(tokens), vocab]
    logits[:, list(banned)] = float("-inf")
    return logits.argmax(-1).tolist()


def randomize(model: nn.Module, seed: int) -> nn.Module:
    """Weights large enough that attention is sharp (HF's 0.02 init makes it nearly uniform,
    which would hide rope and cache bugs); norm weights away from 1. Returns the model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1.0 + 0.2 * noise if "norm" in name else 0.15 * noise)
    return model.eval()


def random_hf_model(config, seed: int) -> nn.Module:
    """A float32 HF model of `config` (eager attention), `randomize`d."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(
        config, attn_implementation="eager", dtype=torch.float32
    )
    return randomize(model, seed)
