"""Integer-quantized linear layers the ops do not read: compressed-tensors' int (and packed) schemes, GPTQ / AWQ
``QuantLinear``s, bitsandbytes' ``Linear4bit`` / ``Linear8bitLt``, HQQ's ``HQQLinear``. Each is recognised by the
attributes its library's layer holds (none of those libraries is imported): ``explain`` names an MLP of them as a
near miss, and ``patch`` leaves it as it is.
"""

from __future__ import annotations

from torch import Tensor, nn

from . import compressed

READS = "the ops read bf16/fp16/fp32 or float8 weights"
_MAKERS = {"auto_gptq": "GPTQ", "gptqmodel": "GPTQ", "awq": "AWQ", "bitsandbytes": "bitsandbytes", "hqq": "HQQ",
           "exllamav2": "ExLlamaV2", "compressed_tensors": "compressed-tensors"}  # a layer's top module -> its maker


def describe(layer: nn.Module) -> str | None:
    """What integer-quantized layer ``layer`` is ("a compressed-tensors int4 (group 128) layer", "GPTQ's
    QuantLinear (qweight packed int4, group 128)"), or None where it is none of the known kinds."""
    weights = getattr(getattr(layer, "quantization_scheme", None), "weights", None)
    if compressed.is_compressed(layer) and weights is not None:
        kind = f"{_v(weights.type)}{weights.num_bits}"
        if kind == "float8":  # compressed-tensors FP8: patch/fp8.py's
            return None
        how = f"group {weights.group_size}" if _v(weights.strategy) == "group" else f"per {_v(weights.strategy)}"
        return f"a compressed-tensors {kind}{'' if weights.symmetric else ' asymmetric'} ({how}) layer"
    qweight = getattr(layer, "qweight", None)
    if isinstance(qweight, Tensor):  # GPTQ, AWQ, ExLlama, Marlin: int4/int8 packed in int32
        bits = getattr(layer, "bits", None) or getattr(layer, "w_bit", None)
        packed = f"packed int{bits}" if isinstance(bits, int) else str(qweight.dtype).removeprefix("torch.")
        return f"{_who(layer)} (qweight {packed}{_group(getattr(layer, 'group_size', None))})"
    if isinstance(getattr(layer, "W_q", None), Tensor):  # HQQ: its meta dict holds bits, group, scales, zeros
        meta = getattr(layer, "meta", None)
        meta = meta if isinstance(meta, dict) else {}
        bits = f" {meta['nbits']}-bit" if isinstance(meta.get("nbits"), int) else ""
        return f"{_who(layer)} (W_q{bits}{_group(meta.get('group_size'))})"
    w = getattr(layer, "weight", None)
    if type(w) not in (type(None), Tensor, nn.Parameter) and any(hasattr(w, a) for a in ("quant_state", "SCB")):
        kind = getattr(w, "quant_type", None) or str(w.dtype).removeprefix("torch.")  # Params4bit nf4 / Int8Params
        return f"{_who(layer)} ({type(w).__name__} {kind} weight)"
    return None


def dims(layer: nn.Module) -> tuple[int, int] | None:
    """(in, out) features of a quantized layer, as its library names them; None where it names neither."""
    for k, n in (("in_features", "out_features"), ("infeatures", "outfeatures")):
        if isinstance(getattr(layer, k, None), int) and isinstance(getattr(layer, n, None), int):
            return getattr(layer, k), getattr(layer, n)
    return None


def _who(layer: nn.Module) -> str:
    maker = _MAKERS.get(type(layer).__module__.split(".")[0])
    name = type(layer).__name__
    if maker is None:
        return f"a {name}"
    return f"{maker}' {name}" if maker.endswith("s") else f"{maker}'s {name}"


def _group(size) -> str:
    return f", group {size}" if isinstance(size, int) and size > 0 else ""


def _v(e) -> str:
    return str(getattr(e, "value", e))
