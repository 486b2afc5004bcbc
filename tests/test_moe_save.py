"""Routed experts' backward "save" (``mlp_fuser::moe_mlp_save``): the forward's gate/up kernel keeps g and u per pair
and the Triton backward reads them instead of recomputing that grouped GEMM. In fp32 under the interpreter the kept
values are the recomputed ones, so y and every gradient equal the recompute mode's bit for bit; in fp16 (g and u
rounded before the activation, forward and backward alike) both modes against float64 autograd."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import KERNEL_DEVICE, poisoned_empty
from test_moe_backward import BAR, CASES, NAMES, check, grads64, make_case, op_case

import mlp_fuser
from mlp_fuser import config
from mlp_fuser.kernels import moe_backward as kbwd
from mlp_fuser.kernels.moe import experts_plan, moe_experts, tma_why_not
from mlp_fuser.ops import moe
from mlp_fuser.reference import rel_err

BITWISE = KERNEL_DEVICE == "cpu"  # the interpreter: gate/up's forward and backward tiles add in one order


def same(a, b) -> bool:
    return (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))


def kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path="sorted"):
    """(y, gu) of the forward that keeps gate/up's output."""
    gu = torch.empty((ids.numel(), w_gu.shape[1]), dtype=x.dtype, device=x.device)
    return moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path, gu=gu), gu


KERNEL_CASES = [("silu_concat", "sorted", "triton"), ("gelu_interleaved_bias_transposed", "sorted_fused", "triton"),
                ("plain_gelu_bias", "sorted", "triton"), ("gpt_oss_clamped", "sorted_fused", "grouped"),
                ("silu_clamp_after", "sorted", "triton"), ("silu_concat", "sorted_fused", "grouped"),
                ("one_token_many_experts", "unsorted", "triton"), ("silu_concat", "sorted_tma", "triton"),
                ("plain_gelu_bias", "sorted_tma", "grouped")]


@pytest.mark.parametrize(("name", "path", "wgrad"), KERNEL_CASES, ids=["-".join(c) for c in KERNEL_CASES])
def test_kept_gate_up_gives_the_recomputed_gradients(name, path, wgrad):
    """fp32: the forward that keeps gu gives y bit for bit, and the backward reading gu every gradient bit for bit,
    as the recomputing ones (each against float64 too); sentinel ids and an expert without tokens included."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed, seed=9)
    if wgrad == "grouped" and KERNEL_DEVICE == "cuda":  # fp32: torch's grouped GEMM is bf16-only on CUDA
        with pytest.raises(NotImplementedError, match="bfloat16 only"):
            kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad=wgrad)
        return
    if path == "sorted_tma":  # its own kernels run (the interpreter reads TMA boxes), not the pointer path's
        assert tma_why_not(x, w_gu, w_d, inter) is None
    with poisoned_empty():
        y, gu = kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path)
        y0 = moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path)
        got = kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad=wgrad, gu=gu)
        want = kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad=wgrad)
    check(got, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[torch.float32])
    if BITWISE:
        assert torch.equal(y, y0)
    if path == "sorted_tma":  # its weight tiles come transposed (another order of the sums): gu against the pointer
        _, gu_ptr = kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, "sorted")  # path's, within fp32 rounding
        valid = ((ids >= 0) & (ids < E)).reshape(-1)  # dropped pairs' rows are never written
        assert rel_err(gu[valid], gu_ptr[valid]) < 1e-6
    elif BITWISE:
        assert all(same(a, b) for a, b in zip(got, want)), [n for n, a, b in zip(NAMES, got, want) if not same(a, b)]


@pytest.mark.parametrize("name", ["silu_concat", "gpt_oss_clamped"])
def test_kept_gate_up_fp16_against_float64(name):
    """fp16: g and u rounded once, before the activation in the forward and in the backward; every gradient within
    fp16's bar of float64 autograd, as the recompute mode's."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float16, gated, bias, transposed, seed=4)
    with poisoned_empty():
        y, gu = kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter)
        got = kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, gu=gu)
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check(got, ref, BAR[torch.float16])
    y64 = moe.reference(*(t.cpu().double() if t is not None and t.is_floating_point() else t
                          for t in (x, ids.cpu(), wts, w_gu, b_gu, w_d, b_d)), gate)
    assert rel_err(y.cpu(), y64) <= BAR[torch.float16]


