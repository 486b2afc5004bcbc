"""mlp_fuser.runtime.plans: a later call with the same signature runs the recorded launches with integers for pointers.

Plans launch compiled kernels, which only exist on a GPU (tests/test_gpu.py checks planned results there). Here
every Launcher answers with a stand-in compiled kernel that records its arguments, so the plan's wiring is checked
on the CPU: the same kernels, the same integers, each input's own pointer read per call, every intermediate a
separate piece of one workspace, the output the tensor returned.
"""

import importlib
import math

import pytest
import torch
import torch.nn.functional as F
from _mlp_cases import make_case

from mlp_fuser import activations, compat, config, reference
from mlp_fuser.dispatch import dense as dispatch
from mlp_fuser.dispatch import dense_training as training
from mlp_fuser.kernels import backward, common
from mlp_fuser.runtime import plans

act_mul_kernels = importlib.import_module("mlp_fuser.kernels.act_mul")  # the package exports a function of that name


class Recorder:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log, name):
        self.log, self.name = log, name

    def run(self, gx, gy, gz, stream, function, meta, m, enter, exit_, *args):
        self.log.append((self.name, (gx, gy, gz), args))


class AlwaysHit(dict):
    """A Launcher cache in which every key is compiled: calls take the direct path, into a Recorder."""

    def __init__(self, log, name):
        super().__init__()
        standin = Recorder(log, name)
        self.hit = (standin, (3, 2, 1), 0, common._direct(standin, (3, 2, 1), 2))  # two constexpr slots (pad)

    def get(self, key, default=None):
        return self.hit


@pytest.fixture
def recorded(monkeypatch):
    log = []
    modules = ("gemm", "splitk", "swapab", "small_m", "act_mul")
    launchers = [v for m in modules for v in vars(__import__(f"mlp_fuser.kernels.{m}", fromlist=["_"])).values()
                 if isinstance(v, common.Launcher)]
    for i, launcher in enumerate(launchers):
        monkeypatch.setattr(launcher, "cache", AlwaysHit(log, i))
        monkeypatch.setattr(launcher, "pad", (None, None), raising=False)
    monkeypatch.setattr(compat, "current_stream", lambda index: 7)
    monkeypatch.setattr(config, "triton_on_cpu", True)
    return log


def recording_gemms(monkeypatch) -> list:
    """The (input, weight as (out, in), output) of every torch.mm / torch.addmm a plan built from now on runs: the
    aten calls F.linear makes of a 2-D input, which plans call directly."""
    made = []
    mm, addmm = torch.mm, torch.addmm

    def recording_mm(a, w_t):
        made.append((a, w_t.t(), mm(a, w_t)))
        return made[-1][2]

    def recording_addmm(b, a, w_t):
        made.append((a, w_t.t(), addmm(b, a, w_t)))
        return made[-1][2]

    monkeypatch.setattr(torch, "mm", recording_mm)
    monkeypatch.setattr(torch, "addmm", recording_addmm)
    return made


def run_and_plan(key, name, fn, x, args):
    """``fn(*args)``, its plan (``plans.record``) kept for ``key`` in the dispatcher's cache, as ``dispatch.run``
    keeps it."""
    y, plan = plans.record(name, fn, x, args)
    dispatch.keep_plan(dispatch.PLANS, key, plan)
    return y


CASES = [  # (M, K, I, O, gated, bias, lead)
    (1, 64, 96, 48, True, False, (1,)),
    (5, 40, 72, 24, True, True, ()),
    (3, 32, 80, 40, False, True, (2,)),
]


