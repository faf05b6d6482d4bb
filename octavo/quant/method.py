"""What a quantization format is to the loader: a `QuantMethod`, and the placement that every
format's tensors take into a Linear.

The loader (checkpoint/loader.py) builds the model, with every Linear weight on the meta
device when a method is set (layers.LINEAR_WEIGHT_DEVICE), and then, with no branch per
format:

    claims = method.claim(net, source, device)     the Linears it makes, their groups or
                                                   scales placed first where it keeps some
    every other parameter <- method.float_weights(source)
    method.fill(net, source, claims, device, threads)   each claimed Linear's QuantizedWeight,
                                                   one Linear at a time

Random weights (load_format="dummy") are drawn in float and then `quantize_random` turns
them into the method's form. A method's tensors reach a Linear through its own weight loader
(`place`), which fuses q/k/v and gate/up and slices for tensor parallelism as it does for
weights, so no format handles fusion or sharding itself.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch
from torch import nn

from octavo.model.layers import Linear, load_nothing

Stream = Iterator[tuple[str, Any]]  # (HF name, tensor or lazy tensor: read when narrowed)


class Source(Protocol):
    """A checkpoint as methods read it (checkpoint/loader.py's Checkpoint)."""

    path: str

    def tensors(self) -> Stream:
        """Every tensor as stored (a GGUF file's dequantized), read anew at each call."""

    def gguf_blocks(self, part: str) -> Stream:
        """A GGUF file's Q4 and Q8_0 matrices as "codes", "groups" or "bits"."""

    def gguf_tensor(self, name: str) -> Any:
        """A GGUF file's tensor `name` (`.bits`, `.shape`, `.codes()`, `.groups()`) or None."""


class QuantMethod:
    """One quantization format. The base class is the float method: nothing claimed, every
    weight loaded as it is stored."""

    name: str | None = None

    def check(self, device: torch.device, model_path: str | None, load_format: str) -> None:
        """Raises ValueError where the method cannot run: the device, the file, the format."""

    def float_weights(self, source: Source) -> Stream:
        """The checkpoint's tensors for the parameters loaded as float."""
        return source.tensors()

    def claim(self, net: nn.Module, source: Source, device: torch.device) -> dict[Linear, Any]:
        """The Linears this method makes (their float weights are never read), each with
        what `fill` needs for it."""
        return {}

    def fill(
        self,
        net: nn.Module,
        source: Source,
        claims: dict[Linear, Any],
        device: torch.device,
        threads: int,
    ) -> None:
        """Gives each claimed Linear its QuantizedWeight (`linear.quant`; `weight` None)."""

    def quantize_random(self, net: nn.Module) -> None:
        """Turns random float Linear weights into the method's form."""
        if self.name is not None:
            raise ValueError(f"quantization={self.name!r} needs a checkpoint, not dummy weights")


def linears(net: nn.Module) -> list[Linear]:
    return [m for m in net.modules() if isinstance(m, Linear)]


def scratch(
    linear: Linear, columns: int, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """[the Linear's rows, columns] in `dtype` on `device`: NaN if floating, else empty."""
    shape = (linear.weight.shape[0], columns)
    if dtype.is_floating_point:
        return torch.full(shape, float("nan"), dtype=dtype, device=device)
    return torch.empty(shape, dtype=dtype, device=device)


@contextmanager
def weight_loaders(loaders: dict[nn.Parameter, Callable]):
    """Gives each parameter its loader here while open; restores theirs on exit (a
    parameter without one, such as a QuantizedWeight's, is left without)."""
    saved = {param: param.__dict__.get("weight_loader") for param in loaders}
    for param, loader in loaders.items():
        param.weight_loader = loader
    try:
        yield
    finally:
        for param, loader in saved.items():
            if loader is None:
                del param.weight_loader
            else:
                param.weight_loader = loader


@contextmanager
def cpu_threads(num_threads: int | None):
    """Runs the block with torch's CPU thread pool at `num_threads` (None: as it is); restores
    the previous count on exit.

    NOTE: loading on the CPU is one memory-bound copy per tensor, which one thread does at
    full speed, while the pool's threads, when other processes share the cores, wait for one
    another far longer than the copy takes.
    """
    previous = torch.get_num_threads()
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    try:
        yield
    finally:
        torch.set_num_threads(previous)


def place(
    net: nn.Module,
    make: dict[Linear, Callable[[], torch.Tensor]],
    stream: Stream,
    finish: Callable[[Linear, torch.Tensor], None] | None = None,
) -> dict[Linear, torch.Tensor]:
    """Feeds `stream` (checkpoint tensors, some standing for Linear weights) through each
    Linear m of `make` to its own weight loader, which fuses and shards them as it does
    weights, into a scratch made by make[m]() at m's first tensor instead of into its weight
    (not touched: it may be on the meta device); every other parameter takes nothing.
    Returns the scratches made. With `finish`, finish(m, scratch) runs as soon as all of m's
    parts have landed, and the scratch is dropped then.

    Raises:
        RuntimeError: with `finish`, a Linear of `make` whose parts did not all land.
        ValueError: with `finish`, a tensor of a Linear that came again once it finished
            (a checkpoint that stores it twice).
    """
    made: dict[Linear, torch.Tensor] = {}
    seen: dict[Linear, set] = {}

    def load(m: Linear, param: nn.Parameter, tensor, *shard_id) -> None:
        if m not in made:
            if m in seen:  # finished and dropped: a second copy would fill a fresh scratch
                name = next(n for n, module in net.named_modules() if module is m)
                raise ValueError(f"the checkpoint holds a tensor of {name} twice")
            made[m] = make[m]()
        m.weight_loader(made[m], tensor, *shard_id)
        seen.setdefault(m, set()).update(shard_id or (None,))
        if finish is not None and seen[m] >= set(getattr(param, "shard_ids", (None,))):
            finish(m, made.pop(m))

    loaders = {p: load_nothing for p in net.parameters()}
    loaders |= {m.weight: lambda *a, m=m: load(m, *a) for m in make}
    with weight_loaders(loaders):
        net.load_weights(stream)
    unfinished = [m for m in make if m not in seen or m in made]
    if finish is not None and unfinished:
        raise RuntimeError(f"the tensors of {len(unfinished)} Linears did not all land")
    return made


def place_one_at_a_time(
    net: nn.Module,
    claims: dict[Linear, Any],
    stream: Stream,
    dtype: torch.dtype | None,
    device: torch.device,
    keep: Callable[[Linear, torch.Tensor], nn.Module],
    threads: int,
) -> None:
    """Places each claimed Linear's codes or weight [N, K] from `stream` in `dtype` scratch
    (None: the weight's dtype),
    and as soon as all its parts have landed sets `m.quant = keep(m, scratch)` (on `threads`
    CPU threads) and drops the float weight: a load holds one Linear's scratch at a time."""

    def finish(m: Linear, tensor: torch.Tensor) -> None:
        with cpu_threads(threads):
            m.quant = keep(m, tensor)
        m.weight = None

    make = {
        m: (lambda m=m: torch.empty(m.weight.shape, dtype=dtype or m.weight.dtype, device=device))
        for m in claims
    }
    place(net, make, stream, finish)
