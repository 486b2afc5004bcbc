"""``patch`` for MLP modules whose projections hold FP8 weights (transformers' ``FP8Linear``).

The module's structure is proven on a twin whose projections are plain ``nn.Linear`` on the meta device (no weight
is read), as for any MLP; the proof's operands then say which child is the gate, the up and the down projection,
and the fused forward calls ``quant_gated_mlp`` / ``quant_mlp`` with each child's float8 weight, its scales and its
bias as stored. Proofs are kept by the module's structure, so a model's identical layers, and the next model of
the same kind, are proven once.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable

import torch
from torch import Tensor, nn

from .. import compat
from ..ops import quant
from . import compressed, modules, packed
from .modules import (
    SWAPPED,
    _projections,
    _prove,
    _stand_in,
    fused_forward,
    in_each_mode,
    is_swapped,
    swapped_class,
    swapped_forward,
)

FP8_DTYPES = (torch.float8_e4m3fn,)
_OPS = {"mlp": torch.ops.mlp_fuser.quant_mlp.default, "gated_mlp": torch.ops.mlp_fuser.quant_gated_mlp.default}
_COMPUTE = {"mlp": quant.compute_mlp, "gated_mlp": quant.compute_gated_mlp}  # the ops' own kernels, as plain calls
_PROOFS: dict = {}  # structure key -> (op name, [child name per weight]) or None; a few entries per process
_MAX_PROOFS = 256


def _stored(child: nn.Module) -> tuple[Tensor, Tensor | None, tuple[int, int] | None, str] | None:
    """(float8 data, scales, block, who made it) of a projection's weight: transformers' FP8Linear (``weight`` and
    ``weight_scale_inv``, ``block_size``), a compressed-tensors layer (``weight`` and ``weight_scale``, its scheme's
    block) or a torchao Float8Tensor weight (``qdata``, ``scale``, ``block_size``); None when its weight is not
    float8."""
    w = child._parameters.get("weight")
    data = getattr(w, "qdata", None)
    if isinstance(data, Tensor) and "float8" in str(data.dtype):  # torchao's quantize_(..., Float8*Config())
        block = getattr(w, "block_size", None)
        return data, getattr(w, "scale", None), tuple(int(b) for b in block) if block else None, "torchao"
    if not isinstance(w, Tensor) or "float8" not in str(w.dtype):
        return None
    if "weight_scale" in child._parameters and "weight_scale_inv" not in child._parameters:
        return w, child._parameters["weight_scale"], compressed.block(child), "compressed-tensors"
    s = child._parameters.get("weight_scale_inv")
    if s is None:
        s = child._buffers.get("weight_scale_inv")
    block = getattr(child, "block_size", None)
    return w, s, tuple(int(b) for b in block) if block is not None else None, "transformers"


def weight_near_miss(module: nn.Module, path: str, options: dict, memo: dict):
    """``modules.weight_near_miss``, a float8 projection's reason being what its format lacks."""
    def lacks(child: nn.Module) -> str | None:
        fmt = fp8_format(child)
        return fmt if isinstance(fmt, str) and fmt else None
    return modules.weight_near_miss(module, path, options, memo, lacks)


def fp8_format(child: nn.Module) -> tuple[str, tuple[int, int] | None, str] | str:
    """(weight_format, block, who made it) of a projection holding a float8 weight with its scales, or why the op
    cannot run it; "" when it holds no float8 weight at all."""
    stored = _stored(child)
    if stored is None:
        return ""
    w, s, block, maker = stored
    if w.dtype not in FP8_DTYPES:
        return f"{w.dtype} weights (the FP8 op reads float8_e4m3fn)"
    if not isinstance(s, Tensor):
        return "no weight_scale_inv beside its float8 weight"
    if maker == "compressed-tensors" and (why := compressed.why_not(child)) is not None:
        return why
    if type(w) not in (Tensor, nn.Parameter) or type(s) not in (Tensor, nn.Parameter):
        return f"a {type(w).__name__} weight (the FP8 op reads plain tensors)"
    if maker == "torchao" and block is not None and block[1] >= w.shape[1] and block[0] in (1, w.shape[0]):
        block = None  # torchao's per-row (or per-tensor) scales as a block: the op reads them from their shape
    try:
        quant._weight("weight", w, s, "fp8_e4m3", block)
    except ValueError as e:
        return str(e).removeprefix("mlp_fuser: ")
    return "fp8_e4m3", block, maker


_SCALES = {"transformers": "weight_scale_inv", "compressed-tensors": "weight_scale"}  # the scales beside ``weight``


def _read(child: nn.Module, maker: str) -> tuple[Tensor, Tensor]:
    """The float8 data and scales of a projection as ``_stored`` found them (read on every call)."""
    w = child._parameters["weight"]
    if maker == "torchao":
        return w.qdata, w.scale
    return w, packed.tensor(child, _SCALES[maker])  # a parameter, or a buffer where the maker registered one


