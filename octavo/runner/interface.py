"""What the engine asks of a model runner: `ModelRunner` (the model in this process) and
`MultiprocRunner` (tensor-parallel workers) both implement it."""

from __future__ import annotations

from typing import Protocol

import torch

from octavo.config import CacheConfig
from octavo.core.sched_output import GrammarBitmask, SchedulerOutput
from octavo.runner.outputs import ModelRunnerOutput


class StepResult(Protocol):
    """A launched step: `result()` waits for its tokens."""

    def result(self) -> ModelRunnerOutput: ...


class Runner(Protocol):
    """A model runner, from the engine's side.

    Start-up is `num_kv_blocks` (how many blocks the budget holds), then `allocate_kv_cache`
    once. Each step has one shape, as vLLM v1's: `execute_async` (the forward pass), then
    `sample_tokens(bitmask or None)`, the bitmask of its structured requests' grammars once
    they have taken every earlier token; `execute` does both and waits.
    """

    dtype: torch.dtype
    kv_cache_dtype: torch.dtype
    vocab_size: int
    device: torch.device
    hf_config: object
    pin_host_memory: bool

    def num_kv_blocks(
        self, cache: CacheConfig, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """The KV blocks the budget in `cache` holds for a step of at most these sizes."""

    def allocate_kv_cache(
        self, num_blocks: int, max_num_seqs: int, max_model_len: int, max_num_batched_tokens: int
    ) -> None:
        """Allocates the cache of `num_blocks` blocks and readies the step buffers, once."""

    def execute_async(self, so: SchedulerOutput) -> StepResult:
        """Launches the step's forward pass; its tokens come from the result, once sampled."""

    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        """Samples the launched step, its structured requests under `grammar_bitmask`."""

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """A step with no structured requests, launched, sampled and waited for."""
        pending = self.execute_async(so)
        self.sample_tokens(None)
        return pending.result()

    def release_kv_blocks(self, ids: dict[bool, list[int]]) -> int:
        """Gives the memory of free blocks back to the system where the cache is in host
        memory (`ids[sliding]`: blocks of each pool); the bytes given back."""

    def cancel_held(self) -> None:
        """Drops a launched step that will never be sampled (the engine failed it)."""

    def shutdown(self) -> None:
        """Stops whatever the runner started (worker processes)."""
