"""The graph pass: find MLP sites with the pattern registry, check each, rewrite it to one ``mlp_fuser::`` op.

It runs on the torch-level FX graph that Dynamo hands a backend (before AOTAutograd), so the op's own autograd
serves training. A site is fused only when every check passes; otherwise it is reported as a near miss that names
the failed check:

- ``activation``: the subgraph between the first projection and the rest computes no registry activation;
- ``allowed`` / ``filter``: the pattern or activation is not enabled, or the user's filter rejected the site;
- ``single_use``: an intermediate has a user outside the MLP (returned, stored, captured by a hook);
- ``same_input``: gate and up read different tensors;
- ``plain_tensors``: x, a weight or a bias is a tensor subclass (quantized weights such as torchao's, a DTensor, any
  ``__torch_dispatch__`` wrapper): the op's kernels read plain tensors, and a subclass that runs only the aten ops it
  knows would fail on the op (the same MLP with a Linear whose forward dequantizes its weight is fused: the graph
  then hands the op the plain dequantized tensor);
- ``dtype_device``: the tensors do not share one dtype and device (a cast inside the MLP, mixed weights); under
  autocast, every value the MLP computes must have the autocast dtype (then the op casts as nn.Linear does);
- ``dropout_inactive``: a dropout inside the MLP is active (training mode, p > 0);
- ``shapes``: the weight, bias and output shapes do not chain as one MLP.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch.fx import GraphModule, Node

from mlp_fuser import compat, config
from mlp_fuser import patterns as P
from mlp_fuser.graph import sharding
from mlp_fuser.ops.dense import _PLAIN
from mlp_fuser.patterns import experts as routed
from mlp_fuser.patterns import router_topk
from mlp_fuser.patterns.common import (
    clean_path,
    dropout_active,
    input_name,
    is_dropout,
    module_path,
    same,
    same_shape,
    val,
)

log = logging.getLogger("mlp_fuser")

CHECKS = ("activation", "allowed", "filter", "single_use", "same_input", "plain_tensors", "dtype_device",
          "dropout_inactive", "shapes", "experts", "training")
# Routed experts in a training graph that Inductor compiles: its grouped_mm graph steps faster than the op there
# (benchmarks/NOTES.md, "Training"), so the region is left to it; eager training (patch, the switch) fuses them.
TRAINED_EXPERTS = ("its output needs gradients and Inductor compiles the graph: Inductor's own grouped_mm experts "
                   "train faster than the op there (experts_implementation='mlp_fuser' forces the op)")


@dataclass
class Site:
    path: str  # module path of the MLP (common ancestor of its projections)
    pattern: str
    activation: str
    K: int
    I: int
    O: int


@dataclass
class NearMiss:
    path: str
    pattern: str
    check: str  # one of CHECKS
    reason: str


@dataclass
class PassReport:
    fused: list[Site] = field(default_factory=list)
    near_misses: list[NearMiss] = field(default_factory=list)
    projections: int = 0  # projections seen (to say why nothing was found)
    routers: list[str] = field(default_factory=list)  # module paths of the MoE routers whose top-k became one op
    routers_with_grad: list[str] = field(default_factory=list)  # routers left alone: their logits need gradients

    def checks_failed(self) -> set[str]:
        return {m.check for m in self.near_misses}

    def summary(self) -> str:
        kinds: dict[str, int] = {}
        for s in self.fused:
            key = f"{s.pattern}/{s.activation}"
            kinds[key] = kinds.get(key, 0) + 1
        what = ", ".join(f"{k}: {n}" for k, n in sorted(kinds.items()))
        text = f"fused {len(self.fused)} MLP(s)" + (f" ({what})" if what else "")
        if self.near_misses:
            text += f"; {len(self.near_misses)} near miss(es), failed: {', '.join(sorted(self.checks_failed()))}"
        if self.routers:
            text += f"; {len(self.routers)} router top-k fused"
        return text


def node_text(n) -> str:
    """How a near miss names a graph node: a weight or input by its path, a projection's output by its module, any
    other value by what computes it and where (``mul in model.layers.0.mlp``), never by Dynamo's variable name."""
    if not isinstance(n, Node):
        return repr(n)
    if n.op == "placeholder":
        return input_name(n)
    if n.op == "get_attr":
        return str(n.target)
    where = module_path(n) or "<root>"
    if P.match_projection(n) is not None:
        return f"the output of {where}"
    t = n.target
    what = t if isinstance(t, str) else getattr(t, "__name__", str(t))
    return f"{what} in {where}"


def _module_at(root, path: str):
    """The module at ``path`` in ``root``, or None (no root, or no such module)."""
    if root is None:
        return None
    try:
        return root.get_submodule(path)
    except AttributeError:
        return None


