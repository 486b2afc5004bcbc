"""Merged gate/up (Phi-3): one Linear of ``2·I`` outputs, ``chunk(2, -1)`` or ``split(I, -1)``, then act(gate) * up.

Each half becomes a projection with a ``narrow`` view of the merged weight's rows, so nothing is copied.
"""

from __future__ import annotations

import dataclasses
import operator

import torch
from torch.fx import Node

from .common import Candidate, arg, is_fn, is_method, val
from .gated import match_gated
from .projections import Proj, match_projection


def _two_halves(split: Node) -> bool:
    """``split`` cuts its input's last dimension into two equal parts."""
    src = val(split.args[0])
    if src is None or not isinstance(src.shape[-1], int) or src.shape[-1] % 2:
        return False
    half_size = src.shape[-1] // 2
    if is_method(split, "chunk") or is_fn(split, torch.chunk):
        ok = arg(split, 1, "chunks") == 2
    elif is_method(split, "split") or is_fn(split, torch.split):
        size = arg(split, 1, "split_size", split.kwargs.get("split_size_or_sections"))
        ok = size == half_size or (isinstance(size, (list, tuple)) and list(size) == [half_size, half_size])
    else:
        return False
    return ok and arg(split, 2, "dim", 0) in (-1, src.dim() - 1)


def half(n) -> Proj | None:
    """``getitem(chunk(proj(x), 2, dim=-1), i)``: the projection onto rows i·I … (i+1)·I of the merged weight."""
    if not is_fn(n, operator.getitem) or not isinstance(n.args[0], Node) or not isinstance(n.args[1], int):
        return None
    split = n.args[0]
    if split.op not in ("call_function", "call_method") or not _two_halves(split):
        return None
    p = match_projection(split.args[0])
    if p is None:
        return None
    return dataclasses.replace(p, out=n, nodes=[*p.nodes, split, n], rows=(n.args[1], 2))


def match(down: Proj) -> Candidate | None:
    c = match_gated(down, half, "merged_gate_up")
    if c is None or c.gate.nodes[-2] is not c.up.nodes[-2]:  # both halves of the same split
        return None
    return c
