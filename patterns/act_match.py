"""Recognize an activation subgraph and name it in the activation registry (``mlp_fuser/activations.py``).

The subgraph is what lies between a projection's output and the node the rest of the MLP reads: a chain of
elementwise ops of that one tensor and Python constants (``F.silu``, ``nn.GELU``, HF's ``ACT2FN`` classes, or a
formula such as gelu_new's ``0.5 * x * (1 + tanh(√(2/π) (x + 0.044715 x³)))``). It is identified by running it in
float64 on probe points and comparing with each registry activation: the way it is written does not matter,
only what it computes. Nodes outside the elementwise whitelist end the subgraph.
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.fx import Node
from torch.fx.node import map_arg

from mlp_fuser.activations import ACTIVATIONS

from .common import input_name, is_identity, same_shape, val

ELEMENTWISE_FNS = {
    operator.mul, operator.add, operator.sub, operator.truediv, operator.neg, operator.pow,
    torch.mul, torch.add, torch.sub, torch.div, torch.pow, torch.neg, torch.square,
    torch.tanh, torch.sigmoid, torch.erf, torch.exp, torch.sqrt, torch.rsqrt, torch.relu,
    torch.special.erf, torch.special.expit, torch.nn.functional.tanh, torch.nn.functional.sigmoid,
    F.relu, F.gelu, F.silu,  # F.gelu is torch._C._nn.gelu, as graphs record it
}  # fmt: skip
ELEMENTWISE_METHODS = {
    "mul", "add", "sub", "div", "pow", "neg", "square", "tanh", "sigmoid", "erf", "exp", "sqrt", "rsqrt", "relu",
}  # fmt: skip
MAX_NODES = 32

_PROBE = torch.cat([torch.linspace(-8.0, 8.0, 321), torch.tensor([-30.0, -1e-3, 1e-3, 30.0, math.pi])]).double()


@dataclass
class ActMatch:
    out: Node  # the activation's output
    leaf: Node  # its one tensor input (a projection's output)
    nodes: list[Node] = field(default_factory=list)  # the subgraph, in topological order
    name: str | None = None  # registry name, or None when it computes none of them
    reads: list[str] = field(default_factory=list)  # tensors it reads besides its input (learned parameters)

    @property
    def desc(self) -> str:
        def short(n):
            t = n.target
            return t if isinstance(t, str) else getattr(t, "__name__", str(t))

        text = " → ".join(short(n) for n in self.nodes)
        if self.reads:
            text += f" (it reads tensors besides its input: {', '.join(self.reads)}; the op's activations are " \
                    "functions of the input alone)"
        return text


def _elementwise(n: Node) -> bool:
    if n.op == "call_function":
        return n.target in ELEMENTWISE_FNS or is_identity(n)
    return n.op == "call_method" and (n.target in ELEMENTWISE_METHODS or is_identity(n))


def _inputs(n: Node) -> list[Node]:
    if is_identity(n):
        return [n.args[0]] if isinstance(n.args[0], Node) else []
    found: list[Node] = []
    map_arg((n.args, n.kwargs), lambda m: found.append(m))
    return found


def _evaluate(nodes: list[Node], leaf: Node, out: Node, x: torch.Tensor) -> torch.Tensor:
    env = {leaf: x}
    for n in nodes:
        if is_identity(n):
            env[n] = env[n.args[0]]
            continue
        args = map_arg(n.args, lambda m: env[m])
        kwargs = {k: v for k, v in map_arg(n.kwargs, lambda m: env[m]).items() if k != "inplace"}
        fn = getattr(torch.Tensor, n.target) if n.op == "call_method" else n.target
        env[n] = fn(*args, **kwargs)
    return env[out]


def identify(nodes: list[Node], leaf: Node, out: Node) -> str | None:
    """The registry name of the function the subgraph computes, or None."""
    try:
        y = _evaluate(nodes, leaf, out, _PROBE.clone())
    except Exception:
        return None
    if not isinstance(y, torch.Tensor) or y.shape != _PROBE.shape:
        return None
    for name, act in ACTIVATIONS.items():
        if torch.allclose(y, act.fn(_PROBE), rtol=1e-6, atol=1e-9):
            return name
    return None


def match(out: Node, is_leaf: Callable[[Node], bool]) -> ActMatch | None:
    """The elementwise subgraph ending at ``out`` with exactly one tensor input, which ``is_leaf`` accepts."""
    nodes: list[Node] = []
    leaves: list[Node] = []
    seen: set[Node] = set()

    def visit(n: Node) -> bool:
        if n in seen:
            return True
        seen.add(n)
        if (n is not out and is_leaf(n)) or not _elementwise(n):
            leaves.append(n)
            return len(leaves) == 1
        for m in _inputs(n):
            if not visit(m):
                return False
        nodes.append(n)
        return len(nodes) <= MAX_NODES

    if not visit(out) or len(leaves) != 1 or not nodes or not is_leaf(leaves[0]):
        return _opaque(out, is_leaf) or _with_parameters(out, is_leaf)
    return ActMatch(out, leaves[0], nodes=nodes, name=identify(nodes, leaves[0], out))


_SHAPE_OPS = {"view", "reshape", "transpose", "permute", "flatten", "unflatten", "squeeze", "unsqueeze", "expand"}


def _opaque(out: Node, is_leaf) -> ActMatch | None:
    """An elementwise-shaped call the registry cannot read (``F.mish``, a custom ``autograd.Function``, a clipped
    GELU) between two projections: returned unnamed, so that it is reported as a near miss."""
    chain, n = [], out
    for _ in range(3):
        inputs = [m for m in _inputs(n) if m.op != "get_attr"]
        chain.insert(0, n)
        if len(inputs) != 1:
            return None
        n = inputs[0]
        if is_leaf(n):
            same = val(out) is not None and val(n) is not None and same_shape(val(out).shape, val(n).shape)
            shape_only = all(c.target in _SHAPE_OPS for c in chain)
            return ActMatch(out, n, nodes=chain, name=None) if same and not shape_only else None
    return None


MAX_PARAMETER_NUMEL = 4  # xIELU's alpha_p, alpha_n, beta and eps are one element each
# what an activation with parameters may apply to its input: elementwise ops (a norm's single call is not one)
_ELEMENTWISE_OF_INPUT_FNS = ELEMENTWISE_FNS | {
    torch.where, torch.gt, torch.lt, torch.ge, torch.le, operator.gt, operator.lt, operator.ge, operator.le,
    torch.min, torch.max, torch.minimum, torch.maximum, torch.clamp, torch.clip, torch.expm1, torch.log1p, torch.log,
    torch.abs, torch.sign, F.softplus, F.elu, F.leaky_relu,
}  # fmt: skip
_ELEMENTWISE_OF_INPUT_METHODS = ELEMENTWISE_METHODS | {
    "gt", "lt", "ge", "le", "clamp", "clip", "expm1", "log1p", "log", "abs", "sign", "minimum", "maximum", "where",
}  # fmt: skip


def _with_parameters(out: Node, is_leaf) -> ActMatch | None:
    """An activation of one projection's output that also reads a few tiny tensors, learned parameters or buffers
    (Apertus' xIELU: ``where(x > 0, α_p·x² + β·x, (expm1(min(x, ε)) − x)·α_n + β·x)`` with softplus'd scalars):
    returned unnamed, with what it reads, so that it is reported as a near miss. Every node that depends on the
    projection's output must be elementwise and keep its shape (a chain of ops on it, not a norm's one call)."""
    nodes: list[Node] = []
    leaves: list[Node] = []
    reads: list[Node] = []
    depends: dict[Node, bool] = {}

    def visit(n: Node) -> bool:
        if n in depends:
            return True
        if n is not out and is_leaf(n):
            leaves.append(n)
            depends[n] = True
            return len(leaves) == 1
        if n.op in ("placeholder", "get_attr"):
            v = val(n)
            if v is None or v.numel() > MAX_PARAMETER_NUMEL:
                return False
            reads.append(n)
            depends[n] = False
            return True
        if n.op not in ("call_function", "call_method"):
            return False
        inputs = _inputs(n)
        for m in inputs:
            if not visit(m):
                return False
        depends[n] = any(depends[m] for m in inputs)
        nodes.append(n)
        return len(nodes) <= MAX_NODES

    if not visit(out) or len(leaves) != 1 or not reads:
        return None
    shape = val(leaves[0]).shape if val(leaves[0]) is not None else None
    if shape is None or any(depends[n] and not _elementwise_of_input(n, shape) for n in nodes):
        return None

    return ActMatch(out, leaves[0], nodes=nodes, name=None, reads=[input_name(n) for n in reads])


def _elementwise_of_input(n: Node, shape) -> bool:
    ok = n.target in _ELEMENTWISE_OF_INPUT_FNS if n.op == "call_function" else n.target in _ELEMENTWISE_OF_INPUT_METHODS
    return (ok or is_identity(n)) and val(n) is not None and same_shape(val(n).shape, shape)
