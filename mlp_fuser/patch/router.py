"""``patch`` for MoE routers: a top-k router module's forward with its softmax → top-k → renorm as one op.

A module qualifies when it holds one 2-D ``weight`` (and at most a 1-D ``bias``), has no children, and its forward,
captured on its own in eval mode without gradients, is a graph over its input and those tensors whose top-k chain
``patterns/router_topk.py`` rewrites to ``mlp_fuser::moe_router_topk`` (transformers' ``Qwen3MoeTopKRouter`` and the
routers that copy it). The installed forward runs that graph for a tensor input in eval mode with no gradient
needed, and the module's own forward otherwise (training: the op has no backward, and some routers add noise).
Modules alike (type, weight shape, dtype, device, their attributes: ``modules._signature``) share one proof, in a model
and across models.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn

from ..graph._dynamo_utils import fresh_code
from ..patterns import router_topk
from .modules import SWAPPED, _plain, _signature, is_swapped, swapped_class, swapped_forward

_PLAIN_ATTRS = (bool, int, float, str, type(None))


def router_forward(graph, names) -> Callable:
    """The forward ``patch`` gives a top-k router module (``swapped_class``): the proof's graph (a plain function)
    on the module's input and tensors (``names[i]``: the placeholder's tensor, None: x), read through the module on
    every call; the module's own forward for anything else. One function per proof, shared by the routers alike."""
    names = tuple(names)

    def forward(self, *args, **kwargs):
        params = self._parameters
        if (len(args) != 1 or kwargs or type(args[0]) is not Tensor or self.training
                or (torch.is_grad_enabled() and (args[0].requires_grad or params["weight"].requires_grad))):
            return getattr(type(self), SWAPPED).forward(self, *args, **kwargs)
        x = args[0]
        return graph(*[x if n is None else params[n] for n in names])

    forward.router = True
    return forward


def is_fused_router(module: nn.Module) -> bool:
    """Whether ``patch`` gave ``module`` a router's fused forward."""
    return getattr(swapped_forward(module), "router", False) is True


def _key(module: nn.Module) -> tuple | None:
    w = module._parameters.get("weight")
    if (not isinstance(w, Tensor) or type(w) not in (Tensor, nn.Parameter) or w.dim() != 2 or module._modules
            or not w.is_floating_point() or w.is_meta or "forward" in module.__dict__ or is_swapped(module)):
        return None
    b = module._parameters.get("bias")
    if set(module._parameters) - {"weight", "bias"} or module._buffers or (b is not None and b.dim() != 1):
        return None
    attrs = tuple(sorted((k, v) for k, v in vars(module).items() if not k.startswith("_") and type(v) in _PLAIN_ATTRS))
    return type(module), tuple(w.shape), w.dtype, w.device, b is not None, attrs


def _prove(module: nn.Module):
    """(graph forward, placeholder names) where the module's forward is a top-k router, else None."""
    w = module.weight
    x = torch.randn(3, w.shape[1], dtype=w.dtype, device=w.device)
    captured = []

    def capture(gm, example_inputs):
        captured.append((gm, list(example_inputs)))
        return gm.forward

    training = module.training
    try:
        module.eval()
        with torch.no_grad():
            torch.compile(fresh_code(type(module).forward), backend=capture, fullgraph=True)(module, x)
    except Exception:
        return None
    finally:
        module.train(training)
    found = captured[:]
    captured.clear()  # Dynamo may keep the backend: no weight is kept through it
    if len(found) != 1:
        return None
    gm, inputs = found[0]
    chains = [c for c in router_topk.find(gm.graph) if not c.needs_grad]
    if len(chains) != 1 or any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return None
    params = {id(t): n for n, t in module._parameters.items() if t is not None}
    names = [None if t is x else params.get(id(t), False) for t in inputs]
    if False in names or names.count(None) != 1:
        return None  # a placeholder that is neither the input nor the module's own tensor
    router_topk.rewrite(gm.graph, chains[0])
    gm.graph.eliminate_dead_code()
    gm.recompile()
    # the rewritten graph against the forward at another token count: a size baked into the graph, or an output
    # structure other than a flat tuple of tensors, rules it out
    x5 = torch.randn(5, w.shape[1], dtype=w.dtype, device=w.device)
    try:
        with torch.no_grad():
            ours = gm.forward(*[x5 if n is None else module._parameters[n] for n in names])
            ref = type(module).forward(module, x5)
    except Exception:
        return None
    if (type(ref) is not tuple or len(ref) != len(ours) or not all(isinstance(r, Tensor) for r in ref)
            or any((a.shape, a.dtype) != (b.shape, b.dtype) for a, b in zip(ours, ref))):
        return None
    return _plain(gm), names


_PROOFS: dict = {}  # (_key, _signature) -> proof or None: a few entries per process (most of them: not a router)
_MAX_PROOFS = 256


def fuse_router(module: nn.Module, memo: dict) -> type | None:
    """The class ``patch`` gives a top-k router module (its forward fused), else None; proofs are shared among modules
    alike (``memo`` for those ``_signature`` cannot key)."""
    key = _key(module)
    if key is None:
        return None
    signature = _signature(module, {})
    if signature is not None:
        key, memo = (key, signature), _PROOFS
        if key not in memo and len(memo) >= _MAX_PROOFS:
            memo.clear()
    if key not in memo:
        proof = _prove(module)
        memo[key] = None if proof is None else router_forward(*proof)
    forward = memo[key]
    return None if forward is None else swapped_class(type(module), forward)
