"""The building blocks of a decoder: norms, activation, linear layers (the rotary embedding
is model/rotary.py's).

Every parameter carries a `weight_loader(param, loaded_weight[, shard_id])` that copies one
checkpoint tensor into it. Fused parameters (`qkv_proj`, `gate_up_proj`) take several
checkpoint tensors, each into its own row range:

    qkv_proj.weight  [(H + 2 * KVH) * D, hidden]
    rows: | q: H * D | k: KVH * D | v: KVH * D |

Under tensor parallelism (model/parallel.py) the loaders take the whole checkpoint tensor and
copy their rank's slice; a lazy tensor (checkpoint/loader.py) reads only that slice from disk.

RMSNorm and SiluAndMul pick their kernel by the input's device, in one `if x.is_cuda` each:
on CUDA one Triton kernel (octavo/kernels, imported there, so the CPU path never imports
Triton), elsewhere the torch code, which is that kernel's reference. Attention's paths are
not chosen here or in the model but by its backend (octavo/attention).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextvars import ContextVar

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels import cpu as cpu_kernels
from octavo.model.parallel import (
    all_gather_columns,
    all_reduce,
    get_tp,
    kv_head_range,
    shard_range,
)


def read_whole(tensor) -> torch.Tensor:
    """A lazy tensor (checkpoint/loader.py's LazyTensor) read whole; a tensor as it is."""
    return tensor if isinstance(tensor, torch.Tensor) else tensor.narrow(0, 0, tensor.shape[0])


def default_weight_loader(param: torch.Tensor, loaded_weight: torch.Tensor) -> None:
    """Copies a whole checkpoint tensor into `param` (casting to its dtype and device)."""
    if tuple(param.shape) != tuple(loaded_weight.shape):
        raise ValueError(
            f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
            f"parameter expects {tuple(param.shape)}"
        )
    param.data.copy_(read_whole(loaded_weight))


def load_nothing(param: nn.Parameter, loaded_weight, *shard_id) -> None:
    """The weight loader of a weight kept in another form: the checkpoint tensor is not read."""


def stand_in(param: nn.Parameter) -> nn.Parameter:
    """An empty stand-in (no rows) for a parameter kept in another form: its other dims, its
    attributes (shard ids), and a loader that loads nothing."""
    empty = nn.Parameter(param.new_empty(0, *param.shape[1:]), requires_grad=False)
    empty.__dict__.update(param.__dict__)
    empty.weight_loader = load_nothing
    return empty


class RMSNorm(nn.Module):
    """Root-mean-square norm, computed in float32 like HF's.

    `forward(x, residual)` fuses the residual add of a pre-norm block: it returns
    `(norm(x + residual), x + residual)`, the second being the next residual.
    """

    rounds_before_weight = True  # Llama's order: the normed x rounded, then times the weight
    weight_dtype: torch.dtype | None = None  # None: the model's

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size, dtype=self.weight_dtype))
        self.weight.weight_loader = default_weight_loader

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            # One call, HF's operations in HF's order (bit for bit the code below).
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        orig_dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x.to(orig_dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if x.is_cuda:  # one Triton kernel instead of ~9 small ones
            from octavo.kernels.rms_norm import rms_norm

            return rms_norm(x, self.weight, self.eps, residual, self.rounds_before_weight)
        if residual is None:
            return self._norm(x)
        x = x + residual
        return self._norm(x), x


class SiluAndMul(nn.Module):
    """SwiGLU's gate: x [T, 2 * I] -> silu(x[:, :I]) * x[:, I:], [T, I]."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda:  # one Triton kernel for the split, the silu and the product
            from octavo.kernels.activation import silu_and_mul

            return silu_and_mul(x)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up


def _capturing(x: torch.Tensor) -> bool:
    """True while a CUDA graph captures on the current stream of x's device."""
    return x.is_cuda and torch.cuda.is_current_stream_capturing()


# Where new Linear weights are made (None: torch's default device). The loader makes them on
# "meta" where a checkpoint's own quantized tensors will stand in for them, so that a float
# weight never takes memory; one that stays float is made on the device then (checkpoint/loader.py).
LINEAR_WEIGHT_DEVICE: ContextVar[str | None] = ContextVar("linear_weight_device", default=None)


class Linear(nn.Module):
    """y = x W^T (+ b), with W [output_size, input_size] whole on every rank; the base of the
    sharded linears below."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        super().__init__()
        self.input_size = input_size
        self.output_size = output_size
        weight = torch.empty(output_size, input_size, device=LINEAR_WEIGHT_DEVICE.get())
        self.weight = nn.Parameter(weight)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(output_size))
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        self.register_module("quant", None)  # a QuantizedWeight (octavo/quant) in its place

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        default_weight_loader(param, loaded_weight)

    # {rows: fn(x, w)}, a GEMM measured faster than F.linear at that many rows; run only
    # while a CUDA graph captures (runner/gemm_tuning.py). Shared by projections of a shape.
    # fn returns None for an input it cannot take; F.linear runs then.
    tuned: dict[int, Callable[[torch.Tensor, torch.Tensor], torch.Tensor | None]] | None = None
    # product(x, weight, bias): the dense product; deterministic mode puts
    # kernels/fixed_gemm.py's here (use_fixed_order_products).
    product = staticmethod(cpu_kernels.dense)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            y = self.quant(x)
            return y if self.bias is None else y + self.bias
        tuned = self.tuned.get(x.shape[0]) if self.tuned and x.dim() == 2 else None
        if tuned is not None and x.is_contiguous() and _capturing(x):
            y = tuned(x, self.weight)
            if y is not None:
                return y
        return self.product(x, self.weight, self.bias)


class RowParallelLinear(Linear):
    """A linear whose input features are split over the tensor-parallel ranks (o_proj,
    down_proj): each rank multiplies its slice, and an all-reduce sums the partial outputs.
    Only rank 0 holds the bias; the others hold zeros, so the sum adds it once."""

    def __init__(self, input_size: int, output_size: int, bias: bool = False) -> None:
        tp = get_tp()
        if input_size % tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} does not divide {input_size} input features"
            )
        super().__init__(input_size // tp.size, output_size, bias)
        self.weight.checkpoint_shapes = {None: (output_size, input_size)}

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        tp = get_tp()
        if param.dim() == 2:
            start, count = shard_range(loaded_weight.shape[1], tp.rank, tp.size)
            loaded_weight = loaded_weight.narrow(1, start, count)
        elif tp.rank > 0:
            param.data.zero_()
            return
        default_weight_loader(param, loaded_weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(super().forward(x))


class _FusedLinear(Linear):
    """A column-parallel linear whose output rows are several checkpoint tensors laid end to
    end, each split over the tensor-parallel ranks.

    `shards` maps a shard id to (rows here, first row taken from the checkpoint tensor, the
    checkpoint tensor's rows). Each parameter lists its `shard_ids`, so a loader can tell when
    all of a fused parameter's pieces have arrived, and `checkpoint_shapes`, the shapes of
    the tensors its loader takes.
    """

    def __init__(
        self, input_size: int, shards: dict[str | int, tuple[int, int, int]], bias: bool
    ) -> None:
        super().__init__(input_size, sum(rows for rows, _, _ in shards.values()), bias)
        self.shards = shards
        offsets = [0]
        for rows, _, _ in shards.values():
            offsets.append(offsets[-1] + rows)
        self.offsets = dict(zip(shards, offsets, strict=False))
        for param in self.parameters():
            param.shard_ids = tuple(shards)
            param.checkpoint_shapes = {
                sid: (full, *param.shape[1:]) for sid, (_, _, full) in shards.items()
            }

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: str | int
    ) -> None:
        """Copies this rank's rows of one checkpoint tensor (e.g. k_proj's) into their place."""
        if shard_id not in self.shards:
            raise ValueError(f"unknown shard {shard_id!r}; expected one of {list(self.shards)}")
        rows, start, full = self.shards[shard_id]
        expected = (full, *param.shape[1:])
        if tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"checkpoint shard has shape {tuple(loaded_weight.shape)}, expected {expected}"
            )
        param.data.narrow(0, self.offsets[shard_id], rows).copy_(
            loaded_weight.narrow(0, start, rows)
        )


class QKVLinear(_FusedLinear):
    """q, k and v projections in one matmul: [T, hidden] -> [T, (H + 2 * KVH) * D], with this
    rank's H / N query heads and its KV heads (see parallel.kv_head_range)."""

    def __init__(
        self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool
    ) -> None:
        tp = get_tp()
        q_start, q_heads = shard_range(num_heads, tp.rank, tp.size)
        kv_start, kv_heads = kv_head_range(num_kv_heads, tp.rank, tp.size)
        q = (q_heads * head_dim, q_start * head_dim, num_heads * head_dim)
        kv = (kv_heads * head_dim, kv_start * head_dim, num_kv_heads * head_dim)
        super().__init__(hidden_size, {"q": q, "k": kv, "v": kv}, bias)


class MergedLinear(_FusedLinear):
    """Several projections of the same input stacked (gate and up: shard ids 0 and 1), each
    split over the tensor-parallel ranks."""

    def __init__(self, input_size: int, output_sizes: Sequence[int], bias: bool = False) -> None:
        tp = get_tp()
        shards = {}
        for i, size in enumerate(output_sizes):
            if size % tp.size:
                raise ValueError(
                    f"tensor_parallel_size={tp.size} does not divide {size} output features"
                )
            start, rows = shard_range(size, tp.rank, tp.size)
            shards[i] = (rows, start, size)
        super().__init__(input_size, shards, bias)


class VocabEmbedding(nn.Module):
    """Token embedding table [vocab, hidden], its rows split over the tensor-parallel ranks
    (the vocabulary padded to a multiple of their number); the LM head may share it."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__()
        tp = get_tp()
        self.vocab_size = vocab_size
        self.rows = -(-vocab_size // tp.size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.empty(self.rows, hidden_size))
        self.weight.weight_loader = self.weight_loader
        self.weight.checkpoint_shapes = {None: (vocab_size, hidden_size)}
        # A GroupRows that looks the rows up instead (a GGUF file's blocks); `weight` is then
        # empty, unless a tied LM head still multiplies by it.
        self.register_module("kept_rows", None)

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor) -> None:
        if get_tp().size == 1:
            default_weight_loader(param, loaded_weight)
            return
        if tuple(loaded_weight.shape) != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"checkpoint tensor has shape {tuple(loaded_weight.shape)}, "
                f"expected {(self.vocab_size, param.shape[1])}"
            )
        count = max(0, min(self.rows, self.vocab_size - self.start))
        param.data.zero_()
        param.data[:count].copy_(loaded_weight.narrow(0, self.start, count))

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.kept_rows is not None:
            return self.kept_rows(input_ids)  # [T, hidden]
        if get_tp().size == 1:
            return F.embedding(input_ids, self.weight)  # [T, hidden]
        local = input_ids - self.start
        outside = (local < 0) | (local >= self.rows)
        hidden = F.embedding(local.masked_fill(outside, 0), self.weight)
        return all_reduce(hidden.masked_fill_(outside.unsqueeze(-1), 0))


class LMHead(VocabEmbedding):
    """Projects hidden states to logits in the model's dtype: [N, hidden] -> [N, vocab]; each
    rank computes its vocabulary rows' logits and an all-gather joins them.
    The sampler upcasts to float32 where it computes with them."""

    def __init__(self, vocab_size: int, hidden_size: int) -> None:
        super().__init__(vocab_size, hidden_size)
        # A QuantizedWeight that computes the logits instead (the table stays for lookups).
        self.register_module("quant", None)

    product = staticmethod(cpu_kernels.dense)  # see Linear.product

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.quant is not None:
            logits = self.quant(hidden)
        else:
            logits = self.product(hidden, self.weight, None)
        return logits if get_tp().size == 1 else all_gather_columns(logits)[:, : self.vocab_size]


def use_fixed_order_products(model: nn.Module, product: Callable) -> None:
    """Every dense projection of `model`, the LM head's included, through `product(x, w, b)`
    (deterministic mode's batch-invariant GEMM)."""
    for module in model.modules():
        if isinstance(module, (Linear, LMHead)):
            module.product = product
