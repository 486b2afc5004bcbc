"""A patched module's call site of the dense op (``EagerSite``): a call that matches one it ran through a launch plan
runs that plan at once, without the entry's checks or the dispatcher's signature (benchmarks/NOTES.md, launch plans
and host time). ``patch`` calls every fused MLP through one."""

from __future__ import annotations

import torch

from .. import compat, config
from ..dispatch import dense as dispatch
from ..dispatch.dense import new_args as _args
from ..kernels.common import stored_as_one
from ..ops.dense import eager_gated_mlp

_plans_apply = dispatch.plans_apply  # a name of the site's own: the tests tell the site CPU calls are planned


class _Seen:
    """A call an ``EagerSite`` ran through a launch plan: what a later call must match to run that plan directly."""

    __slots__ = ("guards", "where", "nones", "pointers", "settings", "frozen", "one", "plan", "generation")


def _settings(dtype) -> tuple:
    """What else a call's signature holds (``dispatch.signature``): the settings that change the dispatcher's choice."""
    return (config.force_impl, config.autotune, config.plans, compat.PRIVATE,
            dtype is torch.float32 and torch.backends.cuda.matmul.allow_tf32)


class _Unplanned:
    """A call an ``EagerSite`` ran without a plan, under these settings: looked for again once they change."""

    __slots__ = ("settings", "generation")

    def __init__(self, settings: tuple, generation: int):
        self.settings, self.generation = settings, generation


def _gated_order(operands: tuple) -> tuple:
    """A plain MLP's (w1, b1, w2, b2) as the gated op's six operands (no up)."""
    return operands[0], operands[1], None, None, operands[2], operands[3]


class EagerSite:
    """One call site of an eager entry, such as a patched module's MLP: ``site(x, *operands)`` is
    ``entry(x, *operands)`` (``entry``: ``eager_mlp`` or ``eager_gated_mlp``). A call that matches one the site ran
    through a launch plan runs that plan at once: Dynamo's C++ tensor guards check every tensor's type, dtype, device,
    sizes, strides and requires_grad, their data pointers are the same, x's alignment too (in the key), no gradient is
    needed and nothing needs the dispatcher (``compat.plain_operands``' rules). That is what the entry's checks and
    the plan's signature establish, for a fifth of their host time (benchmarks/NOTES.md, launch plans and host time)."""

    MAX = 8  # calls kept per site, keyed by x's shape and alignment and the first weight's pointer (copies of a model)

    def __init__(self, entry):
        self.entry = entry
        self.gated = entry is eager_gated_mlp
        self.n = 6 if self.gated else 4  # the op's tensor operands after x
        self.seen: dict = {}

    def __call__(self, x, *args, **kwargs):
        if kwargs or not config.sites or torch.compiler.is_compiling():  # traced: the entry gives Dynamo the op
            return self.entry(x, *args, **kwargs)
        hit = self.seen.get((x.shape, x.data_ptr() & 15, args[0].data_ptr())) if type(x) is torch.Tensor else None
        if type(hit) is _Unplanned:  # the entry ran it without a plan (its implementation has none)
            if hit.generation == dispatch.generation and hit.settings == _settings(x.dtype):
                return self.entry(x, *args)
            hit = None  # another implementation may be chosen now: learn again
        if hit is not None:
            tensors = [args[i] for i in hit.where]
            if ((hit.frozen or not torch.is_grad_enabled()) and hit.generation == dispatch.generation
                    and hit.settings == _settings(x.dtype)  # first: PRIVATE, which the compat checks below need
                    and all(args[i] is None for i in hit.nones) and hit.guards.check(x, *tensors)
                    and hit.pointers == [t.data_ptr() for t in tensors]
                    and compat.nothing_intercepts() and not compat.launch_hooks()
                    and (not hit.one or tensors[0].untyped_storage().data_ptr()
                         == tensors[hit.one].untyped_storage().data_ptr())):
                return hit.plan(x, *(args[:6] if self.gated else _gated_order(args)))
        y = self.entry(x, *args)
        self._learn(x, args)
        return y

    def _learn(self, x, args) -> None:
        """Keep the call's plan for later matching calls, where it ran through one."""
        n = self.n
        operands = args[:n]
        if (type(x) is not torch.Tensor or not _plans_apply(x)
                or (torch.is_grad_enabled() and compat.any_requires_grad(x, *operands))
                or not compat.plain_operands(x, operands) or compat.launch_hooks()):
            return
        a = _args((x, *(operands if self.gated else _gated_order(operands)), args[n]))
        plan = dispatch.PLANS.get(dispatch.signature(a, True))  # what the entry's call ran
        where = tuple(i for i, t in enumerate(operands) if t is not None)
        tensors = [operands[i] for i in where]
        guards = compat.tensor_guards([x, *tensors]) if plan is not None else None
        if len(self.seen) >= self.MAX:
            self.seen.clear()
        key = (x.shape, x.data_ptr() & 15, args[0].data_ptr())
        if guards is None:  # no plan after the entry's call: its implementation has none (or the public path)
            self.seen[key] = _Unplanned(_settings(x.dtype), dispatch.generation)
            return
        seen = _Seen()
        seen.guards, seen.where, seen.plan, seen.generation = guards, where, plan, dispatch.generation
        seen.nones = tuple(i for i in range(n) if operands[i] is None)
        seen.pointers = [t.data_ptr() for t in tensors]
        seen.settings = _settings(x.dtype)
        seen.frozen = not compat.any_requires_grad(x, *tensors)
        # gate and up read as one weight by the plan: they must still share a storage (pointers alone do not say)
        one = self.gated and stored_as_one(a.wg, a.wu, a.wg.data_ptr(), a.wu.data_ptr())
        seen.one = where.index(2) if one else 0
        self.seen[key] = seen