def site_path(c: P.Candidate) -> str:
    paths = [module_path(p.nodes[0]).split(".") for p in (c.gate, c.up, c.down) if p is not None]
    common = []
    for parts in zip(*paths):
        if len(set(parts)) != 1:
            break
        common.append(parts[0])
    return ".".join(common)


# ---- checks ------------------------------------------------------------------------------------------


def _users_outside(n: Node, inside: set[Node]) -> str | None:
    outside = [u for u in n.users if u not in inside]
    if not outside:
        return None
    if any(u.op == "output" for u in outside):
        return f"{node_text(n)} escapes the graph (returned, stored on a module, or captured by a hook)"
    return f"{node_text(n)} is also read by {', '.join(node_text(u) for u in outside)}"


def _check_shapes(c: P.Candidate) -> str | None:
    x = val(c.gate.x)
    projs = [p for p in (c.gate, c.up, c.down) if p is not None]
    shapes = [p.weight_shape() for p in projs]
    if x is None or any(s is None for s in shapes) or val(c.down.out) is None:
        return "a weight is not 2-D, or a shape is unknown"
    if not all(isinstance(d, int) for s in shapes for d in s):
        return "weight shapes are not static"
    (I, K), *_, (O, I2) = shapes
    if not same(x.shape[-1], K):
        return f"x has {x.shape[-1]} features but the first projection takes {K}"
    if c.up is not None and shapes[1] != shapes[0]:
        return f"gate weight {shapes[0]} and up weight {shapes[1]} differ"
    if I2 != I:
        return f"the last projection takes {I2} features but the intermediate has {I}"
    for p, (out, _) in zip(projs, shapes):
        b = val(p.bias) if p.bias is not None else None
        if p.bias is not None and (b is None or b.dim() != 1 or b.shape[0] != out * (p.rows[1] if p.rows else 1)):
            return f"bias {node_text(p.bias)} has shape {tuple(b.shape) if b is not None else '?'}, expected ({out},)"
    for p, n in ((c.gate, I), (c.up, I), (c.down, O)):
        if p is not None and (val(p.out) is None or not same_shape(val(p.out).shape, (*x.shape[:-1], n))):
            return f"{node_text(p.out)} does not have shape x.shape[:-1] + ({n},)"
    for n in c.act.nodes + c.extra:
        v = val(n)
        if v is None or not same_shape(v.shape, (*x.shape[:-1], I)):
            return f"{node_text(n)} does not have the intermediate's shape"
    return None


def _plain(t: torch.Tensor) -> bool:
    """A plain tensor (the types the op's eager entry computes directly), or the fake tensor Dynamo stands in for one
    (a subclass's stand-in has the subclass's type)."""
    return type(t) in _PLAIN or isinstance(t, compat.FakeTensor)


def _autocast_dtype(x) -> torch.dtype | None:
    """The dtype autocast computes this graph's projections in, when it is on for x's device: the graph was
    captured under it (Dynamo guards on it), and the op's own autocast kernel casts its inputs the same way
    ``nn.Linear`` does, so a site whose every computed value has that dtype is the same computation fused."""
    if not isinstance(x, torch.Tensor) or x.is_meta or not torch.is_autocast_enabled(x.device.type):
        return None
    return torch.get_autocast_dtype(x.device.type)


def check(c: P.Candidate, path: str, activations=None, patterns=None, filter_fn=None,
          root=None) -> tuple[str, str] | None:
    """The first failed check as (name, reason), or None when the site may be fused. ``filter_fn(module, fqn)``
    as for ``make_backend``, ``module`` looked up in ``root``."""
    if c.unsupported:
        return "activation", c.unsupported
    if c.act.name is None:
        return "activation", f"unrecognized activation: {c.act.desc}"
    if patterns is not None and c.pattern not in patterns:
        return "allowed", f"pattern {c.pattern!r} is not enabled"
    if activations is not None and c.act.name not in activations:
        return "allowed", f"activation {c.act.name!r} is not enabled"
    if filter_fn is not None and not filter_fn(_module_at(root, path), path):
        return "filter", "rejected by filter_fn"
    inter = c.intermediates()
    inside = set(inter) | {c.down.out}
    for n in inter:
        why = _users_outside(n, inside)
        if why:
            return "single_use", why
    if c.up is not None and c.up.x is not c.gate.x:
        return "same_input", f"gate reads {node_text(c.gate.x)} but up reads {node_text(c.up.x)}"
    x = val(c.gate.x)
    tensors = [p.weight for p in (c.gate, c.up, c.down) if p is not None]
    tensors += [p.bias for p in (c.gate, c.up, c.down) if p is not None and p.bias is not None]
    for n in [c.gate.x, *tensors]:
        v = val(n)
        if isinstance(v, torch.Tensor) and not _plain(v):
            return "plain_tensors", f"{node_text(n)} is {sharding.describe(v)}"
    amp = _autocast_dtype(x)
    computed = set(inter) | {c.down.out}
    for n in tensors + inter + [c.down.out]:
        v = n.meta.get("example_value", n.meta.get("val"))
        vs = list(v) if isinstance(v, (tuple, list)) else [v]
        if x is None or not vs or not all(isinstance(t, torch.Tensor) for t in vs):
            return "dtype_device", f"no dtype/device known for {node_text(n)}"
        for t in vs:
            if t.device != x.device:
                return "dtype_device", f"{node_text(n)} is on {t.device} but x is on {x.device}"
            if amp is None and t.dtype != x.dtype:
                return "dtype_device", f"{node_text(n)} is {t.dtype} but x is {x.dtype}"
            if amp is not None and n in computed and t.dtype != amp:
                return "dtype_device", f"{node_text(n)} is {t.dtype} under autocast to {amp}"
    for n in inter:
        if is_dropout(n) and dropout_active(n):
            return "dropout_inactive", f"{node_text(n)} is an active dropout (training mode, p > 0)"
    why = _check_shapes(c)
    return ("shapes", why) if why else None


