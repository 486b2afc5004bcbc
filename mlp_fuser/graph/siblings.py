"""FP8 linears that read one input and whose weights lie side by side in one buffer (q, k and v, which ``patch``
packs together: ``patch/packed.py``) become one ``quant_linear``: x quantized once, one GEMM, its columns sliced
back out. At decode sizes each linear is a launch or two of a few µs; at prefill sizes x is quantized once, not
three times (benchmarks/NOTES.md, "q, k and v as one FP8 GEMM").

The pass reads what the lone FP8 linears' compiled forward (``patch/fp8.py``) put in the graph:
``quant_linear(x, w, s, b, fmt, block)`` with w and s views of one buffer input (``buf[a:b].view(shape)``, the
scales with a dtype view between). It merges a run of such calls on the same x, buffer, format and block (biases on
all or none: theirs concatenated) whose weights and scales are adjacent, every weight but the last in whole scale
blocks, and whose outputs' ``view`` users hold on a column slice (checked on a meta tensor; symbolic sizes, as in a
graph with dynamic shapes, are not checked and stay apart). Anything else is left as it is.
"""

from __future__ import annotations

import operator
from typing import NamedTuple

import torch
from torch.fx import GraphModule, Node


class _Read(NamedTuple):
    """A ``quant_linear`` node whose weight and scales are views of one buffer input."""

    node: Node
    buf: Node
    w: tuple[int, int, tuple]  # byte offsets [start, end), shape (N, K)
    s: tuple[int, int, tuple]
    s_dtype: torch.dtype | None  # None: the scales are the buffer's own dtype
    chain: tuple[Node, ...]  # the view nodes read (erased once unused)


def _view_of(n, buf_dtype_view: bool):
    """(buffer node, start, end, shape, dtype or None, nodes) where ``n`` is ``buf[start:end]`` viewed as
    ``shape`` (through one dtype view where ``buf_dtype_view``), else None."""
    if not (isinstance(n, Node) and n.op == "call_method" and n.target == "view" and len(n.args) >= 2):
        return None
    shape = n.args[1] if len(n.args) == 2 and isinstance(n.args[1], (tuple, list)) else n.args[1:]
    if not all(isinstance(d, int) for d in shape):
        return None
    nodes, src, dtype = [n], n.args[0], None
    if buf_dtype_view:
        if not (isinstance(src, Node) and src.op == "call_method" and src.target == "view" and len(src.args) == 2
                and isinstance(src.args[1], torch.dtype)):
            return None
        nodes.append(src)
        src, dtype = src.args[0], src.args[1]
    if not (isinstance(src, Node) and src.op == "call_function" and src.target is operator.getitem
            and isinstance(src.args[1], slice) and src.args[1].step is None
            and isinstance(src.args[1].start, int) and isinstance(src.args[1].stop, int)):
        return None
    buf = src.args[0]
    if not (isinstance(buf, Node) and buf.op == "placeholder"):
        return None
    return buf, src.args[1].start, src.args[1].stop, tuple(shape), dtype, (*nodes, src)


def _read(n: Node) -> _Read | None:
    if len(n.args) < 6 or n.kwargs or not (n.args[3] is None or isinstance(n.args[3], Node)):
        return None
    w = _view_of(n.args[1], False)
    s = _view_of(n.args[2], True) or _view_of(n.args[2], False)
    if w is None or s is None or w[0] is not s[0] or len(w[3]) != 2 or len(s[3]) != 2:
        return None
    return _Read(n, w[0], (w[1], w[2], w[3]), (s[1], s[2], s[3]), s[4], w[5] + s[5])


