"""A module's float8 weights and their scales stored as one buffer, so a compiled step reads one tensor per layer
where it read two (an ``FP8Linear``, a compressed-tensors layer) or four (``FP8Experts``).

Each tensor a compiled step reads is a graph input with guards of its own; packed, the FP8 decode step has fewer
inputs than the bf16 model's and fewer guard lines (benchmarks/NOTES.md, "One graph input per FP8 layer": the
host time it was meant to cut turned out to be the modules' other guards). ``patch`` packs what it fuses: the
weights and scales are copied into one byte buffer (a non-persistent buffer of the module, so ``state_dict`` is
unchanged) and each Parameter stays the same object, its ``.data`` now a view of that buffer; no byte is held twice.
Eager calls read the Parameters; compiled ones read the buffer and take the same views inside the graph (no kernel,
no copy).

``unpatch`` gives each tensor its own storage again (same objects, same values). Registering a tensor on a packed
module (``module.weight = ...``, ``load_state_dict(assign=True)``, a bias added) drops the packing: a compiled step
then reads the module's tensors again (``param.data = ...`` is not seen: ``unpatch`` first). ``.to()`` after
``patch`` gives the buffer and each tensor their own copies (the same bytes; twice the memory): move the model
before patching it. ``copy.deepcopy`` likewise: torch clones each Parameter on its own, so the copy holds its packed
layers twice.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

BUFFER = "_mlp_fuser_fp8"  # the bytes: a non-persistent buffer of the module (float8 where the weights are)
LAYOUT = "_mlp_fuser_fp8_layout"  # in the module's __dict__: (((name, offset, bytes, dtype name, shape), ...), meta)
_ALIGN = 256  # each tensor's first byte: the kernels' loads want 16-byte aligned pointers; TMA 128 bytes


def tensor(module: nn.Module, name: str) -> Tensor | None:
    """The parameter or buffer ``name`` of ``module`` (None where it has neither)."""
    t = module._parameters.get(name)
    return t if t is not None else module._buffers.get(name)


def pack(module: nn.Module, names: tuple[str, ...], meta=None) -> bool:
    """Store ``module``'s tensors ``names`` (parameters or buffers) in one buffer, ``meta`` (the caller's constants:
    ints, strings, tuples) beside its layout; True where they are (now or already). Left as they are: tensors on
    several devices or on meta, not contiguous, or a subclass, and modules whose tensors accelerate moves at each
    call (an ``_hf_hook``: the buffer would keep where they were). (The FP8 ops give float8 weights and their
    scales no gradient, whether they ask for one or not.)"""
    ts = [tensor(module, n) for n in names]
    if _why_not([module], ts) is not None:
        return False
    if is_packed(module, names):
        module.__dict__[LAYOUT] = (module.__dict__[LAYOUT][0], meta)
        return True
    layout, offset = [], 0
    for n, t in zip(names, ts):
        layout.append((n, offset, t.numel() * t.element_size(), _name(t.dtype), tuple(t.shape)))
        offset = -(-(offset + layout[-1][2]) // _ALIGN) * _ALIGN
    _store(_buffer(offset, ts), [(module, ts, tuple(layout), meta)])
    return True


def _why_not(modules: list[nn.Module], ts: list[Tensor | None]) -> str | None:
    """Why ``pack`` leaves the tensors ``ts`` of ``modules`` as they are, or None."""
    if any(t is None or type(t.data) is not Tensor or not t.is_contiguous() for t in ts):
        return "a tensor missing, a subclass or not contiguous"
    if len({t.device for t in ts}) != 1 or ts[0].device.type == "meta" or any(hasattr(m, "_hf_hook")
                                                                              for m in modules):
        return "on several devices, on meta, or moved by accelerate at each call"
    return None


def _buffer(nbytes: int, ts: list[Tensor]) -> Tensor:
    # the bytes typed as the weights (float8) where they are bytes: their views then need no dtype view in the graph
    # (a same-size dtype view may lower to a bitcast kernel, a copy of the weight, in some Inductor versions)
    return torch.zeros(nbytes, dtype=ts[0].dtype if ts[0].element_size() == 1 else torch.uint8, device=ts[0].device)


def _store(buf: Tensor, entries) -> None:
    """For each (module, its tensors, their layout in ``buf``, meta): the tensors copied in and made views of
    ``buf``, which the module holds as its buffer with the layout and meta beside it."""
    for module, ts, layout, meta in entries:
        with torch.no_grad():
            for t, view in zip(ts, views(buf, layout)):
                view.copy_(t)
                t.data = view
        module.register_buffer(BUFFER, buf, persistent=False)
        # one constant of strings and ints: Dynamo guards it with one comparison, and it leaves the module's guards
        # skippable as a whole where torch does that (a torch.dtype in it would not: benchmarks/NOTES.md)
        module.__dict__[LAYOUT] = (layout, meta)


def pack_together(modules: list[nn.Module], names: tuple[str, ...], metas: list) -> bool:
    """Siblings' tensors ``names`` in one buffer, each name's side by side (``[w1, w2, ..., s1, s2, ...]``), the
    buffer registered on each and each with its own layout and meta: where the backend's graph sees the siblings
    read one input (q, k and v), it multiplies their weights as one (``graph/siblings.py``). False, nothing done,
    where ``pack`` would leave one alone, or a tensor's bytes would leave the next one unaligned."""
    if together_why_not(modules, names) is not None:
        return False
    ts = [[tensor(m, n) for n in names] for m in modules]
    offsets, offset = [[0] * len(names) for _ in modules], 0
    for j in range(len(names)):
        offset = -(-offset // _ALIGN) * _ALIGN
        for i, row in enumerate(ts):
            offsets[i][j], offset = offset, offset + row[j].numel() * row[j].element_size()
    layouts = [tuple((n, o, t.numel() * t.element_size(), _name(t.dtype), tuple(t.shape))
                     for n, t, o in zip(names, row, offs))
               for row, offs in zip(ts, offsets)]
    _store(_buffer(-(-offset // _ALIGN) * _ALIGN, ts[0]), list(zip(modules, ts, layouts, metas)))
    return True


def together_why_not(modules: list[nn.Module], names: tuple[str, ...]) -> str | None:
    """Why ``pack_together`` would leave these siblings apart, or None."""
    if len(modules) < 2:
        return "no sibling to share a buffer with"
    ts = [[tensor(m, n) for n in names] for m in modules]
    if (why := _why_not(modules, [t for row in ts for t in row])) is not None:
        return why
    if any(t.numel() * t.element_size() % (_ALIGN if j == 0 else 16) for row in ts for j, t in enumerate(row)):
        return "a weight or scales whose bytes would leave the next one unaligned"  # TMA reads weights; 16-byte loads
    return None


def is_packed(module: nn.Module, names: tuple[str, ...]) -> bool:
    """Whether ``module``'s tensors ``names`` are views of its packed buffer, in its layout."""
    buf, found = module._buffers.get(BUFFER), module.__dict__.get(LAYOUT)
    if buf is None or found is None or tuple(e[0] for e in found[0]) != tuple(names):
        return False
    return is_packed_in(module, buf, found[0])


def is_packed_in(module: nn.Module, buf: Tensor, layout: tuple) -> bool:
    base = buf.data_ptr()
    return all((t := tensor(module, n)) is not None and t.data_ptr() == base + off and _name(t.dtype) == dt
               and tuple(t.shape) == shape for n, off, _, dt, shape in layout)


def unpack(module: nn.Module, apart: bool = False) -> None:
    """Drop ``module``'s packing: its compiled steps read its tensors again, which stay views of the same bytes or,
    ``apart``, get a storage each again (as before ``pack``; one layer's bytes copied at a time)."""
    found = module.__dict__.pop(LAYOUT, None)
    buf = module._buffers.pop(BUFFER, None)
    layout = found[0] if found is not None else None
    if apart and layout is not None and buf is not None and is_packed_in(module, buf, layout):
        with torch.no_grad():
            for name, *_ in layout:
                t = tensor(module, name)
                t.data = t.data.clone()


def views(buf: Tensor, layout: tuple) -> tuple[Tensor, ...]:
    """The packed tensors as views of ``buf`` (in a compiled graph: reinterpretations of its input, no kernel)."""
    out = []
    for _, off, size, dt, shape in layout:
        b = buf[off:off + size]
        out.append((b if dt == _name(buf.dtype) else b.view(getattr(torch, dt))).view(shape))
    return tuple(out)


def pickled_state(module: nn.Module, state: dict) -> dict:
    """``state`` (a copy of ``module.__dict__``) as pickle should write it: where ``module`` is packed, without the
    buffer and its layout and each packed tensor a copy of its own (one storage viewed as float8 and float32 cannot
    be pickled; a loaded model is unpatched anyway)."""
    found = state.get(LAYOUT)
    if found is None:
        return state
    state = {k: v for k, v in state.items() if k != LAYOUT}
    state["_buffers"] = dict(state["_buffers"])
    state["_non_persistent_buffers_set"] = set(state["_non_persistent_buffers_set"]) - {BUFFER}
    buf = state["_buffers"].pop(BUFFER, None)
    if buf is not None and is_packed_in(module, buf, found[0]):
        state["_parameters"] = dict(state["_parameters"])
        for name, *_ in found[0]:
            if (p := state["_parameters"].get(name)) is not None:
                q = nn.Parameter(p.data.clone(), p.requires_grad)
                q.__dict__.update(p.__dict__)
                state["_parameters"][name] = q
            else:
                state["_buffers"][name] = state["_buffers"][name].clone()
    return state


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def read(module: nn.Module) -> tuple[tuple[Tensor, ...], object] | None:
    """In compiled code: (``module``'s packed tensors in their layout's order, the ``meta`` given to ``pack``); None
    where it holds none (then read the module's own). Read as attributes, never through ``module.__dict__``: Dynamo
    then guards the module as it guards any, and can skip those guards while the module's dicts are unchanged."""
    found = getattr(module, LAYOUT, None)
    buf = module._buffers.get(BUFFER) if found is not None else None
    return (views(buf, found[0]), found[1]) if buf is not None else None


def _replaced(module: nn.Module, name: str, value):
    """Global registration hook: a tensor registered on a packed module (a packed one replaced, a bias added that
    ``meta`` says is absent) ends the packing: the buffer or the meta would be stale."""
    if name != BUFFER and LAYOUT in module.__dict__:
        unpack(module)


torch.nn.modules.module.register_module_parameter_registration_hook(_replaced)
torch.nn.modules.module.register_module_buffer_registration_hook(_replaced)
