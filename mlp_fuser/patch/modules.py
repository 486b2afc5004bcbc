"""``patch`` for a module that *is* an MLP: its forward replaced by the fused op, the rest of the model left eager.

A module qualifies when its parameters all belong to two or three projection children (``nn.Linear``, GPT-2's
``Conv1D``) and its forward, captured alone with Dynamo on a sample input, rewrites to exactly one fused op that
reads the input and returns the output, every other node a view of a weight. The rewritten graph then runs in
place of the forward, with the module's current parameters, for calls like the captured one: one tensor
argument and the same train/eval mode; any other call runs the original forward. A call the op rejects runs the
original forward too, so a mistake raises what the unpatched module raises.

Compared with running the whole model through Dynamo, nothing but the MLP changes: no guards evaluated per call,
no graph of the attention and the cache to replay op by op.
"""

from __future__ import annotations

import contextlib
import copy
import functools
import inspect
import logging
import types
from collections.abc import Callable
from typing import Any

import torch
from torch import Tensor, nn

from .. import compat
from ..graph import fx_pass, sharding
from ..graph._dynamo_utils import fresh_code
from ..ops.dense import EAGER
from ..patterns.common import dependents, dropout_active, is_dropout, is_fn, is_method
from . import packed, quantized
from .site import EagerSite

OPS = (torch.ops.mlp_fuser.mlp.default, torch.ops.mlp_fuser.gated_mlp.default)
# A proof for one train/eval mode: the rewritten graph's forward, its input getters, the direct call or None, the
# names of the gate and up weights (parameters of the module, no biases; ``merge_gate_up``) or None, and the op's
# operands, each ("x",), ("path", "gate_proj.weight") or ("constant", value), or None (a view of a weight).
Proof = tuple[Callable[..., Any], list, Callable[..., Tensor] | None, tuple[str, str] | None, tuple | None]
# Exceptions raised through the fused forward on purpose: non-reentrant torch.utils.checkpoint stops its
# recomputation from a saved-tensor hook once every tensor the backward needs is recomputed.
_PASS_THROUGH = compat.CHECKPOINT_STOP


def module_forward(graphs: dict[bool, Proof], arg_name: str) -> Callable:
    """The forward ``patch`` gives an MLP module (``swapped_class``, hooks and ``__call__`` stay), ``graphs`` on it.

    ``graphs[training]``: for each train/eval mode the module was proven an MLP in, the rewritten graph's forward
    (inputs in placeholder order, returns a tuple), per placeholder None for the input or a getter of the
    module's tensor (read on every call, so replaced or converted weights are the ones used), and where the op reads
    the weights as they are (no view), ``direct(module, x)``: the same call in one generated function, without the
    graph's frames (host time per call is what decides eager decoding; traced, the graph runs: its op is the same).
    ``arg_name``: the forward's input parameter, for a call that names it. The proof holds for the children it saw
    (kept in the module's ``__dict__`` by ``swap``): once one is replaced (an adapter wrapped around a projection),
    the original forward runs; traced, by the children's ids (Dynamo guards them in C++). The proofs' parts are held
    in dicts (a tuple holding functions would keep Dynamo from skipping the module's guards as a whole)."""
    fwds = {t: g[0] for t, g in graphs.items()}
    getters = {t: None if g[1] is None else dict(enumerate(g[1])) for t, g in graphs.items()}
    directs = {t: g[2] for t, g in graphs.items()}

    def forward(self, *args, **kwargs):
        if len(args) == 1 and not kwargs:
            x = args[0]
        elif not args and len(kwargs) == 1 and arg_name in kwargs:
            x = kwargs[arg_name]
        else:
            return getattr(type(self), SWAPPED).forward(self, *args, **kwargs)
        training, compiling = self.training, torch.compiler.is_compiling()
        if (training not in fwds or not isinstance(x, Tensor)
                or (_child_ids(self._modules) != getattr(self, _IDS, None) if compiling
                    else self._modules != self.__dict__.get(_KEPT))):
            return getattr(type(self), SWAPPED).forward(self, *args, **kwargs)
        direct, inputs = directs[training], getters[training]
        try:
            if direct is not None and (inputs is None or not compiling):
                return direct(self, x)
            return fwds[training](*[x if g is None else g(self) for g in inputs.values()])[0]
        except _PASS_THROUGH:
            raise  # control flow of the caller's, not a failure: checkpoint's recomputation stopping once done
        except Exception as e:
            failure = e
        # Outside the except (no "during handling" chain): what the op rejected, the original forward runs, so a
        # mistake raises eager's own error; where the original succeeds, the failure was mlp_fuser's: raise it.
        getattr(type(self), SWAPPED).forward(self, *args, **kwargs)
        raise failure

    forward.graphs = graphs
    return forward