# ---- rewrite -------------------------------------------------------------------------------------------


def _with_value(n: Node, fn) -> Node:
    try:
        n.meta["example_value"] = fn()
    except Exception:  # the value is a convenience for later passes only
        pass
    return n


def _view(g, t: Node, method: str, *args) -> Node:
    n = g.call_method(method, (t, *args))
    return _with_value(n, lambda: getattr(val(t), method)(*args))


def _weight_args(g, p) -> tuple[Node, Node | None]:
    w, b = p.weight, p.bias
    if p.transposed:
        w = _view(g, w, "t")
    if p.rows is not None:
        size = p.weight_shape()[0]
        start = p.rows[0] * size
        w = _view(g, w, "narrow", 0, start, size)
        b = _view(g, b, "narrow", 0, start, size) if b is not None else None
    return w, b


def rewrite(gm: GraphModule, c: P.Candidate, order: dict[Node, int], save_preact: bool = False) -> Node:
    g = gm.graph
    out = c.down.out
    save = (True,) if save_preact else ()  # the op's default (False) is left implicit
    with g.inserting_before(out):
        gate, down = _weight_args(g, c.gate), _weight_args(g, c.down)
        if c.up is None:
            op, weights = torch.ops.mlp_fuser.mlp.default, (*gate, *down)
        else:
            op, weights = torch.ops.mlp_fuser.gated_mlp.default, (*gate, *_weight_args(g, c.up), *down)
        new = g.call_function(op, (c.gate.x, *weights, c.act.name, *save))
    for key in ("example_value", "nn_module_stack", "stack_trace"):
        if key in out.meta:
            new.meta[key] = out.meta[key]
    out.replace_all_uses_with(new)
    dead = set(c.intermediates()) | {out}
    for p in (c.gate, c.up, c.down):
        if p is not None:
            dead |= set(p.x_nodes) | set(p.w_nodes)
    for n in sorted(dead, key=lambda n: order.get(n, -1), reverse=True):
        if not n.users:
            g.erase_node(n)
    return new


# ---- the pass ---------------------------------------------------------------------------------------------


def _fill_get_attr_values(gm: GraphModule) -> None:
    for n in gm.graph.nodes:
        if n.op == "get_attr" and val(n) is None:
            try:
                n.meta["example_value"] = gm.get_parameter(n.target)
            except AttributeError:
                try:
                    n.meta["example_value"] = gm.get_buffer(n.target)
                except AttributeError:
                    pass


def _fuse_experts(gm: GraphModule, activations, patterns, filter_fn, root, dry_run: bool,
                  leave_trained: bool = False, save: bool | None = None) -> PassReport:
    """Routed experts (``patterns/experts.py``): each experts module's region checked, then rewritten to one
    ``moe_mlp`` call; ``leave_trained``: a region whose output needs gradients is left as it is; ``save``: such a
    region keeps gate/up's output for its backward (``moe_mlp_save``), None: as ``config.moe_backward`` says."""
    report = PassReport()
    if save is None:
        save = config.moe_backward == "save"
    for c in routed.find(gm.graph):
        path = clean_path(c.path)
        failed = None
        if c.reason is not None:
            failed = ("experts", c.reason)
        elif patterns is not None and routed.PATTERN not in patterns:
            failed = ("allowed", f"pattern {routed.PATTERN!r} is not enabled")
        elif activations is not None and c.gate.activation not in activations:
            failed = ("allowed", f"activation {c.gate.activation!r} is not enabled")
        elif filter_fn is not None and not filter_fn(_module_at(root, path), path):
            failed = ("filter", "rejected by filter_fn")
        elif leave_trained and c.needs_grad and c.op is None:
            failed = ("training", TRAINED_EXPERTS)
        if failed:
            report.near_misses.append(NearMiss(path, routed.PATTERN, *failed))
            continue
        report.fused.append(Site(path, routed.PATTERN, f"{c.gate.describe()}, {c.E} experts", c.H, c.I, c.H))
        if not dry_run:
            routed.rewrite(gm.graph, c, save and c.needs_grad)
    return report


