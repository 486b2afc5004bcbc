"""Routed experts: transformers' ``grouped_mm`` and ``batched_mm`` experts implementations, as Dynamo records them.

An experts module (a class with ``@use_experts_implementation``) shows in the graph as the nodes whose module stack
holds it. The region qualifies when it reads exactly the hidden states (T, H), the top-k ids (T, k) and weights
(T, k) and the module's own stacked weights, returns one (T, H) tensor, mutates nothing outside itself, and holds
two expert GEMMs (``_grouped_mm`` / ``grouped_mm`` / transformers' ``grouped_mm_fallback``, or ``bmm`` over gathered
weights): the first reads ``gate_up_proj`` (``up_proj`` for plain experts), the second ``down_proj``. What lies
between them (``_apply_gate`` or ``act_fn``) is identified by running it in float64 on probe rows against the op's
gated activations (``mlp_fuser.moe.Gate``), as ``act_match`` identifies a dense MLP's activation. The rewrite
replaces the region by one ``mlp_fuser::moe_mlp`` call (``moe_mlp_save``'s y where asked to keep gate/up for the
backward).
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
from torch.fx import Graph, Node
from torch.fx.node import map_arg

from mlp_fuser.ops.moe import Gate, gates

from .common import val

PATTERN = "routed_experts"  # the pattern's name in reports and in the pass's ``patterns=`` option
_GEMMS = {"_grouped_mm", "grouped_mm", "grouped_mm_fallback", "bmm"}
_PASS = {"squeeze", "unsqueeze", "masked_fill", "to", "contiguous", "float", "type_as"}
_INPLACE_FNS = {operator.setitem}
_OPS = (torch.ops.mlp_fuser.moe_mlp.default, torch.ops.mlp_fuser.moe_mlp_save.default)  # a region fused already


@dataclass
class ExpertsCandidate:
    path: str
    cls: type
    nodes: list[Node] = field(default_factory=list)  # the region, in graph order
    out: Node | None = None
    x: Node | None = None
    ids: Node | None = None
    wts: Node | None = None
    w_gate_up: Node | None = None
    b_gate_up: Node | None = None
    w_down: Node | None = None
    b_down: Node | None = None
    transposed: bool = False
    gate: Gate | None = None
    E: int = 0
    H: int = 0
    I: int = 0
    reason: str | None = None  # why it cannot be fused: a near miss
    needs_grad: bool = False  # its output needs gradients (a training step's graph)
    op: Node | None = None  # the region already is a moe_mlp call (experts_implementation="mlp_fuser", patch)


def _name(n: Node) -> str:
    t = n.target
    return t if isinstance(t, str) else getattr(t, "__name__", str(t)).split(".")[-1]


def _experts_path(n: Node) -> tuple[str, type] | None:
    """The outermost experts module in the node's module stack: (its stack path, its class)."""
    for path, cls in (n.meta.get("nn_module_stack") or {}).values():
        if isinstance(cls, type) and hasattr(cls, "_apply_gate"):
            return path, cls
    return None


def regions(graph: Graph) -> dict[str, ExpertsCandidate]:
    """Every experts module's nodes (placeholders and get_attrs excluded), keyed by its stack path."""
    found: dict[str, ExpertsCandidate] = {}
    for n in graph.nodes:
        if n.op in ("placeholder", "get_attr", "output"):
            continue
        hit = _experts_path(n)
        if hit is not None:
            found.setdefault(hit[0], ExpertsCandidate(hit[0], hit[1])).nodes.append(n)
    return found


def _inputs(n: Node) -> list[Node]:
    found: list[Node] = []
    map_arg((n.args, n.kwargs), found.append)
    return found


def _strip(n: Node, inside: set[Node]) -> Node:
    """Walk back through pass-through nodes (casts, squeezes, masks) inside the region."""
    while isinstance(n, Node) and n in inside and _name(n) in _PASS and isinstance(n.args[0], Node):
        n = n.args[0]
    return n


def _param_of(n: Node, params: dict[Node, str]) -> Node | None:
    """The stacked parameter a GEMM's weight operand reads (through a transpose or a gather), or None."""
    for _ in range(3):
        if n in params:
            return n
        if not isinstance(n, Node) or not n.args or not isinstance(n.args[0], Node):
            return None
        n = n.args[0]
    return n if n in params else None