_KEPT = "_mlp_fuser_children"  # an MLP module's children when patched: kept alive, so no other object takes an id
_IDS = "_mlp_fuser_children_ids"  # their (name, id) pairs, what a traced forward compares


def _child_ids(children: dict) -> tuple:
    return tuple((k, id(c)) for k, c in children.items())


def swap(module: nn.Module, cls: type) -> None:
    """Give ``module`` the class ``swapped_class`` made (an MLP's: its children kept, as its forward checks them)."""
    module.__class__ = cls
    if hasattr(cls.forward, "graphs"):
        module.__dict__[_KEPT] = dict(module._modules)
        module.__dict__[_IDS] = _child_ids(module._modules)


def fused_mlp(fused) -> bool:
    """Whether ``fused`` (a module, or a class ``fuse_module`` gave) runs an MLP's fused forward."""
    return hasattr(swapped_forward(fused), "graphs")


@contextlib.contextmanager
def _quiet(*loggers: str):
    """No records from these loggers meanwhile: a sample input of the wrong width fails tracing, which is logged."""
    def drop(record):
        return False

    for name in loggers:
        logging.getLogger(name).addFilter(drop)
    try:
        yield
    finally:
        for name in loggers:
            logging.getLogger(name).removeFilter(drop)


SWAPPED = "_mlp_fuser_base"  # on each class ``swapped_class`` makes: the class it extends


class _Swapped:
    """Behaviour every class ``swapped_class`` makes shares: a copy (deep or not) keeps the class, so the copy's
    forward reads the copy; pickle writes the module as its own class, without what ``swap`` kept (a loaded model is
    unpatched)."""

    def __copy__(self):
        twin = object.__new__(type(self))
        twin.__dict__.update(self.__dict__)
        return twin

    def __deepcopy__(self, memo):
        twin = object.__new__(type(self))
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self.__dict__, memo))
        if _KEPT in twin.__dict__:  # the copy's children, by their ids
            twin.__dict__[_IDS] = _child_ids(twin.__dict__[_KEPT])
        return twin

    def __reduce_ex__(self, protocol):
        state = {k: v for k, v in self.__dict__.items() if k not in (_KEPT, _IDS)}
        return _new, (getattr(type(self), SWAPPED),), packed.pickled_state(self, state)


def _new(cls: type):
    return cls.__new__(cls)


_SWAPS: dict = {}  # (class, forward) -> the class swapped_class made: a few per process


def swapped_class(base: type, forward: Callable, keep: bool = True) -> type:
    """``base`` with ``forward(self, *args)`` as its forward (same name, module and qualname: the model prints as
    before), for ``patch`` to set as a module's class. A forward in the class, not an object in the module's
    ``__dict__``: Dynamo then guards the module as any, and where torch skips an unchanged module's guards as a whole
    (recursive dict tags, on in torch 2.10-2.11) it skips the patched layer's too (benchmarks/NOTES.md)."""
    key = (base, forward)
    cls = _SWAPS.get(key)
    if cls is None:
        cls = type(base.__name__, (_Swapped, base), {
            "forward": forward, SWAPPED: base, "__module__": base.__module__, "__qualname__": base.__qualname__})
        if keep:  # forwards shared by layers alike; not one made for one module (``keep=False``)
            _SWAPS[key] = cls
    return cls


