"""The package's layers: every import (module-level or inside a function) points down the order below or stays
within its layer, and no import circle exists (type-only imports aside). The README's "How it works" draws this.
One dispatcher: every op family's implementations are rows of one ``Impl``, chosen and timed in dispatch/core.py."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
# Bottom to top; a module may import its own layer and those before it. The package's __init__ (the public API)
# sits above the library; tools and the command line use that API.
LAYERS = [
    ("base", ["mlp_fuser.compat", "mlp_fuser.config", "mlp_fuser.activations", "mlp_fuser.reference"]),
    ("kernels", ["mlp_fuser.kernels"]),
    ("runtime", ["mlp_fuser.runtime"]),
    ("dispatch", ["mlp_fuser.dispatch"]),
    ("ops", ["mlp_fuser.ops"]),
    ("patterns", ["mlp_fuser.patterns"]),
    ("graph", ["mlp_fuser.graph"]),
    ("patch", ["mlp_fuser.patch"]),
    ("explain", ["mlp_fuser.explain"]),
    ("api", ["mlp_fuser"]),
    ("tools", ["mlp_fuser.tools", "mlp_fuser.cli", "mlp_fuser.__main__"]),
]


def _modules() -> dict[str, Path]:
    """Every module of the package by dotted name (patterns/ ships as mlp_fuser.patterns)."""
    found = {}
    for pkg, base in (("mlp_fuser", ROOT / "mlp_fuser"), ("mlp_fuser.patterns", ROOT / "patterns")):
        for f in base.rglob("*.py"):
            parts = f.relative_to(base).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join((pkg, *parts))] = f
    return found


def _layer(module: str) -> int:
    """The index of the layer owning ``module``: its longest matching prefix."""
    best = max(((len(p), i) for i, (_, prefixes) in enumerate(LAYERS) for p in prefixes
                if module == p or module.startswith(p + ".")), default=None)
    assert best is not None, f"{module} belongs to no layer: add it to LAYERS in tests/test_layers.py"
    return best[1]


def _type_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under ``if TYPE_CHECKING:``."""
    lines = set()
    for n in ast.walk(tree):
        if isinstance(n, ast.If) and "TYPE_CHECKING" in ast.unparse(n.test):
            lines |= {m.lineno for s in n.body for m in ast.walk(s) if isinstance(m, ast.ImportFrom | ast.Import)}
    return lines


def import_graph(modules: dict[str, Path]) -> dict[str, dict[str, int]]:
    """module -> {imported package module: line}, for every import in the module's file, at any depth."""
    graph = {}
    for name, path in modules.items():
        tree = ast.parse(path.read_text())
        skip, edges = _type_only(tree), {}
        package = name if path.name == "__init__.py" else name.rpartition(".")[0]
        for n in ast.walk(tree):
            if getattr(n, "lineno", None) in skip:
                continue
            if isinstance(n, ast.Import):
                targets = [a.name for a in n.names]
            elif isinstance(n, ast.ImportFrom):
                base = n.module or ""
                if n.level:
                    up = package.split(".")[: len(package.split(".")) - (n.level - 1)]
                    base = ".".join(up + ([base] if base else []))
                # `from pkg import sub` imports the submodule; `from pkg import name` the package itself
                targets = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in n.names]
            else:
                continue
            for t in targets:
                while t not in modules and "." in t:  # `import mlp_fuser.x.y` of a name inside x
                    t = t.rpartition(".")[0]
                if t in modules and t != name:
                    edges.setdefault(t, n.lineno)
        graph[name] = edges
    return graph


def _cycle(graph: dict[str, dict[str, int]]) -> list[str] | None:
    """One import circle of ``graph`` as a list of modules, or None."""
    state, stack = {}, []

    def visit(m):
        state[m] = 1
        stack.append(m)
        for t in graph[m]:
            if state.get(t) == 1:
                return stack[stack.index(t):] + [t]
            if t not in state and (found := visit(t)):
                return found
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (found := visit(m)):
            return found
    return None


def upward(graph: dict[str, dict[str, int]]) -> list[str]:
    return [f"{m} (layer {LAYERS[_layer(m)][0]}) imports {t} (layer {LAYERS[_layer(t)][0]}) at line {line}"
            for m, edges in sorted(graph.items()) for t, line in edges.items() if _layer(t) > _layer(m)]