def analyze(c: ExpertsCandidate) -> ExpertsCandidate:
    """Fill in ``c``'s inputs, weights and activation, or its ``reason``."""
    op = next((n for n in c.nodes if n.target in _OPS), None)
    if op is not None:  # fused already: what it computes is in its arguments
        a = list(op.args) + [None] * (12 - len(op.args))
        c.op, c.E, c.H, c.I = op, val(a[3]).shape[0], val(a[0]).shape[-1], val(a[5]).shape[2]
        c.gate = Gate(a[7], val(a[3]).shape[1] == 2 * c.I, bool(a[8]), a[9], bool(a[10]), float(a[11] or 0.0))
        return c
    inside = set(c.nodes)
    outside_inputs = list(dict.fromkeys(m for n in c.nodes for m in _inputs(n) if m not in inside))
    outputs = [n for n in c.nodes if any(u not in inside for u in n.users)]
    if len(outputs) != 1:
        c.reason = f"the experts' nodes hand {len(outputs)} values to the rest of the graph, not one"
        return c
    c.out = outputs[0]
    c.needs_grad = bool(getattr(val(c.out), "requires_grad", False))
    params: dict[Node, str] = {}
    acts = []
    for m in outside_inputs:
        v = val(m)
        name = m.name.rstrip("_")
        if isinstance(v, torch.Tensor) and (v.dim() == 3 or (v.dim() == 2 and name.endswith("bias"))) and \
                any(s in name for s in ("gate_up_proj", "up_proj", "down_proj")):
            params[m] = name
        elif isinstance(v, torch.Tensor):
            acts.append(m)
        elif isinstance(m, Node) and m.op in ("call_function", "call_method") and not isinstance(v, torch.Tensor):
            continue  # a size read outside the region (dynamic shapes)
        else:
            c.reason = f"the experts read {m.name}, which is neither an input nor one of their weights"
            return c
    for n in c.nodes:
        if n.op == "call_method" and _name(n).endswith("_") and n.args and n.args[0] not in inside:
            c.reason = f"{n.name} ({_name(n)}) changes {n.args[0].name} in place, outside the experts"
            return c
        if n.op == "call_function" and n.target in _INPLACE_FNS and n.args[0] not in inside:
            c.reason = f"{n.name} writes into {n.args[0].name}, outside the experts"
            return c
    floats = [m for m in acts if val(m).is_floating_point()]
    ints = [m for m in acts if not val(m).is_floating_point()]
    if len(ints) != 1 or len(floats) != 2:
        c.reason = (f"the experts read {len(acts)} tensors besides their weights ({', '.join(m.name for m in acts)}); "
                    "expected hidden states, top-k ids and top-k weights")
        return c
    c.ids = ints[0]
    k_shape = tuple(val(c.ids).shape)
    wts = [m for m in floats if tuple(val(m).shape) == k_shape]
    xs = [m for m in floats if m not in wts]
    if len(wts) != 1 or len(xs) != 1 or val(xs[0]).dim() != 2 or len(k_shape) != 2:
        c.reason = "the experts' inputs are not (T, H) hidden states with (T, k) ids and weights"
        return c
    c.wts, c.x = wts[0], xs[0]
    gemms = [n for n in c.nodes if n.op in ("call_function", "call_method") and _name(n) in _GEMMS]
    if len(gemms) != 2:
        c.reason = (f"{len(gemms)} expert GEMMs found, not two: an experts implementation the pass does not know "
                    "(grouped_mm and batched_mm are known; experts_implementation='mlp_fuser' always fuses)")
        return c
    first, second = gemms
    w1 = next((p for p in map(lambda a: _param_of(a, params), _inputs(first)) if p is not None), None)
    w2 = next((p for p in map(lambda a: _param_of(a, params), _inputs(second)) if p is not None), None)
    if w1 is None or w2 is None or "down_proj" in params[w1] or "down_proj" not in params[w2]:
        c.reason = "the expert GEMMs do not read gate_up_proj (or up_proj) first and down_proj second"
        return c
    c.w_gate_up, c.w_down = w1, w2
    for p, name in params.items():
        if name.endswith("bias"):
            if "down_proj" in name:
                c.b_down = p
            else:
                c.b_gate_up = p
    wv, dv, H = val(w1), val(w2), val(c.x).shape[-1]
    E = wv.shape[0]
    c.transposed = _transposed(first, w1, inside)
    N, K = (wv.shape[2], wv.shape[1]) if c.transposed else (wv.shape[1], wv.shape[2])
    Hd, I = (dv.shape[2], dv.shape[1]) if c.transposed else (dv.shape[1], dv.shape[2])
    if K != H or Hd != H or N not in (I, 2 * I) or dv.shape[0] != E:
        c.reason = f"the expert weights {tuple(wv.shape)} and {tuple(dv.shape)} do not chain with H = {H}"
        return c
    c.E, c.H, c.I = E, H, I
    gate = _identify(first, second, w2, inside, gated=N == 2 * I)
    if gate is None:
        c.reason = "what lies between the expert GEMMs is none of the op's activations (act·up with a registry act, " \
                   "optionally clamped, up + 1, interleaved)"
        return c
    c.gate = gate
    return c


def _transposed(gemm: Node, w: Node, inside: set[Node]) -> bool:
    """Whether the weight is stored (E, in, out): grouped_mm reads it without a transpose, bmm after the input."""
    if _name(gemm) == "bmm":
        a = gemm.args[0]
        return _param_of(a, {w: ""}) is None  # bmm(x, w[ids]): the weight second, stored (in, out)
    op = gemm.args[1] if len(gemm.args) > 1 else None
    return not (isinstance(op, Node) and op in inside and _name(op) in ("transpose", "mT", "t"))