def swapped_forward(fused) -> Callable | None:
    """The forward of ``fused`` (a module, or a class) where its class is one ``swapped_class`` made, or a subclass of
    one (FSDP2's, made after patch); else None. Each kind's forward says which it is (``graphs``, ``block``, ...)."""
    cls = fused if isinstance(fused, type) else type(fused)
    return cls.forward if any(SWAPPED in c.__dict__ for c in cls.__mro__) else None


def is_swapped(module: nn.Module) -> bool:
    """Whether ``patch`` gave ``module`` a class of its own."""
    return swapped_forward(module) is not None


def unswap(module: nn.Module) -> None:
    """Give a module ``patch`` swapped its class back (where a wrapper subclassed it since, the wrapper's stays)."""
    if SWAPPED in type(module).__dict__:
        module.__class__ = type(module).__dict__[SWAPPED]
    module.__dict__.pop(_KEPT, None)
    module.__dict__.pop(_IDS, None)


def _projections(module: nn.Module, quantized_too: bool = False) -> list[nn.Module]:
    """Children holding a 2-D weight (Linear, Conv1D), and with ``quantized_too`` integer-quantized layers of known
    width (GPTQ's, HQQ's: no ``weight``); empty unless every parameter belongs to them."""
    projs = [c for c in module.children() if (isinstance(getattr(c, "weight", None), Tensor) and c.weight.dim() == 2
                                              and not isinstance(c, nn.Embedding))
             or (quantized_too and quantized.describe(c) is not None and quantized.dims(c) is not None)]
    owned = {id(p) for c in projs for p in c.parameters()}
    if len(projs) not in (2, 3) or any(id(p) not in owned for p in module.parameters()):
        return []
    return projs


def fuse_module(module: nn.Module, **options) -> type | None:
    """The class ``patch`` gives ``module`` (its forward fused) when it is one MLP in eval or train mode (each proven
    on its own: a dropout inside is inactive in one and active in the other), else None. The proofs are kept by
    ``_signature``: a model's identical layers, and the next model of the same kind, are captured once."""
    projs = _projections(module)
    if not projs or "forward" in module.__dict__ or is_swapped(module):
        return None
    key = _signature(module, options)
    graphs = _PROOFS.get(key, _UNSEEN) if key is not None else _UNSEEN
    if graphs is _UNSEEN:
        graphs = _proofs(module, projs, options)
        if key is not None:
            if len(_PROOFS) >= _MAX_PROOFS:
                _PROOFS.clear()
            _PROOFS[key] = graphs
    if not graphs:
        return None
    # each module its own site and tuples: an object shared by every layer costs a Python guard each in a compiled model
    return fused_forward(module, {training: (g[0], tuple(g[1]) if g[1] is not None else None, _own_site(g[2]), *g[3:])
                                  for training, g in graphs.items()})


def fused_forward(module: nn.Module, graphs: dict[bool, Proof]) -> type:
    """The class ``patch`` gives ``module``: its forward fused with its proofs per train/eval mode (``swap`` sets it).
    A class of the module's own (its graphs hold its own sites): one module's plans per site."""
    params = list(inspect.signature(type(module).forward).parameters)
    return swapped_class(type(module), module_forward(graphs, params[1] if len(params) > 1 else ""), keep=False)


def in_each_mode(module: nn.Module, prove: Callable[[], Any]) -> dict[bool, Any]:
    """``prove()`` with ``module`` in eval, then in train mode (a dropout inside is inactive in one, active in the
    other), where it gives something; every submodule's mode restored after."""
    modes = {m: m.training for m in module.modules()}
    found = {}
    try:
        for training in (False, True):
            module.train(training)
            if (value := prove()) is not None:
                found[training] = value
    finally:
        for m, training in modes.items():
            m.training = training
    return found


def _proofs(module: nn.Module, projs: list[nn.Module], options: dict) -> dict[bool, Proof]:
    """The proof of ``module`` in each train/eval mode it is one MLP in."""
    return in_each_mode(module, lambda: _prove(module, projs, options))


