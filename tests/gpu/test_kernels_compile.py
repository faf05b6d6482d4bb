"""The Triton kernels whose variants the CPU interpreter cannot vouch for compile to Hopper
(sm90) cubins, with Triton's own compiler and ptxas: no GPU needed, so a machine without
one catches a kernel that would not build before a GPU run does. Every variant of the
attention kernels (sliding window, soft cap, qkv fused into decode) and of the fused MoE
GEMMs (bf16 and e4m3 experts). Skipped without triton, and under the interpreter."""

from __future__ import annotations

import inspect
import os

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("OCTAVO_TRITON_INTERPRET") == "1":
    pytest.skip("compiles for a GPU", allow_module_level=True)

from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

pytestmark = pytest.mark.gpu


H100_SHARED_BYTES = 232448  # the most shared memory a block may have on sm90


def _compile(kernel, types: dict[str, str], constexprs: dict[str, object], **options) -> dict:
    """The kernel's sm90 assembly; its shared memory must fit a block's."""
    names = inspect.signature(kernel.fn).parameters
    signature = {n: "constexpr" if n in constexprs else types.get(n, "i32") for n in names}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)
    assert compiled.metadata.shared <= H100_SHARED_BYTES
    return compiled.asm


@pytest.mark.parametrize("head_dim", [128, 256])  # 256: Gemma's
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("softcap", [False, True])
@pytest.mark.parametrize("split,partial", [(0, False), (512, False), (512, True)])
def test_prefill_attention_compiles(sliding, softcap, head_dim, split, partial):
    from octavo.kernels.prefill_attention import _prefill_kernel, default_prefill_config

    types = dict.fromkeys(["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr"], "*bf16")
    types |= dict.fromkeys(["query_start_loc_ptr", "seq_lens_ptr", "block_tables_ptr"], "*i32")
    types |= dict.fromkeys(["qk_scale", "v_scale", "softcap"], "fp32")
    types |= dict.fromkeys(["part_out_ptr", "part_ml_ptr"], "*fp32")
    cfg = default_prefill_config(head_dim, 4, split)
    asm = _compile(_prefill_kernel, types, {
        "NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
        "BLOCK_Q": cfg["block_m"] // 4, "BLOCK_M": cfg["block_m"], "BLOCK_N": cfg["block_n"],
        "SLIDING": sliding, "SOFTCAP": softcap, "SPLIT": split, "PARTIAL": partial,
        "USE_PDL": True,
    }, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"],
       **({"enable_fp_fusion": False} if split else {}))  # fmt: skip
    assert asm["cubin"]


@pytest.mark.parametrize("sliding", [False, True])
def test_combine_splits_compiles(sliding):
    from octavo.kernels.prefill_attention import _combine_splits_kernel

    types = dict.fromkeys(["part_out_ptr", "part_ml_ptr"], "*fp32")
    types |= {"out_ptr": "*bf16", "seq_lens_ptr": "*i32", "v_scale": "fp32"}
    asm = _compile(_combine_splits_kernel, types, {
        "NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 4, "HEAD_DIM": 128, "SPLIT": 256,
        "SLIDING": sliding, "USE_PDL": True,
    }, enable_fp_fusion=False)  # fmt: skip
    assert asm["cubin"]


@pytest.mark.parametrize("m", [1, 100, 200, 400, 2048, 8192])
@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (24576, 4096), (4096, 12288),
                                 (151936, 4096)])  # fmt: skip
def test_fixed_gemm_tiles_compile(m, n, k):
    from octavo.kernels.fixed_gemm import _fixed_gemm_kernel, tile_config

    cfg = dict(tile_config(m, n, k))
    options = {"num_warps": cfg.pop("num_warps"), "num_stages": cfg.pop("num_stages")}
    kernel, constexprs = _fixed_gemm_kernel, {}
    types = dict.fromkeys(["x_ptr", "w_ptr", "b_ptr", "y_ptr"], "*bf16")
    constexprs |= cfg | {"HAS_BIAS": True, "GROUP_M": 8, "USE_PDL": True}
    asm = _compile(kernel, types, constexprs, **options)
    assert "wgmma" in asm["ptx"]  # every tile on the same tensor-core instruction


