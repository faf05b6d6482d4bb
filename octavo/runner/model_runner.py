"""The model runner: turns a SchedulerOutput into flat tensors, runs the model, samples.

It owns the model, the KV cache tensors and the sampler; it knows nothing of queues.
"""

from __future__ import annotations

import operator
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import torch

from octavo.attention.backend import AttentionMetadata, build_metadata, get_attention_backend
from octavo.attention.layer import bind_kv_caches
from octavo.core.scheduler import SchedulerOutput
from octavo.model.hf_config import get_head_dim
from octavo.model.layers import Linear
from octavo.model.loader import load_model
from octavo.runner.cuda_graph import (
    CudaGraphRunner,
    GraphShape,
    capture_sizes,
    mixed_capture_sizes,
)
from octavo.runner.gemm_tuning import tune_linears
from octavo.runner.inputs import InputBuilder
from octavo.runner.sampler import (
    GrammarMasks,
    Sampler,
    SamplerOutput,
    SamplingMetadata,
    gather_logprobs,
    seeded_rows,
    to_device,
)
from octavo.sampling_params import SamplingParams

# (token id, log-prob, rank) for the sampled token first, then the top-k alternatives.
TokenLogprobs = list[tuple[int, float, int]]
# Prompt log-probs take the logits of this many positions at a time: a long prompt chunk's
# then need at most ~250 MB more (a 150k vocabulary), not tens of GB.
PROMPT_LOGPROBS_ROWS = 128


@dataclass
class ModelRunnerOutput:
    """Per request that sampled this step: its new tokens (one, or n at the first token of
    an n > 1 request), and their log-probs if asked for. Per request that asked for prompt
    log-probs and computed prompt positions this step: (first position p, entries of
    prompt tokens p + 1, p + 2, ...), the entries shaped as for sampled tokens."""

    sampled_token_ids: dict[str, list[int]]
    logprobs: dict[str, list[TokenLogprobs]] = field(default_factory=dict)
    prompt_logprobs: dict[str, tuple[int, list[TokenLogprobs]]] = field(default_factory=dict)


@dataclass
class PromptLogprobSpan:
    """Positions `first .. first + count - 1` of a request's prompt, whose logits score its
    prompt tokens `first + 1 ..`; `k` alternatives each."""

    request_id: str
    first: int
    count: int
    k: int


def kv_bytes_per_block(hf_config, block_size: int, dtype: torch.dtype) -> int:
    """layers x (K and V) x block_size x kv_heads x head_dim x dtype bytes."""
    num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    return (
        hf_config.num_hidden_layers * 2 * block_size * num_kv_heads * get_head_dim(hf_config) * elem
    )


def warm_up_rows(max_rows: int, per_doubling: int = 8) -> list[int]:
    """Row counts for warm_up_linears: 1-16, then `per_doubling` sizes per doubling up to
    `max_rows`, each as a multiple of 8 and as the odd count after it, and `max_rows`."""
    rows = set(range(1, min(16, max_rows) + 1)) | {max_rows}
    size = 16.0
    while size < max_rows:
        aligned = int(size) // 8 * 8
        rows.update(r for r in (aligned, aligned + 1) if r <= max_rows)
        size *= 2 ** (1 / per_doubling)
    return sorted(rows)


