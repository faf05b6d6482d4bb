"""Test helpers: tiny random Llama / Qwen2 / Qwen3 models quantized by a reference min-max
4-bit quantizer and written in AWQ's or GPTQ's own layout (AutoAWQ's GEMM packing order,
GPTQ's row packing and v1 zeros, act order's g_idx), next to a float checkpoint of their
exact dequantized weights."""

from __future__ import annotations

import json

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # AutoAWQ's order_map: nibble i holds column AWQ_ORDER[i]
DIMS = {
    "vocab_size": 256,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
}
CONFIGS = {
    "llama": lambda **d: LlamaConfig(**DIMS | d, tie_word_embeddings=False),
    "qwen2": lambda **d: Qwen2Config(**DIMS | d, tie_word_embeddings=False),  # q, k, v biases
    "qwen3": lambda **d: Qwen3Config(**{"head_dim": 32} | DIMS | d, tie_word_embeddings=True),
}
# Each projection, and the input it reads: act order's column order comes from the input's
# statistics, so the projections of one input share it.
PROJECTIONS = {
    "q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "o_proj": "o",
    "gate_proj": "gate_up", "up_proj": "gate_up", "down_proj": "down",
}  # fmt: skip


def _words(nibbles: torch.Tensor) -> torch.Tensor:
    """[..., 8] values in 0..15 -> int32 words [...], value i in bits 4i..4i+3."""
    words = sum(nibbles[..., i].long() << (4 * i) for i in range(8))
    return (words - ((words >> 31) & 1) * 2**32).to(torch.int32).contiguous()  # two's complement


def _pack_columns(values: torch.Tensor, order=tuple(range(8))) -> torch.Tensor:
    """[R, C] -> [R, C / 8]: each run of 8 columns a word, nibble i holding column order[i]."""
    rows, cols = values.shape
    return _words(values.view(rows, cols // 8, 8)[:, :, list(order)])


def _quantize(w: torch.Tensor, g_idx: torch.Tensor, groups: int, sym: bool):
    """Min-max 4-bit quantization of w [N, K] by the groups of g_idx, as AutoAWQ's and GPTQ's
    quantizers round: (q [K, N], zeros [G, N], fp16 scales [G, N]), w ~ (q - z) * s."""
    n = w.shape[0]
    scales, zeros = torch.empty(groups, n, dtype=torch.float16), torch.empty(groups, n)
    for g in range(groups):
        block = w[:, g_idx == g]
        if sym:
            scales[g] = (2 * block.abs().amax(1) / 15).half()
            zeros[g] = 8
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            scales[g] = ((hi - lo) / 15).half()
            zeros[g] = torch.round(-lo / scales[g].float()).clamp(1, 15)  # v1 stores z - 1
    s, z = scales.float()[g_idx], zeros[g_idx]  # [K, N]
    q = torch.round(w.t() / s + z).clamp(0, 15)
    return q.long().contiguous(), zeros.long(), scales


def write_checkpoint(arch: str, tmp_path, method: str, dims: dict | None = None, **options):
    """A random `arch` model quantized in `method`'s layout: (the quantized checkpoint's
    directory, a float checkpoint of its exact dequantized weights, HF on those weights).
    dims: sizes to change in DIMS. options: group_size, sym, desc_act, checkpoint_format
    (GPTQ)."""
    group, act_order = options.get("group_size", 128), options.get("desc_act", False)
    gen = torch.Generator().manual_seed(0)
    hf = AutoModelForCausalLM.from_config(CONFIGS[arch](**(dims or {})), dtype=torch.float32)
    hf.eval()
    state, orders = {}, {}
    with torch.no_grad():
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=gen)
            p.copy_(1 + 0.2 * noise if "norm" in name else 0.15 * noise)
        for name, p in hf.named_parameters():
            layer, projection, _ = ("", "", *name.split("."))[-3:]
            if projection not in PROJECTIONS or not name.endswith(".weight"):
                state[name] = p.detach().clone()
                continue
            k = p.shape[1]
            size = k if group == -1 else group
            g_idx = torch.arange(k) // size
            if act_order:
                key = (layer.rsplit(".", 1)[0], PROJECTIONS[projection])
                g_idx = g_idx[orders.setdefault(key, torch.randperm(k, generator=gen))]
            q, z, s = _quantize(p, g_idx, k // size, options.get("sym", False))
            p.copy_(((q - z[g_idx]) * s.float()[g_idx]).t())  # the reference dequantization
            prefix = name.removesuffix(".weight")
            if method == "awq":
                state[f"{prefix}.qweight"] = _pack_columns(q, AWQ_ORDER)
                state[f"{prefix}.qzeros"] = _pack_columns(z, AWQ_ORDER)
            else:
                offset = 0 if options.get("checkpoint_format") == "gptq_v2" else 1
                state[f"{prefix}.qweight"] = _pack_columns(q.t()).t().contiguous()
                state[f"{prefix}.qzeros"] = _pack_columns((z - offset) & 0xF)
                state[f"{prefix}.g_idx"] = g_idx.to(torch.int32)
            state[f"{prefix}.scales"] = s
    if hf.config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    float_dir, quant_dir = tmp_path / "float", tmp_path / method
    hf.save_pretrained(float_dir)
    quant_dir.mkdir()
    save_file(state, quant_dir / "model.safetensors")
    config = json.loads((float_dir / "config.json").read_text())
    config["quantization_config"] = {"quant_method": method, "bits": 4, "group_size": group}
    config["quantization_config"] |= (
        {"zero_point": True, "version": "gemm"} if method == "awq" else {"sym": False} | options
    )
    (quant_dir / "config.json").write_text(json.dumps(config))
    return str(quant_dir), str(float_dir), hf
