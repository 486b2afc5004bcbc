"""Eager-mode fusion: ``patch(model)``, in one of two ways.

- Per module (the default, where it applies): every submodule that *is* an MLP (LLaMA's ``LlamaMLP``, GPT-NeoX's,
  Falcon's, ...) gets a forward that runs the fused op, proven equal by capturing that module alone with Dynamo
  and the graph pass (``patch/modules.py``). The rest of the model runs eagerly, untouched.
- Whole model (where no submodule is an MLP, or ``per_module=False``): the model's forward runs through Dynamo
  with the fusing pass and no Inductor. Working from the captured graph (not from class names) is what finds MLPs
  split across modules (BERT's ``BertIntermediate.dense → GELU`` then ``BertOutput.dense``) and sees HF's control
  flow resolved. The rewritten graph runs op by op, like eager mode; Dynamo's guards re-capture the graph when
  dtype, device, shapes or train/eval change, and each capture is checked afresh (dropout included).

Either way nothing in the module tree changes: ``state_dict()`` keys and tensors stay the same, so save/load,
``.to()``, ``.half()`` and ``generate()`` keep working.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import sys
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..graph._dynamo_utils import fresh_code
from ..graph.backend import FilterFn, check_filter, make_backend, pass_options
from ..graph.fx_pass import NearMiss
from ..kernels.common import stored_as_one
from ..ops.dense import _PLAIN
from . import compressed, hf, packed
from .experts import BACKWARD, fp8_names, fp8_near_miss, fuse_experts, is_fused_experts, spec
from .fp8 import (
    FP8_LINEAR_NAMES,
    fp8_children,
    fp8_linear_block,
    fuse_fp8_linear,
    fuse_fp8_module,
    sibling_groups,
    weight_near_miss,
)
from .modules import _PASS_THROUGH, fuse_module, fused_mlp, is_swapped, swap, swapped_class, unswap
from .router import fuse_router

_ORIG = "_mlp_fuser_original_forward"  # the forward before patching (None: the class's own)
_FUSED = "_mlp_fuser_fused"  # set on the forward that patch installs
_HELD = "_mlp_fuser_held_logs"  # set on an exception: the log records held back while it was raised
_MODULES = "_mlp_fuser_fused_modules"  # per-module patching: the paths of the modules given a fused forward
_SETTINGS = "_mlp_fuser_settings"  # what patch was called with
_MERGED = "_mlp_fuser_merged"  # patch(merge_gate_up=True): the (gate, up) weight paths it stored as one
_SWITCHED = "_mlp_fuser_switched"  # experts whose config patch set to "mlp_fuser": one path per config -> its choice
_MISSING = object()
log = logging.getLogger("mlp_fuser")


def _experts_forward(module: nn.Module, allowed: dict) -> type | None:
    """The fused forward of a routed-experts module, where the pass's options allow it."""
    pats, acts = allowed.get("patterns"), allowed.get("activations")
    forward = fuse_experts(module)
    if forward is None or (pats is not None and "routed_experts" not in pats):
        return None
    return forward if acts is None or spec(module).gate.activation in acts else None


def _router_forward(module: nn.Module, allowed: dict, memo: dict):
    """The fused forward of a top-k router module (``patch_router``), where the pass's options allow it."""
    pats = allowed.get("patterns")
    return None if pats is not None and "router_topk" not in pats else fuse_router(module, memo)


def is_patched(model: nn.Module) -> bool:
    """Whether ``patch`` fused ``model`` (its MLP modules' forwards, or its own forward). A patched model that went
    through pickling (``torch.save`` / ``torch.load``) comes back unpatched: a fused module pickles as its own
    class, a model patched as one (``per_module=False``) with its plain bound method."""
    paths, switched = model.__dict__.get(_MODULES), model.__dict__.get(_SWITCHED)
    if paths is not None or switched is not None:
        return (all(is_swapped(model.get_submodule(p)) for p in paths or ())  # each fused module: a class of its own
                and all(_implementation(model, p) == hf.NAME for p in switched or ()))
    forward = model.__dict__.get("forward")
    return _ORIG in model.__dict__ and getattr(getattr(forward, "__func__", forward), _FUSED, False)