@torch.inference_mode()
def warm_up_linears(model: torch.nn.Module, max_rows: int) -> int:
    """Runs each distinct projection of `model` (by weight shape, dtype and bias) once at
    every row count of warm_up_rows(max_rows), on zeros; returns the number of GEMMs run.

    NOTE: cuBLAS picks a GEMM kernel by shape, and the first launch of each kernel stalls
    the host 2-5 ms, once 19 ms (measured on an H200: benchmarks/gemm_first_call_probe.py).
    A prefill step's row count is its token count, so without this the first steps after
    start-up, each with a new token count, stall ~4 ms per projection: that much more TTFT.
    The inputs are contiguous [rows, in] views, like the activations, since cuBLAS may pick
    another kernel for another row stride.
    """
    linears: dict[tuple, Linear] = {}
    for module in model.modules():
        if isinstance(module, Linear):
            w = module.weight
            linears.setdefault((tuple(w.shape), w.dtype, module.bias is not None), module)
    flats: dict[torch.dtype, torch.Tensor] = {}  # one zero input buffer per weight dtype
    for module in linears.values():
        w, size = module.weight, max_rows * module.input_size
        if w.dtype not in flats or flats[w.dtype].numel() < size:
            flats[w.dtype] = torch.zeros(size, dtype=w.dtype, device=w.device)
    launched = 0
    for rows in warm_up_rows(max_rows):
        for module in linears.values():
            flat = flats[module.weight.dtype]
            module(flat[: rows * module.input_size].view(rows, module.input_size))
            launched += 1
    return launched


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
        cuda_graph_max_tokens: int = 512,
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
        # NOTE: the torch backend plans its work on the host from each step's lengths, which
        # a graph replay would not see: graphs only with the Triton backend.
        self.use_cuda_graphs = device.type == "cuda" and not enforce_eager and backend == "triton"
        self.cuda_graph_max_tokens = cuda_graph_max_tokens
        self.graph_runner: CudaGraphRunner | None = None
        self.inputs: InputBuilder | None = None
        # The previous step's samples on the device: (request id -> row, [R] token ids).
        self._last_sampled: tuple[dict[str, int], torch.Tensor] | None = None
        # The last sampling metadata with the rows' params, while it can serve again.
        self._reusable_md: tuple[list[SamplingParams], SamplingMetadata] | None = None
        self._grammar_masks = GrammarMasks(self.vocab_size, device)  # structured outputs' bans

    def allocate_kv_cache(
        self,
        num_blocks: int,
        max_num_seqs: int = 256,
        max_model_len: int = 2048,
        max_num_batched_tokens: int = 8192,
        warm_up: bool = True,
    ) -> None:
        """Allocates one [2, num_blocks, block_size, kv_heads, head_dim] tensor per layer,
        once, binds them to the model's attention layers, sets up the persistent input
        buffers and captures CUDA graphs. On CUDA, `warm_up` then runs every projection at a
        ladder of row counts up to `max_num_batched_tokens` (warm_up_linears) and the eager
        end of a decode step at every batch size (see _warm_up_eager_decode).

        NOTE: one extra block (id `num_blocks`) is scratch space for the padding rows of a
        CUDA graph; the KV cache manager never hands it out.
        """
        cfg = self.hf_config
        num_kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        shape = (2, num_blocks + 1, self.block_size, num_kv_heads, get_head_dim(cfg))
        self.kv_caches = [
            torch.zeros(shape, dtype=self.dtype, device=self.device)
            for _ in range(cfg.num_hidden_layers)
        ]
        bind_kv_caches(self.model, self.kv_caches, self.attn_backend)
        max_blocks = -(-max_model_len // self.block_size)
        self.inputs = InputBuilder(
            max_num_batched_tokens,
            max_num_seqs,
            max_blocks,
            self.block_size,
            num_blocks,
            self.device,
        )
        self._last_sampled = None
        self._reusable_md = None
        if self.use_cuda_graphs:
            max_mixed_tokens = min(self.cuda_graph_max_tokens, max_num_batched_tokens)
            tune_linears(
                self.model, capture_sizes(max_num_seqs) + mixed_capture_sizes(max_mixed_tokens)
            )
            self.graph_runner = CudaGraphRunner(
                self.model, self.inputs, max_num_seqs, max_mixed_tokens
            )
            self.graph_runner.capture()
        if warm_up and self.device.type == "cuda":
            warm_up_linears(self.model, max_num_batched_tokens)
            self._warm_up_eager_decode(max_num_seqs)

    @torch.inference_mode()
    def _warm_up_eager_decode(self, max_num_seqs: int) -> None:
        """Runs the eager end of a decode step (LM head, sampler, pending-token copy) once
        for every batch size a step can have: all rows greedy, then random and greedy rows
        in turn (a batch of one: random).

        NOTE: cuBLAS and torch pick their kernels by shape and alignment, and CUDA loads a
        kernel's module at its first launch (lazy loading). Without this, a run whose batch
        shrinks from 256 to 1 loads ~20 new kernels on the way, each stalling the host for
        ~7 ms between two steps (measured on an H200; docs/PERFORMANCE.md). A sampler and a
        generator of its own leave the engine's and torch's random streams untouched. Rows
        with filters, penalties or log-probs take other kernels, which this does not load.
        """
        sampler = Sampler(seed=0)
        noise = torch.Generator(self.device).manual_seed(0)
        hidden = torch.randn(
            max_num_seqs,
            self.hf_config.hidden_size,
            dtype=self.dtype,
            device=self.device,
            generator=noise,
        )
        greedy, random_row = SamplingParams(temperature=0.0), SamplingParams(temperature=1.0)
        mixed = [random_row if i % 2 == 0 else greedy for i in range(max_num_seqs)]
        for params in ([greedy] * max_num_seqs, mixed):
            for batch in range(1, max_num_seqs + 1):
                md = SamplingMetadata.build(
                    params[:batch],
                    [[]] * batch,
                    [[]] * batch,
                    self.vocab_size,
                    self.eos_token_ids,
                    self.device,
                )
                sampled = sampler(self.model.compute_logits(hidden[:batch]), md)
                index = torch.arange(batch, device=self.device).repeat(2, 1)  # [2, batch]
                self.inputs.copy_pending(index, sampled.sampled_token_ids)
        torch.cuda.synchronize()

    @torch.inference_mode()
    def profile_activation_bytes(self, num_tokens: int, num_rows: int) -> int:
        """Peak memory of one step's activations: a forward pass over `num_tokens` tokens
        and logits for `num_rows` rows, with a temporary KV cache just large enough."""
        num_blocks = -(-num_tokens // self.block_size)
        self.use_cuda_graphs, graphs = False, self.use_cuda_graphs
        self.allocate_kv_cache(num_blocks, num_rows, num_tokens, num_tokens, warm_up=False)
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
        self.inputs = None
        self.use_cuda_graphs = graphs
        torch.cuda.empty_cache()
        return peak

    def _forward(
        self, input_ids: torch.Tensor, positions: torch.Tensor, md: AttentionMetadata
    ) -> torch.Tensor:
        return self.model(input_ids, positions, md)

    def _graph_shape(self, so: SchedulerOutput) -> GraphShape | None:
        """The CUDA graph to replay for this step, if one fits it."""
        if self.graph_runner is None:
            return None
        return self.graph_runner.shape_for(so.num_batched_tokens, len(so.scheduled))

    def execute(self, so: SchedulerOutput) -> ModelRunnerOutput:
        """Runs one step and waits for its sampled tokens. See execute_async."""
        return self.execute_async(so).result()

    @torch.inference_mode()
    def execute_async(self, so: SchedulerOutput) -> PendingOutput:
        """Queues one step on the device: the forward pass over all scheduled tokens, then
        sampling for the requests whose step reached their last token. Returns without
        waiting for the device; `.result()` of the returned object waits.

        NOTE: a request whose input is pending reads the token this runner sampled for it
        in the previous step, on the device: steps must run in the order scheduled.
        """
        self._copy_blocks(so.block_copies)
        self.inputs.rows.release(so.finished_request_ids + so.preempted_request_ids)
        graph = self._graph_shape(so)
        last_rows, last_sampled = self._last_sampled or ({}, None)
        step = self.inputs.build(so.scheduled, graph, last_rows, last_sampled)
        if graph is not None:
            hidden = self.graph_runner.replay(graph)
        else:
            hidden = self._forward(step.input_ids, step.positions, step.md)  # [T, hidden]
        prompt = self._prompt_logprobs(so, step.md, hidden)
        rows, logits_index = self._sampling_rows(so, step.md)
        self._last_sampled = None
        if not rows:
            return PendingOutput([], None, prompt)
        if logits_index is None:  # one row per token, in order
            hidden = hidden[: len(rows)]
        else:
            hidden = hidden[to_device(logits_index, torch.int64, self.device)]
        logits = self.model.compute_logits(hidden)  # [R, V]

        structured = any(params.structured_outputs is not None for _, params, _ in rows)

        def sample() -> SamplerOutput:
            out = self.sampler(logits, self._sampling_metadata(so, rows, structured))
            self._last_sampled = (
                {request_id: row for row, (request_id, _, _) in enumerate(rows)},
                out.sampled_token_ids,
            )
            return out

        if structured:
            # A grammar's mask needs the previous step's token: sample once the engine has
            # fed it (PendingOutput.sample), while this step's forward pass runs.
            return PendingOutput(rows, None, prompt, sample=sample)
        return PendingOutput(rows, sample(), prompt)

    def _prompt_logprobs(
        self, so: SchedulerOutput, md: AttentionMetadata, hidden: torch.Tensor
    ) -> tuple[list[PromptLogprobSpan], tuple[torch.Tensor, ...]] | None:
        """Raw log-probs of the prompt tokens this step's chunks predict, for the requests
        that asked for them (`prompt_logprobs`): position p's logits score prompt token
        p + 1. Returns the spans and their (token ids, log-probs, ranks), or None."""
        if not so.scores_prompts:
            return None
        spans, index, targets = [], [], []
        starts = md.query_start_loc_cpu
        for i, s in enumerate(so.scheduled):
            k = s.request.sampling_params.prompt_logprobs
            if k is None or s.request.output_token_ids:  # an output: its prompt is scored
                continue
            prompt, first = s.request.prompt_token_ids, s.num_computed_tokens
            count = min(s.num_new_tokens, len(prompt) - 1 - first)
            if count <= 0:
                continue
            spans.append(PromptLogprobSpan(s.request_id, first, count, k))
            index += range(starts[i], starts[i] + count)
            targets += prompt[first + 1 : first + 1 + count]
        if not spans:
            return None
        k = max(span.k for span in spans)
        index_t = to_device(index, torch.int64, self.device)
        targets_t = to_device(targets, torch.int64, self.device)
        parts = []
        for lo in range(0, len(index), PROMPT_LOGPROBS_ROWS):
            rows = slice(lo, lo + PROMPT_LOGPROBS_ROWS)
            raw = self.model.compute_logits(hidden[index_t[rows]]).float().log_softmax(-1)
            parts.append(gather_logprobs(raw, targets_t[rows], k))
        return spans, tuple(torch.cat(column) for column in zip(*parts, strict=True))

    def _sampling_rows(
        self, so: SchedulerOutput, md: AttentionMetadata
    ) -> tuple[list[tuple[str, SamplingParams, int]], list[int] | None]:
        """One sampling row per sample, n rows for the first token of an n > 1 request:
        (request id, params, number of earlier output tokens). Also the index of each row's
        token in the step, None when row r is token r."""
        rows: list[tuple[str, SamplingParams, int]] = []
        index: list[int] = []
        starts = md.query_start_loc_cpu
        for i, s in enumerate(so.scheduled):
            if not s.sample:
                continue
            request = s.request
            params = request.sampling_params
            last = starts[i + 1] - 1
            # NOTE: num_pending_tokens counts this step's sample, and any still in flight.
            num_earlier = len(request.output_token_ids) + request.num_pending_tokens - 1
            if request.awaits_fork:
                rows += [(s.request_id, params.for_sample(k), 0) for k in range(params.n)]
                index += [last] * params.n
            else:
                rows.append((s.request_id, params, num_earlier))
                index.append(last)
        if index == list(range(len(index))):
            return rows, None
        return rows, index

    def _sampling_metadata(
        self, so: SchedulerOutput, rows: list[tuple[str, SamplingParams, int]], structured: bool
    ) -> SamplingMetadata:
        """`structured`: some row has a structured output (its grammar's mask is added).

        NOTE: the metadata of rows whose params all sample from their settings alone is
        reused for as long as the same params objects sample in the same rows (a steady
        decode batch). Their settings alone decide it, and the engine never changes a params
        object once it has taken the request, so the same objects give the same metadata;
        only the seeded rows' noise seeds follow their number of outputs, and are renewed,
        and the grammars' masks follow their tokens, and are made each step. A min_tokens
        row qualifies once it has reached min_tokens: a row's count of outputs never goes
        down while its params object is the same.
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
            md = self._build_sampling_metadata(so, rows, params)
            reuse = all(r[1].samples_from_settings_alone(r[2]) for r in rows)
            self._reusable_md = (params, md) if reuse else None
        if structured:
            requests = {s.request_id: s.request for s in so.scheduled}
            grammars = [requests[r[0]].grammar for r in rows]
            md = replace(md, grammar_bans=self._grammar_masks.bans(grammars))
        return md

    def _build_sampling_metadata(
        self,
        so: SchedulerOutput,
        rows: list[tuple[str, SamplingParams, int]],
        params: list[SamplingParams],
    ) -> SamplingMetadata:
        """The metadata of the rows' settings and tokens, grammars aside."""
        if any(p.needs_output_token_ids for p in params):
            requests = {s.request_id: s.request for s in so.scheduled}
            prompts = [requests[r[0]].prompt_token_ids for r in rows]
            outputs = [requests[r[0]].output_token_ids for r in rows]
        else:  # only penalties and bad words read the token ids
            prompts = outputs = [[]] * len(rows)
        return SamplingMetadata.build(
            params,
            prompts,
            outputs,
            vocab_size=self.vocab_size,
            eos_token_ids=self.eos_token_ids,
            device=self.device,
            num_output_tokens=[r[2] for r in rows],
        )

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy-on-write: gives a sequence its own copy of a shared partial block."""
        if not copies:
            return
        index = to_device(
            [[c[0] for c in copies], [c[1] for c in copies]], torch.int64, self.device
        )
        src, dst = index[0], index[1]
        for cache in self.kv_caches:
            cache[:, dst] = cache[:, src]  # [2, num_blocks, block_size, KVH, D]


class PendingOutput:
    """A step's sampled tokens (and log-probs) on their way to the host: the copies are
    queued behind the step's kernels, and `result()` waits for them.

    With `sample` (a step with a structured output's grammar) the sampling itself waits:
    `sample()` launches it once the grammars have taken the previous step's tokens; the
    next step's inputs read its tokens, so it must run before the next step is launched.
    """

    def __init__(
        self,
        rows: list[tuple[str, SamplingParams, int]],
        out: SamplerOutput | None,
        prompt: tuple[list[PromptLogprobSpan], tuple[torch.Tensor, ...]] | None = None,
        sample: Callable[[], SamplerOutput] | None = None,
    ):
        self.rows = rows
        self._sample = sample
        self._spans = prompt[0] if prompt is not None else []
        self._prompt_host, self._prompt_event = _copy_to_host(prompt[1] if prompt else ())
        self._host, self._event = _copy_to_host(_sampler_tensors(out))

    def sample(self) -> None:
        """Launches a deferred sampling (see the class); nothing if there is none."""
        if self._sample is not None:
            sample, self._sample = self._sample, None
            self._host, self._event = _copy_to_host(_sampler_tensors(sample()))

    def result(self) -> ModelRunnerOutput:
        """Waits for the copies; the tokens of each request, and log-probs if asked for."""
        self.sample()
        for event in (self._prompt_event, self._event):
            if event is not None:
                event.synchronize()
        result = ModelRunnerOutput({})
        if self._spans:
            _collect_prompt_logprobs(self._spans, *self._prompt_host, result)
        if not self.rows:
            return result
        host = self._host
        tokens = host[0].tolist()
        for (request_id, _, _), token in zip(self.rows, tokens, strict=True):
            result.sampled_token_ids.setdefault(request_id, []).append(token)
        if len(host) > 1:
            _collect_logprobs(self.rows, *host[1:], result)
        return result


def _sampler_tensors(out: SamplerOutput | None) -> list[torch.Tensor]:
    if out is None:
        return []
    if out.logprobs is None:
        return [out.sampled_token_ids]
    return [out.sampled_token_ids, out.logprob_token_ids, out.logprobs, out.sampled_token_ranks]


def _copy_to_host(tensors) -> tuple[list[torch.Tensor], torch.cuda.Event | None]:
    """Queues copies of device tensors into host memory (pinned, without waiting, on
    CUDA); returns them and an event recorded after the copies (None off CUDA)."""
    host = []
    on_cuda = bool(tensors) and tensors[0].device.type == "cuda"
    for t in tensors:
        copy = torch.empty(t.shape, dtype=t.dtype, pin_memory=on_cuda)
        copy.copy_(t, non_blocking=on_cuda)
        host.append(copy)
    if not on_cuda:
        return host, None
    event = torch.cuda.Event()
    event.record()
    return host, event


def _collect_prompt_logprobs(
    spans: list[PromptLogprobSpan], token_ids, logprobs, ranks, result: ModelRunnerOutput
) -> None:
    token_ids, values, ranks = token_ids.tolist(), logprobs.tolist(), ranks.tolist()
    row = 0
    for span in spans:
        entries = [
            _entry(token_ids[r], values[r], ranks[r], span.k) for r in range(row, row + span.count)
        ]
        result.prompt_logprobs[span.request_id] = (span.first, entries)
        row += span.count


def _collect_logprobs(
    rows, logprob_token_ids, logprobs, sampled_ranks, result: ModelRunnerOutput
) -> None:
    token_ids = logprob_token_ids.tolist()
    values = logprobs.tolist()
    ranks = sampled_ranks.tolist()
    for row, (request_id, params, _) in enumerate(rows):
        k = params.logprobs
        if k is None:
            continue
        entry = _entry(token_ids[row], values[row], ranks[row], k)
        result.logprobs.setdefault(request_id, []).append(entry)


def _entry(token_ids: list[int], values: list[float], rank: int, k: int) -> TokenLogprobs:
    """One row of gather_logprobs' output as TokenLogprobs: the chosen token with its rank,
    then the top k with theirs (1..k)."""
    return [(token_ids[0], values[0], rank)] + [
        (token_ids[j], values[j], j) for j in range(1, k + 1)
    ]