@pytest.mark.parametrize("case", CASES, ids=str)
@pytest.mark.parametrize("name", sorted(plans.PLANNED))
def test_a_plan_launches_what_the_full_path_launched(recorded, name, case):
    M, K, I, O, gated, bias, lead = case
    c = make_case(M, K, I, O, gated=gated, bias=(bias,) * 3, lead=lead, dtype=torch.float16)
    impl = dispatch.IMPLS_BY_NAME[name]
    if impl.why_not(dispatch.Problem("cpu", c.x.dtype, M, K, I, O, gated)) is not None:
        pytest.skip(f"{name} does not take {case}")
    x2 = c.x.reshape(-1, K)
    args = c.record(x=x2)
    key = ("test", name, case)
    dispatch.clear_plans()
    y_full = run_and_plan(key, name, impl.fn, c.x, args)
    full = list(recorded)
    plan = dispatch.get_plan(key)
    assert plan is not None, f"{name}: no plan"
    assert full, "the full path launched nothing"

    # The plan on fresh tensors of the same signature: it must read their pointers, not the first call's.
    d = make_case(M, K, I, O, gated=gated, bias=(bias,) * 3, lead=lead, dtype=torch.float16)
    inputs = (d.x, d.wg, d.bg, d.wu, d.bu, d.wd, d.bd)
    recorded.clear()
    y_plan = plan(*inputs)
    assert y_plan.shape == (*c.x.shape[:-1], O) and y_plan.dtype == c.x.dtype
    assert [(n, g) for n, g, _ in recorded] == [(n, g) for n, g, _ in full], "other kernels or grids"

    old_inputs = {id(t): i for i, t in enumerate((x2, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd)) if t is not None}
    pieces = {}  # id(intermediate of the full call) -> (pointer in the plan's call, bytes)
    for (_, _, fargs), (_, _, pargs) in zip(full, recorded):
        assert len(fargs) == len(pargs)  # the arguments, then the constexpr slots (None)
        for a, p in zip(fargs, pargs):
            if not isinstance(a, torch.Tensor):
                assert p == a and type(p) is type(a)
            elif id(a) in old_inputs:
                assert p == inputs[old_inputs[id(a)]].data_ptr()
            elif a is y_full and name != "triton_gemm":
                assert p == y_plan.data_ptr()
            else:
                assert isinstance(p, int) and p % 16 == 0
                assert pieces.setdefault(id(a), (p, a.nbytes)) == (p, a.nbytes), "one intermediate, two pointers"
    spans = sorted(pieces.values())
    for (p, n), (q, _) in zip(spans, spans[1:]):
        assert p + n <= q, "intermediates overlap in the workspace"
    for p, _ in spans:
        assert p not in {t.data_ptr() for t in inputs if t is not None} | {y_plan.data_ptr()}


@pytest.mark.parametrize("name", sorted(plans.PLANNED))
def test_the_dispatchers_entry_records_a_plan_then_runs_it(recorded, monkeypatch, name):
    """The op's own path: ``dispatch.run`` on a validated call keeps a plan for its signature on the first call (a
    record, as plans read it) and runs that plan on the next, with no choosing."""
    c = make_case(5, 64, 96, 48, dtype=torch.float16)
    monkeypatch.setattr(config, "force_impl", name)
    monkeypatch.setattr(dispatch, "plans_apply", lambda x: True)  # as on CUDA
    a = c.record()
    dispatch.clear_plans()
    y = dispatch.run(a, 5, False)
    key = dispatch.signature(a, False)
    assert y.shape == (5, 48) and dispatch.get_plan(key) is not None
    monkeypatch.setattr(dispatch, "resolve", None)  # a call of it fails: the plan must run
    monkeypatch.setattr(dispatch, "_resolved", {})
    recorded.clear()
    assert dispatch.run(c.record(), 5, False).shape == (5, 48) and recorded


@pytest.mark.parametrize("gated", [True, False])
def test_the_cublas_act_mul_plan_launches_on_the_gate_and_up_it_computed(recorded, monkeypatch, gated):
    """Its launch reads tensors the plan itself makes with cuBLAS (g, u) and writes h, which the down projection then
    reads: the pointers in the launch must be those of this call's g, u and of the h that goes down."""
    made = recording_gemms(monkeypatch)  # (input, weight, output) of every GEMM the plan runs, in order
    linear = F.linear
    c = make_case(3, 32, 48, 16, gated=gated, bias=(True,) * 3, lead=(2,), dtype=torch.float16)
    impl = dispatch.IMPLS_BY_NAME["cublas_act_mul"]
    dispatch.clear_plans()
    run_and_plan("k", impl.name, impl.fn, c.x, c.record(x=c.x.reshape(-1, 32)))
    plan = dispatch.get_plan("k")
    assert plan is not None
    d = make_case(3, 32, 48, 16, gated=gated, bias=(True,) * 3, lead=(2,), dtype=torch.float16)
    made.clear()
    recorded.clear()
    y = plan(d.x, d.wg, d.bg, d.wu, d.bu, d.wd, d.bd)
    [(_, _, largs)] = recorded
    weights = [d.wg, d.wu, d.wd] if gated else [d.wg, d.wd]
    assert len(made) == len(weights) and all(w._base is t for (_, w, _), t in zip(made, weights))
    g = made[0][2]
    u = made[1][2] if gated else g
    h, _, out = made[-1]
    torch.testing.assert_close(g, linear(d.x.reshape(-1, 32), d.wg, d.bg), rtol=0, atol=0)
    assert largs[:3] == (g.data_ptr(), u.data_ptr(), h.data_ptr()) and largs[3] == g.numel()
    assert h.shape == (6, 48) and y.shape == (2, 3, 16) and y._base is out
    assert all(a.dim() == 2 for a, _, _ in made), "cuBLAS is handed 2-D tensors (no flattening inside F.linear)"
    assert "linear" not in plans.source(plan), "the aten GEMM itself, not F.linear's layers around it"