def _identify(first: Node, second: Node, w_down: Node, inside: set[Node], gated: bool) -> Gate | None:
    """The op's activation equal to the nodes between the two GEMMs, run in float64 on probe rows."""
    a_in = next((a for a in _inputs(second) if _param_of(a, {w_down: ""}) is None), None)
    if a_in is None:
        return None
    end = _strip(a_in, inside)
    # the leaf: the first GEMM's output after its pass-through nodes and bias
    leaf, n = first, first
    while True:
        users = [u for u in n.users if not (u.op == "call_method" and _name(u).endswith("_") and not u.users)]
        if len(users) != 1:
            break
        (u,) = users  # past in-place updates of n with no users of their own (out.add_(bias)): n holds their result
        if u not in inside or u is end:
            break
        if _name(u) in _PASS or (_name(u) in ("add", "add_", "iadd") and len(u.args) == 2):
            leaf = n = u
            continue
        break
    between = _between(leaf, end, inside)
    if between is None:
        return None
    probe = _probe_rows()
    try:
        y = _evaluate(between, leaf, end, probe if gated else probe[:, :2])
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape[0] != probe.shape[0]:
        return None
    limits = [None] + sorted({abs(float(a)) for n in between for a in (*n.args[1:], *n.kwargs.values())
                              if isinstance(a, (int, float)) and not isinstance(a, bool) and a})
    for gate in gates(gated, limits=limits):
        try:
            if torch.allclose(gate(probe if gated else probe[:, :2]), y, rtol=1e-6, atol=1e-9, equal_nan=True):
                return gate
        except Exception:
            continue
    return None


def _between(leaf: Node, end: Node, inside: set[Node]) -> list[Node] | None:
    """The nodes from ``leaf`` (excluded) to ``end`` (included), in graph order; None if they read other tensors."""
    nodes, seen = [], set()

    def visit(n: Node) -> bool:
        if n is leaf or n in seen:
            return True
        if n not in inside or n.op not in ("call_function", "call_method"):
            return False
        seen.add(n)
        for m in _inputs(n):
            if not visit(m):
                return False
        nodes.append(n)
        return len(nodes) <= 64

    return nodes if visit(end) else None


def _probe_rows() -> torch.Tensor:
    """(P, 4) float64 rows: two gate/up column pairs, so that the concatenated and interleaved layouts differ."""
    p = torch.cat([torch.linspace(-10.0, 10.0, 81), torch.tensor([-30.0, -7.0, -1e-3, 1e-3, 7.0, 30.0])]).double()
    g, u = p.repeat_interleave(len(p)), p.repeat(len(p))
    return torch.stack([g, u, 0.5 * g + 0.1, 0.7 * u - 0.2], dim=-1)


def _evaluate(nodes: list[Node], leaf: Node, end: Node, x: torch.Tensor):
    env = {leaf: x}
    for n in nodes:
        args = map_arg(n.args, lambda m: env[m])
        kwargs = {k: v for k, v in map_arg(n.kwargs, lambda m: env[m]).items() if k != "inplace"}
        if n.op == "call_method":
            env[n] = getattr(torch.Tensor, n.target)(*args, **kwargs)
        else:
            env[n] = n.target(*args, **kwargs)
    return env[end]


def find(graph: Graph) -> list[ExpertsCandidate]:
    return [analyze(c) for c in regions(graph).values()]


def rewrite(graph: Graph, c: ExpertsCandidate, save: bool = False) -> Node:
    """Replace the region by one ``moe_mlp`` call (``save``: ``moe_mlp_save``, its y read from the pair); return
    it."""
    if c.op is not None:
        return c.op
    g = c.gate
    out = c.out
    with graph.inserting_before(out):
        x = c.x
        wdtype = val(c.w_gate_up).dtype
        if val(x).dtype != wdtype:
            x = graph.call_method("to", (x, wdtype))
        w1, w2 = c.w_gate_up, c.w_down
        if c.transposed:
            w1 = graph.call_method("transpose", (w1, 1, 2))
            w2 = graph.call_method("transpose", (w2, 1, 2))
        new = graph.call_function(_OPS[save], (
            x, c.ids, c.wts, w1, c.b_gate_up, w2, c.b_down, g.activation, g.interleaved, g.limit, g.clamp_after,
            g.up_offset))
        y = graph.call_function(operator.getitem, (new, 0)) if save else new
        result = y
        if val(out) is not None and val(out).dtype != wdtype:
            result = graph.call_method("to", (y, val(out).dtype))
    for key in ("example_value", "nn_module_stack", "stack_trace"):
        if key in out.meta:
            y.meta[key] = out.meta[key]
            if key != "example_value":
                new.meta[key] = out.meta[key]
    out.replace_all_uses_with(result)
    for n in reversed(c.nodes):
        if not n.users:
            graph.erase_node(n)
    return new
