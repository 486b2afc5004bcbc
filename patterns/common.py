"""What every pattern shares: reading FX nodes, pass-through nodes, and the candidate a pattern returns."""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.experimental.symbolic_shapes import statically_known_true

if TYPE_CHECKING:  # both modules import this one
    from .act_match import ActMatch
    from .projections import Proj

DROPOUT = (F.dropout, torch.dropout, torch.nn.functional.dropout)
# Nodes that hand their first argument on unchanged (a no-op cast is checked later by the dtype check).
IDENTITY_METHODS = ("to", "type", "type_as", "float", "double", "half", "bfloat16", "contiguous")
MUL = (operator.mul, torch.mul)
CLAMP_FNS = (torch.clamp, torch.clip, torch.clamp_min, torch.clamp_max)
CLAMP_METHODS = ("clamp", "clip", "clamp_min", "clamp_max")


def is_fn(n, *targets) -> bool:
    return isinstance(n, Node) and n.op == "call_function" and n.target in targets


def is_method(n, *names) -> bool:
    return isinstance(n, Node) and n.op == "call_method" and n.target in names


def arg(n: Node, i: int, name: str, default=None):
    return n.args[i] if len(n.args) > i else n.kwargs.get(name, default)


def module_path(n: Node) -> str:
    """The dotted path of the innermost module that produced ``n`` (``model.layers.0.mlp.gate_proj``)."""
    stack = n.meta.get("nn_module_stack") or {}
    return clean_path(list(stack.values())[-1][0]) if stack else ""


def clean_path(path: str) -> str:
    """A module stack's path (``L['self']._modules['model'].layers[0]``) as users write it (``model.layers.0``)."""
    path = re.sub(r"^L\['[^']*'\](\[\d+\])?(\.__self__)?\.?|^self\.?", "", path)  # the root: L['self'], L['args'][0]
    path = re.sub(r"\._modules\['([^']*)'\]|\['([^']*)'\]", lambda m: "." + (m.group(1) or m.group(2)), path)
    path = re.sub(r"\[(\d+)\]", r".\1", path)
    return path.strip(".")


def val(n):
    """The node's example value (a fake tensor under Dynamo), or None."""
    if not isinstance(n, Node):
        return None
    v = n.meta.get("example_value", n.meta.get("val"))
    return v if isinstance(v, torch.Tensor) else None


def input_name(n: Node) -> str:
    """A graph input as its user knows it, read back from Dynamo's name for it: a parameter or buffer by its path
    (``l_self_modules_model_modules_layers_modules_0_..._parameters_weight_`` -> ``model.layers.0....weight``),
    an argument by its name (``l_hidden_states_`` -> ``hidden_states``)."""
    parts = re.split(r"_(?:modules|parameters|buffers)_", n.name.rstrip("_"))
    if len(parts) > 1:  # the first part is the root module's argument (l_self, l_fn_self)
        return ".".join(parts[1:])
    return re.sub(r"^l_", "", n.name).rstrip("_")


def same(a, b) -> bool:
    """Provably equal ints or SymInts, without adding a guard."""
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    try:
        return bool(statically_known_true(a == b))
    except Exception:
        return False


def same_shape(a, b) -> bool:
    return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))


def is_dropout(n) -> bool:
    return is_fn(n, *DROPOUT)


def dropout_active(n: Node) -> bool:
    p = arg(n, 1, "p", 0.5)
    training = arg(n, 2, "training" if n.target is not torch.dropout else "train", True)
    return bool(training) and p != 0


def is_identity(n) -> bool:
    return is_dropout(n) or is_method(n, *IDENTITY_METHODS)


def is_mul(n) -> bool:
    return (is_fn(n, *MUL) or is_method(n, "mul")) and len(n.args) == 2 and all(isinstance(a, Node) for a in n.args)


def is_clamp(n) -> bool:
    return (is_fn(n, *CLAMP_FNS) or is_method(n, *CLAMP_METHODS)) and bool(n.args) and isinstance(n.args[0], Node)


def clamp_text(n: Node) -> str:
    """``clamp(min=-7.0, max=7.0)``: the clamp and its bounds, as a near miss names them."""
    name = n.target if isinstance(n.target, str) else n.target.__name__
    bounds = [repr(a) for a in n.args[1:]] + [f"{k}={v!r}" for k, v in n.kwargs.items()]
    return f"{name}({', '.join(bounds)})"


def strip(n: Node) -> tuple[Node, list[Node]]:
    """Walk back through dropout and no-op-cast nodes; return the first real node and the nodes passed."""
    passed = []
    while is_identity(n) and isinstance(n.args[0], Node):
        passed.append(n)
        n = n.args[0]
    return n, passed


@dataclass
class Candidate:
    """One MLP site as a pattern sees it; the checks and the rewrite live in ``mlp_fuser.graph.fx_pass``."""

    pattern: str
    down: Proj
    gate: Proj  # the only first projection of a plain MLP
    up: Proj | None
    act: ActMatch
    extra: list[Node] = field(default_factory=list)  # mul and pass-through nodes between the pieces
    unsupported: str | None = None  # why the op cannot compute this site although it is shaped like an MLP

    def intermediates(self) -> list[Node]:
        """Every node whose value is internal to the MLP: none may have a user outside the site."""
        nodes = list(self.gate.nodes) + list(self.act.nodes) + list(self.extra)
        nodes += list(self.up.nodes) if self.up is not None else []
        nodes += list(self.down.x_nodes) + [n for n in self.down.nodes if n is not self.down.out]
        return list(dict.fromkeys(nodes))


def dependents(node: Node) -> set[Node]:
    """Every node that reads ``node``, directly or through others."""
    seen, todo = set(), list(node.users)
    while todo:
        n = todo.pop()
        if n not in seen:
            seen.add(n)
            todo.extend(n.users)
    return seen
