"""The physical floor of an offline workload: bytes over the copy bandwidth
and FLOPs over the matmul rate, both measured in the same process. Beside it, two bounds for
engines that run a step's kernels one after another: the serial floor (any schedule) and the
FCFS serial estimate (this workload's schedule)."""

from __future__ import annotations

import collections
import functools
from dataclasses import dataclass, field

import torch

# Buffer sizes of the copy ceiling, in bytes. A larger copy moves at a higher rate, since a
# launch's ramp and tail are a smaller share of it; the ceiling is the best rate that fits.
COPY_SIZES = (1 << 30, 1 << 31, 1 << 32)


@dataclass
class DeviceCeilings:
    copy_bytes_per_s: float  # bytes read + written per second, device to device
    matmul_flops: float  # bf16 (or the model dtype) matmul FLOP/s
    copy_by_size: dict[int, float] = field(default_factory=dict)  # buffer bytes -> rate


@dataclass
class Floor:
    weight_bytes: int
    kv_bytes_per_token: int
    kv_read_bytes: int
    memory_s: float
    compute_s: float
    serial_s: float  # see serial_floor: for engines that run a step's kernels in turn
    fcfs_serial_s: float  # see fcfs_serial_estimate: the same, for this workload's schedule

    @property
    def seconds(self) -> float:
        """The overlapped floor: the larger of the memory and compute floors."""
        return max(self.memory_s, self.compute_s)