def test_the_cublas_act_mul_plan_runs_one_gemm_where_gate_and_up_are_stored_as_one(recorded, monkeypatch):
    """Gate and up as halves of one weight: the plan's one GEMM reads their (2I, K) view of this call's weight, and
    act·mul reads its result's two halves (u at g + I elements, rows 2I apart)."""
    made = recording_gemms(monkeypatch)

    def merged_case():
        c = make_case(3, 32, 48, 16, bias=(False, False, False), lead=(2,), dtype=torch.float16)
        w = torch.randn(96, 32, dtype=torch.float16)
        return c, (c.x, w[:48], None, w[48:], None, c.wd, None), w

    c, args, _ = merged_case()
    impl = dispatch.IMPLS_BY_NAME["cublas_act_mul"]
    dispatch.clear_plans()
    run_and_plan("k", impl.name, impl.fn, c.x, dispatch.MLPArgs(c.x.reshape(-1, 32), *args[1:], "silu"))
    plan = dispatch.get_plan("k")
    assert plan is not None and "as_strided" in plans.source(plan)
    _, args, w = merged_case()
    made.clear()
    recorded.clear()
    y = plan(*args)
    [(_, _, largs)] = recorded
    (x2, wgu, gu), (h, wd, out) = made
    assert wgu.shape == (96, 32) and wgu.data_ptr() == w.data_ptr() and wd._base is args[5] and x2.dim() == 2
    assert gu.shape == (6, 96) and largs[0] == gu.data_ptr() and largs[1] == gu.data_ptr() + 48 * 2
    assert largs[2] == h.data_ptr() and largs[3:9] == (6, 48, 96, 1, 96, 1)  # M, I, the halves' strides
    assert y.shape == (2, 3, 16) and y._base is out


