"""Tensor-parallel MLPs: the DTensor chain Dynamo records, lowered to the local computation the graph pass fuses.

Under ``parallelize_module`` (ColwiseParallel on gate/up, RowwiseParallel on down) and transformers' tensor
parallelism with grad on, the graph holds, per projection, ``from_local(x, mesh, placements)`` → ``linear`` on a
DTensor weight → ``redistribute`` → ``to_local``. Each rank holds gate/up rows and down columns of the same
intermediate slice, so the MLP is the plain MLP on the local shards followed by the plan's reduction. Where the
placements are that plan (gate/up weights ``Shard(0)`` reading a ``Replicate`` input, down ``Shard(1)`` reading the
intermediate ``Shard(-1)``, one 1-D mesh, no bias on down), the chain is rewritten to:

    x_local = from_local(x, mesh, (Replicate(),)).to_local(grad_placements=(Partial(),))
    h = act(linear(x_local, w_gate.to_local())) * linear(x_local, w_up.to_local())
    y = from_local(linear(h, w_down.to_local()), mesh, (Partial(),)).redistribute(<the plan's>).to_local()

which is what DTensor computes, collectives included (the output's all-reduce or reduce-scatter is the graph's own
``redistribute``; the input gradient's all-reduce is the ``Partial`` grad placement), and the graph pass then fuses
the local MLP as any other. Any other placements leave the chain as it is, reported as a near miss naming them.
"""

from __future__ import annotations

from copy import deepcopy

import torch
from torch.fx import GraphModule, Node

from .. import compat
from ..patterns.common import arg, is_fn, is_method, module_path, val

try:
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
except ImportError:  # torch built without distributed
    DTensor = DeviceMesh = None
FROM_LOCAL = compat.dtensor_from_local()

_WALK = 64  # nodes walked back from down's input to find the gate/up projections (an MLP's body is a few)


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def holds_dtensors(module) -> bool:
    return DTensor is not None and any(isinstance(p, DTensor) for p in module.parameters())


def describe(t) -> str:
    """``DTensor(Shard(dim=0),)``-style text for a near miss; the type's name for any other subclass."""
    if is_dtensor(t):
        return f"a DTensor with placements {tuple(t.placements)} on a {t.device_mesh.ndim}-D mesh"
    return f"a {type(t).__name__}, a tensor subclass"


def _placements(n: Node):
    p = arg(n, 2, "placements")
    return tuple(p) if isinstance(p, (tuple, list)) else None


def _shard_last(p, ndim: int) -> bool:
    return isinstance(p, Shard) and p.dim in (-1, ndim - 1)


def _dtensor_linear(n) -> bool:
    return is_fn(n, torch.nn.functional.linear) and is_dtensor(val(arg(n, 1, "weight")))


def _colwise(to_local: Node):
    """For ``to_local(redistribute(linear(from_local(x), W)))`` the (linear, from_local) nodes, else None."""
    red = to_local.args[0] if to_local.args else None
    lin = red.args[0] if is_method(red, "redistribute") and red.args else red
    return (lin, arg(lin, 0, "input")) if _dtensor_linear(lin) else None


def _target(red: Node):
    p = arg(red, 1, "placements")
    return tuple(p) if isinstance(p, (tuple, list)) else None


def _colwise_reason(lin: Node, src: Node, red: Node | None, mesh_node: Node) -> str | None:
    w, b = val(arg(lin, 1, "weight")), val(arg(lin, 2, "bias"))
    if is_method(src, "redistribute") and src.args and is_fn(src.args[0], *FROM_LOCAL):
        return (f"{lin.name} reads its input redistributed from {_placements(src.args[0])} to {_target(src)} "
                f"(sequence parallel's all-gather), expected a (Replicate(),) input")
    if not is_fn(src, *FROM_LOCAL):
        return f"{lin.name} reads {src.name}, not a from_local of a local tensor"
    if w.device_mesh.ndim != 1 or arg(src, 1, "device_mesh") is not mesh_node:
        return f"{lin.name}'s weight is on another mesh than down's, or the mesh is not 1-D"
    if tuple(w.placements) != (Shard(0),):
        return f"{lin.name}'s weight is {describe(w)}, expected Shard(0) (ColwiseParallel)"
    if b is not None and (not is_dtensor(b) or tuple(b.placements) != (Shard(0),)):
        return f"{lin.name}'s bias is {describe(b)}, expected Shard(0)"
    if _placements(src) != (Replicate(),):
        return f"{lin.name} reads its input with placements {_placements(src)}, expected (Replicate(),)"
    if len(lin.users) != 1 or (red is not None and (len(red.users) != 1 or _target(red) is None
                                                    or not all(_shard_last(p, val(lin).dim()) for p in _target(red)))):
        return f"{lin.name}'s output is read elsewhere, or redistributed to another placement than Shard(-1)"
    return None


def _copy_meta(new: Node, old: Node, value) -> Node:
    for key in ("nn_module_stack", "stack_trace"):
        if key in old.meta:
            new.meta[key] = old.meta[key]
    if value is not None:
        new.meta["example_value"] = value
    return new


def _to_local(g, n: Node, cache: dict) -> Node | None:
    """``n.to_local()`` (a weight or bias), one node per tensor."""
    if n is None:
        return None
    if n not in cache:
        with g.inserting_after(n):
            cache[n] = _copy_meta(g.call_method("to_local", (n,)), n, compat.local_tensor(val(n)))
    return cache[n]


