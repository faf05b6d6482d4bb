"""quantization="fp8" on an HF fp8 checkpoint, read as it is: e4m3 weights, each with a float32
scale per 128 x 128 block (`<name>.weight_scale_inv`, w = q * scale), as Qwen3's and
DeepSeek's FP8 releases.

The scales are read first and placed by the model's weight loaders: each Linear's loader
gets a `BlockGrid` in place of its weight and one in place of the checkpoint tensor,
matrices in element units that hold one value per block. The loaders only narrow and copy,
so fusing and tensor-parallel slicing put each block's scale where they put the block's
values. The e4m3 codes of the Linears that got scales then go through the same loaders into
e4m3 scratch, never into float weights (Fp8BlockWeight):

    qkv_proj.weight  [(H + 2 * KVH) * D, hidden]   rows: | q: H * D | k: KVH * D | v: KVH * D |
    its scales       [(H + 2 * KVH) * D / 128, hidden / 128]   the same row ranges, / 128

A fused part or a rank's slice that starts or ends inside a block is a ValueError. A
projection without scales (the checkpoint's `modules_to_not_convert`) stays float.

A mixture of experts' experts (Qwen3-30B-A3B-FP8 stores each expert's projections in blocks)
are dequantized as they load into the layer's float experts, then rounded to e4m3 with a
scale per row (quant/rtn.py's `quantize_experts`), the form the fused MoE kernels read: one
more rounding than the checkpoint's, the one quantization="fp8" makes of bf16 experts.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import AbstractContextManager
from typing import Any

import torch
from torch import nn

from octavo.kernels.capability import check_fp8_device
from octavo.model.layers import Linear, read_whole
from octavo.quant.fp8 import Fp8BlockWeight
from octavo.quant.method import QuantMethod, Source, place_one_at_a_time, weight_loaders
from octavo.quant.rounding import FP8_BLOCK, dequantize_fp8_blocks
from octavo.quant.rtn import quantize_experts

SCALE_SUFFIX = ".weight_scale_inv"


def parse_fp8_config(config: dict) -> tuple[int, int]:
    """An HF fp8 `quantization_config` (quant_method "fp8") -> its weight block size, once
    checked to be what octavo reads as it is: e4m3 weights with a float32 scale per 128 x 128
    block (`<name>.weight_scale_inv`, w = q * scale) and activations quantized at each call.

    Raises:
        ValueError: naming the field octavo cannot read.
    """
    block = config.get("weight_block_size")
    if block is None:
        raise ValueError(
            "quantization_config: an fp8 checkpoint without weight_block_size (one scale per "
            "tensor or per channel) is not supported; octavo reads weight_block_size [128, 128]"
        )
    if list(block) != [FP8_BLOCK] * 2:
        raise ValueError(
            f"quantization_config: weight_block_size {list(block)} is not supported; "
            f"octavo reads [{FP8_BLOCK}, {FP8_BLOCK}]"
        )
    for field, supported in (
        ("fmt", "e4m3"),
        ("activation_scheme", "dynamic"),
        ("scale_fmt", "float"),
    ):
        value = config.get(field, supported)
        if value != supported:
            raise ValueError(
                f"quantization_config: {field}={value!r} is not supported; octavo reads "
                f"{field}={supported!r}"
            )
    return FP8_BLOCK, FP8_BLOCK


class Fp8BlockCheckpoint(QuantMethod):
    name = "fp8"

    def __init__(self, config: dict) -> None:
        parse_fp8_config(config)

    def check(self, device: torch.device, model_path: str | None, load_format: str) -> None:
        check_fp8_device("quantization='fp8'", device)

    experts: dict[str, torch.Tensor] | None = None  # expert weight name -> its block scales

    def float_weights(self, source: Source) -> Iterator[tuple[str, Any]]:
        """The float tensors, and the experts' codes dequantized (`claim` found them)."""
        experts = self.experts or {}
        for name, tensor in _codes(source):
            if name in experts:
                tensor = dequantize_fp8_blocks(
                    read_whole(tensor), experts[name], FP8_BLOCK, FP8_BLOCK, torch.float32
                )
            yield name, tensor

    def claim(self, net: nn.Module, source: Source, device: torch.device) -> dict[Linear, Any]:
        scales = _Scales(source.tensors())
        claims = scales.place(net, device)
        self.experts = scales.experts
        return claims

    def fill(self, net, source, claims, device, threads) -> None:
        def keep(m: Linear, codes: torch.Tensor) -> Fp8BlockWeight:
            return Fp8BlockWeight(codes, claims.pop(m).blocks, m.weight.dtype)

        fp8 = torch.float8_e4m3fn
        place_one_at_a_time(net, dict(claims), _codes(source), fp8, device, keep, threads)
        if self.experts:  # loaded in float with the other weights: each row to e4m3
            quantize_experts(net)


def _codes(source: Source) -> Iterator[tuple[str, Any]]:
    return ((n, t) for n, t in source.tensors() if not n.endswith(SCALE_SUFFIX))


