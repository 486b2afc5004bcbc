"""A projection (one Linear) as Dynamo records it.

- ``F.linear(x, w, b)`` (the very function graphs record, ``torch._C._nn.linear``): ``nn.Linear``, weight ``(out, in)``.
- ``addmm(b, x.view(-1, K), w).view(*x.shape[:-1], O)``: GPT-2's ``Conv1D``, weight ``(in, out)``.
- ``x @ w.T`` (+ ``b``): Falcon's ``FalconLinear`` and hand-written projections; ``x @ w`` is an ``(in, out)`` weight.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.fx import Node

from .common import arg, is_fn, is_method, val

LINEAR = (F.linear,)
MATMUL = (operator.matmul, torch.matmul)
ADD = (operator.add, torch.add)
VIEW_METHODS = ("view", "reshape")


@dataclass
class Proj:
    out: Node  # the node whose value the rest of the model reads
    x: Node  # the input, last dimension K
    weight: Node  # the weight as stored
    bias: Node | None
    transposed: bool = False  # weight stored (in, out): the op gets weight.t()
    nodes: list[Node] = field(default_factory=list)  # compute nodes, ``out`` last
    x_nodes: list[Node] = field(default_factory=list)  # views of x (Conv1D's x.view(-1, K))
    w_nodes: list[Node] = field(default_factory=list)  # views of the weight (w.T)
    rows: tuple[int, int] | None = None  # (index, parts): this projection is rows index/parts of a merged weight

    def weight_shape(self):
        """The logical (out, in) shape of this projection's weight, or None."""
        w = val(self.weight)
        if w is None or w.dim() != 2:
            return None
        out, inp = (w.shape[1], w.shape[0]) if self.transposed else (w.shape[0], w.shape[1])
        if self.rows is not None:
            out = out // self.rows[1]
        return out, inp


def _is_view(n) -> bool:
    return is_method(n, *VIEW_METHODS) or is_fn(n, torch.reshape)


def _transposed_weight(n):
    """``w.T`` / ``w.t()`` / ``w.transpose(0, 1)`` of a 2-D tensor: return ``w``, else None."""
    if is_fn(n, getattr) and n.args[1] in ("T", "mT"):
        return n.args[0]
    if is_method(n, "t") or is_fn(n, torch.t):
        return n.args[0]
    if (is_method(n, "transpose") or is_fn(n, torch.transpose)) and sorted(n.args[1:3]) in ([0, 1], [-2, -1]):
        return n.args[0]
    return None


def _matmul(n) -> Proj | None:
    if not is_fn(n, *MATMUL) or len(n.args) != 2:
        return None
    x, w = n.args
    wv = val(w)
    if not isinstance(x, Node) or wv is None or wv.dim() != 2:
        return None
    base = _transposed_weight(w)
    if base is not None:
        return Proj(n, x, base, bias=None, nodes=[n], w_nodes=[w])
    return Proj(n, x, w, bias=None, transposed=True, nodes=[n])


def match_projection(n) -> Proj | None:
    """The projection whose output is ``n``, or None."""
    if not isinstance(n, Node) or n.op not in ("call_function", "call_method"):
        return None
    if is_fn(n, *LINEAR):
        x, w, b = arg(n, 0, "input"), arg(n, 1, "weight"), arg(n, 2, "bias")
        return Proj(n, x, w, bias=b, nodes=[n]) if isinstance(x, Node) and isinstance(w, Node) else None
    if (is_fn(n, *ADD) or is_method(n, "add")) and len(n.args) == 2 and not n.kwargs:
        for mm, b in (n.args, n.args[::-1]):
            p = _matmul(mm)
            bv = val(b)
            if p is not None and bv is not None and bv.dim() == 1:
                p.bias, p.out, p.nodes = b, n, p.nodes + [n]
                return p
        return None
    final = None
    if _is_view(n) and is_fn(n.args[0], torch.addmm):
        final, n = n, n.args[0]
    if is_fn(n, torch.addmm) and len(n.args) == 3 and arg(n, 3, "beta", 1) == 1 and n.kwargs.get("alpha", 1) == 1:
        b, x2, w = n.args
        x_nodes = []
        if _is_view(x2) and val(x2) is not None and val(x2).dim() == 2:
            x_nodes, x2 = [x2], x2.args[0]
        nodes = [n] if final is None else [n, final]
        return Proj(final or n, x2, w, bias=b, transposed=True, nodes=nodes, x_nodes=x_nodes)
    return _matmul(n)


def is_projection(n) -> bool:
    return match_projection(n) is not None
