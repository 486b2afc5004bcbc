"""transformers' routed experts as ``mlp_fuser::moe_mlp``: what a module computes, its forward, the experts switch.

transformers 5 stores routed experts as 3-D parameters in classes decorated with ``@use_experts_implementation``
(Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, DeepSeek-V3, GPT-OSS, …): ``gate_up_proj`` (E, 2I, H) or, transposed,
(E, H, 2I); ``down_proj`` (E, H, I) or (E, I, H); optional biases; ``act_fn`` and a ``_apply_gate`` that families
may override (GPT-OSS: interleaved gate/up, clamps, ``(up + 1)``). ``spec(module)`` reads all of it and says what
the op computes for the module, or why it cannot (``Spec.reason``): the activation is identified by evaluating
``act_fn`` / ``_apply_gate`` in float64 on probe points against the op's gated activations, as the graph pass
identifies activations, so the way a family writes it does not matter.

Three ways in, all through ``experts_forward``:
- importing mlp_fuser registers it in transformers' ``ExpertsInterface`` as ``"mlp_fuser"`` (``hf.py``):
  ``from_pretrained(..., experts_implementation="mlp_fuser")`` or ``model.set_experts_implementation("mlp_fuser")``
  (``generate`` keeps it while decoding: it only swaps ``grouped_mm``);
- ``mlp_fuser.patch(model)`` selects ``"mlp_fuser"`` in the experts' config, as ``set_experts_implementation`` does,
  so a later ``set_experts_implementation("grouped_mm")`` takes effect (``hf.follows_switch``); experts modules whose
  class does not dispatch through the config get an instance-level forward (``fuse_experts``);
- the backend finds the experts' graph in what Dynamo captured (``patterns/experts.py``).
A module ``spec`` rejects runs transformers' own implementation.

FP8 experts (transformers' ``FP8Experts``: float8_e4m3fn weights, a ``*_scale_inv`` beside each) run through
``mlp_fuser::quant_moe_mlp`` with the weights and scales as stored; ``"mlp_fuser"`` is registered in
``FP8ExpertsInterface`` too. Other float8 formats, FP4-packed experts and bad scales are named in ``Spec.reason``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor, nn

from .. import compat, config
from ..ops import quant_moe
from ..ops.moe import Gate, eager_moe_mlp, gates
from . import packed
from .modules import SWAPPED, is_swapped, swapped_class, swapped_forward

NAME = "mlp_fuser"  # the experts implementation's name in transformers' ExpertsInterface
BACKWARD = "_mlp_fuser_moe_backward"  # patch(backward=...) on an experts module: what it keeps for its backward
FP8_WEIGHTS = (torch.float8_e4m3fn,)  # the float8 formats quant_moe_mlp reads


@dataclass(frozen=True)
class Spec:
    """What ``moe_mlp`` computes for one experts module, or why it cannot (``reason``)."""

    gate: Gate | None = None
    transposed: bool = False
    biases: bool = False
    reason: str | None = None
    fp8: tuple | None = None  # FP8 experts: (weight_format, block) of quant_moe_mlp
    # (gated, activation, interleaved, limit, clamp_after, up_offset): what a traced forward reads, as constants (the
    # Gate object is shared by every layer: Dynamo guards each second path to one object with a Python lambda)
    consts: tuple = ()

    @property
    def ok(self) -> bool:
        return self.reason is None


class Traced(NamedTuple):
    """A ``Spec`` as a traced forward reads it: constants only (no ``Gate`` object), so that Dynamo's guards on the
    experts module stay skippable as a whole where torch does that (benchmarks/NOTES.md, recursive dict tags)."""

    reason: str | None
    fp8: tuple | None
    consts: tuple
    transposed: bool
    biases: bool


_TRACED = "_mlp_fuser_traced"  # in an experts module's __dict__, beside its Spec: the Spec's Traced


def is_experts(module: nn.Module) -> bool:
    """Whether ``module`` is a transformers experts module (a class decorated with ``@use_experts_implementation``)."""
    return hasattr(type(module), "_apply_gate") and hasattr(module, "has_gate") and hasattr(module, "down_proj")


def is_routed_like(module: nn.Module) -> bool:
    """A module that holds stacked expert weights without transformers' experts interface (Llama 4's experts run
    every expert on every token): ``explain`` names it."""
    w = getattr(module, "gate_up_proj", None)
    return isinstance(w, Tensor) and w.dim() == 3 and not is_experts(module)


_PROBE = torch.cat([torch.linspace(-10.0, 10.0, 161), torch.tensor([-30.0, -7.0, -1e-3, 1e-3, 7.0, 30.0])]).double()


def _probe_rows() -> Tensor:
    """(P, 2) float64 rows [g, u] running over every pair of ``_PROBE`` values."""
    return torch.stack([_PROBE.repeat_interleave(len(_PROBE)), _PROBE.repeat(len(_PROBE))], dim=-1)


def _limits(module: nn.Module) -> list:
    """The clamp limits a module may apply: its numeric attributes named like one (GPT-OSS's ``limit``)."""
    return [None] + sorted({float(v) for k, v in vars(module).items() if isinstance(v, (int, float))
                            and not isinstance(v, bool) and "limit" in k})


def _identify_gated(module: nn.Module) -> Gate | None:
    """The op's gated activation equal to the module's ``_apply_gate`` on probe rows (float64), or None."""
    interleaved = not getattr(module, "is_concatenated", True)
    rows, width = _probe_rows(), 1  # one gate and one up column: either layout reads them as g, u
    try:
        with torch.no_grad():
            ref = module._apply_gate(rows)
    except Exception:
        return None
    if not isinstance(ref, Tensor) or ref.shape != (rows.shape[0], width):
        return None
    for gate in gates(True, (interleaved,), _limits(module)):
        if torch.allclose(gate(rows), ref, rtol=1e-6, atol=1e-9, equal_nan=True):
            return gate
    return None


def _identify_plain(module: nn.Module) -> Gate | None:
    try:
        with torch.no_grad():
            ref = module.act_fn(_PROBE.clone())
    except Exception:
        return None
    for gate in gates(False):
        if isinstance(ref, Tensor) and ref.shape == _PROBE.shape and torch.allclose(gate(_PROBE), ref, rtol=1e-6,
                                                                                   atol=1e-9):
            return gate
    return None


_GATES: dict[tuple, Gate | None] = {}  # what a class's activation was identified as, per the attributes it reads


def spec(module: nn.Module) -> Spec:
    """What the op computes for ``module`` (a transformers experts module), or why it cannot; cached on the module."""
    cached = module.__dict__.get("_mlp_fuser_spec")
    if cached is not None and _TRACED in module.__dict__:
        return cached
    result = _spec(module)
    module.__dict__["_mlp_fuser_spec"] = result
    module.__dict__[_TRACED] = Traced(result.reason, result.fp8, result.consts, result.transposed, result.biases)
    return result


def _gate_of(module: nn.Module, gated: bool) -> Gate | None:
    act = getattr(module, "act_fn", None)
    key = (type(module), gated, getattr(module, "is_concatenated", True), type(act), repr(act),
           tuple(sorted((k, v) for k, v in vars(module).items() if isinstance(v, (int, float, str, bool)))))
    if key not in _GATES:
        _GATES[key] = _identify_gated(module) if gated else _identify_plain(module)
    return _GATES[key]


def _spec(module: nn.Module) -> Spec:
    name = type(module).__name__
    if not is_experts(module):
        return Spec(reason=f"{name} is not a transformers experts module (@use_experts_implementation)")
    gated = bool(module.has_gate)
    w = module.gate_up_proj if gated else getattr(module, "up_proj", None)
    wd = module.down_proj
    if not isinstance(w, Tensor) or not isinstance(wd, Tensor) or w.dim() != 3 or wd.dim() != 3:
        return Spec(reason=f"{name}'s expert weights are not 3-D tensors")
    for pname, t in (("gate_up_proj" if gated else "up_proj", w), ("down_proj", wd)):
        if type(t) not in (Tensor, nn.Parameter):
            kind = type(t.data).__name__ if isinstance(t, nn.Parameter) else type(t).__name__
            return Spec(reason=f"{pname} is a {kind} (a tensor subclass); the op reads plain tensors")
    scales = fp8_scales(module, gated)
    fp8 = None
    if scales is not None:
        fp8 = _fp8_format(module, w, wd, *scales, gated)
        if isinstance(fp8, str):
            return Spec(reason=fp8)
    else:
        for pname, t in (("gate_up_proj" if gated else "up_proj", w), ("down_proj", wd)):
            if not t.is_floating_point() or t.dtype not in (torch.float16, torch.bfloat16, torch.float32,
                                                            torch.float64):
                return Spec(reason=f"{pname} has dtype {t.dtype} (quantized experts); the op reads float weights")
        if w.dtype != wd.dtype:
            return Spec(reason=f"the expert weights' dtypes differ ({w.dtype}, {wd.dtype})")
    gate = _gate_of(module, gated)
    if gated:
        if gate is None:
            return Spec(reason=f"{name}._apply_gate computes none of the op's gated activations (act·up with a registry"
                               " act, optionally clamped, up + 1, interleaved)")
    elif gate is None:
        return Spec(reason=f"{name}.act_fn ({type(module.act_fn).__name__}) is none of the registry's activations")
    transposed = bool(getattr(module, "is_transposed", False))
    E = w.shape[0]
    H = w.shape[1] if transposed else w.shape[2]
    I = wd.shape[1] if transposed else wd.shape[2]
    N = w.shape[2] if transposed else w.shape[1]
    if N != (2 * I if gated else I) or (wd.shape[2] if transposed else wd.shape[1]) != H or wd.shape[0] != E:
        return Spec(reason=f"{name}'s weight shapes {tuple(w.shape)} and {tuple(wd.shape)} do not chain")
    if fp8 is not None and (transposed or getattr(module, "has_bias", False)):
        return Spec(reason=f"{name}: FP8 experts stored transposed or with biases (the FP8 op reads FP8Experts' "
                           "layout: (E, 2I, H) and (E, H, I), no biases)")
    consts = (gate.gated, gate.activation, gate.interleaved, gate.limit, gate.clamp_after, gate.up_offset)
    return Spec(gate, transposed, bool(getattr(module, "has_bias", False)), fp8=fp8, consts=consts)


def fp8_scales(module: nn.Module, gated: bool) -> tuple[Tensor, Tensor] | None:
    """(gate/up's scales, down's) of FP8 experts (a ``*_scale_inv`` beside each weight, as ``FP8Experts`` holds them),
    else None."""
    names = fp8_names(gated)
    s, sd = getattr(module, names[1], None), getattr(module, names[3], None)
    return (s, sd) if isinstance(s, Tensor) and isinstance(sd, Tensor) else None


def _fp8_format(module: nn.Module, w: Tensor, wd: Tensor, s: Tensor, sd: Tensor, gated: bool) -> tuple | str:
    """(weight_format, block) of quant_moe_mlp for FP8 experts, or why it cannot read them."""
    wname = "gate_up_proj" if gated else "up_proj"
    for pname, t in ((wname, w), ("down_proj", wd)):
        if t.dtype not in FP8_WEIGHTS:
            return f"{pname} has dtype {t.dtype} (the FP8 experts op reads float8_e4m3fn)"
    block = getattr(module, "block_size", None)
    block = tuple(int(b) for b in block) if block is not None else None
    try:
        quant_moe._experts(wname, w, s, "fp8_e4m3", block, gated, not getattr(module, "is_concatenated", True))
        quant_moe._experts("down_proj", wd, sd, "fp8_e4m3", block, False, False)
    except ValueError as e:
        return str(e).removeprefix("mlp_fuser: ")
    return "fp8_e4m3", block


def _spec_while_tracing(module: nn.Module) -> Traced | None:
    """``spec`` while Dynamo traces a forward: run at trace time on the real module (it probes tensors, so it cannot
    be traced) and cached on it, then read back as an attribute (its ``Traced``), which Dynamo guards on. None if
    that failed."""
    compat.comptime(_stash_spec)
    return getattr(module, _TRACED, None)


def _stash_spec(ctx) -> None:
    module = compat.traced_value(ctx.get_local("module"))
    if isinstance(module, nn.Module):
        spec(module)


def weights(module: nn.Module, s: Spec | Traced) -> tuple[Tensor, Tensor | None, Tensor, Tensor | None]:
    """(w_gate_up, b_gate_up, w_down, b_down) in the op's logical shapes: views, never copies."""
    w = module.gate_up_proj if s.consts[0] else module.up_proj
    wd = module.down_proj
    if s.transposed:
        w, wd = w.transpose(1, 2), wd.transpose(1, 2)
    bias = None
    if s.biases:
        bias = module.gate_up_proj_bias if s.consts[0] else module.up_proj_bias
    return w, bias, wd, module.down_proj_bias if s.biases else None


def experts_forward(self: nn.Module, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor) -> Tensor:
    """The ``"mlp_fuser"`` experts implementation: ``moe_mlp`` where ``spec`` allows, else transformers' grouped_mm."""
    compiling = torch.compiler.is_compiling()
    s = _spec_while_tracing(self) if compiling else spec(self)
    if s is None or s.reason is not None:  # a field, not the property: fewer calls for Dynamo to trace
        return _fallback(self)(self, hidden_states, top_k_index, top_k_weights)
    if s.fp8 is not None:
        return _fp8_forward(self, s, hidden_states, top_k_index, top_k_weights, compiling)
    w, b, wd, bd = weights(self, s)
    x = hidden_states if hidden_states.dtype == w.dtype else hidden_states.to(w.dtype)
    args = (x, top_k_index, top_k_weights, w, b, wd, bd, *s.consts[1:])
    save = saves(self)
    if not compiling:
        y = eager_moe_mlp(*args, save_preact=save)
    elif save and torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (x, top_k_weights, w, b,
                                                                                             wd, bd)):
        y = torch.ops.mlp_fuser.moe_mlp_save.default(*args)[0]
    else:
        y = torch.ops.mlp_fuser.moe_mlp.default(*args)
    return y if y.dtype == hidden_states.dtype else y.to(hidden_states.dtype)


