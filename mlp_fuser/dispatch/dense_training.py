"""The dense op's training path below the op: the forward under autograd (the pre-activations kept for the backward
where the call saves them) and the backward, each the dispatcher's choices composed with aten's GEMMs. From an eager
entry on CUDA, each runs the launch plan kept for its signature (``SAVING_PLANS``, ``BACKWARD_PLANS``, beside the
forward's), else computes the call and records its launches into one (``runtime.plans``).

ops/dense.py's autograd.Function validates a call, then calls ``forward`` once, and its backward ``backward`` once;
the helper ops ``act_mul`` and ``mlp_backward`` are registered with the kernels below, so a call that a mode or a
tracer must see (``torch.ops``) lands here too, not back in ops.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from .. import compat, config
from ..activations import get_activation
from ..kernels import act_mul as act_mul_kernel
from ..reference import reference_mlp_backward
from ..runtime import plans
from . import dense as dispatch
from .dense import MLPArgs

# ---- the helper ops' kernels (every device): act_mul and mlp_backward ------------------------------------


def act_mul(g, u, activation):
    """``mlp_fuser::act_mul``: h = act(g) * u (act(g) without up), the Triton kernel where the Triton rows run."""
    if dispatch.triton_act_mul(g.device, g.dtype):
        return act_mul_kernel(g, u, activation)
    act = get_activation(activation)
    return act.fn(g) * u if u is not None else act.fn(g)


def mlp_backward(dy, w_down, g, u, activation, need_h):
    """``mlp_fuser::mlp_backward``: (dgu, h), by the implementation the dispatcher chooses for the shape."""
    M, I = g.shape
    args = (dy, w_down, g, u, activation, need_h)
    dgu, h = dispatch.resolve_backward(dy.device, dy.dtype, M, I, w_down.shape[0], u is not None, args).fn(*args)
    return dgu, h if h is not None else dy.new_empty(0)


# ---- the two halves of a training step, as the full path computes them -------------------------------------


def forward_saving(a: MLPArgs):
    """The forward as cuBLAS gate and up, one act·mul, cuBLAS down: (y, g, u), g and u (M, I) for the backward
    (``a``: a validated call, x as given)."""
    x = a.x
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    g = F.linear(x2, a.wg, a.bg)
    u = F.linear(x2, a.wu, a.bu) if a.wu is not None else None
    if compat.plain_call(g, (u,)):
        h = act_mul(g, u, a.activation)
    else:  # the op where a mode or a tracer must see it
        h = torch.ops.mlp_fuser.act_mul.default(g, u, a.activation)
    y = F.linear(h, a.wd, a.bd)
    return y.view(*x.shape[:-1], a.wd.shape[0]).detach(), g, u  # detach(): a tensor of its own, as run's


def backward_core(need, dy, a: MLPArgs, g=None, u=None):
    """Gradients of the seven tensors of ``a`` (those ``need`` asks for) from dy; g and u, the pre-activations,
    are recomputed from x when not given."""
    x, wg, bg, wu, bu, wd, bd, activation = a
    K, O, I = x.shape[-1], wd.shape[0], wg.shape[0]
    x2 = x.reshape(-1, K)
    dy2 = dy.reshape(-1, O)
    if g is None or torch.is_grad_enabled():  # create_graph=True: saved g, u are not connected to x's graph
        g = F.linear(x2, wg, bg)
        u = F.linear(x2, wu, bu) if wu is not None else None
    if torch.is_grad_enabled():  # create_graph=True: aten ops, which autograd differentiates again
        dgu, h = reference_mlp_backward(dy2, wd, g, u, activation, need[5])
    elif compat.plain_call(dy2, (wd, g, u)):
        dgu, h = mlp_backward(dy2, wd, g, u, activation, need[5])
    else:
        dgu, h = torch.ops.mlp_fuser.mlp_backward.default(dy2, wd, g, u, activation, need[5])
    del g, u  # recomputed ones are freed before the GEMMs below allocate
    dg, du = dgu[:, :I], (dgu[:, I:] if wu is not None else None)
    dwd = dy2.t().mm(h) if need[5] else None
    del h
    dbd = dy2.sum(0) if bd is not None and need[6] else None
    dx = None
    if need[0]:
        dx = dg.mm(wg) if du is None else torch.addmm(dg.mm(wg), du, wu)
        dx = dx.view(x.shape)
    dwg = dwu = dbg = dbu = None
    if du is not None and need[1] and need[3]:  # d(w_gate | w_up) in one GEMM over the packed gradient
        dwgu = dgu.t().mm(x2)
        dwg, dwu = dwgu[:I], dwgu[I:]
    else:
        dwg = dg.t().mm(x2) if need[1] else None
        dwu = du.t().mm(x2) if du is not None and need[3] else None
    if bg is not None and bu is not None and need[2] and need[4]:
        dbgu = dgu.sum(0)
        dbg, dbu = dbgu[:I], dbgu[I:]
    else:
        dbg = dg.sum(0) if bg is not None and need[2] else None
        dbu = du.sum(0) if du is not None and bu is not None and need[4] else None
    return dx, dwg, dbg, dwu, dbu, dwd, dbd


# ---- the entries from the op's autograd.Function: a signature's plan, else the full path (recording its plan) -----


def forward(a: MLPArgs, M: int, save: bool, planned: bool) -> tuple:
    """One validated forward under autograd (``a``: x as given, M its rows): (y, g, u, key), g and u the
    pre-activations where ``save`` keeps them (else None), key the signature the backward's plan builds on (None
    where plans do not apply). ``planned``: from an eager entry (plain tensors), where plans may apply."""
    key = dispatch.signature(a, "save" if save else True) if planned and dispatch.plans_apply(a.x) else None
    if not save:
        return dispatch.run(a, M, True, key), None, None, key
    if key is None:
        return (*forward_saving(a), None)
    plan = dispatch.SAVING_PLANS.get(key)
    if plan is not None and not compat.launch_hooks():
        return (*plan(*a[:7]), key)
    with plans.recording() as launches:
        y, g, u = forward_saving(a)
    x = a.x
    x2 = x.reshape(math.prod(x.shape[:-1]), x.shape[-1])
    dispatch.keep_plan(dispatch.SAVING_PLANS, key, plans.build_saving(x, dispatch.new_args((x2, *a[1:])), launches))
    return y, g, u, key


def backward(need: tuple, dy: Tensor, a: MLPArgs, g: Tensor | None, u: Tensor | None, key: tuple | None) -> tuple:
    """The seven gradients of a call's tensors (those ``need`` asks for; ``g``, ``u``: the saved pre-activations, or
    None); ``key``: the forward's signature (None: no plan), its plan used for a plain dy without create_graph."""
    if key is None or torch.is_grad_enabled() or not compat.plain_call(dy, ()):
        return backward_core(need, dy, a, g, u)
    # the backward's signature: the forward's, the gradients asked for, dy's metadata, the choice's setting
    bkey = (key, need, dy.shape, dy.stride(), dy.dtype, dy.device, dy.data_ptr() & 15, config.triton_backward)
    plan = dispatch.BACKWARD_PLANS.get(bkey)
    if plan is not None and not compat.launch_hooks():
        return plan(dy, *a[:7], g, u)
    with plans.recording() as launches:
        grads = backward_core(need, dy, a, g, u)
    dispatch.keep_plan(dispatch.BACKWARD_PLANS, bkey, plans.build_backward(need, dy, a, g, u, launches))
    return grads