def test_the_signature_tells_apart_everything_a_launch_depends_on():
    c = make_case(4, 32, 48, 16, bias=(True, True, True), dtype=torch.float16)
    base = (c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd)

    def sig(*tensors, act="silu", eager=False):
        return dispatch.signature(dispatch.MLPArgs(*tensors, act), eager)

    key = sig(*base)
    assert sig(*[t.clone() for t in base]) == key  # same metadata, other memory
    assert sig(*base, act="gelu") != key
    assert sig(*base, eager=True) != key
    for i, t in enumerate(base):
        variants = [t.float(), t.t().contiguous().t() if t.dim() == 2 else t[::1].expand(t.shape[0]).clone(),
                    torch.empty(t.numel() + 1, dtype=t.dtype)[1:].view(t.shape)]  # dtype, strides, alignment
        if t.dim() == 2:
            variants.append(t.reshape(t.shape[0] // 2, t.shape[1] * 2))  # shape
        for v in variants:
            args = list(base)
            args[i] = v
            if v.stride() == t.stride() and v.dtype == t.dtype and v.shape == t.shape and \
                    v.data_ptr() % 16 == t.data_ptr() % 16:
                continue  # not a variant of this tensor
            assert sig(*args) != key, (i, v.shape, v.stride(), v.dtype)
    assert sig(c.x, c.wg, None, *base[3:]) != key
    w = torch.cat([c.wg, c.wu])  # gate and up stored as one weight, else the same metadata
    assert sig(c.x, w[:48], c.bg, w[48:], *base[4:]) != key
    for setting, value in (("force_impl", "reference"), ("autotune", False)):
        old = getattr(config, setting)
        setattr(config, setting, value)
        try:
            assert sig(*base) != key, setting
        finally:
            setattr(config, setting, old)


def test_no_plan_while_a_launch_hook_is_set(recorded, monkeypatch):
    c = make_case(2, 32, 48, 16, dtype=torch.float16)
    x2 = c.x.reshape(-1, 32)
    impl = dispatch.IMPLS_BY_NAME["triton_gemm_splitk"]
    dispatch.clear_plans()
    run_and_plan("k", impl.name, impl.fn, c.x, c.record(x=x2))
    assert dispatch.get_plan("k") is not None
    monkeypatch.setattr(compat, "launch_hooks", lambda: True)
    assert dispatch.get_plan("k") is None  # a profiler's hook: every launch goes through Triton's own path


def test_small_m_in_fp32_without_b_down_is_not_planned(recorded):
    """There the kernel accumulates into the output itself, which must start at zero on every call."""
    c = make_case(2, 32, 48, 16, dtype=torch.float32, bias=(False, False, False))
    impl = dispatch.IMPLS_BY_NAME["triton_small_m"]
    args = c.record()
    dispatch.clear_plans()
    run_and_plan("fp32", impl.name, impl.fn, c.x, args)
    assert dispatch.get_plan("fp32") is None
    c = make_case(2, 32, 48, 16, dtype=torch.float32, bias=(False, False, True))
    run_and_plan("fp32 b", impl.name, impl.fn, c.x, c.record())
    assert dispatch.get_plan("fp32 b") is not None  # with b_down a finish kernel writes the output


# ---- training's plans: the save-mode forward and the backward, computed by stand-in kernels ------------------


class Computing:
    """A stand-in compiled kernel that computes what its kernel would, in aten ops, on the tensors behind its
    arguments (tensors from the full path, integer pointers from a plan: looked up among the tensors made so far)."""

    function, packed_metadata = "fn", "meta"

    def __init__(self, compute, made):
        self.compute, self.made, self.calls = compute, made, 0

    def run(self, gx, gy, gz, stream, function, meta, m, enter, exit_, *args):
        self.calls += 1
        by_ptr = {t.data_ptr(): t for t in self.made}
        self.compute(*[by_ptr[a] if type(a) is int and a in by_ptr else a for a in args])


class Compiled(dict):
    """A Launcher cache in which every key is compiled, into the given stand-in."""

    def __init__(self, standin):
        super().__init__()
        self.hit = (standin, (1, 1, 1), 0, common._direct(standin, (1, 1, 1), 0))

    def get(self, key, default=None):
        return self.hit


def _epilogue(act):
    """The default backward's launch: (dh, g, u, dgu, h, n, I) -> dgu = [dh·act'(g)·u | dh·act(g)], h = act(g)·u."""
    def compute(dh, g, u, dgu, h, n, N, *pad):
        gated = dgu.shape[1] == 2 * N
        want, hh = reference.reference_mlp_backward(dh, torch.eye(N, dtype=dh.dtype), g, u if gated else None,
                                                    act, h is not dgu)
        dgu.copy_(want)
        if h is not dgu:
            h.copy_(hh)
    return compute


def _act_mul(act):
    """The flat act·mul launch: (g, u, h, n) -> h = act(g)·u (act(g) where u is g: no up)."""
    def compute(g, u, h, n, *pad):
        a = activations.get_activation(act).fn(g.float())
        h.copy_(a * u.float() if u is not g else a)
    return compute


@pytest.fixture
def computing(monkeypatch):
    """The act·mul and backward launches computed by ``Computing``; every tensor torch.empty / mm / addmm makes from
    now on (plans bind them when built) is kept for the pointer lookup, torch.empty's poisoned with NaN."""
    made = []
    empty, mm, addmm = torch.empty, torch.mm, torch.addmm

    def keep(t):
        made.append(t)
        return t

    monkeypatch.setattr(torch, "empty", lambda *a, **k: keep(empty(*a, **k).fill_(float("nan"))))
    monkeypatch.setattr(torch, "mm", lambda *a, **k: keep(mm(*a, **k)))
    monkeypatch.setattr(torch, "addmm", lambda *a, **k: keep(addmm(*a, **k)))
    monkeypatch.setattr(compat, "current_stream", lambda index: 7)
    monkeypatch.setattr(config, "triton_on_cpu", True)
    stand_ins = {}

    def install(act):
        for launcher, compute in ((backward.act_mul_backward_launcher, _epilogue(act)),
                                  (act_mul_kernels._launch_act_mul_flat, _act_mul(act))):
            standin = Computing(compute, made)
            monkeypatch.setattr(launcher, "cache", Compiled(standin))
            monkeypatch.setattr(launcher, "pad", (), raising=False)
            stand_ins[launcher] = standin
        return stand_ins

    return made, install


TRAINING_CASES = [  # (M, K, I, O, gated, bias, lead)
    (6, 32, 48, 16, True, False, (2,)),
    (5, 24, 40, 12, True, True, ()),
    (4, 16, 56, 20, False, True, (1, 2)),
]
NEEDS = {"all": (True,) * 7, "frozen input": (False,) + (True,) * 6, "input only": (True,) + (False,) * 6,
         "no w_down": (True,) * 5 + (False, True)}


def _need(need, c):
    """``need`` as backward_core takes it for case c: False where the case has no such tensor."""
    tensors = (c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd)
    return tuple(n and t is not None for n, t in zip(need, tensors))


@pytest.mark.parametrize("need", list(NEEDS), ids=str)
@pytest.mark.parametrize("save", [True, False], ids=["save", "recompute"])
@pytest.mark.parametrize("case", TRAINING_CASES, ids=str)
def test_the_backward_plan_gives_the_full_paths_gradients(computing, case, save, need):
    """Planned on one call, the backward on fresh tensors of the same signature returns the full path's seven
    gradients exactly, through the same launch, with every output of torch.empty poisoned first."""
    made, install = computing
    M, K, I, O, gated, bias, lead = case
    stand_in = install("silu")[backward.act_mul_backward_launcher]

    def problem():
        c = make_case(M, K, I, O, gated=gated, bias=(bias,) * 3, lead=lead)
        x2 = c.x.reshape(-1, K)
        g = F.linear(x2, c.wg, c.bg) if save else None
        u = F.linear(x2, c.wu, c.bu) if save and gated else None
        made.extend(t for t in (c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd, g, u) if t is not None)
        return c, c.record(), g, u, torch.randn(*lead, M, O)

    dispatch.clear_plans()
    c, a, g, u, dy = problem()
    n = _need(NEEDS[need], c)
    with torch.no_grad():  # as autograd runs a backward (with grad mode on, backward_core takes aten ops)
        first = training.backward(n, dy, a, g, u, "k")  # "k": the forward's signature
        (plan,) = dispatch.BACKWARD_PLANS.values()
        c, a, g, u, dy = problem()
        want = training.backward_core(n, dy, a, g, u)
        calls = stand_in.calls
        got = training.backward(n, dy, a, g, u, "k")
    assert stand_in.calls == calls + 1, "the plan's one launch"
    assert "backward_core" not in plans.source(plan) and "resolve" not in plans.source(plan)
    for name, w, p, f in zip(("x", "wg", "bg", "wu", "bu", "wd", "bd"), want, got, first):
        assert (w is None) == (p is None) == (f is None) == (not n[("x", "wg", "bg", "wu", "bu", "wd", "bd").index(
            name)]), name
        if w is not None:
            assert p.shape == w.shape and torch.equal(p, w), name
    # and the full path itself is the gradient: against float64 autograd of the unfused MLP
    leaves = [None if t is None else t.double().requires_grad_(wanted)
              for t, wanted in zip((c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd), n)]
    reference.reference_mlp(*leaves, "silu").backward(dy.double())
    for w, leaf in zip(want, leaves):
        if w is not None:
            assert reference.rel_err(w, leaf.grad) < 1e-5


def test_no_backward_plan_from_the_reference(computing, monkeypatch):
    made, install = computing
    install("silu")
    monkeypatch.setattr(config, "force_impl", "reference")
    c = make_case(4, 16, 24, 8)
    dispatch.clear_plans()
    with torch.no_grad():
        training.backward((True,) * 7, torch.randn(4, 8), c.record(), None, None, "k")
    assert not dispatch.BACKWARD_PLANS


@pytest.mark.parametrize("case", TRAINING_CASES, ids=str)
def test_the_saving_plan_returns_what_the_full_path_does(computing, case, monkeypatch):
    """The save-mode forward planned: (y, g, u) on fresh tensors equal the full path's exactly, g and u tensors of
    their own for the backward."""
    made, install = computing
    M, K, I, O, gated, bias, lead = case
    install("silu")
    monkeypatch.setattr(dispatch, "plans_apply", lambda x: True)  # as on CUDA

    def problem():
        c = make_case(M, K, I, O, gated=gated, bias=(bias,) * 3, lead=lead)
        made.extend(t for t in (c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd) if t is not None)
        return c.record()

    dispatch.clear_plans()
    rows = M * math.prod(lead)
    training.forward(problem(), rows, True, True)
    (plan,) = dispatch.SAVING_PLANS.values()
    assert "check" not in plans.source(plan)
    a = problem()
    want = training.forward_saving(a)
    got = training.forward(a, rows, True, True)[:3]
    assert got[1].data_ptr() != want[1].data_ptr()
    for w, p in zip(want, got):
        assert (w is None) == (p is None)
        if w is not None:
            assert p.shape == w.shape and torch.equal(p, w) and not p.isnan().any()
    if gated:
        assert got[1].is_contiguous() and got[2].is_contiguous() and got[1].data_ptr() != got[2].data_ptr()
    torch.testing.assert_close(want[0], reference.reference_mlp(*a), rtol=1e-5, atol=1e-5)
