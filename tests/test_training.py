"""Fine-tuning through the fused ops, on the CPU, against the unfused model.

- Every gradient of the op, both backward choices (``save_preact``), each backward implementation (aten, the
  Triton GEMM with the epilogue, cuBLAS + the Triton elementwise pass; Triton through the interpreter), fp32 and
  fp16: within 1.25 x the unfused module's error against float64; kernel outputs are poisoned (NaN) so an element
  a kernel never writes fails.
- What a fine-tuning user does, through ``patch`` and through the backend, each backward choice: an optimizer
  step, gradient accumulation, frozen weights, bf16 autocast over fp32 master weights, torch.utils.checkpoint and
  HF's ``gradient_checkpointing_enable()``, train/eval switching. The backend runs here as its graph pass followed
  by AOTAutograd without Inductor (``aot_eager``): AOTAutograd's trace of the op's autograd is what training
  depends on, and Inductor's CPU compile costs seconds per graph; the convergence test runs the real backend.
- Convergence, after Liger-Kernel's test: a tiny LLaMA fine-tuned for 30 AdamW steps follows the unfused loss
  curve within 1e-5 (fp32; the curves differ only by rounding: the fused backward sums in another order) and
  its loss falls by more than 30%.
"""

from __future__ import annotations

import copy

import pytest
import torch
from _hf_models import build, count_ops
from _mlp_cases import make_case
from conftest import KERNEL_DEVICE, poisoned_empty
from torch._dynamo.backends.debugging import aot_eager

import mlp_fuser
from mlp_fuser import compat, config
from mlp_fuser.dispatch import dense as dispatch
from mlp_fuser.graph import fx_pass
from mlp_fuser.graph.backend import pass_options
from mlp_fuser.kernels import backward as kernels_backward
from mlp_fuser.ops import dense as ops
from mlp_fuser.reference import reference_mlp, rel_err

BACKWARDS = ["recompute", "save"]
WAYS = [(way, bw) for way in ("patch", "backend") for bw in BACKWARDS]
WAY_IDS = [f"{way}-{bw}" for way, bw in WAYS]


# ---- the op's gradients -----------------------------------------------------------------------------------

NAMES = ("x", "w_gate", "b_gate", "w_up", "b_up", "w_down", "b_down")
CASES = [  # (M, K, I, O, lead, act, gated, bias, layout): odd sizes, remainders in every block of the interpreter
    (17, 24, 40, 16, (2,), "silu", True, (False, False, False), "linear"),
    (5, 33, 70, 9, (), "gelu", False, (True, False, True), "linear"),
    (7, 20, 45, 37, (3,), "gelu_tanh", True, (True, True, True), "merged"),
    (3, 17, 33, 50, (), "relu2", False, (False, False, True), "conv1d"),
]


def _grads(fn, tensors, dy):
    leaves = [None if t is None else t.detach().clone().requires_grad_(True) for t in tensors]
    fn(*leaves).backward(dy)
    return [None if t is None else t.grad for t in leaves]


