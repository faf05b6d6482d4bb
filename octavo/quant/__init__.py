"""Quantization methods, one file each (quant/method.py says what a method is):

    int8, int4, fp8   rtn.py              a float checkpoint's Linear weights rounded on load
    gguf              gguf.py             a GGUF file's Q4_0/Q4_1/Q4_K/Q8_0 blocks as they are
    awq, gptq         awq_gptq.py         such a checkpoint's 4-bit groups as they are
    fp8 on an fp8     fp8_checkpoint.py   its e4m3 codes and 128 x 128 block scales as they are
    checkpoint

This module names them and picks one for a model: the `quantization` option checked against
the device and the checkpoint's own `quantization_config`, and "auto" resolved. It imports
torch only when called, so that the CLI can check its arguments first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from octavo.quant.method import QuantMethod

METHODS = ("int8", "int4", "fp8", "gguf", "awq", "gptq")
QUANTIZATION_CHOICES = ("auto", "none", *METHODS)  # the CLI's: "none" is None
CHECKPOINT_METHODS = ("awq", "gptq", "fp8")  # a checkpoint's quantization_config's quant_method


def get_method(
    name: str | None,
    device: torch.device,
    hf_config=None,
    model_path: str | None = None,
    load_format: str = "auto",
) -> QuantMethod:
    """The method for quantization=`name` (None: float) on `device`, given the model's config
    and path where known.

    Raises:
        ValueError: an unknown name; one the device cannot run (fp8 below sm89); one that
            does not fit the checkpoint (another than its quantization_config's quant_method,
            "awq"/"gptq" without one, "gguf" without a GGUF file).
    """
    if name is not None and name not in METHODS:
        raise ValueError(f"quantization must be None or one of {METHODS}, got {name!r}")
    read = hf_config is not None and load_format != "dummy"
    found = checkpoint_method(hf_config) if read else None
    _check_fits(name, found, load_format)
    method = _make(name, found, hf_config)
    method.check(device, model_path, load_format)
    return method


def _make(name: str | None, found: str | None, hf_config) -> QuantMethod:
    if name is None:
        from octavo.quant.method import QuantMethod

        return QuantMethod()
    if name == "gguf":
        from octavo.quant.gguf import GGUFBlocks

        return GGUFBlocks()
    if name in ("awq", "gptq"):
        from octavo.quant.awq_gptq import Int4Checkpoint

        return Int4Checkpoint(hf_config)
    if found == "fp8":
        from octavo.quant.fp8_checkpoint import Fp8BlockCheckpoint

        return Fp8BlockCheckpoint(_quantization_config(hf_config))
    from octavo.quant.rtn import RoundToNearest

    return RoundToNearest(name)


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
        from octavo.quant import weights

        return "gguf" if gguf and device.type == "cpu" and weights.CPU_KERNELS else None
    return None if method == "none" else method


def _quantization_config(hf_config) -> dict | None:
    config = getattr(hf_config, "quantization_config", None)
    if config is not None and not isinstance(config, dict):
        config = config.to_dict()  # a transformers QuantizationConfigMixin
    return config or None


def checkpoint_method(hf_config) -> str | None:
    """The `quant_method` of a checkpoint quantized already (its config's
    `quantization_config`): "awq", "gptq" or "fp8"; None for a checkpoint without one.

    Raises:
        ValueError: a quantization_config octavo cannot read as it is, naming the field.
    """
    config = _quantization_config(hf_config)
    if config is None:
        return None
    method = str(config.get("quant_method")).lower()
    if method not in CHECKPOINT_METHODS:
        raise ValueError(
            f"quantization_config: quant_method {method!r} is not supported; octavo reads "
            f"{CHECKPOINT_METHODS} checkpoints"
        )
    _make(method, method, hf_config)  # raises for a form octavo does not read
    return method


def _check_fits(name: str | None, found: str | None, load_format: str) -> None:
    """Raises ValueError for an option that does not fit the checkpoint: another than its
    quantization_config's quant_method, or "awq"/"gptq" without one."""
    if name != found and (found is not None or name in ("awq", "gptq")):
        which = (
            f"has quant_method {found!r} in its quantization_config" if found is not None
            else "has no quantization_config" if load_format != "dummy"
            else "is not read (load_format='dummy')"
        )  # fmt: skip
        raise ValueError(
            f"quantization={name!r} does not fit the checkpoint, which {which}: 'auto' "
            "reads a checkpoint's own quant_method ('awq', 'gptq', 'fp8'); 'int4', 'int8' "
            "and 'fp8' quantize float weights"
        )