def _operands(module: nn.Module, projs: list[nn.Module], options: dict) -> tuple | None:
    """The proven op ("mlp" / "gated_mlp"), the child read for each weight in the op's order, the activation and the
    twin's ``fx_pass.Site``; None when the twin is not one MLP or its op reads a weight through a view or a bias of
    another child."""
    twin = copy.copy(module)
    twin._modules = {k: _stand_in(c) if any(c is p for p in projs) else c for k, c in module._modules.items()}
    twin._parameters = dict(module._parameters)
    sites: list = []
    try:
        proof = _prove(twin, _projections(twin), options, sites)
    except Exception:  # a structure the twin cannot stand in for
        return None
    if proof is None or proof[4] is None or not sites:
        return None
    operands = proof[4]
    gated = len(operands) >= 7 and operands[3][0] == "path"
    children = []
    for i in (1, 3, 5) if gated else (1, 3):
        kind, path = operands[i]
        if kind != "path" or not path.endswith(".weight") or path.count(".") != 1:
            return None
        child = path.split(".")[0]
        if operands[i + 1] not in (("constant", None), ("path", f"{child}.bias")):
            return None
        children.append(child)
    if operands[0] != ("x",) or len(set(children)) != len(children):
        return None
    return ("gated_mlp" if gated else "mlp"), children, operands[7 if gated else 5][1], sites[0]


def _proof(module: nn.Module, projs: list[nn.Module], options: dict) -> tuple | None:
    """``_operands`` for the module in its current train/eval mode, kept by its structure."""
    names = {id(c): name for name, c in module.named_children()}
    key = (type(module), module.training, repr(sorted(options.items())),
           tuple((names[id(c)], type(c), tuple(c.weight.shape), c.bias is not None) for c in projs))
    if key not in _PROOFS:
        if len(_PROOFS) >= _MAX_PROOFS:
            _PROOFS.clear()
        _PROOFS[key] = _operands(module, projs, options)
    return _PROOFS[key]


def _format(projs: list[nn.Module]) -> tuple[str, tuple[int, int] | None] | None:
    """The one FP8 format every projection holds, or None."""
    formats = {fp8_format(c) for c in projs}
    return formats.pop() if len(formats) == 1 and isinstance(next(iter(formats)), tuple) else None


def fp8_site(module: nn.Module, path: str, options: dict):
    """The ``fx_pass.Site`` ``explain`` reports for an FP8 MLP module ``patch`` fuses (its pattern naming the weight
    format), or None."""
    projs = _projections(module)
    fmt = _format(projs) if projs and "forward" not in module.__dict__ and not is_swapped(module) else None
    found = _proof(module, projs, options) if fmt is not None else None
    if found is None:
        return None
    site = found[3]
    if fmt[1] is not None:
        block = f" {fmt[1][0]}x{fmt[1][1]} blocks"
    else:
        block = " per tensor" if _stored(projs[0])[1].numel() == 1 else " per channel"
    maker = "" if fmt[2] == "transformers" else f", {fmt[2]}"
    if fmt[2] == "compressed-tensors":
        maker += compressed.note(projs[0])
    return dataclasses.replace(site, path=path, pattern=f"{site.pattern} ({fmt[0]}{block}{maker})")


def _direct(op_name: str, children: list[str], activation: str, block, maker: str):
    """``(module, x) -> y``: the op on the children's weights, scales and biases as stored; computed right there (no
    dispatcher hop, no autograd node) where ``compat.plain_call`` allows it, else through the registered op. Children
    and block are tuples of this function's own (a list shared by every layer, the proof's, costs a Python guard a
    layer in a compiled model; a tuple of ints one guard, not a list's); the op is looked up by name (an op object
    in the closure would keep Dynamo from skipping the module's guards as a whole)."""
    children = tuple(children)
    block = tuple(int(b) for b in block) if block is not None else None

    def direct(m, x):
        args, biases = [], []
        compiling = torch.compiler.is_compiling()
        for name in children:
            child = m._modules[name]
            b = child._parameters.get("bias")
            found = packed.read(child) if compiling else None  # one graph input for weight and scales
            args += [*(found[0] if found is not None else _read(child, maker)), b]
            biases.append(b)
        blocks = list(block) if block is not None else None
        if compat.plain_call(x, biases):
            return _COMPUTE[op_name](x, *args, activation, "fp8_e4m3", blocks)
        return _OPS[op_name](x, *args, activation, "fp8_e4m3", blocks)

    return direct


def fuse_fp8_module(module: nn.Module, **options) -> type | None:
    """The class ``patch`` gives an MLP module whose projections all hold FP8 weights of one format (its forward
    fused), else None."""
    projs = _projections(module)
    if not projs or "forward" in module.__dict__ or is_swapped(module) or (fmt := _format(projs)) is None:
        return None
    found = in_each_mode(module, lambda: _proof(module, projs, options))
    if not found:
        return None
    return fused_forward(module, {training: (None, None, _direct(op, children, act, fmt[1], fmt[2]), None, None)
                                  for training, (op, children, act, _) in found.items()})