def count_launches(monkeypatch, name: str) -> list:
    """A list that grows by one per launch of the backward kernel ``name`` (kernels/backward.py)."""
    attr = {"triton_backward_gemm": "_launch", "cublas_backward_act": "_launch_elementwise"}[name]
    launches, real = [], getattr(kernels_backward, attr)
    monkeypatch.setattr(kernels_backward, attr, lambda *a, **k: launches.append(1) or real(*a, **k))
    return launches


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize("backward", BACKWARDS)
@pytest.mark.parametrize("path", ["reference", "triton_backward_gemm", "cublas_backward_act"])
def test_every_gradient_within_unfused_error(path, backward, dtype, monkeypatch):
    """``path``: the backward implementation (the Triton ones through the interpreter; the forward is then the
    dispatcher's Triton choice too)."""
    device = "cpu"
    if path != "reference":
        device = KERNEL_DEVICE
        monkeypatch.setattr(config, "triton_on_cpu", True)
        monkeypatch.setattr(config, "force_impl", path)
    launches = count_launches(monkeypatch, "triton_backward_gemm" if path == "reference" else path)
    for M, K, I, O, lead, act, gated, bias, layout in CASES:
        case = make_case(M, K, I, O, gated=gated, act=act, dtype=dtype, bias=bias, layout=layout, lead=lead,
                         device=device)
        tensors = (case.x, case.wg, case.bg, case.wu, case.bu, case.wd, case.bd)
        dy = torch.randn(*case.x.shape[:-1], O, device=device).to(dtype)

        def fused(x, wg, bg, wu, bu, wd, bd, act=act, gated=gated):
            if gated:
                return mlp_fuser.gated_mlp(x, wg, bg, wu, bu, wd, bd, act, backward == "save")
            return mlp_fuser.mlp(x, wg, bg, wd, bd, act, backward == "save")

        def unfused(*ts, act=act):
            return reference_mlp(*ts, act)

        with poisoned_empty():
            got = _grads(fused, tensors, dy)
        want = _grads(unfused, tensors, dy)
        ref = _grads(unfused, [None if t is None else t.double() for t in tensors], dy.double())
        for name, g, u, r in zip(NAMES, got, want, ref):
            if r is None:
                assert g is None, name
                continue
            assert g.dtype == dtype and g.shape == r.shape, name
            err, bar = rel_err(g, r), 1.25 * rel_err(u, r) + 1e-6
            assert err <= bar, f"{case.act} {'gated' if gated else 'plain'} d{name}: {err:.3g} > {bar:.3g}"
    assert len(launches) == (0 if path == "reference" else len(CASES))


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_eager_entry_applies_the_autograd_function_itself(gated, save, monkeypatch):
    """``patch``'s entry with gradients on plain tensors applies the op's autograd.Function right there (key set None:
    no hop down the dispatcher and back); under autocast, a dispatch mode or vmap it calls the registered op. The
    gradients either way within 1.25x the unfused module's error against float64."""
    applied, real = [], ops._MLPFunction.apply
    monkeypatch.setattr(ops._MLPFunction, "apply", lambda *a: applied.append(a[0]) or real(*a))
    case = make_case(17, 24, 40, 16, gated=gated, act="gelu_tanh", dtype=torch.float32, bias=(True, False, True),
                     lead=(2,))
    tensors = (case.x, case.wg, case.bg, case.wu, case.bu, case.wd, case.bd)
    dy = torch.randn(*case.x.shape[:-1], 16)

    def entry(x, wg, bg, wu, bu, wd, bd):
        if gated:
            return ops.eager_gated_mlp(x, wg, bg, wu, bu, wd, bd, case.act, save)
        return ops.eager_mlp(x, wg, bg, wd, bd, case.act, save)

    def registered(x, wg, bg, wu, bu, wd, bd):
        if gated:
            return mlp_fuser.gated_mlp(x, wg, bg, wu, bu, wd, bd, case.act, save)
        return mlp_fuser.mlp(x, wg, bg, wd, bd, case.act, save)

    with poisoned_empty():
        direct = _grads(entry, tensors, dy)
    assert applied == [None]
    with poisoned_empty():
        dispatched = _grads(registered, tensors, dy)
    assert len(applied) == 2 and applied[1] is not None  # the op's autograd kernel passes its key set
    unfused = _grads(lambda *ts: reference_mlp(*ts, case.act), tensors, dy)
    ref = _grads(lambda *ts: reference_mlp(*ts, case.act), [None if t is None else t.double() for t in tensors],
                 dy.double())
    for name, d, o, u, r in zip(NAMES, direct, dispatched, unfused, ref):
        if r is None:
            assert d is None and o is None, name
            continue
        bar = 1.25 * rel_err(u, r) + 1e-6
        assert rel_err(d, r) <= bar and rel_err(o, r) <= bar, name

    with torch.autocast("cpu", dtype=torch.bfloat16):
        _grads(entry, tensors, dy.bfloat16())
    assert len(applied) == 3 and applied[2] is not None
    seen, plain = [], compat.plain_operands
    monkeypatch.setattr(compat, "plain_operands", lambda *a: seen.append(plain(*a)) or seen[-1])
    torch.func.vmap(lambda x: entry(x, *tensors[1:]))(case.x)
    assert seen and not any(seen)  # under vmap the registered op, whose batching fallback runs it per slice


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_double_backward(gated, save):
    """create_graph=True (a gradient penalty, gradgradcheck): the backward is differentiable again."""
    case = make_case(3, 5, 7, 4, gated=gated, dtype=torch.float64, act="gelu_tanh", lead=(2,))
    tensors = [t for t in (case.x, case.wg, case.bg, case.wu, case.bu, case.wd, case.bd) if t is not None]
    leaves = [t.detach().clone().requires_grad_(True) for t in tensors]

    def f(*ls):
        it = iter(ls)
        full = [None if t is None else next(it) for t in (case.x, case.wg, case.bg, case.wu, case.bu, case.wd, case.bd)]
        x, wg, bg, wu, bu, wd, bd = full
        if gated:
            return mlp_fuser.gated_mlp(x, wg, bg, wu, bu, wd, bd, case.act, save)
        return mlp_fuser.mlp(x, wg, bg, wd, bd, case.act, save)

    assert torch.autograd.gradgradcheck(f, leaves)