def _time_cuda(fn, repeats: int) -> float:
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return sorted(times)[len(times) // 2]


def copy_sizes(free_bytes: int, spare: int = 1 << 30) -> list[int]:
    """The copy buffers to time: the smallest of COPY_SIZES always, each larger one only if
    its source and destination fit in `free_bytes` with `spare` bytes left over (an engine's
    KV cache leaves little free)."""
    return [s for s in COPY_SIZES if s == COPY_SIZES[0] or 2 * s + spare <= free_bytes]


def measure_ceilings(dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> DeviceCeilings:
    """Device copies of 1 GiB and up (the best rate of COPY_SIZES that fit) and an 8192^3
    matmul, median of several runs each."""
    torch.cuda.empty_cache()
    rates = {}
    for size in copy_sizes(torch.cuda.mem_get_info(device)[0]):
        rates[size] = copy_rate(size, device)
        torch.cuda.empty_cache()  # its buffers are gone: give the memory back
    flops = _matmul_rate(dtype, device)
    torch.cuda.empty_cache()
    return DeviceCeilings(max(rates.values()), flops, rates)


def copy_rate(size: int, device: str) -> float:
    """Bytes read + written per second by a device copy of `size` bytes, median of 20."""
    src = torch.randn(size // 4, device=device)  # float32, random (never zeros)
    dst = torch.empty_like(src)
    return 2 * size / _time_cuda(lambda: dst.copy_(src), 20)


def _matmul_rate(dtype: torch.dtype, device: str, n: int = 8192) -> float:
    """FLOP/s of an n x n x n matmul in `dtype`, median of 20."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    return 2 * n**3 / _time_cuda(lambda: a @ b, 20)


def meta_model(hf_config, dtype: torch.dtype) -> torch.nn.Module:
    """The whole model (world size 1) on the meta device: its parameters' shapes, no memory;
    what a floor counts when the model's shards live in other processes."""
    from octavo.checkpoint.loader import _default_dtype
    from octavo.model.registry import get_model_class

    with _default_dtype(dtype), torch.device("meta"):
        return get_model_class(hf_config)(hf_config)


def weights_read_per_step(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters one forward pass reads whole: all of them, tied ones once, except an
    input embedding's (a step reads only its batch's rows of its table or kept blocks) and a
    float table the LM head holds but does not multiply by (it has a quantized form)."""
    from octavo.model.layers import LMHead, VocabEmbedding

    read = {id(p) for p in lm_head_weights(model)}
    skipped = set()
    for m in model.modules():
        if type(m) is VocabEmbedding:
            skipped |= {id(p) for p in m.parameters()} - read
        elif isinstance(m, LMHead) and m.quant is not None:
            skipped.add(id(m.weight))
    params = {id(p): p for p in model.parameters() if id(p) not in skipped}
    return list(params.values())


def bytes_read_per_token(model: torch.nn.Module) -> float:
    """A one-token decode step's weight reads: every parameter weights_read_per_step counts,
    but of a mixture-of-experts layer's experts only the k its token is routed to."""
    from octavo.model.moe import FusedMoE

    share = {}  # id(param) -> the fraction of it one token reads
    for m in model.modules():
        if isinstance(m, FusedMoE):
            experts = [m.w13, m.w2, *(m.quant.parameters() if m.quant is not None else ())]
            share |= dict.fromkeys(map(id, experts), m.top_k / m.num_experts)
    params = weights_read_per_step(model)
    return sum(p.numel() * p.element_size() * share.get(id(p), 1.0) for p in params)


def serial_work(
    model: torch.nn.Module, hf_config, kv_dtype: torch.dtype, prompt_lens: list[int],
    output_lens: list[int],
) -> SerialWork:  # fmt: skip
    """What the workload asks of the device running `model`, its KV cache in `kv_dtype`."""
    from octavo.model.config import get_head_dim, layer_windows

    params = weights_read_per_step(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    num_params = sum(p.numel() for p in params)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    elem = torch.empty((), dtype=kv_dtype).element_size()
    kv_per_token = hf_config.num_hidden_layers * 2 * kv_heads * get_head_dim(hf_config) * elem
    return SerialWork(
        prompt_lens, output_lens, weight_bytes, num_params,
        lm_head_params(model), kv_per_token, *_expert_parts(model),
        windows=tuple(layer_windows(hf_config)),
    )  # fmt: skip


def workload_floor(
    model: torch.nn.Module,
    hf_config,
    kv_dtype: torch.dtype,
    prompt_lens: list[int],
    output_lens: list[int],
    ceilings: DeviceCeilings,
) -> Floor:
    """memory floor = (KV read by all decode steps + each step's weight reads) / bandwidth;
    compute floor = 2 x active params x all tokens / matmul rate; the floor is the larger.
    A step reads every weight, but of a mixture of experts' experts only those its tokens
    reach (SerialWork.step_weight_bytes). The KV cache holds `kv_dtype`."""
    work = serial_work(model, hf_config, kv_dtype, prompt_lens, output_lens)
    weight_bytes, kv_per_token = work.weight_bytes, work.kv_bytes_per_token
    kv_read = sum(work.kv_bytes_read(p, o) for p, o in zip(prompt_lens, output_lens, strict=True))
    steps = max(output_lens, default=0)
    weight_read = sum(work.step_weight_bytes(work.running(t)) for t in range(steps))
    memory_s = (kv_read + weight_read) / ceilings.copy_bytes_per_s
    tokens = sum(prompt_lens) + sum(output_lens)
    compute_s = 2 * work.active_params * tokens / ceilings.matmul_flops
    return Floor(
        weight_bytes, kv_per_token, kv_read, memory_s, compute_s,
        serial_floor(work, ceilings), fcfs_serial_estimate(work, ceilings),
    )  # fmt: skip


def _expert_parts(model: torch.nn.Module) -> tuple[int, int, float]:
    """(bytes, parameters) of a mixture of experts' experts, and the share k / E of them one
    token reaches; (0, 0, 1.0) for a dense model."""
    from octavo.model.moe import FusedMoE

    nbytes = count = 0
    share = 1.0
    for m in model.modules():
        if isinstance(m, FusedMoE):
            for p in (m.w13, m.w2, *(m.quant.parameters() if m.quant is not None else ())):
                nbytes, count = nbytes + p.numel() * p.element_size(), count + p.numel()
            share = m.top_k / m.num_experts
    return nbytes, count, share


def lm_head_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    """What the LM head multiplies by, once if several modules share it: its quantized form's
    tensors where it has one, else its weight."""
    from octavo.model.layers import LMHead

    found = {}
    for m in model.modules():
        if isinstance(m, LMHead):
            tensors = [m.weight] if m.quant is None else list(m.quant.parameters())
            found |= {id(p): p for p in tensors}
    return list(found.values())


def lm_head_params(model: torch.nn.Module) -> int:
    """The LM head's parameters as a matrix (vocabulary rows x hidden), however it holds them."""
    from octavo.model.layers import LMHead

    return sum(
        m.weight.numel() if m.quant is None else m.quant.out_features * m.quant.in_features
        for m in model.modules()
        if isinstance(m, LMHead)
    )


@dataclass
class SerialWork:
    """What an offline workload asks of the device, for the two serial bounds below."""

    prompt_lens: list[int]
    output_lens: list[int]
    weight_bytes: int  # W: what one forward pass reads
    num_params: int  # P: the parameters behind W
    head_params: int  # the LM head's share of P (prompts use it at their last token only)
    kv_bytes_per_token: int  # K
    # A mixture of experts: its experts' share of W and P, and k / E.
    expert_bytes: int = 0
    expert_params: int = 0
    expert_share: float = 1.0
    # Each layer's sliding window (None: the whole context), where K counts every layer
    # alike; () for a model without windows. A sliding layer reads at most its window.
    windows: tuple[int | None, ...] = ()

    @property
    def active_params(self) -> int:
        """The parameters one token multiplies by (of the experts, its k)."""
        return round(self.num_params - self.expert_params * (1 - self.expert_share))

    def running(self, step: int) -> int:
        """Requests with an output token at `step` (0: the prefill's)."""
        return sum(1 for o in self.output_lens if o > step)

    def step_weight_bytes(self, tokens: int) -> float:
        """What a step of `tokens` tokens reads of the weights: all, but of the experts the
        expected share that tokens routed uniformly at random reach, 1 - (1 - k / E)^tokens
        (dummy weights route about so)."""
        missed = (1 - self.expert_share) ** max(tokens, 1)
        return self.weight_bytes - self.expert_bytes * missed

    def gemm_seconds(self, tokens: int, ceilings: DeviceCeilings) -> float:
        """The floor of a step's GEMMs over `tokens` tokens: the weights they reach or their
        FLOPs, whichever takes longer."""
        return max(self.step_weight_bytes(tokens) / ceilings.copy_bytes_per_s,
                   2.0 * self.active_params * tokens / ceilings.matmul_flops)  # fmt: skip

    def prefill_flops(self) -> float:
        prompt_params = self.active_params - self.head_params
        return 2.0 * (
            prompt_params * sum(self.prompt_lens) + self.head_params * len(self.prompt_lens)
        )

    def decode_kv_bytes(self, step: int) -> int:
        """KV read by decode step `step` (>= 1) of every request that has one: the prefill
        samples output token 1, decode step t feeds token t and attends over prompt + t."""
        return sum(
            self.kv_bytes_read(p + step, 1)
            for p, o in zip(self.prompt_lens, self.output_lens, strict=True)
            if o > step
        )

    def kv_bytes_read(self, context: int, steps: int) -> float:
        """KV read by `steps` tokens in a row, the first over `context` positions, each next
        one over one more: the sum of min(c, window) per layer for c = context ..."""
        if not self.windows:
            return self.kv_bytes_per_token * _sum_up_to(context, steps, None)
        per_layer = self.kv_bytes_per_token / len(self.windows)
        return per_layer * sum(n * _sum_up_to(context, steps, w) for w, n in self._window_counts)

    @functools.cached_property
    def _window_counts(self) -> list[tuple[int | None, int]]:
        return list(collections.Counter(self.windows).items())


def _sum_up_to(first: int, count: int, cap: int | None) -> int:
    """sum of min(first + t, cap) for t < count (cap None: no cap)."""
    below = count if cap is None else max(min(count, cap - first), 0)
    return below * first + below * (below - 1) // 2 + (count - below) * (cap or 0)


def serial_floor(work: SerialWork, ceilings: DeviceCeilings) -> float:
    """The least time of a workload, in any schedule, for an engine that runs kernels one
    after another (octavo, vLLM, nano-vllm): attention's KV reads cannot hide behind GEMMs.

        decode KV read / B  +  max(max_out x W / B,  (prefill + decode FLOPs) / F)

    The longest request needs max_out steps (its prefill, then one per later token), each
    reading every weight; GEMMs take at least their weight reads and at least their FLOPs.
    Attention FLOPs and the prefill's own KV traffic are left out, so it stays a floor.
    Unlike the overlapped floor (the larger of memory and compute over the whole run) it
    does not let attention's memory time hide the GEMMs' arithmetic.
    """
    steps = max(work.output_lens, default=0)
    decode_tokens = sum(max(o - 1, 0) for o in work.output_lens)
    flops = work.prefill_flops() + 2.0 * work.active_params * decode_tokens
    kv_bytes = sum(work.decode_kv_bytes(t) for t in range(1, steps))
    weight_read = sum(work.step_weight_bytes(work.running(t)) for t in range(steps))
    gemm_s = max(weight_read / ceilings.copy_bytes_per_s, flops / ceilings.matmul_flops)
    return kv_bytes / ceilings.copy_bytes_per_s + gemm_s


def fcfs_serial_estimate(work: SerialWork, ceilings: DeviceCeilings) -> float:
    """The serial time of the schedule first-come-first-served continuous batching gives
    when every request fits in one batch (the nano-vllm workload: 256 requests, 256 seqs):
    all prompts first, then every request decoding in the same steps until it ends.

        max(W / B, prefill FLOPs / F)  +  sum over decode steps t >= 1 of
            KV_t / B + max(W / B, 2 x P x (requests still running) / F)

    Its steps carry a batch that shrinks from 256 to 1; at large batches their GEMMs are
    compute-bound, and nothing in this schedule hides that. An estimate, not a floor: a
    scheduler that delays requests to even out the batch could do better.
    """
    bandwidth, flops = ceilings.copy_bytes_per_s, ceilings.matmul_flops
    seconds = max(work.weight_bytes / bandwidth, work.prefill_flops() / flops)
    for t in range(1, max(work.output_lens, default=0)):
        kv_s = work.decode_kv_bytes(t) / bandwidth
        seconds += kv_s + work.gemm_seconds(work.running(t), ceilings)
    return seconds