def original_forward(model: nn.Module):
    """The forward as it was before ``patch``."""
    orig = model.__dict__.get(_ORIG, _MISSING)
    if orig is _MISSING or orig is None:
        return type(model).forward.__get__(model)
    return orig


def patch(model: nn.Module, filter_fn: FilterFn | None = None, *,
          per_module: bool = True, merge_gate_up: bool = False, **options) -> nn.Module:
    """Fuse ``model``'s MLP blocks in place (eager mode), routed experts and MoE routers' top-k too; return ``model``.
    Idempotent; undone by ``unpatch``.

    ``filter_fn(module, fqn) -> bool`` picks the sites to fuse, as torchao's ``quantize_`` takes it: ``fqn`` is the
    site's module path (the common ancestor of its projections, e.g. ``model.layers.0.mlp``), ``module`` the module
    at that path (None where the path names no module). ``options`` go to ``make_backend`` (``activations=``,
    ``patterns=``, ``backward="save" | "recompute"``: what the fused ops keep for training, as for ``make_backend``:
    by default "save" for the dense MLPs and ``config.moe_backward`` for routed experts). ``per_module=False`` runs
    the whole forward through Dynamo even where the MLPs are modules of their own. An MLP module whose weights the
    op cannot read (float8, integer, a tensor subclass such as torchao's) is left as it is, with its reason logged
    (``explain`` reports it); where that leaves nothing to fuse, the model is left exactly as it was. A call that
    fails raises what the unpatched forward raises. Patching a patched model again with other options re-patches it
    with those. Routed experts of transformers' ``@use_experts_implementation`` classes are fused by selecting
    ``"mlp_fuser"`` in their config, so ``set_experts_implementation`` still switches them afterwards.
    ``merge_gate_up=True``: then ``merge_gate_up(model, filter_fn)``, which ``unpatch`` undoes.
    """
    filter_fn = check_filter(filter_fn)
    settings = (repr(filter_fn), per_module, merge_gate_up, repr(sorted(options.items())))  # strings: pickle keeps it
    if is_patched(model) and model.__dict__.get(_SETTINGS) == settings:
        return model
    unpatch(model)  # patched with other options, or unpickled from a patched model: drop the entries, patch afresh
    if per_module:
        fused, allowed, misses, memo, routers = {}, pass_options(**options), [], {}, {}
        for path, module in model.named_modules():
            forward = (fuse_fp8_module(module, **allowed) or fuse_module(module, **allowed)
                       or _experts_forward(module, allowed) or _router_forward(module, allowed, routers)
                       or fuse_fp8_linear(module))
            if forward is None and (miss := weight_near_miss(module, path, allowed, memo)
                                    or fp8_near_miss(module, path)) is not None:
                misses.append(miss)
            if forward is not None and (filter_fn is None or filter_fn(module, path)):
                fused[path] = forward
        misses += _keep_compressed(model, fused)
        for m in misses:
            log.info("mlp_fuser.patch: not fused %s (%s): %s", m.path, m.check, m.reason)
        if misses and not fused:  # its MLPs are modules the op cannot run: Dynamo over the whole model would not either
            log.warning("mlp_fuser.patch: nothing fused, the model is left as it was: %s", misses[0].reason)
            return model
        if fused:
            for path, forward in fused.items():
                if is_fused_experts(forward) and allowed["save_experts"] is not None:
                    model.get_submodule(path).__dict__[BACKWARD] = "save" if allowed["save_experts"] else "recompute"
            switched = _switchable(model, fused)
            for path in switched:
                hf.select(model.get_submodule(path).config, hf.NAME)
            _pack(model, fused)
            for path in [p for p in fused if _same_config(model, p, switched)]:
                module = model.get_submodule(path)  # its own forward; the class pickles it unpacked (swapped_class)
                swap(module, swapped_class(type(module), type(module).forward))
            fused = {p: f for p, f in fused.items() if not _same_config(model, p, switched)}
            for path, forward in fused.items():
                swap(model.get_submodule(path), forward)
            model.__dict__[_MODULES] = list(fused)
            model.__dict__[_SWITCHED] = switched
            model.__dict__[_SETTINGS] = settings
            if merge_gate_up:
                model.__dict__[_MERGED] = _merge(model, _gate_up_paths(fused))
            return model
    orig = model.__dict__.get("forward")  # an instance-level forward (e.g. from a wrapper) to restore later
    be = make_backend(inductor=False, filter_fn=filter_fn, root=model, **options)
    _hold_back_meta_failure_logs()
    forward = type(model).forward if orig is None else orig
    fused_forward = functools.wraps(forward)(_fused(torch.compile(fresh_code(forward), backend=be), eager=forward))
    # The class's forward is bound to the model: a deepcopy then rebinds it to the copy.
    model.forward = types.MethodType(fused_forward, model) if orig is None else fused_forward
    model.__dict__[_ORIG] = orig
    model.__dict__[_SETTINGS] = settings
    if merge_gate_up:
        model.__dict__[_MERGED] = _merge(model, _gate_up_paths(_proven(model, filter_fn, pass_options(**options))))
    return model