@pytest.mark.parametrize("head_dim", [128, 256])
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("sliding", [False, True])
@pytest.mark.parametrize("softcap", [False, True])
def test_decode_attention_compiles(fused, sliding, softcap, head_dim):
    from octavo.kernels.decode_attention import _decode_split_kernel, default_decode_config

    types = dict.fromkeys(
        ["q_ptr", "k_cache_ptr", "v_cache_ptr", "out_ptr", "q_norm_ptr", "k_norm_ptr"], "*bf16"
    )
    types |= dict.fromkeys(["seq_lens_ptr", "block_tables_ptr", "order_ptr"], "*i32")
    types |= dict.fromkeys(["part_out_ptr", "part_lse_ptr", "cos_sin_ptr"], "*fp32")
    types |= {"slot_ptr": "*i64"} | dict.fromkeys(
        ["eps", "qk_scale", "k_scale", "v_scale", "softcap"], "fp32"
    )
    cfg = default_decode_config(head_dim)
    asm = _compile(_decode_split_kernel, types, {
        "NUM_KV_HEADS": 8, "GROUP": 4, "GROUP_PAD": 16, "HEAD_DIM": head_dim, "BLOCK_SIZE": 16,
        "BLOCK_N": cfg["block_n"], "SINGLE_SPLIT": False, "HAS_ORDER": True, "FUSED_QK": fused,
        "HAS_NORM": fused, "SLIDING": sliding, "SOFTCAP": softcap, "USE_PDL": True,
    }, num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])  # fmt: skip
    assert asm["cubin"]


@pytest.mark.parametrize("weights", ["*bf16", "*fp8e4nv"])
@pytest.mark.parametrize("gated", [False, True])
def test_fused_moe_gemms_compile(weights, gated):
    from octavo.kernels import fused_moe

    types = {"a_ptr": "*bf16", "b_ptr": weights, "c_ptr": "*bf16", "weights_ptr": "*fp32",
             "sorted_ptr": "*i32", "block_expert_ptr": "*i32", "total_ptr": "*i32",
             "b_scale_ptr": "*fp32"}  # fmt: skip
    scaled = weights != "*bf16"
    for rows in (8, 4096 * 8):  # the smallest and the largest tiles of the rule
        cfg = fused_moe.tile_config(rows, 128)
        asm = _compile(fused_moe._moe_gemm_kernel, types, {
            "ROWS_PER_A": 8 if gated else 1, "GATED": gated, "WEIGHTED": not gated,
            "BLOCK_M": cfg.block_m, "BLOCK_N": cfg.block_n, "BLOCK_K": cfg.block_k,
            "EVEN_K": True, "IEEE": False, "SCALED": scaled, "USE_PDL": True,
        }, num_warps=cfg.num_warps, num_stages=cfg.num_stages)  # fmt: skip
    assert asm["cubin"]
    common = {"BLOCK_N": 16, "BLOCK_K": 512, "SCALED": scaled, "USE_PDL": True, "TOP_K": 8}
    small = {"x_ptr": "*bf16", "w13_ptr": weights, "h_ptr": "*bf16", "ids_ptr": "*i32",
             "scale_ptr": "*fp32"}  # fmt: skip
    assert _compile(fused_moe._small_gate_up_kernel, small, common)["cubin"]
    down = {"h_ptr": "*bf16", "w2_ptr": weights, "out_ptr": "*bf16", "ids_ptr": "*i32",
            "weights_ptr": "*fp32", "scale_ptr": "*fp32"}  # fmt: skip
    assert _compile(fused_moe._small_down_kernel, down,
                    common | {"K_POW2": 8, "BLOCK_N": 4, "BLOCK_K": 256})["cubin"]  # fmt: skip


@pytest.mark.parametrize("pairs", [8, 4096])  # one token's pairs; the most the kernel takes
def test_fused_moe_align_compiles(pairs):
    from octavo.kernels import fused_moe

    types = {"ids_ptr": "*i32", "sorted_ptr": "*i32", "block_expert_ptr": "*i32",
             "total_ptr": "*i32"}  # fmt: skip
    asm = _compile(fused_moe._align_kernel, types, {
        "BLOCK_M": 16, "BINS": 256, "PAIRS": pairs, "MAX_BLOCKS": max(pairs // 16, 2),
        "USE_PDL": True,
    }, num_warps=4 if pairs <= 1024 else 8)  # fmt: skip
    assert asm["cubin"]
