"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It owns the model, the KV cache tensors and the sampler; it knows nothing of queues.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, replace

import torch

from octavo.attention.backend import AttentionMetadata
from octavo.attention.layer import bind_kv_caches
from octavo.attention.registry import get_attention_backend
from octavo.checkpoint.loader import load_model
from octavo.config import CacheConfig
from octavo.core.sched_output import GrammarBitmask, SchedulerOutput
from octavo.model.moe import expert_load, reset_expert_load
from octavo.model.parallel import broadcast_from_first
from octavo.runner import kv_setup
from octavo.runner.cuda_graph import CudaGraphRunner, capture_sizes, mixed_capture_sizes
from octavo.runner.deterministic import fixed_split, make_deterministic
from octavo.runner.draft import DraftModel, DraftOptions
from octavo.runner.gemm_tuning import tune_linears
from octavo.runner.host_copy import to_device
from octavo.runner.inputs import InputBuilder
from octavo.runner.interface import Runner
from octavo.runner.outputs import PendingOutput
from octavo.runner.prompt_logprobs import prompt_logprobs
from octavo.runner.sampler import Sampler, SamplerOutput
from octavo.runner.sampling_metadata import GrammarMasks, SamplingMetadata, seeded_rows
from octavo.sampling_params import SamplingParams


@dataclass(slots=True)
class CachedRequestState:
    """What the runner keeps of a request between steps (from `NewRequestData`)."""

    prompt_token_ids: list[int]
    output_token_ids: list[int]  # kept up to date only for requests whose sampling reads it
    sampling_params: SamplingParams


