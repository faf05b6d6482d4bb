"""Deterministic mode on CUDA: a token's tokens and log-probs never depend on what else runs.

`LLM(..., deterministic=True)` swaps every place where a row's result depends on the rows
beside it for one that does not:

- dense products (every projection and the LM head): kernels/fixed_gemm.py, each output
  summed in one fixed order, instead of cuBLAS, which picks a kernel (and an order) by shape;
  from LT_ROWS rows up, cuBLASLt algorithms that give the same bits
  (kernels/fixed_order_product.py);
- attention: kernels/prefill_attention.py over fixed spans of the context (`split` below)
  for every step, decode included, instead of the decode kernel, whose split count follows
  the batch; so a token gets the same bits decoded alone, beside 255 others, or recomputed
  in a prefill chunk after preemption or behind a prefix hit;
- all-reduces over more than two ranks: an all-gather summed in rank order
  (model/parallel.py; two ranks add one pair, the same either way).

RMSNorm, rotary, the activation and the sampler already work row by row, and a seeded
request draws its noise from its own seed. CUDA graphs stay. The CPU's float32 kernels are
batch-invariant already (kernels/cpu_kernels.c).
"""

from __future__ import annotations

import torch

from octavo.model.layers import use_fixed_order_products
from octavo.model.moe import FusedMoE
from octavo.model.parallel import use_fixed_order_sums

MIN_SPLIT = 512  # context positions a span at least: a decode step's programs each read one
MAX_SPLITS = 16  # spans of the longest context at most: the decode workspace's size


def fixed_split(max_model_len: int) -> int:
    """The span length for a context of up to `max_model_len` positions: a power of two, at
    least MIN_SPLIT, at most MAX_SPLITS spans. Fixed for the engine's life."""
    split = MIN_SPLIT
    while split * MAX_SPLITS < max_model_len:
        split *= 2
    return split


def check_deterministic(model: torch.nn.Module, backend: str, quantization: str | None) -> None:
    """ValueError unless deterministic mode covers this model on CUDA."""
    if backend != "triton":
        raise ValueError("deterministic=True runs the Triton attention backend on CUDA")
    if quantization is not None:
        raise ValueError(
            f"deterministic=True covers 16-bit weights; quantization={quantization!r} is not "
            "batch-invariant yet (use quantization='none')"
        )
    if any(isinstance(m, FusedMoE) for m in model.modules()):
        raise ValueError("deterministic=True covers dense models; mixtures of experts are not "
                         "batch-invariant yet")  # fmt: skip
    dtype = next(model.parameters()).dtype
    if dtype not in (torch.bfloat16, torch.float16):
        raise ValueError(f"deterministic=True on CUDA runs bfloat16 or float16, not {dtype}")


def make_deterministic(
    model: torch.nn.Module, backend: str, quantization: str | None, device: torch.device
) -> None:
    """Routes the all-reduces and, on CUDA (after checking the model), the products through
    the fixed-order ones. The attention backend's span length is set once the context limit
    is known (`fixed_split`)."""
    use_fixed_order_sums()
    if device.type != "cuda":  # the CPU's float32 kernels are batch-invariant already
        return
    check_deterministic(model, backend, quantization)
    from octavo.kernels.fixed_order_product import FixedOrderProduct  # Triton: CUDA only

    use_fixed_order_products(model, FixedOrderProduct())