def _pack(model: nn.Module, fused: dict) -> None:
    """Each fused FP8 layer's float8 weights and scales as one buffer (``packed``): one graph input a layer."""
    for path, forward in fused.items():
        module = model.get_submodule(path)
        if is_fused_experts(forward) and (s := spec(module)).fp8 is not None:
            packed.pack(module, fp8_names(bool(s.consts[0])))
        elif fused_mlp(forward):
            for child, names in fp8_children(module):
                packed.pack(child, names)
    lone = [(p, model.get_submodule(p), block) for p, f in fused.items() if (block := fp8_linear_block(f)) is not False]
    for group in sibling_groups(lone):  # side by side where they fit: q, k and v then multiply as one weight
        modules, metas = [m for _, m, _ in group], [meta for _, _, meta in group]
        if not packed.pack_together(modules, FP8_LINEAR_NAMES, metas):
            for module, meta in zip(modules, metas):
                packed.pack(module, FP8_LINEAR_NAMES, meta)


def _keep_compressed(model: nn.Module, fused: dict) -> list:
    """Where fused MLPs read compressed-tensors layers, keep them compressed (``compressed.settle``); where they
    cannot be, drop them from ``fused``: their near misses."""
    paths = [p for p in fused if compressed.compressed_children(model.get_submodule(p))]
    why = compressed.settle(model, paths) if paths else None
    if why is None:
        return []
    for p in paths:
        del fused[p]
    return [NearMiss(p, "mlp", "plain_tensors", why) for p in paths]


def _switchable(model: nn.Module, fused: dict) -> dict[str, str | None]:
    """The experts configs ``patch`` selects ``"mlp_fuser"`` in, as {path of one experts module: the config's choice}:
    those whose every experts module is in ``fused`` and follows the switch, held by a model in ``model`` (so
    ``set_experts_implementation`` reaches them and no module outside ``model`` reads them)."""
    groups: dict[int, list[str]] = {}
    for path, module in model.named_modules():
        if hf.follows_switch(module):
            groups.setdefault(id(module.config), []).append(path)
    owners = {id(m.config) for m in model.modules() if hasattr(m, "set_experts_implementation")
              and hasattr(m, "config")}
    return {paths[0]: model.get_submodule(paths[0]).config._experts_implementation for key, paths in groups.items()
            if key in owners and all(is_fused_experts(fused.get(p)) for p in paths)}


def _same_config(model: nn.Module, path: str, switched: dict) -> bool:
    """Whether the module at ``path`` is an experts module reading one of the ``switched`` configs."""
    module = model.get_submodule(path)
    return hf.follows_switch(module) and any(module.config is model.get_submodule(p).config for p in switched)


def _implementation(model: nn.Module, path: str) -> str | None:
    return getattr(model.get_submodule(path).config, "_experts_implementation", None)