def _upstream_to_locals(h: Node) -> list[Node] | None:
    """The ``to_local`` nodes the local intermediate ``h`` is computed from (walking back over plain-tensor nodes),
    or None when it reads anything else that is computed (a DTensor, another input)."""
    found, seen, todo = [], set(), [h]
    while todo:
        n = todo.pop()
        if n in seen:
            continue
        seen.add(n)
        if len(seen) > _WALK:
            return None
        if is_method(n, "to_local"):
            found.append(n)
            continue
        if n.op in ("placeholder", "get_attr") or is_dtensor(val(n)):
            if n.op == "placeholder" and val(n) is not None and val(n).dim() <= 1:
                continue  # a scalar or 1-D parameter of the activation
            return None
        todo.extend(a for a in n.all_input_nodes)
    return found


def lower(gm: GraphModule, copy: bool = False) -> tuple[GraphModule, list[tuple[str, str, str, str]]]:
    """Rewrite every colwise → rowwise MLP chain of ``gm`` (of a copy, with ``copy``: a dry run) to its local
    computation; return the graph and the chains with other placements as (path, pattern, check, reason) near
    misses. A graph without DTensors is returned as it is."""
    if DTensor is None or not any(is_dtensor(val(n)) for n in gm.graph.nodes if n.op == "placeholder"):
        return gm, []
    if copy:
        gm = GraphModule(gm, deepcopy(gm.graph))

    g = gm.graph
    misses, dead, weights = [], [], {}
    order = {n: i for i, n in enumerate(g.nodes)}
    for down in [n for n in g.nodes if _dtensor_linear(n)]:
        src, hops = arg(down, 0, "input"), []
        while is_method(src, "redistribute") and src.args:
            hops.append(src)
            src = src.args[0]
        if not is_fn(src, *FROM_LOCAL) or is_dtensor(val(src.args[0])):
            continue
        tls = sorted(_upstream_to_locals(src.args[0]) or (), key=order.__getitem__)
        cols = [_colwise(t) for t in tls or ()]
        if not tls or len(tls) > 2 or any(c is None for c in cols):
            continue  # not the end of an MLP: its gate/up projections are not DTensor linears
        path = module_path(down).rsplit(".", 1)[0]
        pattern = "gated" if len(cols) == 2 else "plain"
        wd, bd = val(arg(down, 1, "weight")), arg(down, 2, "bias")
        reason = None
        if wd.device_mesh.ndim != 1 or tuple(wd.placements) != (Shard(1),):
            reason = f"{down.name}'s weight is {describe(wd)}, expected Shard(1) (RowwiseParallel)"
        elif bd is not None:
            reason = f"{down.name} has a bias, {describe(val(bd))}: it is added once, after the reduction"
        elif (_placements(src) is None or len(_placements(src)) != 1 or not _shard_last(_placements(src)[0],
                                                                                        val(src).dim())
              or any(_target(h) != _placements(src) or len(h.users) != 1 for h in hops) or len(src.users) != 1):
            to = f", redistributed to {_target(hops[-1])}" if hops else ""
            reason = f"{down.name} reads its input with placements {_placements(src)}{to}, expected (Shard(-1),)"
        else:
            for t, (lin, s) in zip(tls, cols):
                red = t.args[0] if t.args[0] is not lin else None
                reason = reason or _colwise_reason(lin, s, red, arg(src, 1, "device_mesh"))
            if reason is None and len(cols) == 2 and cols[0][1].args[0] is not cols[1][1].args[0]:
                reason = "gate and up read different tensors"
            if reason is None and any(t.kwargs or len(t.args) > 1 for t in tls):
                reason = "a to_local names grad placements"
        if reason:
            misses.append((path, pattern, "plain_tensors", reason))
            continue
        x, x_local = cols[0][1].args[0], None
        for t, (lin, s) in zip(tls, cols):
            dead += [t, t.args[0], lin, s]
            if x_local is None:
                with g.inserting_after(s):
                    x_local = g.call_method("to_local", (s,), {"grad_placements": (Partial(),)})
                    _copy_meta(x_local, s, val(x))
            with g.inserting_before(t):
                w, b = (_to_local(g, arg(lin, i, k), weights) for i, k in ((1, "weight"), (2, "bias")))
                new = g.call_function(torch.nn.functional.linear, (x_local, w, b))
            t.replace_all_uses_with(_copy_meta(new, lin, val(t)))
        with g.inserting_before(down):
            wl = _to_local(g, arg(down, 1, "weight"), weights)
            y = _copy_meta(g.call_function(torch.nn.functional.linear, (src.args[0], wl, None)), down,
                           compat.local_tensor(val(down)))
            mesh_node = arg(src, 1, "device_mesh")
            out = g.call_function(FROM_LOCAL[-1], (y, mesh_node, (Partial(),)), {"run_check": False})
            _copy_meta(out, down, val(down))
        down.replace_all_uses_with(out)
        dead += [down, src, *hops]  # a redistribute to the placement it has (transformers' hook) goes too
    if dead:
        for n in sorted(set(dead), key=order.__getitem__, reverse=True):
            if not n.users:  # a from_local that x_local reads stays
                g.erase_node(n)
        g.lint()
        gm.recompile()
    return gm, misses


def placeholder_getter(value):
    """For ``patch``'s proof: a getter of a graph input that is no tensor of the module's, when it is the device
    mesh the sharded projections read (the same object on every call), else None."""
    if DeviceMesh is not None and isinstance(value, DeviceMesh):
        return lambda module: value
    return None
