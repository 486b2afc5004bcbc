"""Eager-mode fusion: ``patch(model)`` runs the model's forward through Dynamo with the fusing pass and no Inductor.

Working from the captured graph (not from class names) is what finds MLPs split across modules (BERT's
``BertIntermediate.dense → GELU`` then ``BertOutput.dense``) and sees HF's control flow resolved. The rewritten
graph runs op by op, like eager mode. Nothing in the module tree changes: ``state_dict()`` keys and tensors stay
the same, so save/load, ``.to()``, ``.half()`` and ``generate()`` keep working; Dynamo's guards re-capture the
graph when dtype, device, shapes or train/eval change, and each capture is checked afresh (dropout included).
"""

from __future__ import annotations

import functools
import types
from collections.abc import Callable

import torch
from torch import nn

from ._dynamo_utils import fresh_code
from .backend import make_backend

_ORIG = "_mlp_fuser_original_forward"  # the forward before patching (None: the class's own)
_FUSED = "_mlp_fuser_fused"  # set on the forward that patch installs
_MISSING = object()


def is_patched(model: nn.Module) -> bool:
    """Whether ``model.forward`` is the fused forward ``patch`` installed. A patched model that went through
    pickling (``torch.save`` / ``torch.load``) comes back unpatched: its fused forward is a compiled function,
    not state, and pickle restores the plain bound method in its place."""
    forward = model.__dict__.get("forward")
    return _ORIG in model.__dict__ and getattr(getattr(forward, "__func__", forward), _FUSED, False)


def original_forward(model: nn.Module):
    """The forward as it was before ``patch``."""
    orig = model.__dict__.get(_ORIG, _MISSING)
    if orig is _MISSING or orig is None:
        return type(model).forward.__get__(model)
    return orig


def patch(model: nn.Module, filter_fn: Callable[[str, nn.Module | None], bool] | None = None, **options) -> nn.Module:
    """Fuse ``model``'s MLP blocks in place (eager mode); return ``model``. Idempotent; undone by ``unpatch``.

    ``filter_fn(path, module) -> bool`` picks the sites to fuse; ``path`` is the site's module path (the common
    ancestor of its projections, e.g. ``model.layers.0.mlp``). ``options`` go to ``make_backend``
    (``activations=``, ``patterns=``).
    """
    if is_patched(model):
        return model
    if _ORIG in model.__dict__:  # unpickled from a patched model: drop the stale entries, then patch afresh
        _restore(model)
    orig = model.__dict__.get("forward")  # an instance-level forward (e.g. from a wrapper) to restore later

    def path_filter(path: str) -> bool:
        try:
            module = model.get_submodule(path)
        except AttributeError:
            module = None
        return filter_fn(path, module)

    be = make_backend(inductor=False, filter_fn=path_filter if filter_fn else None, **options)
    if orig is None:
        # Compile the class's forward and bind it to the model: a deepcopy then rebinds it to the copy.
        cls_forward = type(model).forward
        compiled = torch.compile(fresh_code(cls_forward), backend=be)

        @functools.wraps(cls_forward)
        def fused_forward(self, *args, **kwargs):
            return compiled(self, *args, **kwargs)

        setattr(fused_forward, _FUSED, True)
        model.forward = types.MethodType(fused_forward, model)
    else:
        compiled_orig = torch.compile(fresh_code(orig), backend=be)

        @functools.wraps(orig)
        def fused_instance_forward(*args, **kwargs):
            return compiled_orig(*args, **kwargs)

        setattr(fused_instance_forward, _FUSED, True)
        model.forward = fused_instance_forward
    model.__dict__[_ORIG] = orig
    return model


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the forward ``patch`` replaced; return ``model``."""
    if _ORIG in model.__dict__:  # patched, or unpickled from a patched model
        _restore(model)
    return model


def _restore(model: nn.Module) -> None:
    orig = model.__dict__.pop(_ORIG)
    if orig is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = orig
