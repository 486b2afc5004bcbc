"""compressed-tensors FP8 checkpoints (RedHat / neuralmagic "FP8", "FP8_DYNAMIC", "FP8_BLOCK") as transformers loads
them, for ``patch/fp8.py``.

transformers' default load (``CompressedTensorsConfig(dequantize=False)``) leaves each quantized ``nn.Linear`` with its
float8 ``weight``, its ``weight_scale`` (multiplied to dequantize: per channel (N, 1), per tensor (1,) or per block),
an optional static ``input_scale``, a ``quantization_scheme`` and ``quantization_status`` "compressed", and puts a
forward pre-hook on the model (``ct_decompress_hook``) that decompresses every such layer to the model's dtype on its
first forward. ``use_optimized_inference=True`` (sm89+) loads ``CompressedTensorsFP8Linear`` instead: ``weight_scale``
(1, N) fp32, activations quantized per token. Nothing here imports compressed_tensors until a layer is decompressed.
"""

from __future__ import annotations

from torch import nn

from .. import compat

HOOK = "ct_decompress_hook"  # compressed-tensors' attribute for its pre-hook that decompresses the model
_ACT = "x per token and 128 columns"  # how the FP8 kernels quantize x (the CPU's aten reference does not)


def is_compressed(module: nn.Module) -> bool:
    """Whether ``module`` is a compressed-tensors layer still holding its compressed weights."""
    return getattr(module, "quantization_status", None) == "compressed"


def block(child: nn.Module) -> tuple[int, int] | None:
    """The weight's block size where its scheme scales blocks, else None (per channel or per tensor)."""
    weights = getattr(getattr(child, "quantization_scheme", None), "weights", None)
    if weights is None or _v(weights.strategy) != "block" or not weights.block_structure:
        return None
    return tuple(int(b) for b in weights.block_structure)


def why_not(child: nn.Module) -> str | None:
    """Why the FP8 op cannot compute what this layer's compressed-tensors scheme does, or None."""
    scheme = getattr(child, "quantization_scheme", None)
    if scheme is None:  # transformers' CompressedTensorsFP8Linear: per-channel weights, x per token
        return None
    if not is_compressed(child):
        return f"its compressed-tensors status is {getattr(child, 'quantization_status', None)}, not compressed"
    if compat.has_forward_hooks(child):
        return "its hooks (compressed-tensors transforms?) would be skipped by the fused op"
    w, x = scheme.weights, scheme.input_activations
    if w is None or _v(w.type) != "float" or w.num_bits != 8 or not w.symmetric or w.dynamic:
        return f"its compressed-tensors weights are {_args(w)}: the FP8 op reads static symmetric float8 weights"
    if _v(w.strategy) not in ("channel", "tensor", "block"):
        return (f"its compressed-tensors weights are scaled per {_v(w.strategy)}: the FP8 op reads them per channel, "
                "tensor or block")
    if scheme.output_activations is not None:
        return "its outputs are quantized too (compressed-tensors output_activations): the FP8 op does not"
    if x is not None and not (_v(x.type) == "float" and x.num_bits == 8 and x.symmetric
                              and (_v(x.strategy) in ("token", "tensor")
                                   or (_v(x.strategy) == "group" and x.group_size == 128 and x.dynamic is True))):
        return f"its activations are quantized as {_args(x)}: the FP8 op quantizes {_ACT}"
    return None


def note(child: nn.Module) -> str:
    """How the op's activations differ from the layer's own scheme, for ``explain`` ("" where they do not)."""
    x = getattr(getattr(child, "quantization_scheme", None), "input_activations", None)
    if x is None and getattr(child, "quantization_scheme", None) is not None:
        return f"; {_ACT}, not left unquantized"
    if x is None:  # CompressedTensorsFP8Linear
        return f"; {_ACT}, not per token"
    if _v(x.strategy) == "group":
        return ""
    if not x.dynamic:
        return f"; {_ACT}, not by its static input_scale"
    return f"; {_ACT}, not per {_v(x.strategy)}"


def _v(e) -> str:
    """A compressed-tensors enum's value ("channel", "float", ...)."""
    return str(getattr(e, "value", e))


def _args(a) -> str:
    if a is None:
        return "none"
    return f"{_v(a.type)} {a.num_bits}-bit {'' if a.symmetric else 'asymmetric '}per {_v(a.strategy)}"


def compressed_children(module: nn.Module) -> list[nn.Module]:
    return [c for c in module.children() if is_compressed(c)]


def settle(model: nn.Module, fused: dict) -> str | None:
    """Before ``patch`` installs ``fused`` ({path: forward}): where a fused module's projections are compressed-tensors
    layers, compressed-tensors' hook on ``model`` would decompress them on the first forward, under the op that reads
    them. So the hook goes, and every other compressed layer is decompressed now, as the hook would have done (the
    rest of the model runs as it would have). Why not, where the hook is not on ``model`` (a submodule was given)."""
    keep = {id(c) for path in fused for c in compressed_children(model.get_submodule(path))}
    if not keep:
        return None
    handle = model.__dict__.get(HOOK)
    if handle is None:
        return ("compressed-tensors decompresses the whole model on its first forward: patch the model "
                "from_pretrained returned")
    handle.remove()
    del model.__dict__[HOOK]
    _decompress([m for m in model.modules() if is_compressed(m) and id(m) not in keep])
    return None


def rehook(model: nn.Module) -> None:
    """After ``unpatch``: the layers still compressed are decompressed on the next forward, as compressed-tensors'
    own hook would have done (not now: a ``patch`` that follows reads them compressed)."""
    if HOOK in model.__dict__ or not any(is_compressed(m) for m in model.modules()):
        return

    def decompress(module, args):
        model.__dict__.pop(HOOK).remove()
        _decompress([m for m in module.modules() if is_compressed(m)])

    model.__dict__[HOOK] = model.register_forward_pre_hook(decompress)


def _decompress(modules: list[nn.Module]) -> None:
    from compressed_tensors.compressors import decompress_module

    for m in modules:
        decompress_module(m)
