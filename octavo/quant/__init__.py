"""Which quantization method a model runs with: the `quantization` option checked against the
device and against the checkpoint's own `quantization_config`, and "auto" resolved.

The methods themselves (their weights and products) are in quant/weights.py. This
module imports torch only when called, so that the CLI can check its arguments first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from octavo.kernels.capability import check_fp8_device

if TYPE_CHECKING:
    import torch

METHODS = ("int8", "int4", "fp8", "gguf", "awq", "gptq")
QUANTIZATION_CHOICES = ("auto", "none", *METHODS)  # the CLI's: "none" is None


def resolve_quantization(
    method: str | None, model_path: str, hf_config, device: torch.device, load_format: str
) -> str | None:
    """ "auto" -> the checkpoint's quant_method when its config has a quantization_config;
    "gguf" for a GGUF file read on the CPU (its blocks kept, as llama.cpp runs them;
    perplexity as float32's); else None. "none" -> None; others as given."""
    if method == "auto":
        found = checkpoint_method(hf_config) if load_format != "dummy" else None
        if found is not None:
            return found
        gguf = model_path.endswith(".gguf") and load_format != "dummy"
        from octavo.quant.weights import CPU_KERNELS

        return "gguf" if gguf and device.type == "cpu" and CPU_KERNELS else None
    return None if method == "none" else method


def check_quantization(
    method: str | None, device: torch.device, hf_config=None, load_format: str = "auto"
) -> None:
    """Raises ValueError for an unknown method, fp8 on a CUDA GPU without FP8 (below sm89),
    or, given the model's config, a method other than its checkpoint's quant_method (AWQ and
    GPTQ checkpoints, of a form octavo reads, need theirs; others none)."""
    if method is not None and method not in METHODS:
        raise ValueError(f"quantization must be None or one of {METHODS}, got {method!r}")
    if method == "fp8":
        check_fp8_device("quantization='fp8'", device)
    if hf_config is not None:
        check_checkpoint_quantization(method, hf_config, load_format)


def parse_fp8_config(config: dict) -> tuple[int, int]:
    """An HF fp8 `quantization_config` (quant_method "fp8") -> its weight block size, once
    checked to be what octavo reads as it is: e4m3 weights with a float32 scale per 128 x 128
    block (`<name>.weight_scale_inv`, w = q * scale) and activations quantized at each call.

    Raises:
        ValueError: naming the field octavo cannot read.
    """
    from octavo.quant.rounding import FP8_BLOCK  # here: the CLI imports this module, not torch

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


def checkpoint_method(hf_config) -> str | None:
    """The `quant_method` of a checkpoint quantized already (its config's
    `quantization_config`): "awq", "gptq" or "fp8"; None for a checkpoint without one.

    Raises:
        ValueError: a quantization_config octavo cannot read as it is, naming the field.
    """
    from octavo.quant.awq_gptq import CHECKPOINT_METHODS, int4_format

    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()  # a transformers QuantizationConfigMixin
    if not config:
        return None
    method = str(config.get("quant_method")).lower()
    if method == "fp8":
        parse_fp8_config(config)
    elif method in CHECKPOINT_METHODS:
        int4_format(hf_config)  # raises for a form octavo does not read
    else:
        raise ValueError(
            f"quantization_config: quant_method {method!r} is not supported; octavo reads "
            f"{(*CHECKPOINT_METHODS, 'fp8')} checkpoints"
        )
    return method


def check_checkpoint_quantization(method: str | None, hf_config, load_format: str) -> None:
    """Raises ValueError for an option that does not fit the checkpoint: another than its
    quantization_config's quant_method, or "awq"/"gptq" without one. load_format "dummy"
    reads no checkpoint."""
    from octavo.quant.awq_gptq import CHECKPOINT_METHODS

    found = checkpoint_method(hf_config) if load_format != "dummy" else None
    if method != found and (found is not None or method in CHECKPOINT_METHODS):
        which = (
            f"has quant_method {found!r} in its quantization_config" if found is not None
            else "has no quantization_config" if load_format != "dummy"
            else "is not read (load_format='dummy')"
        )  # fmt: skip
        raise ValueError(
            f"quantization={method!r} does not fit the checkpoint, which {which}: 'auto' "
            "reads a checkpoint's own quant_method ('awq', 'gptq', 'fp8'); 'int4', 'int8' "
            "and 'fp8' quantize float weights"
        )
