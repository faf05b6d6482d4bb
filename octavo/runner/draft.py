"""A draft model for speculative decoding: a smaller model of the same vocabulary that guesses
the target's next tokens greedily.

It keeps a KV cache of its own, in the same blocks and slots as the target's (the block
tables are shared), and computes every token the target computes, in the same step:

    step:      target forward over the step's tokens -> draft forward over the same inputs
    verified:  each request that sampled -> k draft decode passes from its last kept token
               at position P: guess 1 at P + 1, ... (their KV lands in the lookahead slots
               the scheduler reserved, and is written again when the target verifies them)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from octavo.attention.layer import bind_kv_caches
from octavo.checkpoint.loader import load_model
from octavo.core.sched_output import ScheduledRequest, SchedulerOutput
from octavo.runner.inputs import InputBuilder, StepInputs
from octavo.runner.kv_setup import kv_bytes_per_block, kv_cache_shape, zeroed_kv_cache
from octavo.runner.outputs import ModelRunnerOutput


@dataclass(frozen=True)
class DraftOptions:
    """What the runner needs to load a draft: its path, config and quantization method, and
    how many tokens it guesses."""

    model_path: str
    hf_config: object
    quantization: str | None
    num_speculative_tokens: int


class DraftModel:
    def __init__(
        self,
        options: DraftOptions,
        dtype: torch.dtype,
        device: torch.device,
        load_format: str,
        seed: int,
    ) -> None:
        self.hf_config = options.hf_config
        self.k = options.num_speculative_tokens
        self.device = device
        self.model = load_model(
            options.model_path, options.hf_config, dtype, device, load_format, seed,
            options.quantization,
        )  # fmt: skip
        self.kv_caches: list[torch.Tensor] = []

    def kv_bytes_per_block(self, block_size: int, kv_dtype: torch.dtype) -> int:
        return kv_bytes_per_block(self.hf_config, block_size, kv_dtype)

    def allocate_kv_cache(self, num_blocks: int, block_size: int, kv_dtype, backend) -> None:
        """Its cache: as many blocks as the target's (the scratch block included)."""
        shape = kv_cache_shape(self.hf_config, num_blocks, block_size)
        self.kv_caches = [
            zeroed_kv_cache(shape, kv_dtype, self.device)
            for _ in range(self.hf_config.num_hidden_layers)
        ]
        bind_kv_caches(self.model, self.kv_caches, backend)

    def catch_up(self, step: StepInputs) -> None:
        """Computes the step's tokens' KV, as the target just did."""
        self.model(step.input_ids, step.positions, step.md)

    @torch.inference_mode()
    def propose(
        self, so: SchedulerOutput, result: ModelRunnerOutput, inputs: InputBuilder, requests
    ) -> None:
        """Fills `result.draft_token_ids` with up to k greedy guesses for each request of the
        step that sampled (but an n > 1 request's first token: it forks), within the slots
        its block table holds. `requests`: the runner's states, by id."""
        starts: dict[str, tuple[int, int]] = {}  # request id -> (position, last kept token)
        for s in so.scheduled:
            kept = result.sampled_token_ids.get(s.request_id)
            if not s.sample or not kept or requests[s.request_id].sampling_params.n > 1:
                continue
            last_known = s.num_computed_tokens + s.num_new_tokens - 1 - len(s.spec_token_ids)
            starts[s.request_id] = (last_known + len(kept), kept[-1])
        if not starts:
            return
        block_size = inputs.block_size
        rounds = {
            rid: min(self.k, inputs.rows.capacity(rid) * block_size - position)
            for rid, (position, _) in starts.items()
        }
        guesses: dict[str, list[int]] = {rid: [] for rid in starts}
        for j in range(max(rounds.values())):
            live = [rid for rid in starts if rounds[rid] > j]
            scheduled = [
                _decode_one(rid, starts[rid][0] + j, (guesses[rid] or [starts[rid][1]])[-1])
                for rid in live
            ]
            step = inputs.build(scheduled, None, {}, None)
            hidden = self.model(step.input_ids, step.positions, step.md)
            tokens = self.model.compute_logits(hidden).argmax(-1).tolist()
            for rid, token in zip(live, tokens, strict=True):
                guesses[rid].append(token)
        result.draft_token_ids = guesses

    def copy_blocks(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]


def _decode_one(request_id: str, position: int, token: int) -> ScheduledRequest:
    """One token of a request at `position`, over its block table as the runner holds it."""
    return ScheduledRequest(request_id, [token], position, True, False, 0, 0, [])
