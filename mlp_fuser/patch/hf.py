"""transformers' experts switch: ``experts_forward`` registered as the experts implementation ``"mlp_fuser"`` in
``ExpertsInterface`` (and ``FP8ExpertsInterface``), at once where transformers has loaded them, else when it does;
which experts modules the switch reaches (``follows_switch``), and selecting it in a config (``select``: ``patch``)."""

from __future__ import annotations

import functools
import importlib.abc
import importlib.machinery
import sys

from torch import nn

from .experts import NAME, experts_forward


def register() -> bool:
    """Register ``experts_forward`` as transformers' experts implementation ``"mlp_fuser"`` (in ``ExpertsInterface``
    and, for FP8 experts, ``FP8ExpertsInterface``); False without transformers."""
    try:
        from transformers.integrations.moe import ExpertsInterface
    except Exception:
        return False
    ExpertsInterface.register(NAME, experts_forward)
    try:
        from transformers.integrations.finegrained_fp8 import FP8ExpertsInterface
    except Exception:  # a transformers without FP8 experts
        return True
    FP8ExpertsInterface.register(NAME, experts_forward)
    return True


@functools.cache
def _switch_code():
    """The code of the forward ``@use_experts_implementation`` gives a class (it reads the config's experts
    implementation on every call), or None without transformers."""
    try:
        from transformers.integrations.moe import use_experts_implementation
    except Exception:
        return None

    class Probe(nn.Module):
        def forward(self):
            pass

    return use_experts_implementation(Probe).forward.__code__


def follows_switch(module: nn.Module) -> bool:
    """Whether ``module``'s class forward picks its implementation from ``module.config`` through an experts interface
    that holds ``"mlp_fuser"`` (transformers' experts classes, ``FP8Experts`` too), so the config selects it."""
    forward = type(module).forward
    code = getattr(forward, "__code__", None)
    if code is None or code is not _switch_code() or "experts_interface" not in code.co_freevars:
        return False
    interface = forward.__closure__[code.co_freevars.index("experts_interface")].cell_contents
    return NAME in interface and hasattr(getattr(module, "config", None), "_experts_implementation")


def select(config, implementation: str | None) -> None:
    """Set ``config``'s experts implementation alone (not its sub-configs'), as ``set_experts_implementation`` does."""
    if hasattr(config, "_experts_implementation_internal"):
        config._experts_implementation_internal = implementation
    else:
        config._experts_implementation = implementation


_MODULE = "transformers.integrations.moe"
_INTERFACES = {_MODULE: "ExpertsInterface", "transformers.integrations.finegrained_fp8": "FP8ExpertsInterface"}


class _RegisterOnImport(importlib.abc.MetaPathFinder):
    """Registers the experts implementation right after each of transformers' experts integrations (``_INTERFACES``)
    is first imported, so that importing mlp_fuser costs no transformers import and
    ``experts_implementation="mlp_fuser"`` works either way."""

    def find_spec(self, fullname, path, target=None):
        if fullname not in _INTERFACES:
            return None
        for finder in sys.meta_path:
            if finder is self:
                continue
            found = finder.find_spec(fullname, path, target) if hasattr(finder, "find_spec") else None
            if found is not None and found.loader is not None and hasattr(found.loader, "exec_module"):
                loader = found.loader
                run = loader.exec_module

                def exec_module(mod, _run=run, _name=fullname):
                    _run(mod)
                    getattr(mod, _INTERFACES[_name]).register(NAME, experts_forward)
                    if all(m in sys.modules for m in _INTERFACES):
                        sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, _RegisterOnImport)]

                loader.exec_module = exec_module
                return found
        return None


def install() -> None:
    """Register now in the experts interfaces transformers has loaded, else as soon as it loads them."""
    for module, interface in _INTERFACES.items():
        if module in sys.modules:
            getattr(sys.modules[module], interface).register(NAME, experts_forward)
    if not all(m in sys.modules for m in _INTERFACES) and not any(isinstance(f, _RegisterOnImport)
                                                                  for f in sys.meta_path):
        sys.meta_path.insert(0, _RegisterOnImport())