def test_backward_dispatch_rules(monkeypatch):
    """CPU: the aten backward, or under the interpreter cuBLAS dh + the Triton epilogue pass (the Triton dh GEMM only
    when asked for); MLP_FUSER_IMPL forces a backward
    implementation and leaves the forward's choice free (and a forward one leaves the backward's free); "reference"
    forces both; an unknown name is an error naming both lists."""
    args = (torch.randn(4, 3), torch.randn(3, 8), torch.randn(4, 8), None, "gelu", True)
    cpu = torch.device("cpu")

    def backward_choice():
        return dispatch.resolve_backward(cpu, torch.float32, 4, 8, 3, False, args).name

    def forward_choice():
        return dispatch.chosen(dispatch.Problem("cpu", torch.float32, 4, 3, 8, 3, False))

    assert backward_choice() == "reference"
    monkeypatch.setattr(config, "triton_on_cpu", True)
    assert backward_choice() == "cublas_backward_act"  # the Triton dh GEMM is opt-in: slower on the H200
    monkeypatch.setattr(config, "triton_backward", True)
    assert backward_choice() == "triton_backward_gemm"
    monkeypatch.setattr(config, "force_impl", "cublas_backward_act")
    assert (backward_choice(), forward_choice()) == ("cublas_backward_act", "triton_small_m")
    monkeypatch.setattr(config, "force_impl", "cublas_act_mul")
    assert (backward_choice(), forward_choice()) == ("triton_backward_gemm", "cublas_act_mul")
    monkeypatch.setattr(config, "force_impl", "reference")
    assert (backward_choice(), forward_choice()) == ("reference", "reference")
    monkeypatch.setattr(config, "force_impl", "nope")
    with pytest.raises(ValueError, match="nope.*cublas_backward_act"):
        backward_choice()


def test_save_keeps_the_pre_activations_and_recompute_keeps_nothing_of_their_size():
    case = make_case(4, 8, 16, 8, dtype=torch.float64)
    for save, expected in ((False, 0), (True, 2)):
        saved = []
        x = case.x.detach().clone().requires_grad_(True)
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            mlp_fuser.gated_mlp(x, *case.args()[1:], save).sum().backward()
        assert saved.count((4, 16)) == expected, (save, saved)


@pytest.mark.parametrize("save", [False, True])
@pytest.mark.parametrize("gated", [True, False])
def test_opcheck_with_gradients(gated, save):
    """The op family's registrations agree (schema, fake, autograd, AOTAutograd's trace) with save_preact set."""
    case = make_case(3, 8, 16, 5, gated=gated, dtype=torch.float64, act="gelu_tanh", lead=(2,))
    for t in (case.x, case.wg, case.wd):
        t.requires_grad_(True)
    torch.library.opcheck(case.op(), (*case.args(), save))


def test_opcheck_helper_ops():
    g, u, dy, wd = torch.randn(5, 7), torch.randn(5, 7), torch.randn(5, 3), torch.randn(3, 7)
    torch.library.opcheck(torch.ops.mlp_fuser.act_mul.default, (g, u, "silu"))
    torch.library.opcheck(torch.ops.mlp_fuser.act_mul.default, (g, None, "gelu"))
    for uu, need_h in ((u, True), (None, False)):
        torch.library.opcheck(torch.ops.mlp_fuser.mlp_backward.default, (dy, wd, g, uu, "silu", need_h))


def test_patching_again_with_another_backward_choice_takes_it():
    model, ids, n_mlp = tiny_llama()
    intermediate = (ids.numel(), model.config.intermediate_size)
    for backward, kept in ((None, 2 * n_mlp), ("recompute", 0), ("save", 2 * n_mlp), ("recompute", 0)):
        mlp_fuser.patch(model, **({} if backward is None else {"backward": backward}))  # None: the default, save
        saved = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t, saved=saved: saved.append(tuple(t.shape)) or t,
                                                      lambda t: t):
            loss_of(model, ids).backward()
        assert saved.count(intermediate) == kept, (backward, saved.count(intermediate))
    assert mlp_fuser.is_patched(model)


def test_backward_option_is_checked():
    with pytest.raises(ValueError, match="backward='fast'.*'recompute'.*'save'"):
        mlp_fuser.make_backend(backward="fast")
    model, _, _ = build("llama")
    with pytest.raises(ValueError, match="backward='fast'"):
        mlp_fuser.patch(model, backward="fast")


# ---- a fine-tuning user's steps, through patch and the backend ---------------------------------------------