def test_every_import_goes_down():
    assert upward(import_graph(_modules())) == []


def test_no_import_circle():
    assert _cycle(import_graph(_modules())) is None


def test_the_check_sees_upward_imports_and_circles():
    modules = _modules()
    graph = import_graph(modules)
    assert graph["mlp_fuser.ops.dense"].get("mlp_fuser.dispatch.dense")  # a relative import, resolved
    assert "mlp_fuser.patterns" in graph["mlp_fuser.graph.fx_pass"]  # `from mlp_fuser import patterns`
    graph["mlp_fuser.kernels.common"] = {**graph["mlp_fuser.kernels.common"], "mlp_fuser.ops.moe": 1}
    assert any(u.startswith("mlp_fuser.kernels.common (layer kernels) imports") for u in upward(graph))
    assert _cycle({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}}) == ["a", "b", "c", "a"]


def _definitions(modules: dict[str, Path], pattern: str) -> list[str]:
    """The modules whose source matches ``pattern`` (a line's start), once per match."""
    return [name for name, path in sorted(modules.items())
            for _ in re.finditer(pattern, path.read_text(), re.MULTILINE)]


def test_one_dispatcher():
    """One ``Impl`` class, one timing routine and one GPU sleep behind which candidates are timed, all in
    dispatch/core.py: a family with its own is a second dispatcher (the dense, experts, router and FP8 tables are
    rows of it)."""
    modules = _modules()
    core = ["mlp_fuser.dispatch.core"]
    assert _definitions(modules, r"^\s*class Impl\b") == core
    assert _definitions(modules, r"^\s*def time_candidates\b") == core
    assert _definitions(modules, r"^(?!\s*def ).*gpu_sleep\(") == core  # its one caller outside compat
    from mlp_fuser.dispatch import core as dispatch_core
    from mlp_fuser.dispatch import dense, experts, fp8, fp8_experts, router

    for table in (dense.IMPLS, dense.BACKWARD_IMPLS, experts.IMPLS, router.IMPLS, fp8.IMPLS, fp8_experts.IMPLS,
                  fp8_experts.BACKWARD_IMPLS):
        assert all(type(i) is dispatch_core.Impl for i in table)