@pytest.mark.parametrize("path", ["sorted", "sorted_fused", "sorted_tma"])
def test_planned_forward_keeps_what_the_unplanned_one_keeps(path):
    """``experts_plan(save_gu=True)`` (the op's forward under "save") returns y and gu bit for bit as ``moe_experts``
    with a gu buffer, on every path the op's table may choose for it."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES["silu_concat"]
    x, ids, wts, w_gu, b_gu, w_d, b_d, _ = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed, seed=5)
    with poisoned_empty():
        y, gu = experts_plan(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path, save_gu=True)(
            x, ids, wts, w_gu, b_gu, w_d, b_d)
        y0, gu0 = kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path)
    valid = ((ids >= 0) & (ids < E)).reshape(-1)  # dropped pairs' rows are never written
    assert not valid.all() and torch.equal(y, y0) and torch.equal(gu[valid], gu0[valid])
    assert torch.isfinite(gu[valid]).all()


def test_kept_gate_up_checked():
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(6, 2, 4, 16, 8, torch.float32)
    act = CASES["silu_concat"][5]
    for bad in (torch.empty(11, 16), torch.empty(12, 16, dtype=torch.float16), torch.empty(16, 12).t()):
        with pytest.raises(ValueError, match="gu"):
            kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, False, dy, gu=bad.to(KERNEL_DEVICE))
    with pytest.raises(ValueError, match="keeps no pre-activations"):
        kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, False, "pairs")


# ---- the op: mlp_fuser.moe_mlp(save_preact=True) and the entries -----------------------------------------------


@pytest.fixture
def triton_rows(monkeypatch):
    """The Triton rows on CPU tensors (the interpreter), the Triton backward forced; the list of its calls, each
    (need_dx, need_weights, whether it read a kept gu)."""
    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", "triton_moe_backward")
    moe.reset()
    calls, real = [], kbwd.moe_backward
    monkeypatch.setattr(kbwd, "moe_backward", lambda *a, **k: calls.append(
        (k["need_dx"], k["need_weights"], k.get("gu") is not None)) or real(*a, **k))
    yield calls
    moe.reset()


def leaves_of(tensors, frozen=False):
    x, wts, *ws = tensors
    return [x.clone().requires_grad_(), wts.clone().requires_grad_()] + [
        None if t is None else t.clone().requires_grad_(not frozen) for t in ws]


def step(leaves, ids, act, dy, save):
    y = mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act, save_preact=save)
    y.backward(dy)
    return y.detach(), [t.grad if t is not None else None for t in leaves]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_op_save_against_recompute_and_float64(triton_rows, dtype):
    """Every gradient through the op with save_preact against the recompute mode (fp32: bit for bit) and float64;
    the backward read the kept gu, the recompute one did not."""
    ids, act, gate, tensors = op_case("gated_top2_bias", dtype, seed=13)
    dy = tensors[-1]
    with poisoned_empty():
        y, got = step(leaves_of(tensors[:-1]), ids, act, dy, True)
        y0, want = step(leaves_of(tensors[:-1]), ids, act, dy, False)
    assert triton_rows == [(True, True, True), (True, True, False)]
    x, wts, w_gu, b_gu, w_d, b_d = tensors[:-1]
    check(got, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    if BITWISE and dtype == torch.float32:
        assert torch.equal(y, y0) and all(same(a, b) for a, b in zip(got, want))


def test_op_save_frozen_experts_3d_input(triton_rows):
    """Frozen experts: the forward still keeps gu (dx and dwts read it), gradients reach x and the routing weights
    only; x with two leading dimensions."""
    ids, act, gate, tensors = op_case("gated_top1", torch.float32, seed=2)
    x, wts, w_gu, b_gu, w_d, b_d, dy = tensors
    xg, wg = x.clone().view(1, *x.shape).requires_grad_(), wts.clone().view(1, *wts.shape).requires_grad_()
    with poisoned_empty():
        y = mlp_fuser.moe_mlp(xg, ids.view(1, *ids.shape), wg, w_gu, b_gu, w_d, b_d, act, save_preact=True)
        y.backward(dy.view(1, *dy.shape))
    assert triton_rows == [(True, False, True)]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check([xg.grad.view(x.shape), wg.grad.view(wts.shape)], ref[:2], BAR[torch.float32])


def test_op_save_checkpointed_under_autocast(triton_rows):
    """Non-reentrant checkpointing and fp16 autocast over fp32 master weights: the recomputed forward keeps gu
    again, the backward reads it, the fp32 leaves' gradients within fp16's bar of float64."""
    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=11)
    leaves = [torch.nn.Parameter(t.clone()) for t in tensors[:-1]]
    dy = tensors[-1]

    def f(*args):
        return mlp_fuser.moe_mlp(args[0], ids, *args[1:], act, save_preact=True)

    with torch.autocast(KERNEL_DEVICE, dtype=torch.float16), poisoned_empty():
        y = torch.utils.checkpoint.checkpoint(f, *leaves, use_reentrant=False)
    assert y.dtype == torch.float16
    y.backward(dy.half())
    assert triton_rows == [(True, True, True)]
    assert all(t.grad.dtype == torch.float32 for t in leaves)
    check([t.grad for t in leaves], grads64(tensors[0], ids, *tensors[1:-1], gate, dy), BAR[torch.float16])


def test_no_gate_up_kept_without_gradients(triton_rows, monkeypatch):
    """Inference with save_preact: no gradient recorded (no_grad) or none asked (nothing requires grad) never calls
    moe_mlp_save, so gu is never stored; eager entry and op entry alike."""
    kept_calls = []
    real = moe._forward_save
    monkeypatch.setattr(moe, "_forward_save", lambda *a: kept_calls.append(1) or real(*a))
    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case("gated_top2_bias", torch.float32, seed=5)
    args = (x, ids, wts, w_gu, b_gu, w_d, b_d, act)
    with torch.no_grad():
        y0 = moe.eager_moe_mlp(*(t.clone().requires_grad_() if t is x else t for t in args), save_preact=True)
        mlp_fuser.moe_mlp(*(t.clone().requires_grad_() if t is x else t for t in args), save_preact=True)
    y1 = moe.eager_moe_mlp(*args, save_preact=True)
    mlp_fuser.moe_mlp(*args, save_preact=True)
    assert not kept_calls and torch.equal(y0, y1)
    mlp_fuser.moe_mlp(x.clone().requires_grad_(), *args[1:], save_preact=True)
    assert kept_calls == [1]


def test_save_forward_plan_reused(triton_rows):
    """The first call of a signature builds its launch plan, the next ones run it: the same y and gu bit for bit as
    the first call's, x with two leading dimensions too."""
    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case("gated_top2_bias", torch.float32, seed=10)
    op = torch.ops.mlp_fuser.moe_mlp_save.default
    for shape in (x.shape, (1, *x.shape)):
        args = (x.view(shape), ids.view(*shape[:-1], -1), wts.view(*shape[:-1], -1), w_gu, b_gu, w_d, b_d, act)
        moe.reset()
        with poisoned_empty():
            first = op(*args)
            assert len(moe._SAVING) == 1
            again = op(*args)
        valid = ids.reshape(-1) < w_gu.shape[0]  # rows of dropped pairs are left unwritten
        assert first[0].shape == shape and torch.equal(first[0], again[0])
        assert torch.equal(first[1][valid], again[1][valid]) and not first[1][valid].isnan().any()


