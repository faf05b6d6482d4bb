"""The physical floor of an offline workload (BENCHMARKS.md): bytes over the copy bandwidth
and FLOPs over the matmul rate, both measured in the same process."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class DeviceCeilings:
    copy_bytes_per_s: float  # bytes read + written per second, device to device
    matmul_flops: float  # bf16 (or the model dtype) matmul FLOP/s


@dataclass
class Floor:
    weight_bytes: int
    kv_bytes_per_token: int
    kv_read_bytes: int
    memory_s: float
    compute_s: float
    serial_s: float  # see serial_bound: a bound for engines that run a step's kernels in turn

    @property
    def seconds(self) -> float:
        """BENCHMARKS.md's floor: the larger of the memory and compute floors."""
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


def measure_ceilings(dtype: torch.dtype = torch.bfloat16, device: str = "cuda") -> DeviceCeilings:
    """A 1 GiB device copy and an 8192^3 matmul, median of several runs each."""
    src = torch.randn(1 << 28, device=device)  # 1 GiB of float32, random (never zeros)
    dst = torch.empty_like(src)
    copy_s = _time_cuda(lambda: dst.copy_(src), 20)
    n = 8192
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    mm_s = _time_cuda(lambda: a @ b, 20)
    del src, dst, a, b
    torch.cuda.empty_cache()
    return DeviceCeilings(2 * (1 << 30) / copy_s, 2 * n**3 / mm_s)


def weights_read_per_step(model: torch.nn.Module) -> list[torch.Tensor]:
    """The parameters one forward pass reads whole: all of them, tied ones once, except an
    input embedding table that is not also the LM head (a step reads only its batch's rows
    of that table)."""
    from octavo.model.layers import LMHead, VocabEmbedding

    heads = {m.weight.data_ptr() for m in model.modules() if isinstance(m, LMHead)}
    lookups = {
        m.weight.data_ptr()
        for m in model.modules()
        if type(m) is VocabEmbedding and m.weight.data_ptr() not in heads
    }
    params = {p.data_ptr(): p for p in model.parameters() if p.data_ptr() not in lookups}
    return list(params.values())


def workload_floor(
    model: torch.nn.Module,
    hf_config,
    dtype: torch.dtype,
    prompt_lens: list[int],
    output_lens: list[int],
    ceilings: DeviceCeilings,
) -> Floor:
    """memory floor = (KV read by all decode steps + weights x longest output) / bandwidth;
    compute floor = 2 x params x all tokens / matmul rate; the floor is the larger."""
    from octavo.model.hf_config import get_head_dim

    params = weights_read_per_step(model)
    weight_bytes = sum(p.numel() * p.element_size() for p in params)
    num_params = sum(p.numel() for p in params)
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or hf_config.num_attention_heads
    elem = torch.empty((), dtype=dtype).element_size()
    kv_per_token = hf_config.num_hidden_layers * 2 * kv_heads * get_head_dim(hf_config) * elem
    # sum over t < out of (prompt + t) = out * prompt + out * (out - 1) / 2
    kv_tokens = sum(o * p + o * (o - 1) // 2 for p, o in zip(prompt_lens, output_lens, strict=True))
    kv_read = kv_per_token * kv_tokens
    memory_s = (kv_read + weight_bytes * max(output_lens)) / ceilings.copy_bytes_per_s
    compute_s = 2 * num_params * (sum(prompt_lens) + sum(output_lens)) / ceilings.matmul_flops
    head_params = sum(p.numel() for p in lm_head_weights(model))
    serial_s = serial_bound(
        prompt_lens, output_lens, weight_bytes, num_params, head_params, kv_per_token, ceilings
    )
    return Floor(weight_bytes, kv_per_token, kv_read, memory_s, compute_s, serial_s)


def lm_head_weights(model: torch.nn.Module) -> list[torch.Tensor]:
    from octavo.model.layers import LMHead

    return list(
        {m.weight.data_ptr(): m.weight for m in model.modules() if isinstance(m, LMHead)}.values()
    )


def serial_bound(
    prompt_lens: list[int],
    output_lens: list[int],
    weight_bytes: int,
    num_params: int,
    head_params: int,
    kv_bytes_per_token: int,
    ceilings: DeviceCeilings,
) -> float:
    """The least time of a workload for an engine that runs a step's kernels one after
    another (octavo, vLLM, nano-vllm): each decode step reads its KV (bandwidth), then runs
    its GEMMs, which take the larger of their weight read and their FLOPs; the prompts cost
    their GEMM FLOPs (the LM head only at each prompt's last token).

        decode step t, its requests R_t = {r : output_r > t}:
            KV_t / B + max(W / B, 2 x params x |R_t| / F),  KV_t = K x sum over R_t of (prompt_r + t)
        prefill: 2 x ((params - head) x sum(prompt) + head x len(prompts)) / F

    Unlike the floor (max of memory and compute over the whole run) it does not let one
    step's arithmetic hide behind another's memory traffic. Attention FLOPs are left out,
    so it stays a lower bound.
    """
    bandwidth, flops = ceilings.copy_bytes_per_s, ceilings.matmul_flops
    seconds = 2 * ((num_params - head_params) * sum(prompt_lens) + head_params * len(prompt_lens))
    seconds /= flops
    for t in range(max(output_lens, default=0)):
        running = [p for p, o in zip(prompt_lens, output_lens, strict=True) if o > t]
        kv_bytes = kv_bytes_per_token * (sum(running) + t * len(running))
        gemm_s = max(weight_bytes / bandwidth, 2 * num_params * len(running) / flops)
        seconds += kv_bytes / bandwidth + gemm_s
    return seconds
