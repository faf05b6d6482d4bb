"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It owns the model, the KV cache tensors and the sampler; it knows nothing of queues.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from octavo.attention.backend import AttentionMetadata, build_metadata, get_attention_backend
from octavo.attention.layer import bind_kv_caches
from octavo.engine.scheduler import SchedulerOutput
from octavo.model.hf_config import get_head_dim
from octavo.runner.cuda_graph import CudaGraphRunner
from octavo.model.loader import load_model
from octavo.runner.sampler import Sampler, SamplingMetadata
from octavo.sampling_params import SamplingParams

# (token id, log-prob, rank) for the sampled token first, then the top-k alternatives.
TokenLogprobs = list[tuple[int, float, int]]


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step: its new tokens (one, or n at the first token of
    an n > 1 request), and their log-probs if asked for."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """layers x (K and V) x block_size x kv_heads x head_dim x dtype bytes."""
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        hf_config.num_hidden_layers * 2 * block_size * num_kv_heads * get_head_dim(hf_config) * elem
    )


class ModelRunner:
    """Loads the model, allocates the paged KV cache, and executes scheduled steps."""

    def __init__(
        self,
        model_path: str,
        hf_config,
        dtype: torch.dtype,
        device: torch.device,
        block_size: int,
        load_format: str = "auto",
        seed: int = 0,
        attention_backend: str | None = None,
        enforce_eager: bool = False,
    ) -> None:
        self.hf_config = hf_config
        self.dtype = dtype
        self.device = device
        self.block_size = block_size
        self.vocab_size = hf_config.vocab_size
        self.model = load_model(model_path, hf_config, dtype, device, load_format, seed)
        backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(backend)
        self.sampler = Sampler(seed=seed)
        self.kv_caches: list[torch.Tensor] = []
        self.eos_token_ids: list[int] = []
        self.use_cuda_graphs = device.type == "cuda" and not enforce_eager
        self.graph_runner: CudaGraphRunner | None = None

    def allocate_kv_cache(
        self, num_blocks: int, max_num_seqs: int = 256, max_model_len: int = 2048
    ) -> None:
        """Allocates one [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer,
        once, binds them to the model's attention layers, and captures CUDA graphs.

        NOTE: with CUDA graphs one extra block (id `num_blocks`) is allocated as scratch
        space for the padded rows of a graph; the KV cache manager never hands it out.
        """
        cfg = self.hf_config
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        extra = 1 if self.use_cuda_graphs else 0
        shape = (2, num_blocks + extra, self.block_size, num_kv_heads, get_head_dim(cfg))
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        bind_kv_caches(self.model, self.kv_caches, self.attn_backend)
        if self.use_cuda_graphs:
            max_blocks = -(-max_model_len // self.block_size)
            self.graph_runner = CudaGraphRunner(
                self.model, max_num_seqs, max_blocks, self.block_size, num_blocks, self.device
            )
            self.graph_runner.capture()

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_rows: int) -> int:
        """Peak memory of one step's activations: a forward pass over `num_tokens` tokens
        and logits for `num_rows` rows, with a temporary KV cache just large enough."""
        num_blocks = -(-num_tokens // self.block_size)
        self.use_cuda_graphs, graphs = False, self.use_cuda_graphs
        self.allocate_kv_cache(num_blocks)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats(self.device)
        base = torch.cuda.memory_allocated(self.device)
        md = build_metadata(
            [num_tokens], [num_tokens], [list(range(num_blocks))], self.block_size, self.device
        )
        ids = torch.randint(0, self.vocab_size, (num_tokens,), device=self.device)
        pos = torch.arange(num_tokens, device=self.device)
        hidden = self.model(ids, pos, md)
        self.model.compute_logits(hidden[:num_rows].repeat(-(-num_rows // num_tokens), 1))
        torch.cuda.synchronize()
        peak = torch.cuda.max_memory_allocated(self.device) - base
        self.kv_caches = []
        self.use_cuda_graphs = graphs
        torch.cuda.empty_cache()
        return peak

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        graphs = self.graph_runner
        if graphs is not None and md.is_all_decode and graphs.padded_size(md.num_seqs):
            return graphs.run(input_ids, positions, md)
        return self.model(input_ids, positions, md)

    @torch.inference_mode()
    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step: the forward pass over all scheduled tokens, then sampling for the
        requests whose step reached their last known token."""
        self._copy_blocks(so.block_copies)
        input_ids, positions, md = self._prepare_inputs(so)
        hidden = self._forward(input_ids, positions, md)  # [T, hidden]
        # One sampling row per sample: n rows for the first token of an n > 1 request.
        rows: list[tuple[str, SamplingParams, int]] = []  # (request id, params, token index)
        for i, s in enumerate(so.scheduled):
            if not s.sample:
                continue
            params = s.request.sampling_params
            last = md.query_start_loc_cpu[i + 1] - 1
            if s.request.awaits_fork:
                rows += [(s.request_id, params.for_sample(k), last) for k in range(params.n)]
            else:
                rows.append((s.request_id, params, last))
        if not rows:
            return ModelRunnerOutput({})
        logits = self.model.compute_logits(hidden[[r[2] for r in rows]])  # [R, V] float32
        requests = {s.request_id: s.request for s in so.scheduled}
        sampling_md = SamplingMetadata.build(
            [r[1] for r in rows],
            [requests[r[0]].prompt_token_ids for r in rows],
            [requests[r[0]].output_token_ids for r in rows],
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
        )
        out = self.sampler(logits, sampling_md)
        result = ModelRunnerOutput({})
        for (request_id, _, _), token in zip(rows, out.sampled_token_ids.tolist(), strict=True):
            result.sampled_token_ids.setdefault(request_id, []).append(token)
        if out.logprobs is not None:
            self._collect_logprobs(rows, out, result)
        return result

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: gives a sequence its own copy of a shared partial block."""
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], dtype=torch.int64, device=self.device)
        dst = torch.tensor([c[1] for c in copies], dtype=torch.int64, device=self.device)
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]  # [2, num_blocks, block_size, KVH, D]

    def _prepare_inputs(
        self, so: SchedulerOutput
    ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        input_ids: list[int] = []
        positions: list[int] = []
        for s in so.scheduled:
            input_ids += s.token_ids
            positions += range(s.num_computed_tokens, s.seq_len)
        md = build_metadata(
            [s.num_new_tokens for s in so.scheduled],
            [s.seq_len for s in so.scheduled],
            [s.block_ids for s in so.scheduled],
            self.block_size,
            self.device,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.tensor(positions, dtype=torch.int64, device=self.device)
        return ids, pos, md

    @staticmethod
    def _collect_logprobs(rows, out, result: ModelRunnerOutput) -> None:
        token_ids = out.logprob_token_ids.tolist()
        values = out.logprobs.tolist()
        ranks = out.sampled_token_ranks.tolist()
        for row, (request_id, params, _) in enumerate(rows):
            k = params.logprobs
            if k is None:
                continue
            entries = [(token_ids[row][0], values[row][0], ranks[row])]
            entries += [(token_ids[row][j], values[row][j], j) for j in range(1, k + 1)]
            result.logprobs.setdefault(request_id, []).append(entries)