def test_save_op_double_backward_through_aten(triton_rows):
    """create_graph=True through moe_mlp_save: the aten path, as for moe_mlp (its gu unread), differentiable again."""
    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=12)
    outs = []
    for save in (True, False):
        leaves = [t.detach().clone().requires_grad_() for t in tensors[:-1]]
        y = mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act, save_preact=save)
        grads = torch.autograd.grad(y, leaves, tensors[-1], create_graph=True)
        outs.append((*grads, *torch.autograd.grad((grads[0] * grads[0]).sum(), leaves[4])))
    assert not triton_rows
    assert all(rel_err(a, b) <= BAR[torch.float32] for a, b in zip(*outs))


def saved_bytes(fn) -> int:
    """The bytes of the distinct storages autograd keeps for the backward while ``fn()`` runs."""
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        fn()
    return sum(seen.values())


@pytest.mark.parametrize("triton_on_cpu", [True, False])
def test_saved_bytes(triton_rows, monkeypatch, triton_on_cpu):
    """What the save mode keeps beyond the recompute mode: gu, T·k·2I elements of x's dtype, exactly; nothing where
    the Triton backward cannot run (the aten path recomputes: gu is empty)."""
    monkeypatch.setattr(config, "triton_on_cpu", triton_on_cpu)
    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=6)
    if not triton_on_cpu:  # the aten path: CPU tensors without the opt-in (on CUDA the Triton backward runs)
        ids, tensors = ids.cpu(), [t.cpu() if t is not None else None for t in tensors]
    leaves = leaves_of(tensors[:-1])
    T, k = ids.shape
    extra = T * k * leaves[2].shape[1] * 4 if triton_on_cpu else 0
    modes = [saved_bytes(lambda s=s: mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act, save_preact=s))
             for s in (False, True)]
    assert modes[1] - modes[0] == extra