def merge_gate_up(model: nn.Module, filter_fn: FilterFn | None = None) -> list[str]:
    """Store each gated MLP module's gate and up weights as the two halves of one buffer, in place; return the
    modules' paths. The model computes the same; the fused op then runs one GEMM over both (``cublas_act_mul``), or
    quack's gated GEMM where it is installed (``quack_gated_*``), as for a model that keeps one merged weight (Phi-3).

    Each Parameter stays the same object (optimizers, hooks and tied references still hold it); its ``.data`` becomes
    a view of the buffer. Taken: the MLP modules ``patch`` fuses on their own (``filter_fn`` as for ``patch``) whose
    gate and up are bias-free contiguous parameters of one shape, dtype and device. ``.to()`` / ``.cuda()`` /
    ``.half()`` give each weight its own storage again (merge after them), as does ``split_gate_up``. ``torch.save``
    keeps the shared buffer; transformers' ``save_pretrained`` writes the halves as two tensors
    (tests/test_merge_gate_up.py loads them back)."""
    return list(_merge(model, _gate_up_paths(_proven(model, check_filter(filter_fn)))))


def split_gate_up(model: nn.Module, filter_fn: FilterFn | None = None) -> list[str]:
    """``merge_gate_up`` undone: each MLP module's gate and up weights stored as one get a storage each again; return
    the modules' paths."""
    return _split(model, _gate_up_paths(_proven(model, check_filter(filter_fn))))


def _proven(model: nn.Module, filter_fn, options: dict | None = None) -> dict[str, type]:
    """The MLP modules ``patch`` would fuse on their own (with the pass's ``options``), each with the class of its
    proof (already patched ones: theirs)."""
    proven = {}
    for path, module in model.named_modules():
        forward = type(module) if fused_mlp(module) else fuse_module(module, **(options or {}))
        if forward is not None and (filter_fn is None or filter_fn(module, path)):
            proven[path] = forward
    return proven


def _gate_up_paths(fused: dict) -> dict[str, tuple[str, str]]:
    """Module path -> the names of its gate and up weights, from its proof (the first mode that names them)."""
    pairs = {}
    for path, forward in fused.items():
        graphs = getattr(getattr(forward, "forward", None), "graphs", {})  # experts and routers: no gate and up
        names = next((g[3] for g in graphs.values() if g[3] is not None), None)
        if names is not None:
            pairs[path] = names
    return pairs


def _weights(model: nn.Module, pairs: dict[str, tuple[str, str]]):
    """(module path, gate weight, up weight) for each entry of ``pairs`` (``_gate_up_paths``)."""
    for path, (g_name, u_name) in pairs.items():
        module = model.get_submodule(path)
        yield path, module.get_parameter(g_name), module.get_parameter(u_name)


def _merge(model: nn.Module, pairs: dict[str, tuple[str, str]]) -> dict[str, tuple[str, str]]:
    """The entries of ``pairs`` whose weights are now stored as one (merged here, or already)."""
    merged = {}
    with torch.no_grad():
        for path, wg, wu in _weights(model, pairs):
            if (wg is wu or wg.shape != wu.shape or wg.dtype != wu.dtype or wg.device != wu.device
                    or not (wg.is_contiguous() and wu.is_contiguous()) or type(wg.data) not in _PLAIN
                    or type(wu.data) not in _PLAIN or wg.dim() != 2):
                continue
            if not stored_as_one(wg, wu, wg.data_ptr(), wu.data_ptr()):
                w = torch.cat([wg.data, wu.data])
                wg.data, wu.data = w[: wg.shape[0]], w[wg.shape[0]:]
            merged[path] = pairs[path]
    return merged


def _split(model: nn.Module, pairs: dict[str, tuple[str, str]]) -> list[str]:
    split = []
    with torch.no_grad():
        for path, wg, wu in _weights(model, pairs):
            if wg is not wu and stored_as_one(wg, wu, wg.data_ptr(), wu.data_ptr()):
                wg.data, wu.data = wg.data.clone(), wu.data.clone()
                split.append(path)
    return split


def _fused(compiled: Callable[..., Any], eager: Callable[..., Any]) -> Callable[..., Any]:
    """The forward ``patch`` installs: ``compiled``; where that raises, ``eager`` runs (see ``_eager_error``)."""

    def fused_forward(*args, **kwargs):
        try:
            return compiled(*args, **kwargs)
        except _PASS_THROUGH:
            raise
        except Exception as error:
            failure = error
        raise _eager_error(failure, eager, args, kwargs)  # outside the except: no "during handling" chain

    setattr(fused_forward, _FUSED, True)
    return fused_forward