class ModelRunner(Runner):
    """Loads the model, allocates the paged KV cache, and executes scheduled steps."""

    pin_host_memory = property(lambda self: self.device.type == "cuda")

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
        cuda_graph_max_tokens: int = 512,
        quantization: str | None = None,
        kv_cache_dtype: torch.dtype | None = None,
        draft: DraftOptions | None = None,
        deterministic: bool = False,
    ) -> None:
        self.hf_config = hf_config
        self.dtype = dtype
        self.kv_cache_dtype = kv_cache_dtype or dtype  # see kv_setup.kv_cache_dtype
        self.device = device
        self.block_size = block_size
        self.vocab_size = hf_config.vocab_size
        self.model = load_model(
            model_path, hf_config, dtype, device, load_format, seed, quantization
        )
        # Speculative decoding's draft model, beside the target (runner/draft.py).
        self.draft = None if draft is None else DraftModel(draft, dtype, device, load_format, seed)
        self._num_launched = 0  # steps launched: a draft guesses only after the newest
        backend = attention_backend or ("triton" if device.type == "cuda" else "torch")
        self.attn_backend = get_attention_backend(backend)
        self.deterministic = deterministic and device.type == "cuda"  # the CPU's always is
        if deterministic:
            make_deterministic(self.model, backend, quantization, device)
        self.sampler = Sampler(seed=seed)
        self.kv_caches: list[torch.Tensor] = []
        # NOTE: graphs only with the Triton backend: the torch one plans on the host.
        self.use_cuda_graphs = (
            device.type == "cuda"
            and not enforce_eager
            and backend == "triton"
            and getattr(self.model, "supports_cuda_graphs", True)
        )
        self.cuda_graph_max_tokens = cuda_graph_max_tokens
        self._begin_step = getattr(self.model, "begin_step", None)  # model/moe.py's
        self.thread_governor = None  # CPU threads that follow the free cores (the builder's)
        self.graph_runner: CudaGraphRunner | None = None
        self.inputs: InputBuilder | None = None
        # The previous step's samples on the device: (request id -> row, [R] token ids).
        self._last_sampled: tuple[dict[str, int], torch.Tensor] | None = None
        # The last sampling metadata with the rows' params, while it can serve again.
        self._reusable_md: tuple[list[SamplingParams], SamplingMetadata] | None = None
        self._grammar_masks = GrammarMasks(device)  # structured outputs' bans
        self.requests: dict[str, CachedRequestState] = {}
        # The step's sampling rows at speculative guesses: row -> the guesses before it.
        self._guessed_outputs: dict[int, list[int]] = {}
        # The executed step whose rows wait for sample_tokens.
        self._unsampled: tuple[PendingOutput, list, torch.Tensor] | None = None

    def num_kv_blocks(
        self, cache: CacheConfig, max_num_batched_tokens: int, max_num_seqs: int
    ) -> int:
        """How many KV blocks the budget in `cache` holds (kv_setup.num_kv_blocks); on CUDA
        after profiling a step of `max_num_batched_tokens` tokens and `max_num_seqs` rows over
        temporary caches, freed before the cache is allocated."""
        per_block, split = kv_setup.pool_block_bytes(
            self.hf_config, cache.block_size, self.kv_cache_dtype, max_num_seqs,
            max_num_batched_tokens,
        )  # fmt: skip
        if self.draft is not None:  # its cache has as many blocks
            per_block += self.draft.kv_bytes_per_block(cache.block_size, self.kv_cache_dtype)

        def activation_bytes() -> int:
            blocks = -(-max_num_batched_tokens // self.block_size)
            shape = kv_setup.kv_cache_shape(self.hf_config, blocks, self.block_size)
            return kv_setup.profile_activation_bytes(
                self.model, self.attn_backend, shape, self.kv_cache_dtype, self.device,
                max_num_batched_tokens, max_num_seqs,
            )  # fmt: skip

        return kv_setup.num_kv_blocks(cache, per_block, self.device, activation_bytes, split)

    def allocate_kv_cache(
        self,
        num_blocks: int,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 8192,
    ) -> None:
        """Allocates one [2, num_blocks, block_size, kv_heads, head_dim] tensor of
        `kv_cache_dtype` per layer, once, binds them to the attention layers, sets up the
        input buffers and captures CUDA graphs; on CUDA it then runs every projection at
        row counts up to `max_num_batched_tokens` and the eager end of a decode step at
        every batch size (kv_setup's warm-ups).

        NOTE: one extra block (id `num_blocks`) is scratch space for the padding rows of a
        CUDA graph; the KV cache manager never hands it out.
        """
        if self.kv_caches:
            raise RuntimeError("the KV cache is allocated once")
        num_sliding = kv_setup.sliding_pool_size(
            self.hf_config, num_blocks, self.block_size, max_num_seqs, max_num_batched_tokens
        )
        self.kv_caches = kv_setup.allocate_kv_caches(
            self.hf_config, num_blocks, num_sliding, self.block_size, self.kv_cache_dtype,
            self.device,
        )  # fmt: skip
        bind_kv_caches(self.model, self.kv_caches, self.attn_backend)
        if self.draft is not None:
            self.draft.allocate_kv_cache(
                num_blocks + 1, self.block_size, self.kv_cache_dtype, self.attn_backend
            )
        max_blocks = -(-max_model_len // self.block_size)
        self.inputs = InputBuilder(
            max_num_batched_tokens,
            max_num_seqs,
            max_blocks,
            self.block_size,
            num_blocks,
            self.device,
            num_sliding,
        )
        if self.deterministic:
            self.attn_backend.split = fixed_split(max_model_len)
        if self.use_cuda_graphs:
            max_mixed_tokens = min(self.cuda_graph_max_tokens, max_num_batched_tokens)
            if not self.deterministic:  # cuBLASLt's algorithms; fixed_gemm has its own tiles
                tune_linears(self.model, capture_sizes(max_num_seqs)
                             + mixed_capture_sizes(max_mixed_tokens))  # fmt: skip
            self.graph_runner = CudaGraphRunner(
                self.model, self.inputs, max_num_seqs, max_mixed_tokens
            )
            self.graph_runner.capture()
        if self.device.type == "cuda":
            kv_setup.warm_up_linears(self.model, max_num_batched_tokens)
            kv_setup.warm_up_eager_decode(self.model, self.inputs, self.dtype, max_num_seqs)
        reset_expert_load(self.model)

    def expert_load(self) -> tuple[list[int], float] | None:
        """A mixture of experts' routing so far (model/moe.py's expert_load), else None."""
        return expert_load(self.model)

    def release_kv_blocks(self, ids: dict[bool, list[int]]) -> int:
        """Gives free blocks' memory back to the system: `ids[sliding]` in the layers of each
        pool (kv_setup.release_kv_pages); the bytes given back."""
        draft = self.draft.kv_caches if self.draft is not None else []
        kinds = kv_setup.sliding_layers(self.hf_config) + [False] * len(draft)
        return kv_setup.release_kv_pages(self.kv_caches + draft, kinds, ids)

    def shutdown(self) -> None:
        """Nothing to stop: the model lives in this process (see MultiprocRunner)."""

    def _update_states(self, so: SchedulerOutput) -> None:
        """Drops finished and preempted requests, takes new ones, appends output tokens."""
        gone = so.finished_request_ids + so.preempted_request_ids
        if gone:
            self.inputs.rows.release(gone)
            for request_id in gone:
                self.requests.pop(request_id, None)
        for new in so.new_requests:
            if new.request_id in self.requests:  # taken anew (its params changed at a fork)
                self.inputs.rows.release([new.request_id])
            self.requests[new.request_id] = CachedRequestState(
                new.prompt_token_ids, list(new.output_token_ids), new.sampling_params
            )
        for s in so.scheduled:
            if s.new_output_token_ids:
                self.requests[s.request_id].output_token_ids += s.new_output_token_ids

    def _before_step(self, num_tokens: int) -> None:
        """The model's hook (the step's real rows), and the CPU threads' check."""
        if self._begin_step is not None:
            self._begin_step(num_tokens)
        if self.thread_governor is not None:
            self.thread_governor.tick()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        """Queues one step's forward pass over all scheduled tokens on the device, and the
        logits of the requests whose step reached their last token; `sample_tokens` then
        samples them, always, under a grammar bitmask or None. Returns without waiting for
        the device; `.result()` of the returned object waits, once sampled.

        NOTE: a request whose input is pending reads the token this runner sampled for it
        in the previous step, on the device: steps must run, and be sampled, in order.
        """
        if self._unsampled is not None:
            raise RuntimeError("the previous step was never sampled (sample_tokens)")
        self._update_states(so)
        self._copy_blocks(so.block_copies, so.sliding_block_copies)
        graph = None  # the CUDA graph to replay for this step, if one fits it
        if self.graph_runner is not None:
            graph = self.graph_runner.shape_for(so.num_batched_tokens, len(so.scheduled))
        last_rows, last_sampled = self._last_sampled or ({}, None)
        step = self.inputs.build(so.scheduled, graph, last_rows, last_sampled)
        self._before_step(step.md.num_tokens)
        if graph is not None:
            hidden = self.graph_runner.replay(graph)
        else:
            hidden = self.model(step.input_ids, step.positions, step.md)  # [T, hidden]
        self._num_launched += 1
        if self.draft is not None:
            self.draft.catch_up(step)
        prompt = prompt_logprobs(so, step.md, hidden, self.requests, self.model)
        rows, logits_index = self._sampling_rows(so, step.md)
        self._last_sampled = None
        if not rows:
            return PendingOutput([], prompt)
        if logits_index is None:  # one row per token, in order
            hidden = hidden[: len(rows)]
        else:
            hidden = hidden[to_device(logits_index, torch.int64, self.device)]
        logits = self.model.compute_logits(hidden)  # [R, V]
        guesses = {s.request_id: s.spec_token_ids for s in so.scheduled if s.spec_token_ids}
        pending = PendingOutput(rows, prompt, guesses)
        if self.draft is not None:  # its guesses from the kept tokens, unless a later step
            launched = self._num_launched  # has launched over the inputs since
            pending.then = lambda result: (
                self._num_launched == launched
                and self.draft.propose(so, result, self.inputs, self.requests)
            )
        self._unsampled = (pending, rows, logits)
        return pending

    @torch.inference_mode()
    def sample_tokens(self, grammar_bitmask: GrammarBitmask | None) -> None:
        """Samples the executed step (see execute_async), its structured requests under
        their grammars' bitmask; a step with no rows to sample has nothing to do."""
        if self._unsampled is None:
            return
        (pending, rows, logits), self._unsampled = self._unsampled, None
        pending.attach(self._sample(rows, logits, grammar_bitmask))

    def cancel_held(self) -> None:
        """Drops an executed step that will never be sampled (the engine failed it)."""
        self._unsampled = None

    def _sample(
        self, rows: list, logits: torch.Tensor, grammar_bitmask: GrammarBitmask | None
    ) -> SamplerOutput:
        out = self.sampler(logits, self._sampling_metadata(rows, grammar_bitmask))
        # Tensor-parallel ranks sample alike, and take rank 0's tokens so they never differ.
        broadcast_from_first(out.sampled_token_ids)
        self._last_sampled = (
            {request_id: row for row, (request_id, _, _) in enumerate(rows)},
            out.sampled_token_ids,
        )
        return out

    def _sampling_rows(
        self, so: SchedulerOutput, md: AttentionMetadata
    ) -> tuple[list[tuple[str, SamplingParams, int]], list[int] | None]:
        """One sampling row per sample, n rows for the first token of an n > 1 request:
        (request id, params, number of earlier output tokens). Also the index of each row's
        token in the step, None when row r is token r.

        A request that verifies k guesses samples k + 1 rows, at its last known token and
        at each guess, as if the guesses before the row were its outputs
        (`_guessed_outputs`); PendingOutput keeps the samples that agree with the guesses.
        """
        rows: list[tuple[str, SamplingParams, int]] = []
        index: list[int] = []
        self._guessed_outputs = {}
        starts = md.query_start_loc_cpu
        for i, s in enumerate(so.scheduled):
            if not s.sample:
                continue
            params = self.requests[s.request_id].sampling_params
            last = int(starts[i + 1]) - 1
            if s.spec_token_ids:
                k = len(s.spec_token_ids)
                for j in range(1, k + 1):
                    self._guessed_outputs[len(rows) + j] = s.spec_token_ids[:j]
                rows += [(s.request_id, params, s.num_output_tokens + j) for j in range(k + 1)]
                index += range(last - k, last + 1)
            elif params.n > 1:  # its first token: n samples, and the scheduler forks it
                rows += [(s.request_id, params.for_sample(k), 0) for k in range(params.n)]
                index += [last] * params.n
            else:
                rows.append((s.request_id, params, s.num_output_tokens))
                index.append(last)
        return rows, None if index == list(range(len(index))) else index

    def _sampling_metadata(
        self, rows: list[tuple[str, SamplingParams, int]], grammar_bitmask: GrammarBitmask | None
    ) -> SamplingMetadata:
        """The rows' sampling metadata, with the grammars' bans where a bitmask is given.

        NOTE: while the same params objects sample in the same rows (a steady decode
        batch) and each samples from its settings alone, the metadata is reused: the engine
        never changes a params object it has taken. Seeded rows' noise seeds (they follow
        the output count) and the grammars' masks are made anew each step; a min_tokens row
        qualifies once past min_tokens, as its output count never goes down.
        """
        params = [r[1] for r in rows]
        reusable = self._reusable_md
        if (
            reusable is not None
            and len(reusable[0]) == len(params)
            and all(map(operator.is_, reusable[0], params))
        ):
            md = reusable[1]
            if md.seeded_rows:
                counts = [r[2] for r in rows]
                seeded = [row for row, _ in md.seeded_rows]
                md = replace(md, seeded_rows=seeded_rows(params, counts, seeded))
        else:
            md = self._build_sampling_metadata(rows, params)
            reuse = all(r[1].samples_from_settings_alone(r[2]) for r in rows)
            self._reusable_md = (params, md) if reuse else None
        if grammar_bitmask is not None:
            md = replace(md, grammar_bans=self._grammar_masks.bans(rows, grammar_bitmask))
        return md

    def _build_sampling_metadata(
        self, rows: list[tuple[str, SamplingParams, int]], params: list[SamplingParams]
    ) -> SamplingMetadata:
        """The metadata of the rows' settings and tokens, grammars aside."""
        if any(p.needs_output_token_ids for p in params):
            states = [self.requests[r[0]] for r in rows]
            prompts = [state.prompt_token_ids for state in states]
            outputs = [state.output_token_ids for state in states]
            for row, guessed in self._guessed_outputs.items():
                outputs[row] = outputs[row] + guessed
        else:  # only penalties and bad words read the token ids
            prompts = outputs = [[]] * len(rows)
        return SamplingMetadata.build(
            params, prompts, outputs, vocab_size=self.vocab_size, device=self.device,
            num_output_tokens=[r[2] for r in rows],
        )  # fmt: skip

    def _copy_blocks(self, copies: list[tuple[int, int]], sliding: list[tuple[int, int]]) -> None:
        """Copy-on-write: gives a sequence its own copy of a shared partial block."""
        pairs = kv_setup.copy_blocks(self.kv_caches, self.hf_config, copies, sliding, self.device)
        if pairs is not None and self.draft is not None:
            self.draft.copy_blocks(*pairs)