def test_save_op_compiled_and_opcheck(triton_rows):
    """moe_mlp_save under torch.compile (AOTAutograd: gu a saved output of the forward graph, the backward op reading
    it) gives eager's y and gradients (fp32: bit for bit); opcheck passes (routing without sentinels: rows of dropped
    pairs in gu are left unwritten)."""
    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=8)
    dy = tensors[-1]
    torch._dynamo.reset()
    f = torch.compile(lambda *a: mlp_fuser.moe_mlp(a[0], ids, *a[1:], act, save_preact=True), backend="aot_eager",
                      fullgraph=True)
    leaves = leaves_of(tensors[:-1])
    y = f(*leaves)
    y.backward(dy)
    y0, want = step(leaves_of(tensors[:-1]), ids, act, dy, True)
    assert triton_rows == [(True, True, True)] * 2
    got = [t.grad if t is not None else None for t in leaves]
    if BITWISE:
        assert torch.equal(y.detach(), y0) and all(same(a, b) for a, b in zip(got, want))
    check(got, grads64(tensors[0], ids, *tensors[1:-1], gate, dy), BAR[torch.float32])
    torch._dynamo.reset()
    valid = ids.clamp(max=tensors[2].shape[0] - 1)
    x, *rest = leaves_of(tensors[:-1])
    torch.library.opcheck(torch.ops.mlp_fuser.moe_mlp_save.default, (x, valid, *rest, act))


def test_save_op_empty_and_dropped(triton_rows):
    """No tokens, and every pair dropped (sentinel ids only): zero output and zero gradients."""
    ids, act, gate, tensors = op_case("gated_top2_bias", torch.float32, seed=3)
    for T, ids_ in ((0, ids[:0]), (ids.shape[0], torch.full_like(ids, tensors[2].shape[0]))):
        leaves = leaves_of([t[:T] if i < 2 else t for i, t in enumerate(tensors[:-1])])
        y = mlp_fuser.moe_mlp(leaves[0], ids_, *leaves[1:], act, save_preact=True)
        y.backward(torch.ones_like(y))
        assert not y.any() and all(not t.grad.any() for t in leaves if t is not None)


# ---- the user's switches: patch(backward=...), config.moe_backward, the backend ------------------------------