def saves(module: nn.Module) -> bool:
    """Whether ``module``'s experts keep gate/up's output for their backward: as ``patch(backward=...)`` set it on
    the module, else as ``config.moe_backward`` says."""
    mode = getattr(module, BACKWARD, None) or config.moe_backward
    if mode not in ("recompute", "save"):
        raise ValueError(f"mlp_fuser: experts backward {mode!r} (config.moe_backward, MLP_FUSER_MOE_BACKWARD); "
                         "expected 'recompute' or 'save'")
    return mode == "save"


def _fallback(module: nn.Module):
    """transformers' grouped_mm implementation for the module: its FP8 one for FP8 experts."""
    if fp8_scales(module, bool(getattr(module, "has_gate", True))) is not None:
        from transformers.integrations.finegrained_fp8 import fp8_grouped_mm_experts_forward

        return fp8_grouped_mm_experts_forward
    from transformers.integrations.moe import grouped_mm_experts_forward

    return grouped_mm_experts_forward


def _fp8_forward(self: nn.Module, s: Spec | Traced, hidden_states: Tensor, top_k_index: Tensor, top_k_weights: Tensor,
                 compiling: bool) -> Tensor:
    """FP8 experts through ``quant_moe_mlp``: the float8 weights and their scales as stored, y in x's dtype."""
    gated, activation, interleaved, limit, clamp_after, up_offset = s.consts
    fmt, block = s.fp8
    found = packed.read(self) if compiling else None  # one graph input for the four (patch packed them)
    ws = found[0] if found is not None else tuple(getattr(self, n) for n in fp8_names(gated))
    op = torch.ops.mlp_fuser.quant_moe_mlp.default if compiling else quant_moe.eager_quant_moe_mlp
    return op(hidden_states, top_k_index, top_k_weights, *ws, activation, fmt,
              list(block) if block is not None else None, interleaved, limit, clamp_after, up_offset)