def aot_backend(backward: str):
    """The backend's graph pass with ``backward``, then AOTAutograd without Inductor."""
    options = pass_options(backward=backward)

    def backend(gm, example_inputs):
        fx_pass.fuse_mlps(gm, **options)
        return aot_eager(gm, example_inputs)

    return backend


def fused_copy(model, way: str, backward: str):
    """(the copy whose parameters train, the callable to run it)"""
    model = copy.deepcopy(model)
    if way == "patch":
        return model, mlp_fuser.patch(model, backward=backward)
    torch._dynamo.reset()
    return model, torch.compile(model, backend=aot_backend(backward))


def tiny_llama():
    model, inputs, n_mlp = build("llama", batch=2, seq=9)
    return model.train(), inputs["input_ids"], n_mlp


def loss_of(forward, ids):
    return forward(input_ids=ids, labels=ids).loss


def backward_of(loss):
    loss.backward()
    return loss


def grads(model):
    return {n: p.grad for n, p in model.named_parameters()}


def assert_same_grads(got: dict, want: dict):
    assert got.keys() == want.keys()
    for name, g in got.items():
        if want[name] is None:
            assert g is None, f"{name}: a gradient for a frozen parameter"
        else:
            torch.testing.assert_close(g, want[name], msg=lambda m, name=name: f"{name}: {m}")


def run_fused(n_mlp, step):
    """``step()`` with the fused ops counted: at least one forward and one backward per MLP must run."""
    out = []
    calls = count_ops(lambda: out.append(step()), ops=None)
    assert calls >= 2 * n_mlp, f"the fused ops ran {calls} times, expected >= {2 * n_mlp}"
    return out[0]


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_optimizer_steps(way, backward):
    base, ids, n_mlp = tiny_llama()
    ref = copy.deepcopy(base)
    model, forward = fused_copy(base, way, backward)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (ref, model)]
    for _ in range(3):
        want = loss_of(ref, ids)
        want.backward()
        got = run_fused(n_mlp, lambda: backward_of(loss_of(forward, ids)))
        torch.testing.assert_close(got, want)
        assert_same_grads(grads(model), grads(ref))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)
    for (name, p), q in zip(model.named_parameters(), ref.parameters()):
        torch.testing.assert_close(p, q, msg=lambda m, name=name: f"after 3 steps, {name}: {m}")


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_gradient_accumulation(way, backward):
    base, ids, n_mlp = tiny_llama()
    other = torch.randint(1, 128, ids.shape, generator=torch.Generator().manual_seed(7))
    ref = copy.deepcopy(base)
    model, forward = fused_copy(base, way, backward)
    for batch in (ids, other):  # two micro-batches, one backward each, no zero_grad between
        loss_of(ref, batch).backward()
        run_fused(n_mlp, lambda batch=batch: loss_of(forward, batch).backward())
    assert_same_grads(grads(model), grads(ref))


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_frozen_weights(way, backward):
    """LoRA-style: some projections frozen (layer 0: gate and down; layer 1: the whole MLP), the rest trained."""
    base, ids, n_mlp = tiny_llama()
    mlps = [layer.mlp for layer in base.model.layers]
    for p in (mlps[0].gate_proj.weight, mlps[0].down_proj.weight, *mlps[1].parameters()):
        p.requires_grad_(False)
    ref = copy.deepcopy(base)
    model, forward = fused_copy(base, way, backward)
    loss_of(ref, ids).backward()
    run_fused(1, lambda: loss_of(forward, ids).backward())
    assert_same_grads(grads(model), grads(ref))
    assert model.model.layers[0].mlp.up_proj.weight.grad is not None


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_autocast_bf16_over_fp32_master_weights(way, backward):
    """Loss and gradients under CPU bf16 autocast: fp32 gradients, each within 1.25 x the unfused model's error
    (also under autocast) against the float64 model without autocast."""
    base, ids, n_mlp = tiny_llama()
    ref64 = copy.deepcopy(base).double()
    loss_of(ref64, ids).backward()
    ref = copy.deepcopy(base)
    model, forward = fused_copy(base, way, backward)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        want = backward_of(loss_of(ref, ids))
        got = run_fused(n_mlp, lambda: backward_of(loss_of(forward, ids)))
    bar = 1.25 * abs(want.item() - loss_of(ref64, ids).item()) + 1e-3
    assert abs(got.item() - loss_of(ref64, ids).item()) <= bar
    for (name, p), q, r in zip(model.named_parameters(), ref.parameters(), ref64.parameters()):
        assert p.grad.dtype == torch.float32, name
        err, unfused = rel_err(p.grad, r.grad), rel_err(q.grad, r.grad)
        assert err <= 1.25 * unfused + 1e-6, f"{name}: {err:.3g} > 1.25 x {unfused:.3g}"


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_hf_gradient_checkpointing(way, backward):
    base, ids, n_mlp = tiny_llama()
    ref = copy.deepcopy(base)
    base.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model, forward = fused_copy(base, way, backward)
    loss_of(ref, ids).backward()
    run_fused(n_mlp, lambda: loss_of(forward, ids).backward())
    assert_same_grads(grads(model), grads(ref))