def test_patch_backward_save_and_the_config(monkeypatch):
    """patch(model, backward="save") keeps gu in every experts layer of a training step, with the recompute mode's
    loss and gradients (fp32: bit for bit); plain patch follows config.moe_backward ("recompute" by default); the
    experts switch reads config.moe_backward at each call; unpatch forgets the module's mode."""
    from test_moe_training import tiny_qwen3_moe

    from mlp_fuser.patch import experts

    monkeypatch.setattr(config, "triton_on_cpu", True)
    moe.reset()
    kept_calls = []
    real = moe._forward_save
    monkeypatch.setattr(moe, "_forward_save", lambda *a: kept_calls.append(1) or real(*a))
    base = tiny_qwen3_moe()
    layers = base.config.num_hidden_layers
    ids = torch.randint(1, base.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(5))
    ids = ids.to(KERNEL_DEVICE)

    def train_step(model, forward):
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    results = {}
    for mode in ("save", "recompute", None):
        model = copy.deepcopy(base)
        forward = mlp_fuser.patch(model, **({} if mode is None else {"backward": mode}))
        kept_calls.clear()
        results[mode] = train_step(model, forward)
        assert len(kept_calls) == (layers if mode == "save" else 0), mode
        mlp_fuser.unpatch(model)
        assert not any(experts.BACKWARD in m.__dict__ for m in model.modules())
    (loss, grads), (loss0, grads0) = results["save"], results["recompute"]
    assert grads.keys() == grads0.keys()
    if BITWISE:
        assert torch.equal(loss, loss0)
        assert all(torch.equal(grads[name], grads0[name]) for name in grads), "save's gradients are not recompute's"
    else:  # the GPU's tiles add gate/up in another order per mode: each within fp32's bar of float64
        exact = copy.deepcopy(base).double()
        exact.set_experts_implementation("eager")  # transformers' per-expert loop: grouped_mm takes no float64
        _, exact_grads = train_step(exact, exact)
        for name, g64 in exact_grads.items():
            err, err0 = rel_err(grads[name], g64), rel_err(grads0[name], g64)
            # a ratio of the two would compare rounding noise (H100: 1.2e-6 against 8.2e-7 on a norm's weight)
            assert max(err, err0) < 1e-5, f"{name}: save {err:.2e} from float64, recompute {err0:.2e}"

    model = copy.deepcopy(base)
    model.set_experts_implementation(experts.NAME)
    monkeypatch.setattr(config, "moe_backward", "save")
    kept_calls.clear()
    train_step(model, model)
    assert len(kept_calls) == layers
    monkeypatch.setattr(config, "moe_backward", "keep")
    with pytest.raises(ValueError, match="moe_backward"):
        train_step(model, model)
    moe.reset()


def test_backend_without_inductor_and_pass_keep_gate_up(monkeypatch):
    """The graph pass rewrites a training graph's experts to moe_mlp_save where asked (save_experts, or
    config.moe_backward without it), inference graphs to moe_mlp; make_backend(inductor=False, backward="save")
    trains through it."""
    from test_moe_families import experts_modules, graphs_of, toy

    from mlp_fuser.graph import fx_pass

    model, inputs = toy("qwen3_moe")
    n_layers = len(experts_modules(model))

    def ops_in(graphs, **kw):
        for gm in graphs:
            fx_pass.fuse_mlps(gm, **kw)
        targets = [n.target for gm in graphs for n in gm.graph.nodes]
        return (targets.count(torch.ops.mlp_fuser.moe_mlp_save.default),
                targets.count(torch.ops.mlp_fuser.moe_mlp.default))

    assert ops_in(graphs_of(model, inputs, True), save_experts=True) == (n_layers, 0)
    assert ops_in(graphs_of(model, inputs, True)) == (0, n_layers)
    monkeypatch.setattr(config, "moe_backward", "save")
    assert ops_in(graphs_of(model, inputs, True)) == (n_layers, 0)
    assert ops_in(graphs_of(model, inputs, True), save_experts=False) == (0, n_layers)
    assert ops_in(graphs_of(model, inputs, False), save_experts=True) == (0, n_layers)
    monkeypatch.setattr(config, "moe_backward", "recompute")
    kept_calls = []
    real = moe._forward_save
    monkeypatch.setattr(moe, "_forward_save", lambda *a: kept_calls.append(1) or real(*a))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mlp_fuser.make_backend(inductor=False, backward="save"))
    out = compiled(*inputs).logits
    out.sum().backward()
    assert len(kept_calls) == n_layers
    with torch.no_grad():
        assert rel_err(out.detach(), model(*inputs).logits) <= 1e-5
    torch._dynamo.reset()
