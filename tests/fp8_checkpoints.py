"""Test helpers: a tiny random Qwen3 / Llama written as an HF fp8 checkpoint in the layout of
Qwen3's FP8 releases (e4m3 weights, a float32 `weight_scale_inv` per 128 x 128 block, and
`quantization_config` {"quant_method": "fp8", "weight_block_size": [128, 128]}) by a
reference block quantizer, next to its dequantized float32 twin."""

from __future__ import annotations

import json
import math

import torch
from safetensors.torch import save_file
from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config, Qwen3MoeConfig

FP8_CONFIG = {
    "quant_method": "fp8",
    "fmt": "e4m3",
    "activation_scheme": "dynamic",
    "weight_block_size": [128, 128],
}
# hidden 320: a last block of 64 columns (qkv, gate_up) and of 64 rows (o, down); heads of
# 128 keep q, k and v on whole blocks, as in Qwen3; intermediate 512 splits on blocks in two.
DIMS = {
    "vocab_size": 256,
    "hidden_size": 320,
    "intermediate_size": 512,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 128,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
}
CONFIGS = {
    "qwen3": lambda **dims: Qwen3Config(**(DIMS | dims), tie_word_embeddings=True),
    "llama": lambda **dims: LlamaConfig(**(DIMS | dims), tie_word_embeddings=False),
}
# A mixture of experts, as Qwen3-30B-A3B-FP8 stores one (each expert's projections in blocks).
MOE_CONFIG = {
    "qwen3_moe": lambda **dims: Qwen3MoeConfig(
        **(DIMS | dims), num_experts=4, num_experts_per_tok=2, moe_intermediate_size=256,
        tie_word_embeddings=True,
    ),
}  # fmt: skip
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
KEPT_FLOAT = "model.layers.1.self_attn.o_proj"  # as a checkpoint's modules_to_not_convert


def per_block(blocks: torch.Tensor, shape: tuple[int, int]) -> torch.Tensor:
    """One value per 128 x 128 block [ceil(N / 128), ceil(K / 128)] -> [N, K]."""
    rows = blocks.repeat_interleave(128, dim=0)[: shape[0]]
    return rows.repeat_interleave(128, dim=1)[:, : shape[1]]


def block_quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference: w [N, K] -> (e4m3 codes [N, K], float32 scale_inv [N/128, K/128]),
    w ~ codes * scale_inv in each 128 x 128 block, the block's largest |w| at 448."""
    n, k = w.shape
    codes = torch.empty(n, k, dtype=torch.float8_e4m3fn)
    scale = torch.empty(math.ceil(n / 128), math.ceil(k / 128))
    for i in range(0, n, 128):
        for j in range(0, k, 128):
            block = w[i : i + 128, j : j + 128]
            scale[i // 128, j // 128] = block.abs().max() / 448
            codes[i : i + 128, j : j + 128] = (block / scale[i // 128, j // 128]).to(
                torch.float8_e4m3fn
            )
    return codes, scale


def _per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with transformers' stacked experts (`experts.gate_up_proj` [E, 2 I, H],
    `experts.down_proj` [E, H, I]) as the hub stores them: `experts.{e}.gate_proj.weight`..."""
    out = {}
    for name, t in state.items():
        if name.endswith(".experts.gate_up_proj"):
            prefix, inter = name.removesuffix("gate_up_proj"), t.shape[1] // 2
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.gate_proj.weight"] = t[e, :inter]
                out[f"{prefix}{e}.up_proj.weight"] = t[e, inter:]
        elif name.endswith(".experts.down_proj"):
            prefix = name.removesuffix("down_proj")
            for e in range(t.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = t[e]
        else:
            out[name] = t
    return out


def write_checkpoints(root, arch: str, drop: str | None = None, **dims) -> tuple[str, str]:
    """(fp8 checkpoint dir, its dequantized float32 twin's dir) of one random model `arch`
    with DIMS | dims. The projections get a magnitude per 128 x 128 block, so that a scale
    in the wrong place shows; KEPT_FLOAT stays float32 in both; `drop` names a weight whose
    scales are left out."""
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config((CONFIGS | MOE_CONFIG)[arch](**dims), dtype=torch.float32)
    hf.config.architectures = [type(hf).__name__]
    gen = torch.Generator().manual_seed(1)
    fp8, twin = {}, {}
    for name, p in _per_expert(hf.state_dict()).items():
        if name == "lm_head.weight" and hf.config.tie_word_embeddings:
            continue
        noise = torch.randn(p.shape, generator=gen)
        if "norm" in name:
            fp8[name] = twin[name] = 1.0 + 0.2 * noise
            continue
        w = 0.15 * noise
        if not name.endswith(tuple(f"{proj}.weight" for proj in PROJECTIONS)):
            fp8[name] = twin[name] = w
            continue
        if name.startswith(KEPT_FLOAT):
            fp8[name] = twin[name] = w
            continue
        blocks = (math.ceil(w.shape[0] / 128), math.ceil(w.shape[1] / 128))
        w = w * per_block(2 ** (torch.rand(blocks, generator=gen) * 4 - 2), w.shape)
        codes, scale = block_quantize(w)
        fp8[name], twin[name] = codes, codes.float() * per_block(scale, w.shape)
        if name != drop:
            fp8[name.removesuffix(".weight") + ".weight_scale_inv"] = scale
    paths = []
    for kind, tensors in (("fp8", fp8), ("twin", twin)):
        path = root / kind
        hf.config.save_pretrained(path)
        if kind == "fp8":
            config = json.loads((path / "config.json").read_text())
            config["quantization_config"] = FP8_CONFIG
            (path / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in tensors.items()}, path / "model.safetensors")
        paths.append(str(path))
    return paths[0], paths[1]