def fp8_names(gated: bool) -> tuple[str, str, str, str]:
    """FP8 experts' weights and scales in ``quant_moe_mlp``'s order, as ``FP8Experts`` names them."""
    w = "gate_up_proj" if gated else "up_proj"
    return w, f"{w}_scale_inv", "down_proj", "down_proj_scale_inv"


def fused_experts_forward(self: nn.Module, *args, **kwargs):
    """The forward ``patch`` gives an experts module it cannot switch by its config (``swapped_class``):
    ``experts_forward`` for calls shaped like transformers' (three tensors), the module's own forward for anything
    else."""
    if len(args) == 3 and not kwargs and all(isinstance(a, Tensor) for a in args):
        return experts_forward(self, *args)
    return getattr(type(self), SWAPPED).forward(self, *args, **kwargs)


def is_fused_experts(fused) -> bool:
    """Whether ``fused`` (a class ``fuse_experts`` gave, or a module) runs ``fused_experts_forward``."""
    return swapped_forward(fused) is fused_experts_forward


def unfused_reason(module: nn.Module) -> str | None:
    """Why an experts module (or one that looks like one) was not fused in the graphs explain saw; None for other
    modules."""
    if is_experts(module):
        s = spec(module)
        if not s.ok:
            return s.reason
        impl = getattr(getattr(module, "config", None), "_experts_implementation", None)
        return (f"not captured as one graph region (experts implementation {impl!r}; 'eager' loops over experts in "
                "Python and breaks the graph): set experts_implementation='mlp_fuser', or use mlp_fuser.patch")
    if is_routed_like(module):
        return (f"{type(module).__name__} runs every expert on every token (router-scaled inputs, no top-k ids): "
                "a batched matmul over all experts, not routed experts")
    return None