def _mergeable(a: _Read, b: _Read, block) -> bool:
    """Whether ``b`` continues ``a``: weights and scales adjacent, one K, ``a`` in whole scale blocks of rows."""
    (_, aw1, (an, ak)), (bw0, _, (_, bk)) = a.w, b.w
    (_, as1, (ar, ac)), (bs0, _, (_, bc)) = a.s, b.s
    return (aw1 == bw0 and as1 == bs0 and ak == bk and ac == bc and a.s_dtype == b.s_dtype
            and an % block[0] == 0 and ar == an // block[0])


def _views_hold(r: _Read, n_total: int) -> bool:
    """Whether every ``view`` of ``r``'s output still holds where the output is its columns of an (..., n_total)
    product (a column slice: strides of the wider rows); a view that cannot be checked counts as failing."""
    value = r.node.meta.get("example_value")
    if not isinstance(value, torch.Tensor) or value.dim() < 1:
        return False
    shape = tuple(value.shape)
    strides, acc = [], 1
    for d in reversed((*shape[:-1], n_total)):
        strides.append(acc)
        acc *= d
    try:
        cols = torch.empty_strided(shape, tuple(reversed(strides)), device="meta", dtype=value.dtype)
    except Exception:  # a symbolic size: left unmerged
        return False
    for user in r.node.users:
        if user.target in ("view", torch.Tensor.view) and user.args and user.args[0] is r.node:
            dims = user.args[1] if len(user.args) == 2 and isinstance(user.args[1], (tuple, list)) else user.args[1:]
            if user.kwargs or not all(isinstance(d, int) for d in dims):
                return False
            try:
                cols.view(*dims)
            except RuntimeError:
                return False
    return True


def _biases_before(run: list[_Read], order: dict) -> bool:
    """Whether each bias of the run exists before its first call (where the merged call goes)."""
    first = min(order[r.node] for r in run)
    return all(not isinstance(b := r.node.args[3], Node) or order.get(b, first) < first for r in run)


def merge(gm: GraphModule) -> int:
    """Merge each run of sibling FP8 linears in ``gm``; the number of linears now computed in a merged one."""
    op = torch.ops.mlp_fuser.quant_linear.default
    groups: dict[tuple, list[_Read]] = {}
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for n in gm.graph.nodes:
        if n.op == "call_function" and n.target is op:
            block = n.args[5]
            r = _read(n)
            if r is not None and isinstance(block, (list, tuple)) and len(block) == 2:
                key = (n.args[0], r.buf, n.args[4], tuple(block), n.args[3] is None)  # all biased or none
                groups.setdefault(key, []).append(r)
    merged = 0
    for (x, buf, fmt, block, _), reads in groups.items():
        reads.sort(key=lambda r: r.w[0])
        run: list[_Read] = []
        for r in [*reads, None]:
            if r is not None and run and _mergeable(run[-1], r, block):
                run.append(r)
                continue
            if (len(run) > 1 and all(_views_hold(r, sum(q.w[2][0] for q in run)) for r in run)
                    and _biases_before(run, order)):
                _rewrite(gm, run, x, buf, fmt, block, order)
                merged += len(run)
            run = [r] if r is not None else []
    if merged:
        gm.graph.lint()
        gm.recompile()
    return merged


def _rewrite(gm: GraphModule, run: list[_Read], x: Node, buf: Node, fmt, block, order) -> None:
    g = gm.graph
    first = min((r.node for r in run), key=order.__getitem__)
    n_total = sum(r.w[2][0] for r in run)
    k, cols = run[0].w[2][1], run[0].s[2][1]
    with g.inserting_before(first):
        w = g.call_method("view", (g.call_function(operator.getitem, (buf, slice(run[0].w[0], run[-1].w[1]))),
                                   (n_total, k)))
        s = g.call_function(operator.getitem, (buf, slice(run[0].s[0], run[-1].s[1])))
        if run[0].s_dtype is not None:
            s = g.call_method("view", (s, run[0].s_dtype))
        s = g.call_method("view", (s, (sum(r.s[2][0] for r in run), cols)))
        biases = [r.node.args[3] for r in run]
        b = None if biases[0] is None else g.call_function(torch.cat, (biases,))  # a few kB: one small copy
        y = g.call_function(torch.ops.mlp_fuser.quant_linear.default, (x, w, s, b, fmt, list(block)))
        start = 0
        for r in run:
            n = r.w[2][0]
            part = g.call_method("narrow", (y, -1, start, n))
            start += n
            for key in ("nn_module_stack", "stack_trace"):
                if key in r.node.meta:
                    part.meta[key] = r.node.meta[key]
            r.node.replace_all_uses_with(part)
    for r in run:
        g.erase_node(r.node)
        for v in r.chain:
            if not v.users:
                g.erase_node(v)
