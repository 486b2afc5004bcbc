"""An MoE router's top-k: ``softmax(logits, float32)`` → ``topk`` → (÷ sum) → ``.to(dtype)``, as Dynamo records it.

The chain of Qwen3-MoE, Qwen2-MoE, OLMoE, Mixtral (``softmax(logits.float())``) and the families that copy their
router. It qualifies when the softmax is over the last dimension of 2-D logits that need no gradient, in fp32, read
only by a ``topk`` (largest, sorted, last dimension) whose values go nowhere but the renormalisation (a ``sum`` over
the last dimension kept, a division by it) and the cast; the ids may go anywhere. The rewrite replaces the chain by
one ``mlp_fuser::moe_router_topk`` call.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.fx import Graph, Node

from .common import val

PATTERN = "router_topk"
_SOFTMAX = {torch.softmax, F.softmax, torch.Tensor.softmax, torch.special.softmax}
_TOPK = {torch.topk, torch.Tensor.topk}
_DIV = {operator.truediv, operator.itruediv, torch.div, torch.true_divide}


@dataclass
class RouterCandidate:
    logits: Node  # what the op reads: the softmax's input (before Mixtral's .float())
    k: int
    renorm: bool
    out_dtype: torch.dtype
    weights: Node  # the chain's last node on the weights' side
    ids: Node | None
    nodes: list[Node]  # the chain, to erase once unused
    needs_grad: bool  # the logits need gradients: the op has no backward, so the chain is only reported


def _is(n: Node, fns: set, method: str) -> bool:
    return (n.op == "call_function" and n.target in fns) or (n.op == "call_method" and n.target == method)


def _arg(n: Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def _last_dim(dim, ndim: int) -> bool:
    return isinstance(dim, int) and dim in (-1, ndim - 1)


def _only_user(n: Node) -> Node | None:
    return next(iter(n.users)) if len(n.users) == 1 else None


def match(softmax: Node) -> RouterCandidate | None:
    """The chain starting at ``softmax``, or None (``needs_grad`` says whether it may be rewritten)."""
    if not _is(softmax, _SOFTMAX, "softmax"):
        return None
    x, v = softmax.args[0], val(softmax)
    if not isinstance(x, Node) or not isinstance(val(x), torch.Tensor) or not isinstance(v, torch.Tensor):
        return None
    if val(x).dim() != 2 or v.dtype != torch.float32:
        return None
    if not _last_dim(_arg(softmax, 1, "dim"), 2):
        return None
    nodes = [softmax]
    # Mixtral: softmax(logits.float()): read the logits themselves where the cast feeds nothing else
    if (x.op == "call_method" and x.target == "float" and len(x.users) == 1 and isinstance(x.args[0], Node)
            and isinstance(val(x.args[0]), torch.Tensor)):
        nodes.insert(0, x)
        x = x.args[0]
    topk = _only_user(softmax)
    if topk is None or not _is(topk, _TOPK, "topk"):
        return None
    k = _arg(topk, 1, "k")
    if (not isinstance(k, int) or not _last_dim(_arg(topk, 2, "dim", -1), 2)
            or _arg(topk, 3, "largest", True) is not True or _arg(topk, 4, "sorted", True) is not True):
        return None
    nodes.append(topk)
    values = ids = None
    for u in topk.users:
        if u.op != "call_function" or u.target is not operator.getitem or u.args[1] not in (0, 1):
            return None
        if u.args[1] == 0:
            values = u
        else:
            ids = u
    if values is None:
        return None
    nodes.append(values)
    weights, renorm = values, False
    if len(values.users) == 2:  # the renormalisation: values / values.sum(-1, keepdim=True)
        total = next((u for u in values.users if _is(u, {torch.sum}, "sum")), None)
        div = next((u for u in values.users if u is not total), None)
        if (total is None or div is None or not _is(div, _DIV, "div") or div.args[:2] != (values, total)
                or _only_user(total) is not div or not _last_dim(_arg(total, 1, "dim"), 2)
                or _arg(total, 2, "keepdim", False) is not True or len(div.kwargs) > 0):
            return None
        nodes += [total, div]
        weights, renorm = div, True
    out_dtype = torch.float32
    cast = _only_user(weights)
    if cast is not None and cast.op == "call_method" and cast.target == "to" and len(cast.args) == 2 \
            and isinstance(cast.args[1], torch.dtype) and not cast.kwargs:
        nodes.append(cast)
        weights, out_dtype = cast, cast.args[1]
    elif len(weights.users) == 0 or any(u in nodes for u in weights.users):
        return None
    if ids is not None:
        nodes.append(ids)
    return RouterCandidate(x, k, renorm, out_dtype, weights, ids, nodes, bool(val(softmax.args[0]).requires_grad))


def find(graph: Graph) -> list[RouterCandidate]:
    """Every chain, those whose logits need gradients included (``needs_grad``)."""
    return [c for n in list(graph.nodes) if (c := match(n)) is not None]


def rewrite(graph: Graph, c: RouterCandidate) -> Node:
    """Replace the chain by one ``moe_router_topk`` call; return it."""
    topk = next(n for n in c.nodes if _is(n, _TOPK, "topk"))
    with graph.inserting_after(topk):  # before every user of the ids
        op = graph.call_function(torch.ops.mlp_fuser.moe_router_topk.default, (c.logits, c.k, c.renorm, c.out_dtype))
        with graph.inserting_after(op):
            w = graph.call_function(operator.getitem, (op, 0))
            i = graph.call_function(operator.getitem, (op, 1))
    if "example_value" in c.weights.meta:
        w.meta["example_value"] = c.weights.meta["example_value"]
    c.weights.replace_all_uses_with(w)
    if c.ids is not None:
        i.meta.update({k: v for k, v in c.ids.meta.items() if k == "example_value"})
        c.ids.replace_all_uses_with(i)
    for n in reversed(c.nodes):
        if not n.users:
            graph.erase_node(n)
    return op