def _own_site(direct: Callable | None) -> Callable | None:
    """``direct`` with an ``EagerSite`` of its own: a site keeps the plans of a few weights (one module's)."""
    if direct is None:
        return None
    namespace = {**direct.__globals__, "op": EagerSite(direct.__globals__["op"].entry)}
    return types.FunctionType(direct.__code__, namespace, direct.__name__)


_PROOFS: dict = {}  # _signature -> {training: Proof}: a few entries per process (one per kind of MLP module)
_MAX_PROOFS = 256
_UNSEEN = object()
_MODULE_STATE = frozenset(vars(nn.Module()))  # nn.Module's own bookkeeping (parameters, children, hooks, training)
_HOOKS = tuple(k for k in _MODULE_STATE if "hooks" in k)


def _signature(module: nn.Module, options: dict) -> tuple | None:
    """What a proof of ``module`` depends on: its class, each submodule's class and plain attributes (activation
    settings, a config), each parameter's and buffer's type, shape, strides, dtype, device and requires_grad, and the
    pass's options. None where something else could decide what Dynamo captures (a hook on a child, an attribute of
    another kind): that module is proven on its own."""
    try:
        parts: list = [tuple(sorted((k, _value(v)) for k, v in options.items()))]
        for path, m in module.named_modules(remove_duplicate=False):
            if m is not module and any(getattr(m, h, None) for h in _HOOKS):
                return None
            tensors = [(k, None if t is None else (type(t), t.shape, t.stride(), t.dtype, t.device, t.requires_grad))
                       for k, t in (*m._parameters.items(), *m._buffers.items())]
            if any(t is not None and t[0] not in (Tensor, nn.Parameter) for _, t in tensors):
                return None  # a DTensor's proof reads its mesh and placements; a subclass is not proven anyway
            attrs = sorted((k, _value(v, m)) for k, v in vars(m).items() if k not in _MODULE_STATE)
            parts.append((path, type(m), tuple(tensors), tuple(attrs)))
        key = tuple(parts)
        hash(key)
    except Exception:  # _Unkeyed, an unhashable value, a config that cannot be written out
        return None
    return key


class _Unkeyed(Exception):
    """A value ``_signature`` cannot key by."""


_PLAIN_VALUES = (type(None), bool, int, float, complex, str, bytes, torch.dtype, torch.device, torch.Size)


def _value(v, owner: nn.Module | None = None):
    """A hashable stand-in for attribute value ``v`` equal for values a forward cannot tell apart."""
    if isinstance(v, _PLAIN_VALUES) or isinstance(v, (types.FunctionType, types.BuiltinFunctionType, type)):
        return v
    if isinstance(v, (tuple, list, set, frozenset)):
        items = tuple(_value(x, owner) for x in v)
        return type(v), tuple(sorted(items, key=repr)) if isinstance(v, (set, frozenset)) else items
    if isinstance(v, dict):
        return dict, tuple(sorted(((k, _value(x, owner)) for k, x in v.items()), key=repr))
    if isinstance(v, types.MethodType) and v.__self__ is owner:  # an activation picked from the module's methods
        return types.MethodType, v.__func__
    if isinstance(v, functools.partial):
        return functools.partial, _value(v.func, owner), _value(v.args, owner), _value(v.keywords, owner)
    if callable(getattr(v, "to_json_string", None)):  # a transformers config
        return type(v), v.to_json_string(use_diff=False)
    raise _Unkeyed(type(v))


