"""Mixture-of-experts decoders, Qwen3-MoE and Mixtral: the Llama family's attention, and in
place of (some of) its MLPs a router and E experts, each a SwiGLU MLP.

    router   p = softmax(x W_gate^T) in float32 [T, E]; each token's k largest, renormalized
             to sum 1 (Mixtral always, Qwen3-MoE when norm_topk_prob)
    experts  y = sum over the token's k experts e, in the order of e, of
             p_e * down_e(silu(gate_e(x)) * up_e(x))

A layer's experts are two stacked parameters, HF's own layout:

    w13  [E, 2 I, hidden]   each expert's rows: | gate: I | up: I |
    w2   [E, hidden, I]

Under tensor parallelism each rank holds I / N of every expert's intermediate features (the
gate/up rows and the down columns of its slice), as vLLM does; with expert parallelism
(`enable_expert_parallel=True`) E / N whole experts instead. Every rank routes every token
alike (the router is whole everywhere), and one all-reduce sums the ranks' shares. Qwen3-MoE
layers listed in `mlp_only_layers`, or not on the `decoder_sparse_step`, keep a dense MLP.

On the CPU the experts run one at a time over the tokens routed to them (index_select, then
index_add in expert order), through the same products as every Linear: a token's output does
not depend on what else the step holds. On CUDA the Triton kernels of kernels/fused_moe.py
run the layer in four launches without reading anything back, so CUDA graphs hold it.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from octavo.kernels import cpu as cpu_kernels
from octavo.model.layers import SiluAndMul, default_weight_loader, read_whole, stand_in
from octavo.model.llama import LlamaForCausalLM, LlamaMLP, Qwen3ForCausalLM
from octavo.model.parallel import all_reduce, get_tp, shard_range

if TYPE_CHECKING:
    from transformers import PretrainedConfig

_EXPERT = re.compile(r"\.experts\.(\d+)\.(\w+)\.weight$")
_STACKED = re.compile(r"\.experts\.(\w+_proj)\.weight$")


class FusedMoE(nn.Module):
    """A router and `num_experts` SwiGLU experts: x [T, hidden] -> [T, hidden]."""

    def __init__(
        self, num_experts: int, top_k: int, hidden: int, intermediate: int, renormalize: bool
    ) -> None:
        super().__init__()
        tp = get_tp()
        if intermediate % tp.size:
            raise ValueError(
                f"tensor_parallel_size={tp.size} does not divide the experts' {intermediate} "
                "intermediate features"
            )
        if not 0 < top_k <= num_experts:
            raise ValueError(f"num_experts_per_tok={top_k} must be in 1..{num_experts}")
        self.num_experts, self.top_k, self.renormalize = num_experts, top_k, renormalize
        if tp.expert_parallel and tp.size > 1:  # whole experts, E / N of them
            if num_experts % tp.size:
                raise ValueError(
                    f"expert parallelism over {tp.size} ranks needs a multiple of {tp.size} "
                    f"experts, not {num_experts}"
                )
            self.first, self.local = shard_range(num_experts, tp.rank, tp.size)
            self.start, self.inter = 0, intermediate
        else:  # a slice of every expert
            self.first, self.local = 0, num_experts
            self.start, self.inter = shard_range(intermediate, tp.rank, tp.size)
        self.gate = _Router(hidden, num_experts)
        self.w13 = nn.Parameter(torch.empty(self.local, 2 * self.inter, hidden))
        self.w2 = nn.Parameter(torch.empty(self.local, hidden, self.inter))
        experts = range(self.first, self.first + self.local)
        for param, parts, shape in (
            (self.w13, ("gate", "up"), (intermediate, hidden)),
            (self.w2, ("down",), (hidden, intermediate)),
        ):
            param.weight_loader = self.weight_loader
            param.shard_ids = tuple((e, p) for e in experts for p in parts)
            param.checkpoint_shapes = dict.fromkeys(param.shard_ids, shape)
        self.act_fn = SiluAndMul()
        # Tokens routed to each expert (all ranks route alike), for the engine's stats.
        self.register_buffer("expert_tokens", torch.zeros(num_experts, dtype=torch.int64),
                             persistent=False)  # fmt: skip
        # On CUDA: the step's real tokens [1] (the model's, set before each step), so that a
        # CUDA graph's padding rows are not counted.
        self.real_tokens: torch.Tensor | None = None
        # Each expert's QuantizedWeights ({"w13": [...], "w2": [...]}, this rank's experts)
        # where a method keeps a checkpoint's blocks; w13 and w2 are then empty.
        self.register_module("quant", None)
        # quantization="fp8": w13 and w2 hold e4m3 codes, times these float32 scales per row
        # ([E', 2 I] and [E', hidden]).
        self.register_buffer("w13_scale", None)
        self.register_buffer("w2_scale", None)

    def hold_fp8(self, name: str, codes: torch.Tensor, scale: torch.Tensor) -> None:
        """Computes with e4m3 `codes` in place of w13 or w2 (`name`), each row times its
        float32 `scale` ([E', rows]); quant/rtn.py makes them (quantization="fp8")."""
        setattr(self, name, nn.Parameter(codes, requires_grad=False))
        setattr(self, f"{name}_scale", scale)

    def _expert(self, name: str, local: int, dtype: torch.dtype) -> torch.Tensor:
        """Expert `local`'s w13 or w2 in `dtype` (dequantized where they hold e4m3 codes)."""
        weight, scale = getattr(self, name)[local], getattr(self, f"{name}_scale")
        return weight if scale is None else (weight.float() * scale[local][:, None]).to(dtype)

    def keep(self, w13: list[nn.Module], w2: list[nn.Module]) -> None:
        """Computes with these in place of w13 and w2 (each expert's, this rank's share);
        the float parameters become empty and load nothing."""
        self.quant = nn.ModuleDict({"w13": nn.ModuleList(w13), "w2": nn.ModuleList(w2)})
        self.w13, self.w2 = stand_in(self.w13), stand_in(self.w2)

    def weight_loader(
        self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: tuple[int, str]
    ) -> None:
        """Copies this rank's slice of expert e's gate, up or down projection into place (an
        expert another rank holds: nothing)."""
        expert, part = shard_id
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert {expert} of a layer of {self.num_experts} experts")
        expert -= self.first
        if not 0 <= expert < self.local:
            return
        expected = param.checkpoint_shapes.get(shard_id)
        if expected is None or tuple(loaded_weight.shape) != expected:
            raise ValueError(
                f"expert tensor {shard_id} has shape {tuple(loaded_weight.shape)}, expected "
                f"{expected} of {self.num_experts} experts"
            )
        if part == "down":
            param.data[expert].copy_(loaded_weight.narrow(1, self.start, self.inter))
        else:
            rows = param.data[expert].narrow(0, 0 if part == "gate" else self.inter, self.inter)
            rows.copy_(loaded_weight.narrow(0, self.start, self.inter))

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [T, hidden] -> (each token's k experts [T, k] int64, their weights [T, k] fp32)."""
        probs = F.softmax(cpu_kernels.dense(x, self.gate.weight).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        if self.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
        return experts, weights

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return all_reduce(self.partial(x))

    def partial(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's share of the output (its experts, or its slice of each): the ranks'
        shares sum to the whole."""
        if x.is_cuda and self.quant is None:
            return self._fused(x)
        experts, weights = self.route(x)
        self.expert_tokens += torch.bincount(experts.flatten(), minlength=self.num_experts)
        out = torch.zeros_like(x)
        for expert in torch.unique(experts).tolist():  # ascending
            local = expert - self.first
            if not 0 <= local < self.local:
                continue
            tokens, slot = torch.where(experts == expert)
            rows = x.index_select(0, tokens)
            if self.quant is not None:  # kept in a checkpoint's blocks
                y = self.quant["w2"][local](self.act_fn(self.quant["w13"][local](rows)))
            else:
                h = cpu_kernels.dense(rows, self._expert("w13", local, x.dtype))
                y = cpu_kernels.dense(self.act_fn(h), self._expert("w2", local, x.dtype))
            out.index_add_(0, tokens, (y * weights[tokens, slot, None]).to(x.dtype))
        return out

    def _fused(self, x: torch.Tensor) -> torch.Tensor:
        from octavo.kernels import fused_moe

        logits = F.linear(x, self.gate.weight)
        experts, weights = fused_moe.route(
            logits, self.top_k, self.renormalize, self.expert_tokens, self.real_tokens
        )
        scales = None if self.w13_scale is None else (self.w13_scale, self.w2_scale)
        return fused_moe.fused_experts(
            x, self.w13, self.w2, experts, weights, self.first, self.num_experts, scales=scales
        )


class _Router(nn.Module):
    """The router's weight [E, hidden], whole on every rank and never quantized."""

    def __init__(self, hidden: int, num_experts: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.weight.weight_loader = default_weight_loader


class _MoEForCausalLM(LlamaForCausalLM):
    """Routes the checkpoint's per-expert tensors into the stacked parameters."""

    # Checkpoint name of an expert's projection -> its part of w13 / w2.
    expert_parts: dict[str, str] = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
    moe_block = "mlp"  # the layer's attribute in the checkpoint's names

    def __init__(self, config: PretrainedConfig) -> None:
        super().__init__(config)
        # The step's real rows [1] (begin_step), made on the model's device; every FusedMoE
        # reads the one tensor, whose address CUDA graphs keep.
        self.real_tokens = torch.zeros(1, dtype=torch.int32)
        for m in self.modules():
            if isinstance(m, FusedMoE):
                m.real_tokens = self.real_tokens

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        return super().load_weights(_per_expert(weights))

    @property
    def supports_cuda_graphs(self) -> bool:
        """True unless experts kept in a checkpoint's blocks run their loop, which reads the
        routing on the host."""
        return all(m.quant is None for m in self.modules() if isinstance(m, FusedMoE))

    def begin_step(self, num_tokens: int) -> None:
        """Called before each step's forward pass or graph replay: of its rows, the first
        `num_tokens` are real (the rest a CUDA graph's padding)."""
        if self.real_tokens.is_cuda:  # the CPU loop counts its rows itself
            self.real_tokens.fill_(num_tokens)

    def route(self, name: str) -> tuple[str, str | int | tuple | None]:
        name = name.replace(f".{self.moe_block}.", ".mlp.")
        match = _EXPERT.search(name)
        if match is None:
            return super().route(name)
        part = self.expert_parts.get(match.group(2))
        if part is None:
            raise ValueError(f"checkpoint tensor {name!r} matches no parameter of the model")
        param = "w2" if part == "down" else "w13"
        return f"{name[: match.start()]}.{param}", (int(match.group(1)), part)


def _per_expert(weights: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, object]]:
    """The weights with every stacked experts' tensor (a GGUF file's `ffn_*_exps`, named
    `...mlp.experts.gate_proj.weight`, [E, rows, columns]) as E lazy tensors, one per expert:
    the stack is read (dequantized) once, when a loader first narrows one of them, and never
    where the experts are kept in another form."""
    for name, tensor in weights:
        match = _STACKED.search(name)
        if match is None:
            yield name, tensor
            continue
        stack, prefix = _Stack(tensor), name[: match.start()]
        for expert in range(tensor.shape[0]):
            yield f"{prefix}.experts.{expert}.{match.group(1)}.weight", _ExpertOf(stack, expert)


class _Stack:
    """A stacked tensor, read once, on first use."""

    def __init__(self, tensor) -> None:
        self.tensor, self.read = tensor, None

    def whole(self) -> torch.Tensor:
        if self.read is None:
            self.read = read_whole(self.tensor)
        return self.read


class _ExpertOf:
    """One expert's tensor of a _Stack, as a loader sees a lazy tensor (`shape`, `narrow`)."""

    def __init__(self, stack: _Stack, expert: int) -> None:
        self.stack, self.expert = stack, expert
        self.shape = tuple(stack.tensor.shape[1:])

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        return self.stack.whole()[self.expert].narrow(dim, start, length)


class Qwen3MoeForCausalLM(_MoEForCausalLM, Qwen3ForCausalLM):
    """Qwen3-MoE: Qwen3's attention; sparse layers on every `decoder_sparse_step`-th layer
    but those in `mlp_only_layers`, dense MLPs (intermediate_size) elsewhere."""

    def make_mlp(self, config: PretrainedConfig, layer: int) -> nn.Module:
        step = getattr(config, "decoder_sparse_step", 1) or 1
        sparse = config.num_experts > 0 and (layer + 1) % step == 0
        if not sparse or layer in (getattr(config, "mlp_only_layers", None) or ()):
            return LlamaMLP(config)
        return FusedMoE(
            config.num_experts, config.num_experts_per_tok, config.hidden_size,
            config.moe_intermediate_size, bool(getattr(config, "norm_topk_prob", False)),
        )  # fmt: skip


class MixtralForCausalLM(_MoEForCausalLM):
    """Mixtral: Llama's attention, every layer sparse (`block_sparse_moe` with experts
    w1 = gate, w3 = up, w2 = down), top-k weights renormalized."""

    expert_parts = _MoEForCausalLM.expert_parts | {"w1": "gate", "w3": "up", "w2": "down"}
    moe_block = "block_sparse_moe"

    def make_mlp(self, config: PretrainedConfig, layer: int) -> nn.Module:
        return FusedMoE(
            config.num_local_experts, config.num_experts_per_tok, config.hidden_size,
            config.intermediate_size, True,
        )  # fmt: skip


def expert_load(model: nn.Module) -> tuple[list[int], float] | None:
    """(tokens routed to each expert, summed over the layers; the largest load any layer put
    on one expert over that layer's mean), None for a model without experts."""
    layers = [m.expert_tokens for m in model.modules() if isinstance(m, FusedMoE)]
    if not layers:
        return None
    counts = torch.stack(layers).float()  # [L, E]
    mean = counts.mean(-1).clamp(min=1e-9)
    imbalance = (counts.amax(-1) / mean).max().item() if counts.sum() else 0.0
    return counts.sum(0).long().tolist(), imbalance


def reset_expert_load(model: nn.Module) -> None:
    """Forgets the counts so far (those of start-up's warm-up steps)."""
    for m in model.modules():
        if isinstance(m, FusedMoE):
            m.expert_tokens.zero_()
