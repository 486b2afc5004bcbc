"""The torch.compile backend: fuse the MLPs of the graph Dynamo captured, then hand it to Inductor.

The rewrite runs before AOTAutograd, so training works through the op's own autograd, and Inductor
(``compile_fx``) still does everything else. ``torch.compile(model, backend=mlp_fuser.backend)``, or
``backend="mlp_fuser"`` once the package is imported. ``mode=`` and ``options=`` mean what they mean for
``backend="inductor"``: torch.compile hands them to the backend, which hands them to Inductor through the very
wrapper ``backend="inductor"`` uses (``reduce-overhead`` and ``max-autotune`` turn on Inductor's CUDA-graph
trees), and ``torch._dynamo.reset()`` resets what they created. Where the mode runs without CUDA graphs, the
fused ops in the graph take the dispatcher's choice for eager calls (``without_graphs``), as ``patch`` does: each
launch then costs host time, which that choice weighs. Inductor's generated code calls the op's Python entry
directly, not through the dispatcher (``mlp_fuser.runtime.inductor``).
"""

from __future__ import annotations

import inspect
import itertools
import logging
from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from .. import compat, config
from .. import patterns as registry
from ..activations import get_activation
from ..ops import dense as ops
from ..runtime.inductor import install as install_direct_calls
from . import fx_pass, siblings

log = logging.getLogger("mlp_fuser")
_graph_ids = itertools.count()


def inductor_compiler(mode: str | None = None, options: dict[str, Any] | None = None):
    """What ``torch.compile(backend="inductor", mode=mode, options=options)`` compiles a graph with: the config
    patches of the mode and the options, checked as Inductor checks them (an unknown mode or option raises)."""
    return compat.inductor_compiler(mode, options)


def uses_cuda_graphs(compiler) -> bool:
    """Whether Inductor runs what ``compiler`` compiles as CUDA graphs (its mode's and options' setting, else
    Inductor's global one)."""
    return bool(compiler.config.get("triton.cudagraphs", compat.inductor_cudagraphs()))


def without_graphs(compiled: Callable) -> Callable:
    """``compiled`` (Inductor's callable for one graph, or the graph module's own forward) with the op's calls
    inside it taking the dispatcher's choice for eager calls, which weighs the host's time per call: the graph runs
    without CUDA graphs, so every launch costs host time again."""

    def run(*args):
        before = ops.calls.eager
        ops.calls.eager = True
        try:
            return compiled(*args)
        finally:
            ops.calls.eager = before

    run = torch.compiler.disable(run)  # as Inductor's own callable: Dynamo must not trace the call
    run.__dict__.update({k: v for k, v in compiled.__dict__.items() if not k.startswith("_torchdynamo")})
    return run  # with _boxed_call and the rest that Dynamo reads from Inductor's callable


BACKWARD = ("recompute", "save")
FilterFn = Callable[[nn.Module | None, str], bool]


def check_filter(filter_fn: FilterFn | None) -> FilterFn | None:
    """``filter_fn`` as given, once it is known to take ``(module, fqn)`` (a wrong arity raises TypeError here, not
    at the first site)."""
    if filter_fn is None:
        return None
    if not callable(filter_fn):
        raise TypeError(f"mlp_fuser: filter_fn must be callable, got {type(filter_fn).__name__}")
    try:
        sig = inspect.signature(filter_fn)
    except (TypeError, ValueError):  # a builtin without a signature: taken as it is
        return filter_fn
    try:
        sig.bind(None, "")
    except TypeError:
        raise TypeError(f"mlp_fuser: filter_fn{sig} must take two arguments, (module, fqn) -> bool, as torchao's "
                        "quantize_ takes it: module is the MLP's module (or None), fqn its path such as "
                        "'model.layers.0.mlp'") from None
    return filter_fn


def pass_options(activations: Iterable[str] | None = None, patterns: Iterable[str] | None = None,
                 backward: str | None = None) -> dict[str, Any]:
    """``fuse_mlps``'s keyword arguments for the allowed activations (registry names or aliases) and patterns
    (names from ``mlp_fuser.patterns.PATTERNS``), None allowing all, and for what the fused ops keep for their
    backward (``backward``: "recompute" or "save"; None: "save" for the dense ops, ``config.moe_backward`` for routed
    experts). Unknown names raise ValueError."""
    acts = None if activations is None else {get_activation(a).name for a in activations}
    pats = None if patterns is None else set(patterns)
    if pats is not None and pats - set(registry.NAMES):
        raise ValueError(f"mlp_fuser: unknown pattern(s) {sorted(pats - set(registry.NAMES))}; "
                         f"known: {', '.join(registry.NAMES)}")
    if backward is not None and backward not in BACKWARD:
        raise ValueError(f"mlp_fuser: backward={backward!r}; expected 'recompute' (keep nothing of the "
                         "intermediate's size for the backward, recompute gate and up: least memory) or 'save' (keep "
                         "the gate and up outputs: fastest)")
    return dict(activations=acts, patterns=pats, save_preact=backward != "recompute",
                save_experts=None if backward is None else backward == "save")


