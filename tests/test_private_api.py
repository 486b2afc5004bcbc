"""Every private torch/Triton name goes through ``mlp_fuser.compat``: an ``ast`` scan of the library and the patterns.

Private: a dotted name under ``torch.`` or ``triton.`` with a segment starting with ``_`` (dunders aside), reached by
an import (``import torch._dynamo``, ``from torch._C import x``, ``from torch import _C``) or by an attribute chain on
a name bound to torch or Triton (``torch._C._foo``, ``F._x`` after ``import torch.nn.functional as F``); Triton's
internal packages (``triton.runtime``, ``triton.compiler``, ``triton.backends``), whose names Triton's public API
re-exports where it means them to be used; and the private attributes of torch's and Triton's objects
(``module._parameters``, ``tensor._base``, ...: the names in ``PRIVATE_ATTRS``), whatever the object's name.
``torch.ops.<namespace>.<op>`` is an op by its registered name (ours start with ``_`` where only our code calls them).
"""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
SCANNED = ("mlp_fuser", "patterns")
EXEMPT = {"mlp_fuser/compat.py"}  # the one door
INTERNAL = ("triton.runtime", "triton.compiler", "triton.backends")

# Private attributes of torch's and Triton's objects, looked for on any object (their owners can't be told apart
# statically): nn.Module's own dicts and hooks, Tensor and DTensor internals, Triton's compiled-kernel internals.
PRIVATE_ATTRS = frozenset({
    "_parameters", "_modules", "_buffers", "_forward_hooks", "_forward_pre_hooks", "_backward_hooks",
    "_base", "_is_view", "_local_tensor", "_spec", "_version", "_cdata", "_typed_storage",
})

# (file, dotted name or attribute) allowed outside compat, each with why no public path exists or is needed.
_MODULE_DICTS = ("nn.Module's own dicts: read on every call of a patched module, where a call through compat costs "
                 "host time, and replaced in a proof's twin; the public named_* iterators skip None and cannot replace")
ALLOWED: dict[tuple[str, str], str] = {
    ("mlp_fuser/patch/modules.py", "_modules"): _MODULE_DICTS,
    ("mlp_fuser/patch/modules.py", "_parameters"): _MODULE_DICTS,
    ("mlp_fuser/patch/modules.py", "_buffers"): _MODULE_DICTS,
    ("mlp_fuser/patch/router.py", "_modules"): _MODULE_DICTS,
    ("mlp_fuser/patch/router.py", "_parameters"): _MODULE_DICTS,
    ("mlp_fuser/patch/router.py", "_buffers"): _MODULE_DICTS,
    ("mlp_fuser/patch/fp8.py", "_modules"): _MODULE_DICTS,
    ("mlp_fuser/patch/fp8.py", "_parameters"): _MODULE_DICTS,
    ("mlp_fuser/patch/fp8.py", "_buffers"): _MODULE_DICTS,
    ("mlp_fuser/patch/packed.py", "_parameters"): _MODULE_DICTS,
    ("mlp_fuser/patch/packed.py", "_buffers"): _MODULE_DICTS,
}


def _alias_map(tree: ast.AST) -> dict[str, str]:
    """Local name -> the torch/triton dotted name it is bound to by the module's imports (any scope)."""
    names = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                root = a.name.split(".")[0]
                if root in ("torch", "triton"):
                    names[a.asname or root] = a.name if a.asname else root
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            if node.module.split(".")[0] in ("torch", "triton"):
                for a in node.names:
                    names[a.asname or a.name] = f"{node.module}.{a.name}"
    return names


def _private(dotted: str) -> bool:
    if dotted.startswith("torch.ops.") and dotted.count(".") >= 3:
        dotted = ".".join(dotted.split(".")[:3])  # torch.ops.<ns>.<op>: an op's registered name
    parts = dotted.split(".")
    if parts[0] not in ("torch", "triton"):
        return False
    if any(p.startswith("_") and not (p.startswith("__") and p.endswith("__")) for p in parts):
        return True
    return any(dotted == m or dotted.startswith(m + ".") for m in INTERNAL)


def _chain(node: ast.Attribute) -> tuple[ast.AST, list[str]]:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return node, parts[::-1]


def _parents(tree: ast.AST) -> None:
    for node in ast.walk(tree):
        for child in ast.iter_child_nodes(node):
            child.parent = node


def scan(source: str) -> list[tuple[int, str]]:
    """(line, name) of every private torch/Triton name ``source`` reaches, as the module docstring describes."""
    tree = ast.parse(source)
    _parents(tree)
    aliases = _alias_map(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names if _private(a.name)]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [(node.lineno, f"{node.module}.{a.name}") for a in node.names
                      if _private(f"{node.module}.{a.name}")]
        elif isinstance(node, ast.Attribute) and not isinstance(node.parent, ast.Attribute):
            base, parts = _chain(node)  # the whole chain once, from its outermost attribute
            if isinstance(base, ast.Name) and base.id in aliases:
                dotted = ".".join([aliases[base.id], *parts])
                if _private(dotted):
                    found.append((node.lineno, dotted))
                    continue
            if isinstance(base, ast.Name) and base.id in ("self", "cls"):
                parts = parts[1:]  # an object's own attributes are its own business
            found += [(node.lineno, p) for p in parts if p in PRIVATE_ATTRS]
    return found


def _files():
    for top in SCANNED:
        for path in sorted((ROOT / top).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            if rel not in EXEMPT:
                yield rel, path


def test_no_private_api_outside_compat():
    bad = [f"{rel}:{line}: {name}" for rel, path in _files() for line, name in scan(path.read_text())
           if (rel, name) not in ALLOWED]
    assert not bad, "private torch/Triton names outside mlp_fuser/compat.py (route them through compat):\n" + \
        "\n".join(bad)


def test_allow_list_is_live():
    """Each allowed use still exists (a stale entry would let a new use of the same name in through the list)."""
    used = {(rel, name) for rel, path in _files() for _, name in scan(path.read_text())}
    assert not set(ALLOWED) - used, sorted(set(ALLOWED) - used)
    assert all(reason.strip() for reason in ALLOWED.values())


@pytest.mark.parametrize("source, name", [
    ("import torch._dynamo", "torch._dynamo"),
    ("from torch._C import _nn", "torch._C._nn"),
    ("from torch import _C", "torch._C"),
    ("import torch\ntorch._C._foo()", "torch._C._foo"),
    ("import torch.nn.functional as F\nF._pad(1)", "torch.nn.functional._pad"),
    ("import torch\nwith torch._C._AutoDispatchBelowAutograd(): pass", "torch._C._AutoDispatchBelowAutograd"),
    ("from triton.runtime.jit import JITFunction", "triton.runtime.jit.JITFunction"),
    ("import triton\ntriton.runtime.Autotuner", "triton.runtime.Autotuner"),
    ("def f(m):\n    return m._parameters", "_parameters"),
])
def test_scan_finds(source, name):
    assert name in [n for _, n in scan(source)]


@pytest.mark.parametrize("source", [
    "import torch\ntorch.ops.mlp_fuser._inductor_mlp(1)",
    "import torch\ntorch.library.custom_op",
    "import torch\ntorch.__version__",
    "import triton.language as tl\ntl.dot",
    "class A:\n    def f(self):\n        return self._parameters",
    "def f(x):\n    return x._private_of_ours",
])
def test_scan_allows(source):
    assert scan(source) == []