def _eager_error(error: Exception, eager: Callable[..., Any], args: tuple, kwargs: dict) -> Exception:
    """Run the forward eagerly where the compiled one raised ``error``, so that a user's mistake (a wrong feature
    size, float ``input_ids``) raises what the unpatched model raises, not Dynamo's ``TorchRuntimeError`` around
    it. What the forward did before the error (a KV cache update, say) may be done twice.

    When the eager forward succeeds, the failure is mlp_fuser's or Dynamo's own: the log records held back while
    it was raised are logged, and ``error`` is returned to be raised.
    """
    eager(*args, **kwargs)
    e, seen = error, set()
    while e is not None and id(e) not in seen:  # error and the exceptions it wraps
        seen.add(id(e))
        for record in getattr(e, _HELD, ()):
            logging.getLogger(record.name).callHandlers(record)
        e = e.__cause__ or e.__context__
    return error


def _hold_back(record: logging.LogRecord) -> bool:
    """A filter on fake tensors' logger, which logs a meta kernel's error with its traceback (``failed while
    attempting to run meta``) before raising it. Inside a fused forward the error reaches ``_eager_error``, so the
    record is held on the exception instead, and logged only if the eager forward succeeds. (When Dynamo recovers
    from the error with a graph break, the record goes with the exception: eager mode prints nothing there.)"""
    error = record.exc_info[1] if record.exc_info else None
    frame = sys._getframe(1)
    while error is not None and frame is not None:
        if frame.f_code.co_name == "fused_forward" and frame.f_globals is globals():
            setattr(error, _HELD, [*getattr(error, _HELD, ()), record])
            return False
        frame = frame.f_back
    return True


def _hold_back_meta_failure_logs() -> None:
    logger = logging.getLogger("torch._subclasses.fake_tensor")
    if _hold_back not in logger.filters:
        logger.addFilter(_hold_back)


@contextlib.contextmanager
def fused_forwards_aside(model: nn.Module):
    """Meanwhile, the modules ``patch`` gave a fused forward run their own (``explain`` reports what they are)."""
    aside, configs = {}, {}
    for path in model.__dict__.get(_MODULES, ()):
        module = model.get_submodule(path)
        if is_swapped(module):
            aside[module] = type(module)
            unswap(module)
    for path, before in model.__dict__.get(_SWITCHED, {}).items():
        if _implementation(model, path) == hf.NAME:
            configs[path] = model.get_submodule(path).config
            hf.select(configs[path], before)
    try:
        yield list(model.__dict__.get(_MODULES, ())) + list(configs)
    finally:
        for module, forward in aside.items():
            swap(module, forward)
        for config in configs.values():
            hf.select(config, hf.NAME)


def unpatch(model: nn.Module) -> nn.Module:
    """Restore the forwards ``patch`` replaced, and the weights' storages where it merged them; return ``model``."""
    model.__dict__.pop(_SETTINGS, None)
    for module in model.modules():
        module.__dict__.pop(BACKWARD, None)
    for path, before in model.__dict__.pop(_SWITCHED, {}).items():
        if _implementation(model, path) == hf.NAME:  # else the user chose another since: theirs stays
            hf.select(model.get_submodule(path).config, before)
    merged = model.__dict__.pop(_MERGED, None)
    if merged:
        _split(model, merged)
    for module in model.modules():
        packed.unpack(module, apart=True)
    for module in model.modules():  # each class patch gave: fused modules, experts run by their config's switch
        unswap(module)
    paths = model.__dict__.pop(_MODULES, None)
    for path in paths or ():  # unpickled from a patch of before classes: a bound forward in the module's __dict__
        module = model.get_submodule(path)
        if getattr(module.__dict__.get("forward"), "__func__", None) is type(module).forward:
            del module.__dict__["forward"]
    if paths:
        compressed.rehook(model)
    if _ORIG in model.__dict__:  # patched whole, or unpickled from such a model
        _restore(model)
    return model


def _restore(model: nn.Module) -> None:
    orig = model.__dict__.pop(_ORIG)
    if orig is None:
        model.__dict__.pop("forward", None)
    else:
        model.forward = orig
