"""quantization="int8" | "int4" | "fp8" on a float checkpoint: each Linear's weight (qkv, o,
gate_up, down; not the embedding, norms or LM head) rounded to nearest as it lands, a Linear
at a time, so a load never holds the float projections together. A rank quantizes the shard
it loaded, so a row-parallel shard gets scales of its own. With fp8 a mixture of experts'
experts are rounded too (e4m3, a scale per row), once loaded; int8 and int4 leave them in
float."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from octavo.kernels.capability import check_fp8_device
from octavo.model.layers import Linear
from octavo.quant.fp8 import Fp8Weight
from octavo.quant.method import QuantMethod, Source, linears, place_one_at_a_time
from octavo.quant.rounding import quantize_fp8
from octavo.quant.weights import Int4Weight, Int8Weight, QuantizedWeight

WEIGHTS = {"int8": Int8Weight, "int4": Int4Weight, "fp8": Fp8Weight}


def quantize(linear: Linear, method: str) -> None:
    """Replaces the Linear's loaded weight (this rank's shard) by its `method` quantization;
    `weight` is None from then on."""
    linear.quant = quantize_weight(method, linear.weight.detach())
    linear.weight = None


def quantize_weight(method: str, weight: torch.Tensor) -> QuantizedWeight:
    """weight [N, K] (output rows, input columns) -> its `method` quantization."""
    if method not in WEIGHTS:
        raise ValueError(
            f"quantization={method!r} cannot quantize float weights (gguf, awq and gptq keep a "
            f"checkpoint's own groups); use one of {tuple(WEIGHTS)}"
        )
    return WEIGHTS[method](weight)


class RoundToNearest(QuantMethod):
    def __init__(self, name: str) -> None:
        self.name = name  # one of WEIGHTS (quant/__init__.py's get_method makes it)

    def check(self, device: torch.device, model_path: str | None, load_format: str) -> None:
        if self.name == "fp8":
            check_fp8_device("quantization='fp8'", device)

    def claim(self, net: nn.Module, source: Source, device: torch.device) -> dict[Linear, Any]:
        return dict.fromkeys(linears(net))

    def fill(self, net, source, claims, device, threads) -> None:
        weights = self.float_weights(source)
        place_one_at_a_time(net, claims, weights, None, device, self._quantized, threads)
        if self.name == "fp8":  # the experts loaded in float with the other weights
            quantize_experts(net)

    def _quantized(self, linear: Linear, weight: torch.Tensor) -> QuantizedWeight:
        return quantize_weight(self.name, weight)

    def quantize_random(self, net: nn.Module) -> None:
        for linear in linears(net):
            quantize(linear, self.name)
        if self.name == "fp8":
            quantize_experts(net)


def quantize_experts(net: nn.Module) -> None:
    """Rounds every expert's rows to e4m3 with a float32 scale each, an expert at a time,
    so the float weights and their codes are never all held twice."""
    from octavo.model.moe import FusedMoE

    for module in net.modules():
        if not isinstance(module, FusedMoE) or module.quant is not None:
            continue
        for name in ("w13", "w2"):
            weight = getattr(module, name).detach()
            codes = torch.empty(weight.shape, dtype=torch.float8_e4m3fn, device=weight.device)
            scale = torch.empty(weight.shape[:2], dtype=torch.float32, device=weight.device)
            for e in range(weight.shape[0]):
                codes[e], scale[e] = quantize_fp8(weight[e])
            del weight
            module.hold_fp8(name, codes, scale)