def _prove(module: nn.Module, projs: list[nn.Module], options: dict, sites: list | None = None) -> Proof | None:
    """Capture ``module``'s forward on a sample input; the rewritten graph's forward and its input getters when it
    is exactly one fused MLP (its ``fx_pass.Site`` appended to ``sites``)."""
    # the sample input's dtype and device: the first tensor's of a dtype x can have (a quantized projection may hold
    # int8 or float8, its scales float32)
    first = next((t for t in (*module.parameters(), *module.buffers()) if t.dtype in COMPUTE_DTYPES), None)
    if first is None:
        return None
    widths = [getattr(projs[0], "in_features", None), getattr(projs[0], "nx", None)]  # Linear, Conv1D
    widths += [d for p in projs for d in p.weight.shape]  # else the input width is one of the weight sides
    for K in dict.fromkeys(w for w in widths if isinstance(w, int)):
        x = torch.randn(2, 3, K, dtype=first.dtype, device=first.device)
        captured: list = []

        def capture(gm, example_inputs, captured=captured):
            captured.append((gm, list(example_inputs), fx_pass.fuse_mlps(gm, **options)))
            return gm.forward

        try:
            # grad on for DTensor weights: transformers' tensor parallelism records its autograd-correct chain then
            with torch.set_grad_enabled(sharding.holds_dtensors(module)), _quiet("torch._subclasses.fake_tensor",
                                                                                  "torch._dynamo"):
                torch.compile(fresh_code(type(module).forward), backend=capture, fullgraph=True)(module, x)
        except compat.dynamo_errors()[1]:
            raise  # the graph pass failed: a bug to see, not a sample input of the wrong width
        except Exception:
            continue
        found = captured[:]
        captured.clear()  # Dynamo may keep the backend: no weight is kept through it
        if len(found) == 1:
            proof = _graph(module, x, *found[0])
            if proof is not None and sites is not None:
                sites += found[0][2].fused[:1]
            return proof
    return None


COMPUTE_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _unreadable(t: Tensor) -> str | None:
    """Why the op cannot read weight ``t`` as it is stored (a float8 or integer dtype, a tensor subclass), or None.
    A DTensor is left to ``sharding``."""
    if sharding.is_dtensor(t):
        return None
    if type(t) not in (Tensor, nn.Parameter):
        return f"{sharding.describe(t)} (of {t.dtype}): the op's kernels read plain tensors"
    if t.dtype in COMPUTE_DTYPES:
        return None
    dtype = str(t.dtype).removeprefix("torch.")
    if "float8" in dtype:
        return f"a Float8 tensor ({dtype}): the FP8 op reads float8_e4m3fn weights with their weight_scale_inv"
    return f"a quantized tensor ({dtype}): the op reads fp16, bf16, fp32 or fp64 weights"


def _stand_in(child: nn.Module) -> nn.Module:
    """``child`` with plain weights on the meta device: a Linear (FP8Linear is one) becomes ``nn.Linear``, any other
    projection a shallow copy with meta tensors of the same shapes. Nothing of ``child`` is changed."""
    if isinstance(child, nn.Linear):
        return nn.Linear(child.in_features, child.out_features, bias=child.bias is not None, device="meta")
    if quantized.describe(child) is not None and (dims := quantized.dims(child)) is not None:
        return nn.Linear(*dims, bias=isinstance(getattr(child, "bias", None), Tensor), device="meta")
    twin = copy.copy(child)
    twin._parameters = {k: None if p is None else nn.Parameter(torch.empty(p.shape, device="meta"))
                        for k, p in child._parameters.items()}
    return twin


def weight_near_miss(module: nn.Module, path: str, options: dict, memo: dict,
                     lacks=None) -> fx_pass.NearMiss | None:
    """A near miss for ``module`` when it is an MLP whose projections hold weights the op cannot read (float8,
    integer, a tensor subclass such as torchao's): proven on a twin of the module whose projections are plain
    Linears on the meta device, so no weight is read, converted or changed. ``memo`` keeps the proofs by the
    module's structure (a model's identical layers are proven once). ``lacks(projection)``: a reason in place of
    the weight's type where it has one (patch/fp8.py: what a float8 format lacks)."""
    projs = _projections(module, quantized_too=True)
    if not projs or "forward" in module.__dict__ or is_swapped(module):
        return None
    names = {id(c): name for name, c in module.named_children()}
    bad = []
    for c in projs:
        if (what := quantized.describe(c)) is not None:
            bad.append((names[id(c)], f"{what}: {quantized.READS}"))
        else:
            bad += [(f"{names[id(c)]}.{k}", why) for k, t in c.named_parameters(recurse=False)
                    if k in ("weight", "bias") and (why := _unreadable(t)) is not None]
    if not bad:
        return None
    key = (type(module), module.training, tuple((names[id(c)], type(c), quantized.dims(c) if quantized.describe(c)
                                                 else tuple(c.weight.shape)) for c in projs))
    if key not in memo:
        twin = copy.copy(module)
        twin._modules = {k: _stand_in(c) if any(c is p for p in projs) else c for k, c in module._modules.items()}
        twin._parameters = dict(module._parameters)
        sites: list = []
        try:
            _prove(twin, _projections(twin), options, sites)
        except Exception:  # a structure the twin cannot stand in for: not reported as an MLP
            sites = []
        memo[key] = sites[0].pattern if sites else None
    if memo[key] is None:
        return None
    name, why = bad[0]
    child = name.split(".")[0]
    if "." in name and lacks is not None and (reason := lacks(module.get_submodule(child))):
        where = ".".join(p for p in (path, child) if p)
        return fx_pass.NearMiss(path, memo[key], "plain_tensors", f"{where}: {reason}")
    return fx_pass.NearMiss(path, memo[key], "plain_tensors", f"{'.'.join(p for p in (path, name) if p)} is {why}")