@pytest.mark.parametrize("use_reentrant", [False, True])
@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_torch_checkpoint_around_the_mlp(way, backward, use_reentrant):
    torch.manual_seed(0)
    mlp = build("llama")[0].model.layers[0].mlp.train()
    x = torch.randn(2, 5, mlp.gate_proj.in_features)
    ref = copy.deepcopy(mlp)
    module, forward = fused_copy(mlp, way, backward)

    def step(fn, m):
        xx = x.clone().requires_grad_(True)
        torch.utils.checkpoint.checkpoint(fn, xx, use_reentrant=use_reentrant).square().sum().backward()
        return xx.grad, grads(m)

    want = step(ref, ref)
    got = run_fused(1, lambda: step(forward, module))
    torch.testing.assert_close(got[0], want[0])
    assert_same_grads(got[1], want[1])


@pytest.mark.parametrize("way,backward", WAYS, ids=WAY_IDS)
def test_train_eval_switching(way, backward):
    base, ids, n_mlp = tiny_llama()
    ref = copy.deepcopy(base)
    model, forward = fused_copy(base, way, backward)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (ref, model)]
    for _ in range(2):
        for m in (ref, model):
            m.eval()
        with torch.no_grad():
            torch.testing.assert_close(forward(input_ids=ids).logits, ref(input_ids=ids).logits)
            assert count_ops(lambda: forward(input_ids=ids)) == n_mlp
        for m in (ref, model):
            m.train()
        loss_of(ref, ids).backward()
        run_fused(n_mlp, lambda: loss_of(forward, ids).backward())
        assert_same_grads(grads(model), grads(ref))
        for opt in opts:
            opt.step()
            opt.zero_grad(set_to_none=True)


# ---- convergence ------------------------------------------------------------------------------------------

STEPS = 30


def loss_curve(model, forward, batches):
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    curve = []
    for ids in batches:
        loss = loss_of(forward, ids)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        curve.append(loss.item())
    return curve


# Every backward choice on the aten path; the slow ways (interpreter, Inductor) one each, their other choice checked
# step by step above (test_every_gradient_within_unfused_error, the WAYS tests).
CONVERGENCE = {"patch": BACKWARDS, "patch-triton": ["save"], "backend": ["recompute"]}


@pytest.mark.parametrize("way", list(CONVERGENCE))
def test_convergence_matches_unfused(way, monkeypatch):
    """A tiny LLaMA fine-tuned for 30 steps on 4 repeating batches: the fused loss curve (each backward choice of
    CONVERGENCE) follows the unfused one within 1e-5, and the loss falls by more than 30%. ``patch-triton`` runs
    the Triton kernels (the interpreter, or the GPU where there is one; fp32); ``backend`` the real backend,
    Inductor included."""
    device = KERNEL_DEVICE if way == "patch-triton" else "cpu"
    base, ids, _ = tiny_llama()
    base = base.to(device)
    g = torch.Generator().manual_seed(3)
    batches = [torch.randint(1, 128, (2, 12), generator=g).to(device) for _ in range(4)] * (STEPS // 4 + 1)
    batches = batches[:STEPS]
    ref = copy.deepcopy(base)
    want = loss_curve(ref, ref, batches)
    assert want[-1] < 0.7 * want[0], want  # it learns: 4.89 -> 3.16
    if way == "patch-triton":
        monkeypatch.setattr(config, "triton_on_cpu", True)
        monkeypatch.setattr(config, "triton_backward", True)
    for backward in CONVERGENCE[way]:
        model = copy.deepcopy(base)
        if way == "backend":
            torch._dynamo.reset()
            forward = torch.compile(model, backend=mlp_fuser.make_backend(backward=backward))
        else:
            forward = mlp_fuser.patch(model, backward=backward)
        got = loss_curve(model, forward, batches)
        worst = max(abs(a - b) for a, b in zip(got, want))
        assert worst <= 1e-5, f"{way} {backward}: the loss curves differ by up to {worst:.3g}"
    torch._dynamo.reset()