def _fuse_routers(gm: GraphModule, patterns, filter_fn, root, dry_run: bool) -> tuple[list[str], list[str]]:
    """MoE routers' softmax → top-k → renorm → cast (``patterns/router_topk.py``), each rewritten to one
    ``moe_router_topk`` call; returns their module paths, and those of the chains left alone for needing gradients."""
    if patterns is not None and router_topk.PATTERN not in patterns:
        return [], []
    paths, with_grad = [], []
    for c in router_topk.find(gm.graph):
        path = clean_path(module_path(c.nodes[-1]))
        if filter_fn is not None and not filter_fn(_module_at(root, path), path):
            continue
        (with_grad if c.needs_grad else paths).append(path)
        if not dry_run and not c.needs_grad:
            router_topk.rewrite(gm.graph, c)
    return paths, with_grad


def fuse_mlps(
    gm: GraphModule,
    *,
    activations=None,
    patterns=None,
    filter_fn: Callable[..., bool] | None = None,
    dry_run: bool = False,
    save_preact: bool = False,
    root=None,
    leave_trained_experts: bool = False,
    save_experts: bool | None = None,
) -> PassReport:
    """Find, check and (unless ``dry_run``) rewrite every MLP site of ``gm``; return what was fused and missed.
    ``save_preact``: the ops keep their pre-activations for the backward instead of recomputing them.
    ``filter_fn(module, fqn)``: as for ``make_backend``, ``module`` the module at ``fqn`` in ``root`` or None.
    ``leave_trained_experts``: routed experts whose output needs gradients are left to the compiler (check
    "training"); the backend asks this when Inductor compiles. ``save_experts``: the routed experts whose output
    needs gradients keep gate/up's output (``moe_mlp_save``); None: as ``config.moe_backward`` says."""
    _fill_get_attr_values(gm)
    report = PassReport()
    gm, lowered = sharding.lower(gm, copy=dry_run)  # a tensor-parallel MLP's DTensor chain, as its local computation
    report.near_misses += [NearMiss(*m) for m in lowered]
    experts = _fuse_experts(gm, activations, patterns, filter_fn, root, dry_run, leave_trained_experts, save_experts)
    report.routers, report.routers_with_grad = _fuse_routers(gm, patterns, filter_fn, root, dry_run)
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    seen: set[Node] = set()
    for n in reversed(list(order)):
        if n in seen or getattr(n, "_erased", False) or n.op not in ("call_function", "call_method"):
            continue
        down = P.match_projection(n)
        if down is None:
            continue
        report.projections += 1
        seen.update(down.nodes)
        c = P.find(down)
        if c is None:
            continue
        path = site_path(c)
        failed = check(c, path, activations, patterns, filter_fn, root)
        if failed:
            report.near_misses.append(NearMiss(path, c.pattern, *failed))
            continue
        I, K = c.gate.weight_shape()
        report.fused.append(Site(path, c.pattern, c.act.name, K, I, c.down.weight_shape()[0]))
        seen.update(c.intermediates())
        if not dry_run:
            rewrite(gm, c, order, save_preact)
    report.fused.reverse()
    report.near_misses.reverse()
    report.fused += experts.fused
    report.near_misses += experts.near_misses
    if (report.fused or report.routers) and not dry_run:
        gm.graph.lint()
        gm.recompile()
    # The bodies of higher-order ops (torch.utils.checkpoint's tag_activation_checkpoint, which HF's
    # gradient_checkpointing_enable() wraps every layer in, under torch.compile) are graphs of their own.
    for sub in gm.children():
        if isinstance(sub, GraphModule):
            inner = fuse_mlps(sub, activations=activations, patterns=patterns, filter_fn=filter_fn, dry_run=dry_run,
                              save_preact=save_preact, root=root, leave_trained_experts=leave_trained_experts,
                              save_experts=save_experts)
            report.fused += inner.fused
            report.near_misses += inner.near_misses
            report.projections += inner.projections
            report.routers += inner.routers
            report.routers_with_grad += inner.routers_with_grad
    return report