def _graph(module: nn.Module, x: Tensor, gm, example_inputs: list, report) -> Proof | None:
    if any(sharding.placeholder_getter(v) for v in example_inputs):  # a tensor-parallel MLP, the mesh an input
        return _sharded_proof(module, x, gm, example_inputs, report)
    if len(report.fused) != 1 or report.near_misses:
        return None
    g = gm.graph
    g.eliminate_dead_code()
    if any(n.op == "get_attr" for n in g.nodes):  # a tensor held by the graph, not read from the module per call
        return None
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs):
        return None
    names = {id(t): name for name, t in [*module.named_parameters(remove_duplicate=False),
                                         *module.named_buffers(remove_duplicate=False)]}
    getters, paths, x_node = [], {}, None
    for node, value in zip(placeholders, example_inputs):
        if value is x:
            getters.append(None)
            x_node = node
        elif id(value) in names:
            getters.append(_getter(names[id(value)]))
            paths[node] = names[id(value)]
        else:  # a value the graph read from elsewhere (a global tensor, a size): not a plain MLP forward
            return None
    ops = [n for n in g.nodes if n.op == "call_function" and n.target in OPS]
    output = next(n for n in g.nodes if n.op == "output")
    if x_node is None or len(ops) != 1 or ops[0].args[0] is not x_node or len(output.args[0]) != 1:
        return None
    result, passed = output.args[0][0], {ops[0], output}
    while is_dropout(result) and not dropout_active(result):  # GPT-2's dropout after the MLP, inactive in eval
        passed.add(result)
        result = result.args[0]
    if result is not ops[0] or any(n not in passed for n in dependents(x_node)):
        return None  # the graph does more with the input than the MLP
    buffers = {name for name, _ in module.named_buffers(remove_duplicate=False)}
    a = ops[0].args
    gate_up = None
    if (ops[0].target == OPS[1] and a[2] is None and a[4] is None and paths.get(a[1]) and paths.get(a[3])
            and paths[a[1]] not in buffers and paths[a[3]] not in buffers and paths[a[1]] != paths[a[3]]):
        gate_up = (paths[a[1]], paths[a[3]])
    operands = tuple(("x",) if v is x_node else ("path", paths[v]) if isinstance(v, torch.fx.Node) and v in paths
                     else ("constant", v) for v in a)
    if any(o[0] == "constant" and not isinstance(o[1], _CONSTANT) for o in operands):
        operands = None
    ops[0].target = EAGER[ops[0].target]  # the op minus the dispatcher's hop where nothing needs it
    gm.recompile()
    return _plain(gm), getters, _direct_call(ops[0], x_node, paths, buffers), gate_up, operands


_CONSTANT = (type(None), bool, int, float, str)