def fp8_children(module: nn.Module) -> list[tuple[nn.Module, tuple[str, str]]]:
    """The projections of an FP8 MLP module whose float8 weight and scales ``packed`` can hold, with their names in
    ``_read``'s order: transformers' FP8Linear and compressed-tensors' layers (torchao's subclass weights: not)."""
    return [(c, ("weight", _SCALES[st[3]])) for c in _projections(module)
            if (st := _stored(c)) is not None and st[3] in _SCALES]


def fp8_linear_forward(block) -> Callable:
    """The forward ``patch`` gives a lone FP8 linear layer (attention's, a shared expert's; ``swapped_class``) where
    transformers' own FP8 kernel does not load: ``quant_linear`` with the layer's weight, scales and bias as stored.
    One function per block (``block`` on it: the packing's meta), shared by the layers."""
    found = _LINEAR_FORWARDS.get(block)
    if found is not None:
        return found
    blocks = list(block) if block is not None else None

    def forward(self, x, *args, **kwargs):
        if args or kwargs or not isinstance(x, Tensor):
            return getattr(type(self), SWAPPED).forward(self, x, *args, **kwargs)
        if torch.compiler.is_compiling() and (found := packed.read(self)) is not None:
            # one graph input for weight and scales; block and bias presence from the packing's one constant, so
            # that Dynamo guards neither the parameters dict nor anything of this function (patch packed with them)
            (w, s), (blk, has_bias) = found
            b = self._parameters["bias"] if has_bias else None
            return torch.ops.mlp_fuser.quant_linear.default(x, w, s, b, "fp8_e4m3", list(blk) if blk else None)
        p = self._parameters
        w, s, b = p["weight"], p.get("weight_scale_inv"), p.get("bias")
        if s is None:
            s = self._buffers["weight_scale_inv"]
        if compat.plain_call(x, (b,)):
            return quant.compute_linear(x, w, s, b, "fp8_e4m3", blocks)
        return torch.ops.mlp_fuser.quant_linear.default(x, w, s, b, "fp8_e4m3", blocks)

    forward.block = block
    _LINEAR_FORWARDS[block] = forward
    return forward


_LINEAR_FORWARDS: dict = {}  # block -> fp8_linear_forward's function (a few per process)


def fp8_linear_block(fused) -> tuple | None | bool:
    """The block of the class ``fuse_fp8_linear`` gave (or a module of that class); False for anything else."""
    return getattr(swapped_forward(fused), "block", False)


FP8_LINEAR_NAMES = ("weight", "weight_scale_inv")  # what ``patch`` packs of a lone FP8 linear


def sibling_groups(lone: list[tuple[str, nn.Module, tuple | None]]) -> list[list[tuple[str, nn.Module, tuple]]]:
    """Lone FP8 linears ``(path, module, block)`` grouped as ``patch`` packs them side by side: children of one
    module alike in what one merged GEMM needs (K, dtypes, scale columns, block, a bias or none), in order; each
    with its packing meta (block, has bias)."""
    groups: dict[tuple, list] = {}
    for path, module, block in lone:
        meta = (block, getattr(module, "bias", None) is not None)
        s = packed.tensor(module, "weight_scale_inv")
        alike = (path.rpartition(".")[0], module.weight.shape[1:], module.weight.dtype,
                 None if s is None else (s.dtype, s.shape[1:]), meta)
        groups.setdefault(alike, []).append((path, module, meta))
    return list(groups.values())


def fuse_fp8_linear(module: nn.Module) -> type | None:
    """The class ``patch`` gives a lone FP8Linear layer (its forward fused) when transformers' FP8 kernel does not
    load here, else None."""
    if (not isinstance(module, nn.Linear) or "forward" in module.__dict__ or is_swapped(module)
            or transformers_fp8_kernel_loads()):
        return None
    fmt = fp8_format(module)  # torchao's Float8 layers run torchao's own kernels: left to it
    if not isinstance(fmt, tuple) or fmt[2] != "transformers":
        return None
    block = tuple(int(b) for b in fmt[1]) if fmt[1] is not None else None
    return swapped_class(type(module), fp8_linear_forward(block))


_TRIED: dict = {}  # transformers' FP8 module -> whether its kernel loaded when first asked


def transformers_fp8_kernel_loads() -> bool:
    """Whether transformers' own FP8 linear kernel (fetched from the Hub) is loaded, or loads when first asked."""
    try:
        from transformers.integrations import finegrained_fp8 as hf
    except ImportError:
        return False
    if compat.hf_fp8_kernel(hf) is not None:
        return True
    if hf not in _TRIED:
        try:
            hf.load_finegrained_fp8_kernel()
            _TRIED[hf] = True
        except Exception:  # offline, no kernels package, no CUDA build: it cannot run its FP8 layers
            _TRIED[hf] = False
    return _TRIED[hf]