def make_backend(
    activations: Iterable[str] | None = None,
    patterns: Iterable[str] | None = None,
    enabled: bool = True,
    inductor: bool = True,
    filter_fn: FilterFn | None = None,
    backward: str | None = None,
    root: nn.Module | None = None,
):
    """A backend that fuses MLP sites, then compiles with Inductor (or, with ``inductor=False``, runs the graph).

    ``activations``: registry names or aliases allowed (default: all); ``patterns``: names from
    ``mlp_fuser.patterns.PATTERNS`` allowed (default: all); ``enabled=False``: no fusion at all;
    ``filter_fn(module, fqn) -> bool``: which sites may be fused, as torchao's ``quantize_`` takes it: ``fqn`` is
    the site's module path (the common ancestor of its projections, ``model.layers.0.mlp``), ``module`` the module
    at that path in ``root`` (the model this backend compiles, when given), else None: a graph holds no modules.
    ``backward`` (training only):
    "save" (the dense MLPs' default) keeps the gate and up outputs, 2·tokens·I elements per MLP (fastest; less than
    torch.compile keeps); "recompute" keeps nothing of the intermediate's size between forward and backward and
    recomputes the gate and up GEMMs in the backward (least memory, two more GEMMs). Routed experts (in graphs
    Inductor does not compile, ``inductor=False``) follow a ``backward`` given here, else ``config.moe_backward``
    ("recompute" by default; "save" keeps tokens·k·2I elements a layer). torch.compile's ``mode`` and ``options``
    reach Inductor unchanged.
    """
    allowed = pass_options(activations, patterns, backward)
    filter_fn = check_filter(filter_fn)
    compilers: list = []  # the Inductor wrappers this backend compiled with, for reset()

    def mlp_fuser_backend(gm, example_inputs, *, mode: str | None = None, options: dict[str, Any] | None = None):
        if not inductor and ((mode and mode != "default") or options):
            raise ValueError(f"mlp_fuser: mode={mode!r} / options={options!r} configure Inductor, and this backend "
                             "runs without it (inductor=False, as patch() does)")
        compiler = inductor_compiler(mode, options) if inductor else None  # a bad mode or option raises here
        gid = next(_graph_ids)
        if enabled:
            report = fx_pass.fuse_mlps(gm, filter_fn=filter_fn, root=root, leave_trained_experts=compiler is not None,
                                       **allowed)
            merged = siblings.merge(gm) if config.fp8_merge else 0  # q, k and v packed side by side: one GEMM
            log.info("mlp_fuser: graph %d: %s%s", gid, report.summary(),
                     f"; {merged} FP8 linears merged into GEMMs of their siblings" if merged else "")
            for m in report.near_misses:
                log.debug("mlp_fuser: graph %d: not fused %s (%s): %s: %s", gid, m.path, m.pattern, m.check, m.reason)
        else:
            log.info("mlp_fuser: graph %d: fusion disabled", gid)
        if compiler is None:  # the graph runs op by op, as eager code does: the ops minus the dispatcher's hop
            for node in gm.graph.nodes:
                if node.op == "call_function" and node.target in ops.EAGER:
                    node.target = ops.EAGER[node.target]
            gm.recompile()
            return without_graphs(gm.forward)
        if compiler not in compilers:
            compilers.append(compiler)
        install_direct_calls()  # Inductor's code calls the op's Python entry, not the dispatcher (runtime/inductor.py)
        compiled = compiler(gm, example_inputs)
        return compiled if uses_cuda_graphs(compiler) else without_graphs(compiled)

    def reset() -> None:
        """Called by ``torch._dynamo.reset()``: drop what the modes created (Inductor's CUDA-graph trees)."""
        for compiler in [*compilers, inductor_compiler(None, None)]:
            compiler.reset()
        compilers.clear()

    mlp_fuser_backend.reset = reset
    return mlp_fuser_backend


backend = make_backend()