def _calls_between_modules(fn) -> list[tuple[str, str, str]]:
    """(caller module, callee module, callee function) of every Python call from one of the package's modules into
    another that ``fn()`` makes, in order."""
    by_file = {str(path.resolve()): name for name, path in _modules().items()}
    calls = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_back is not None:
            callee = by_file.get(frame.f_code.co_filename)
            caller = by_file.get(frame.f_back.f_code.co_filename)
            if callee and caller and callee != caller:
                calls.append((caller, callee, frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return calls


@pytest.mark.parametrize("path", ["cpu", "recorded", "planned"])
def test_the_dense_ops_call_passes_each_layer_once(monkeypatch, path):
    """Following the dense op's input from its entry (torch.ops, no gradient): ops validates and calls the dispatcher
    once, the dispatcher chooses (or finds the plan it keeps) and calls down into runtime and kernels, and nothing
    calls back up a layer (runtime calling the dispatcher's or the op's functions, the op looking a plan up before or
    after the dispatcher). ``recorded``: as on CUDA, the chosen implementation's launches recorded into a plan;
    ``planned``: a later call with that signature, run by the plan the dispatcher keeps (a stand-in here)."""
    import torch

    from mlp_fuser import config
    from mlp_fuser.dispatch import dense as dispatch
    from mlp_fuser.reference import reference_mlp, rel_err

    dtype = torch.float32
    x, wg, wu, wd = (torch.randn(*s, dtype=dtype) for s in ((2, 3, 32), (48, 32), (48, 32), (16, 48)))
    if path != "cpu":
        monkeypatch.setattr(config, "triton_on_cpu", True)  # the interpreter runs the Triton act·mul
        monkeypatch.setattr(config, "force_impl", "cublas_act_mul")
        monkeypatch.setattr(dispatch, "plans_apply", lambda x: True)  # as on CUDA
    ran = []
    if path == "planned":
        def plan(*tensors):
            ran.append(1)
            return reference_mlp(*tensors, "silu")
        a = dispatch.MLPArgs(x, wg, None, wu, None, wd, None, "silu")
        monkeypatch.setitem(dispatch.PLANS, dispatch.signature(a, False), plan)
    y = []
    with torch.no_grad():
        calls = _calls_between_modules(
            lambda: y.append(torch.ops.mlp_fuser.gated_mlp.default(x, wg, None, wu, None, wd, None, "silu")))
    want = reference_mlp(*(t.double() for t in (x, wg)), None, wu.double(), None, wd.double(), None, "silu")
    assert rel_err(y[0], want) < 1e-5
    assert [c for c in calls if _layer(c[1]) > _layer(c[0])] == []  # a call up a layer
    below_ops = [c for c in calls if c[0].startswith("mlp_fuser.ops") and _layer(c[1]) < _layer(c[0])
                 and LAYERS[_layer(c[1])][0] != "base"]
    assert below_ops == [("mlp_fuser.ops.dense", "mlp_fuser.dispatch.dense", "run")]
    assert (ran == [1]) == (path == "planned")
    if path == "recorded":
        assert ("mlp_fuser.dispatch.dense", "mlp_fuser.runtime.plans", "record") in calls


class _EveryPlan(dict):
    """A plan cache holding a stand-in plan for every signature (``make(key)``)."""

    def __init__(self, make):
        super().__init__()
        self.make = make

    def get(self, key, default=None):
        return self.make(key)


@pytest.mark.parametrize("save", [False, True], ids=["recompute", "save"])
@pytest.mark.parametrize("entry,path", [("op", "cpu"), ("eager", "cpu"), ("eager", "recorded"), ("eager", "planned")])
def test_the_dense_ops_training_call_passes_each_layer_once(monkeypatch, entry, path, save):
    """A call with gradients, forward and backward, followed as above: the op validates and calls down once for the
    forward (the training path's entry, or the dispatcher's ``run`` where the op redispatches a recomputing call) and
    once for the backward, and nothing calls back up (plans record the launches of code that runs inside the
    recording, not of a callback). ``op``: through torch.ops; ``eager``: patch's entry (plain tensors), where on CUDA
    the forward and the backward record plans (``recorded``) and later run them (``planned``: stand-ins here)."""
    import torch

    from mlp_fuser import config
    from mlp_fuser.dispatch import dense as dispatch
    from mlp_fuser.dispatch import dense_training as training
    from mlp_fuser.ops import dense as ops
    from mlp_fuser.reference import reference_mlp, rel_err

    dtype = torch.float32
    x, wg, wu, wd = (torch.randn(*s, dtype=dtype) for s in ((2, 3, 32), (48, 32), (48, 32), (16, 48)))
    dy = torch.randn(2, 3, 16, dtype=dtype)
    leaves = [t.clone().requires_grad_() for t in (x, wg, wu, wd)]
    if path != "cpu":
        monkeypatch.setattr(config, "triton_on_cpu", True)  # the interpreter runs the Triton act·mul and backward
        monkeypatch.setattr(config, "force_impl", "cublas_act_mul")
        monkeypatch.setattr(dispatch, "plans_apply", lambda x: True)  # as on CUDA
    ran = []
    if path == "planned":
        def forward_plan(key):
            return lambda *t: ran.append("forward") or reference_mlp(*t, "silu")

        def saving_plan(key):
            return lambda *t: ran.append("saving") or training.forward_saving(dispatch.MLPArgs(*t, "silu"))

        def backward_plan(bkey):  # (the forward's signature, need, ...)
            return lambda dy, *t: ran.append("backward") or training.backward_core(
                bkey[1], dy, dispatch.MLPArgs(*t[:7], "silu"), *t[7:])

        for name, make in (("PLANS", forward_plan), ("SAVING_PLANS", saving_plan), ("BACKWARD_PLANS", backward_plan)):
            monkeypatch.setattr(dispatch, name, _EveryPlan(make))
    call = torch.ops.mlp_fuser.gated_mlp.default if entry == "op" else ops.eager_gated_mlp
    xg, wgg, wug, wdg = leaves

    def step():
        y = call(xg, wgg, None, wug, None, wdg, None, "silu", save)
        y.backward(dy)
        ran.append(y.detach())

    calls = _calls_between_modules(step)
    y = ran.pop()
    want = [t.double().requires_grad_() for t in (x, wg, wu, wd)]
    y64 = reference_mlp(want[0], want[1], None, want[2], None, want[3], None, "silu")
    y64.backward(dy.double())
    assert rel_err(y, y64) < 1e-5
    for got, w in zip(leaves, want):
        assert rel_err(got.grad, w.grad) < 1e-5
    assert [c for c in calls if _layer(c[1]) > _layer(c[0])] == []  # a call up a layer
    below_ops = [c for c in calls if c[0].startswith("mlp_fuser.ops") and _layer(c[1]) < _layer(c[0])
                 and LAYERS[_layer(c[1])][0] != "base"]
    first = ("mlp_fuser.dispatch.dense", "run") if entry == "op" and not save else (
        "mlp_fuser.dispatch.dense_training", "forward")
    assert below_ops == [("mlp_fuser.ops.dense", *first),
                         ("mlp_fuser.ops.dense", "mlp_fuser.dispatch.dense_training", "backward")]
    if path == "planned":
        assert ran == ["saving" if save else "forward", "backward"]
    if path == "recorded":
        assert ("mlp_fuser.dispatch.dense_training", "mlp_fuser.runtime.plans", "build_backward") in calls


def _functions_with_imports() -> set[tuple[str, int]]:
    """(file, first line) of every function of the package whose body imports something."""
    found = set()
    for path in _modules().values():
        for n in ast.walk(ast.parse(path.read_text())):
            if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef) and any(
                    isinstance(m, ast.Import | ast.ImportFrom) for m in ast.walk(n)):
                found.add((str(path.resolve()), min([n.lineno, *(d.lineno for d in n.decorator_list)])))
    return found


@pytest.mark.parametrize("grad", [False, True], ids=["no_grad", "grad"])
def test_the_moe_ops_call_goes_down_to_its_kernels_without_imports(monkeypatch, grad):
    """The MoE op's input followed from torch.ops down to the Triton kernels (the interpreter on CPU), forward and,
    with gradients, backward: no call goes up a layer, and no function on the way imports anything (its modules
    are imported with the package, not per call)."""
    import torch

    from mlp_fuser import config
    from mlp_fuser.reference import Gate, reference_experts, rel_err

    monkeypatch.setattr(config, "triton_on_cpu", True)
    T, k, E, H, I = 6, 2, 4, 16, 8
    x = torch.randn(T, H, requires_grad=grad)
    ids = torch.rand(T, E).argsort(-1)[:, :k]
    wts = torch.rand(T, k) + 0.1
    wgu = (torch.randn(E, 2 * I, H) / H**0.5).requires_grad_(grad)
    wd = (torch.randn(E, H, I) / I**0.5).requires_grad_(grad)
    dy = torch.randn(T, H)
    out = []

    def call():
        with torch.set_grad_enabled(grad):
            y = torch.ops.mlp_fuser.moe_mlp.default(x, ids, wts, wgu, None, wd, None, "silu")
            if grad:
                y.backward(dy)
        out.append(y.detach())

    by_file = {str(path.resolve()): name for name, path in _modules().items()}
    called, calls = set(), []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_filename in by_file:
            called.add((frame.f_code.co_filename, frame.f_code.co_firstlineno, frame.f_code.co_name))
            caller = by_file.get(frame.f_back.f_code.co_filename) if frame.f_back is not None else None
            if caller:
                calls.append((caller, by_file[frame.f_code.co_filename], frame.f_code.co_name))

    sys.setprofile(profile)
    try:
        call()
    finally:
        sys.setprofile(None)
    want = [t.detach().double().requires_grad_(grad) for t in (x, wgu, wd)]
    y64 = reference_experts(want[0], ids, wts.double(), want[1], None, want[2], None, Gate("silu"))
    assert rel_err(out[-1], y64) < 1e-5
    if grad:
        y64.backward(dy.double())
        for t, w in zip((x, wgu, wd), want):
            assert rel_err(t.grad, w.grad) < 1e-5
    assert any(by_file[f].startswith("mlp_fuser.kernels.moe") for f, _, _ in called)  # down to its kernels
    assert [c for c in calls if _layer(c[1]) > _layer(c[0])] == []
    importing = _functions_with_imports()
    assert sorted((by_file[f], name) for f, line, name in called if (f, line) in importing) == []