def _direct_call(op, x_node, paths: dict, buffers: set) -> Callable[[nn.Module, Tensor], Tensor] | None:
    """``(module, x) -> op(x, weights...)`` as one generated function that reads each weight from the modules' dicts,
    when every argument of the op is the input, a weight placeholder or a constant; else None (a view of a weight,
    such as a merged gate/up weight's halves, needs the graph). ``op`` is called through an ``EagerSite`` (site.py)."""
    def source(a):
        if a is x_node:
            return "x"
        if a in paths:
            *path, leaf = paths[a].split(".")
            kind = "_buffers" if paths[a] in buffers else "_parameters"
            held = "".join(f"._modules[{p!r}]" for p in path)
            return f"m{held}.{kind}[{leaf!r}]"
        if isinstance(a, _CONSTANT):
            return repr(a)
        raise LookupError(a)

    try:
        args = [source(a) for a in op.args] + [f"{k}={source(v)}" for k, v in op.kwargs.items()]
    except LookupError:
        return None
    namespace = {"op": EagerSite(op.target)}  # the entry, with the call's plan found by tensor guards once seen
    exec(f"def direct(m, x):\n    return op({', '.join(args)})\n", namespace)  # noqa: S102 (source built above)
    return namespace["direct"]


def _sharded_proof(module, x, gm, example_inputs: list, report) -> Proof | None:
    """The proof for a module whose graph holds DTensors: the rewritten graph's forward and its input getters
    when the graph is one lowered MLP (x → from_local → to_local → op → from_local → redistribute → to_local), the
    mesh among its inputs; None otherwise (the module keeps its forward)."""
    if len(report.fused) != 1 or report.near_misses:
        return None
    g = gm.graph
    placeholders = [n for n in g.nodes if n.op == "placeholder"]
    if len(placeholders) != len(example_inputs) or any(n.op == "get_attr" for n in g.nodes):
        return None
    names = {id(t): name for name, t in module.named_parameters(remove_duplicate=False)}
    getters, x_node = [], None
    for node, value in zip(placeholders, example_inputs):
        mesh = sharding.placeholder_getter(value)
        if value is x:
            x_node = node
        getters.append(None if value is x else _getter(names[id(value)]) if id(value) in names else mesh)
        if getters[-1] is None and value is not x:
            return None
    ops = [n for n in g.nodes if n.op == "call_function" and n.target in OPS]
    output = next(n for n in g.nodes if n.op == "output")
    if x_node is None or len(ops) != 1 or len(output.args[0]) != 1:
        return None
    x_local, result = ops[0].args[0], output.args[0][0]
    # the output: to_local(redistribute(from_local(op, mesh, (Partial(),))))
    red = result.args[0] if is_method(result, "to_local") else None
    back = red.args[0] if is_method(red, "redistribute") else None
    if not (is_fn(back, *sharding.FROM_LOCAL) and back.args[0] is ops[0]):
        return None
    src = x_local.args[0] if is_method(x_local, "to_local") else None
    if not (is_fn(src, *sharding.FROM_LOCAL) and src.args[0] is x_node):
        return None
    allowed = {src, x_local, ops[0], back, red, result, output}
    if any(u not in allowed for u in dependents(x_node)):
        return None  # the graph does more with the input than the MLP
    return _plain(gm), getters, None, None, None


def _plain(gm: torch.fx.GraphModule):
    """The graph's forward as a plain function where its code reads no attribute of the module (no get_attr or
    call_module), so that Dynamo, tracing it for every layer, meets no shared module object; else ``gm.forward``."""
    if any(n.op in ("get_attr", "call_module") for n in gm.graph.nodes):
        return gm.forward
    _ = gm.code  # reading the code generates a lazy graph module's forward: the one taken here, not the lazy one
    code = type(gm).forward

    def graph(*args):
        return code(None, *args)

    return graph


def _getter(name: str) -> Callable[[nn.Module], Tensor]:
    """``module -> module.<name>`` for a parameter or buffer name like ``gate_proj.weight``, read from the modules'
    own dicts (``getattr`` would go through ``nn.Module.__getattr__`` twice per weight on every call)."""
    *path, leaf = name.split(".")
    path = tuple(path)

    def get(module):
        for child in path:
            module = module._modules[child]
        t = module._parameters.get(leaf)
        return t if t is not None else module._buffers[leaf]

    return get