def fp8_site(module: nn.Module, path: str):
    """The ``fx_pass.Site`` ``explain`` reports for FP8 experts ``patch`` fuses (its pattern naming the weight
    format), or None: transformers' own FP8 path does not trace (its kernel comes from the Hub at run time)."""
    if not is_experts(module) or fp8_scales(module, bool(getattr(module, "has_gate", True))) is None:
        return None
    s = spec(module)
    if not s.ok or s.fp8 is None:
        return None
    from ..graph.fx_pass import Site

    fmt, block = s.fp8
    E, H, I = module.down_proj.shape
    where = f" {block[0]}x{block[1]} blocks" if block is not None else ""
    return Site(path, f"routed_experts ({fmt}{where})", f"{s.gate.describe()}, {E} experts", H, I, H)


def fp8_near_miss(module: nn.Module, path: str):
    """An ``fx_pass.NearMiss`` for FP8 experts the op cannot read (another float8 format, FP4, bad scales), which
    ``patch`` logs, else None."""
    if (not is_experts(module) or "forward" in module.__dict__
            or fp8_scales(module, bool(getattr(module, "has_gate", True))) is None or spec(module).ok):
        return None
    from ..graph.fx_pass import NearMiss

    return NearMiss(path, "routed_experts", "experts", spec(module).reason)


def fuse_experts(module: nn.Module) -> type | None:
    """The class ``patch`` gives a transformers experts module ``spec`` accepts (its forward fused), else None."""
    if not is_experts(module) or "forward" in module.__dict__ or is_swapped(module) or not spec(module).ok:
        return None
    return swapped_class(type(module), fused_experts_forward)
