"""The op in Inductor's generated code: called directly, not through the dispatcher.

Inductor has no lowering for a custom op, so it runs it as a fallback kernel: the graph's generated Python calls
``torch.ops.mlp_fuser.gated_mlp.default(...)``, which goes down the dispatcher (C++, the arguments boxed) and back up
into the op's Python kernels. That round trip is host time on every call (benchmarks/NOTES.md, "Inductor's code calls
the op's Python entry"), and the decode step of a model compiled without CUDA graphs (the dynamic cache) waits on the
host. ``install()`` registers the same fallback Inductor would create (its layout constraint included) and renames the
call the Python wrapper emits to ``torch.ops.mlp_fuser._inductor_gated_mlp`` (``ops.inductor_gated_mlp``; for each op
in ``INDUCTOR_NAMES``: the dense MLPs, the routed experts, the quant_* ops): it computes the op right there when
nothing needs the dispatcher's layers (no gradient, autocast, dispatch or function mode, profiler), else calls the
registered op. The C++ wrapper (AOTInductor)
and the FX wrapper keep the registered op, and so does every graph compiled while ``config.inductor_direct`` is off.
Where Inductor's internals differ from what this expects, nothing is installed or renamed: the graph calls the
registered op as before. The backend installs it before Inductor compiles; the ops' fake kernels install it too when
Inductor is already imported, so a graph that reaches Inductor another way (``torch.compile`` of a patched model with
the default backend) gets the same call.
"""

from __future__ import annotations

import logging

import torch

from .. import compat, config

log = logging.getLogger("mlp_fuser")
_installed: dict[str, object] = {}  # op name -> the lowering ours wraps (Inductor's fallback)
INDUCTOR_NAMES = {"mlp": "_inductor_mlp", "gated_mlp": "_inductor_gated_mlp",  # op -> its torch.ops.mlp_fuser entry
                  "moe_mlp": "_inductor_moe_mlp", "quant_linear": "_inductor_quant_linear",
                  "quant_mlp": "_inductor_quant_mlp", "quant_gated_mlp": "_inductor_quant_gated_mlp",
                  "quant_moe_mlp": "_inductor_quant_moe_mlp"}


def install() -> bool:
    """Register the renaming fallback lowering for the ops (once per process); False where it cannot be (on
    ``compat``'s public path, or where Inductor's internals differ)."""
    if len(_installed) == len(INDUCTOR_NAMES):
        return True
    try:
        for op_name, direct in INDUCTOR_NAMES.items():
            op = getattr(torch.ops.mlp_fuser, op_name).default
            if op_name in _installed:
                continue
            inner = compat.inductor_lowering(op)
            if inner is None:
                return False

            def lower(*args, _inner=inner, _op=op, _direct=direct, _name=f"torch.ops.mlp_fuser.{direct}", **kwargs):
                out = _inner(*args, **kwargs)
                kernel = compat.fallback_kernel(out)
                if (config.inductor_direct and compat.PRIVATE and _direct in vars(torch.ops.mlp_fuser)
                        and kernel is not None and kernel.op_overload is _op and compat.python_wrapper()):
                    kernel.python_kernel_name = _name
                return out

            compat.set_inductor_lowering(op, lower, fallback=True)  # still a fallback, as far as Inductor checks
            _installed[op_name] = inner
    except Exception as e:  # another torch's internals: the registered op stays what Inductor calls
        log.debug("mlp_fuser: Inductor's direct call not installed: %s: %s", type(e).__name__, e)
        return False
    return True


def install_if_inductor() -> None:
    """``install()`` if Inductor is already imported (it will lower the graph being traced), else nothing: called
    while a graph with the op is traced, so that ``torch.compile``'s default backend (a patched model compiled with
    Inductor, say) gets the direct call too, and nothing imports Inductor for it."""
    if len(_installed) < len(INDUCTOR_NAMES) and compat.inductor_imported():
        install()


def uninstall() -> None:
    """Give Inductor back its own fallbacks for the ops (for tests)."""
    for op_name, inner in _installed.items():
        compat.set_inductor_lowering(getattr(torch.ops.mlp_fuser, op_name).default, inner, fallback=False)
    _installed.clear()