class BlockGrid:
    """A matrix of `shape` (element units) holding one value per 128 x 128 block in `blocks`
    [ceil(rows / 128), ceil(cols / 128)]: what a weight loader narrows and copies in place of
    a parameter (`.data`, `.shape`, `.dim()`) or of a checkpoint tensor. A narrowed grid is
    a view: its copies land in the whole grid's blocks."""

    def __init__(
        self,
        blocks: torch.Tensor,
        shape: tuple[int, int],
        origin: tuple[int, int] = (0, 0),
        whole: tuple[int, int] | None = None,
    ) -> None:
        self.blocks = blocks
        self.shape = tuple(shape)
        self.origin = origin  # where this view starts in the whole matrix
        self.whole = whole or self.shape

    @property
    def data(self) -> BlockGrid:
        return self

    def dim(self) -> int:
        return 2

    def narrow(self, dim: int, start: int, length: int) -> BlockGrid:
        origin, shape = list(self.origin), list(self.shape)
        origin[dim] += start
        shape[dim] = length
        return BlockGrid(self.blocks, tuple(shape), tuple(origin), self.whole)

    def copy_(self, source: BlockGrid) -> BlockGrid:
        self.blocks[self._block_index()] = source.blocks[source._block_index()].to(self.blocks)
        return self

    def _block_index(self) -> tuple[slice, slice]:
        """The blocks this view covers; it must start on a block and end on one or at the
        whole matrix's end (a last, partial block)."""
        index = []
        for axis, start, length, whole in zip(
            ("rows", "columns"), self.origin, self.shape, self.whole, strict=True
        ):
            end = start + length
            if start % FP8_BLOCK or (end % FP8_BLOCK and end != whole):
                raise ValueError(
                    f"{axis} {start}..{end} of {whole} do not start and end on the "
                    f"checkpoint's {FP8_BLOCK} x {FP8_BLOCK} blocks"
                )
            index.append(slice(start // FP8_BLOCK, -(-end // FP8_BLOCK)))
        return index[0], index[1]


def _blocks_of(shape: tuple[int, int]) -> tuple[int, int]:
    return -(-shape[0] // FP8_BLOCK), -(-shape[1] // FP8_BLOCK)


class _Scales:
    """An fp8 checkpoint's scales (read whole: they are small) and its weights' shapes, read
    from `weights` (its tensors, lazy ones not read); `place` finds the Linears they
    cover, whose e4m3 codes are then kept in Fp8BlockWeights."""

    def __init__(self, weights: Iterator[tuple[str, torch.Tensor]]) -> None:
        self.scales: dict[str, torch.Tensor] = {}  # weight name -> [N / 128, K / 128]
        self.experts: dict[str, torch.Tensor] = {}  # those of experts' weights (`place`)
        self.shapes: dict[str, tuple[int, int]] = {}  # weight name -> [N, K]
        for name, tensor in weights:
            if name.endswith(SCALE_SUFFIX):
                self.scales[name.removesuffix("_scale_inv")] = read_whole(tensor).float()
            elif name.endswith(".weight"):
                self.shapes[name] = tuple(tensor.shape)

    def place(self, net: nn.Module, device: torch.device) -> dict[Linear, BlockGrid]:
        """Places the scales through the model's weight loaders; returns the grid of each
        Linear that got scales for all its weight (one that got none, a module the
        checkpoint keeps in float, is left out).

        Raises:
            ValueError: a scale tensor of the wrong shape or for no Linear's weight, a Linear
                with scales for part of its weight, or a fused part or tensor-parallel slice
                that does not start and end on 128 x 128 blocks.
        """
        names = {m: n for n, m in net.named_modules() if isinstance(m, Linear)}
        grids = {
            m: BlockGrid(
                torch.full(_blocks_of(m.weight.shape), float("nan"), device=device),
                tuple(m.weight.shape),
            )
            for m in names
        }
        with _loaders_onto(net, grids, names, self.experts):
            net.load_weights((name, self._grid(name, s)) for name, s in self.scales.items())
        kept = {}
        for module, grid in grids.items():
            missing = grid.blocks.isnan()
            if missing.all():
                continue
            if missing.any():
                raise ValueError(
                    f"the checkpoint's fp8 scales cover only part of {names[module]}.weight"
                )
            kept[module] = grid
        return kept

    def _grid(self, name: str, scale: torch.Tensor) -> BlockGrid:
        shape = self.shapes.get(name)
        if shape is None:
            raise ValueError(f"checkpoint tensor {name}_scale_inv has no weight {name}")
        if tuple(scale.shape) != _blocks_of(shape):
            raise ValueError(
                f"checkpoint tensor {name}_scale_inv has shape {tuple(scale.shape)}, expected "
                f"{_blocks_of(shape)}: one scale per {FP8_BLOCK} x {FP8_BLOCK} block of {shape}"
            )
        grid = BlockGrid(scale, shape)
        grid.name = name
        return grid


def _loaders_onto(
    net: nn.Module,
    grids: dict[Linear, BlockGrid],
    names: dict[Linear, str],
    experts: dict[str, torch.Tensor],
) -> AbstractContextManager:
    """While open, each Linear weight's loader places a checkpoint BlockGrid into the Linear's
    own grid through the Linear's weight_loader, the experts' loaders note theirs in
    `experts`, and every other parameter's refuses one."""
    loaders = {}
    weights = {id(m.weight): m for m in grids}
    for name, param in net.named_parameters():
        module = weights.get(id(param))
        if module is None and name.endswith((".w13", ".w2")):  # a mixture of experts' experts

            def load(param, grid, *shard_id):
                experts[grid.name] = grid.blocks

        elif module is None:

            def load(param, grid, *shard_id, name=name):
                raise ValueError(f"the checkpoint has fp8 scales for {name}, kept in float here")

        else:

            def load(param, grid, *shard_id, module=module):
                try:
                    module.weight_loader(grids[module], grid, *shard_id)
                except ValueError as e:
                    raise ValueError(
                        f"fp8 scales of {names[module]}.weight: {e}; fused parts and "
                        "tensor-parallel slices must start and end on whole blocks"
                    ) from None

        loaders[param] = load
    return weight_loaders(loaders)
