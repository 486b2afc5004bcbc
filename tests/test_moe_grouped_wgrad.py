"""The experts' backward with its weight gradients, and dx, by torch's grouped GEMM
(mlp_fuser.kernels.moe_grouped_wgrad, the ``triton_moe_backward_grouped_wgrad`` and ``triton_moe_backward_grouped``
rows) against float64 autograd through the aten reference, every gradient."""

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty
from test_moe_backward import BAR, CASES, check, grads64, make_case, op_case

from mlp_fuser.kernels import moe_grouped_wgrad as gw
from mlp_fuser.kernels.moe import ExpertAct
from mlp_fuser.kernels.moe_backward import moe_backward
from mlp_fuser.ops.moe import Gate

ROW = "triton_moe_backward_grouped_wgrad"
ROW_DX = "triton_moe_backward_grouped"


def _to8(n):  # grouped_mm's operands: rows of a multiple of 16 bytes
    return -(-n // 8) * 8


DTYPE_CASES = [(n, dt) for dt in KERNEL_DTYPES for n in CASES]


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES, ids=[f"{n}-{dt}" for n, dt in DTYPE_CASES])
def test_grouped_wgrad_matches_float64_autograd(name, dtype):
    """Every case of the Triton backward's tests (H and I rounded up to multiples of 8): sentinel ids, an expert
    without tokens, biases, interleaved and transposed weights, the clamps; dx and dwts bit for bit the Triton
    row's (the same kernels), the weight and bias gradients by grouped_mm against float64."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    H, I = _to8(H), _to8(I)
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, dtype, gated, bias, transposed)
    reason = gw.why_not(x.device, dtype, E, H, I)
    if reason is not None:  # on a GPU: the dtypes torch's CUTLASS kernel does not take say so
        with pytest.raises(NotImplementedError, match="grouped_mm"):
            moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad="grouped")
        return
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad="grouped")
        tri = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy)
    check(out, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    assert torch.equal(out[0], tri[0]) and torch.equal(out[1], tri[1])
    assert not out[4][E - 1].any() and not out[2][E - 1].any()  # the expert without tokens gets zero
    if bias:
        assert not out[3][E - 1].any() and not out[5][E - 1].any()


def test_grouped_wgrad_every_pair_dropped_and_frozen():
    """Every id a sentinel: zero gradients (every expert's run empty); without weight gradients it is the Triton
    backward's work, and the row says so."""
    from mlp_fuser.dispatch import experts

    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(5, 2, 4, 24, 16, torch.float32, bias=True)
    if gw.why_not(x.device, x.dtype, 4, 24, 16) is not None:  # a GPU: fp32 is not the CUTLASS kernel's
        x, wts, w_gu, b_gu, w_d, b_d, dy = (t.bfloat16() for t in (x, wts, w_gu, b_gu, w_d, b_d, dy))
    silu = ExpertAct("silu")
    with poisoned_empty():
        out = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped")
        ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, Gate("silu"), dy)
        check(out, ref, BAR[x.dtype])
        gone = moe_backward(x, ids, torch.zeros_like(wts), w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped")
        dropped = moe_backward(x, torch.full_like(ids, 4), wts, w_gu, b_gu, w_d, b_d, silu, False, dy,
                               wgrad="grouped")
        frozen = moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, silu, False, dy, wgrad="grouped",
                              need_weights=False)
    assert not gone[4].any() and not gone[5].any()  # every routing weight 0: no dWd, no dbd
    for g in dropped:
        assert torch.equal(g, torch.zeros_like(g))
    assert frozen[2:] == (None,) * 4
    check(frozen[:2], ref[:2], BAR[x.dtype])
    p = experts.StepProblem("cpu", torch.float32, 5, 2, 4, 24, 16, Gate("silu"), True, True, False)
    assert experts.BACKWARD_BY_NAME[ROW].not_worth(p).startswith("frozen experts")


@pytest.mark.parametrize(("name", "dtype"), DTYPE_CASES, ids=[f"{n}-{dt}" for n, dt in DTYPE_CASES])
def test_grouped_dx_matches_float64_autograd(name, dtype):
    """dx by grouped_mm (``dgrad="grouped"``) on every case: sentinel ids, an expert without tokens, biases, gated
    and plain, interleaved and transposed weights; with the weight gradients by grouped_mm (the row's mode: they and
    dwts bit for bit those of wgrad="grouped" alone), by the Triton kernel, and none (frozen experts)."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    H, I = _to8(H), _to8(I)
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, dtype, gated, bias, transposed, seed=3)
    if gw.why_not(x.device, dtype, E, H, I) is not None:  # on a GPU: the dtypes torch's CUTLASS kernel does not take
        with pytest.raises(NotImplementedError, match="grouped_mm dx"):
            moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, dgrad="grouped", need_weights=False)
        return
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    args = (x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy)
    with poisoned_empty():
        out = moe_backward(*args, wgrad="grouped", dgrad="grouped")
        gw_only = moe_backward(*args, wgrad="grouped")
        mixed = moe_backward(*args, dgrad="grouped")
        frozen = moe_backward(*args, dgrad="grouped", need_weights=False)
    for got in (out, mixed, frozen[:2]):
        check(got, ref, BAR[dtype])
    assert frozen[2:] == (None,) * 4
    assert all(torch.equal(a, b) for a, b in zip(out[1:], gw_only[1:]) if a is not None)
    assert torch.equal(out[0], mixed[0]) and torch.equal(out[0], frozen[0])
    assert not out[4][E - 1].any() and not out[2][E - 1].any()  # the expert without tokens gets zero


def test_grouped_dx_every_pair_dropped_and_refusals():
    """Every id a sentinel: dx exactly zero (every run empty, no row read); float8 experts keep their dx kernel, a
    misaligned Wgu is a named refusal, an unknown mode a ValueError."""
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(5, 2, 4, 24, 16, torch.float32, bias=True)
    if gw.why_not(x.device, x.dtype, 4, 24, 16) is not None:  # a GPU: fp32 is not the CUTLASS kernel's
        x, wts, w_gu, b_gu, w_d, b_d, dy = (t.bfloat16() for t in (x, wts, w_gu, b_gu, w_d, b_d, dy))
    silu = ExpertAct("silu")
    with poisoned_empty():
        for need in (True, False):
            dropped = moe_backward(x, torch.full_like(ids, 4), wts, w_gu, b_gu, w_d, b_d, silu, False, dy,
                                   wgrad="grouped", dgrad="grouped", need_weights=need)
            assert torch.equal(dropped[0], torch.zeros_like(x)) and not dropped[1].any()
    shifted = torch.empty(w_gu.numel() + 1, dtype=w_gu.dtype, device=w_gu.device)[1:].view(w_gu.shape)
    shifted.copy_(w_gu)
    assert "16-byte aligned" in gw.why_not(x.device, x.dtype, 4, 24, 16, shifted)
    with pytest.raises(NotImplementedError, match="no grouped_mm dx: w_gate_up"):
        moe_backward(x, ids, wts, shifted, b_gu, w_d, b_d, silu, False, dy, dgrad="grouped")
    with pytest.raises(ValueError, match="float8 experts"):
        moe_backward(x, ids, wts, w_gu, None, w_d, None, silu, False, dy, need_weights=False, dgrad="grouped",
                     scales=(None, None))
    with pytest.raises(ValueError, match="dgrad must be"):
        moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, silu, False, dy, dgrad="cutlass")


def test_why_not_says_what_grouped_mm_cannot_run(monkeypatch):
    """The reasons: strides of a multiple of 16 bytes anywhere; on CUDA bfloat16 on sm90 only, fewer than 1024
    experts (the rest is torch's fallback with a host sync, or sm100's wrong empty experts)."""
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    assert gw.why_not(cpu, torch.float32, 8, 36, 20) is None  # 4 floats: 16 bytes
    assert "multiples of 8" in gw.why_not(cpu, torch.float16, 8, 36, 24)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    monkeypatch.setattr(torch.version, "hip", None)
    assert gw.why_not(cuda, torch.bfloat16, 128, 2048, 768) is None
    assert "bfloat16 only" in gw.why_not(cuda, torch.float16, 128, 2048, 768)
    assert "fewer than 1024" in gw.why_not(cuda, torch.bfloat16, 1024, 2048, 768)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm90 only" in gw.why_not(cuda, torch.bfloat16, 128, 2048, 768)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    assert "sm_80" in gw.why_not(cuda, torch.bfloat16, 128, 2048, 768)
    from mlp_fuser.dispatch import experts

    p = experts.StepProblem("cuda", torch.bfloat16, 64, 8, 128, 2048, 768, Gate("silu"), False, True, True)
    assert "sm90 only" in experts.BACKWARD_BY_NAME[ROW].why_not(p)
    assert "sm90 only" in experts.BACKWARD_BY_NAME[ROW_DX].why_not(p)
    no_dx = experts.StepProblem("cpu", torch.float32, 5, 2, 4, 24, 16, Gate("silu"), True, False, True)
    assert experts.BACKWARD_BY_NAME[ROW_DX].not_worth(no_dx).startswith("no dx asked")


# ---- through the op: mlp_fuser.moe_mlp with gradients, the row forced -------------------------------------------


@pytest.fixture(params=[ROW, ROW_DX])
def forced_row(monkeypatch, request):
    """The Triton rows allowed on CPU tensors (the interpreter), each grouped row forced in turn, the choices
    forgotten around; (the row, the list of moe_backward's calls (need_dx, need_weights, wgrad, dgrad))."""
    from mlp_fuser import config
    from mlp_fuser.kernels import moe_backward as kbwd
    from mlp_fuser.ops import moe

    monkeypatch.setattr(config, "triton_on_cpu", True)
    monkeypatch.setattr(config, "force_impl", request.param)
    calls, real = [], kbwd.moe_backward
    monkeypatch.setattr(kbwd, "moe_backward", lambda *a, **k: calls.append((k["need_dx"], k["need_weights"],
                                                                             k["wgrad"], k["dgrad"])) or real(*a, **k))
    moe.reset()
    yield request.param, calls
    moe.reset()


OP_CASES = [("gated_top1", torch.float32), ("gated_top2_bias", torch.float32), ("plain_top1_bias", torch.float32),
            ("gated_top2_bias", torch.float16)] + [("gated_top2_bias", torch.bfloat16)] * (KERNEL_DEVICE == "cuda")


@pytest.mark.parametrize(("name", "dtype"), OP_CASES, ids=[f"{n}-{dt}" for n, dt in OP_CASES])
def test_op_gradients_through_the_row(forced_row, name, dtype):
    """Every input's gradient through mlp_fuser.moe_mlp (weights as a model's Parameters, skewed routing with an
    unused expert) against float64 autograd; frozen experts: dx and the routing weights' only."""
    import mlp_fuser

    row, calls = forced_row
    ids, act, gate, (x, wts, w_gu, b_gu, w_d, b_d, dy) = op_case(name, dtype, seed=len(name))
    E, H, I = w_d.shape
    if gw.why_not(x.device, dtype, E, H, I) is not None:  # on a GPU: forcing the row is refused with the reason
        with pytest.raises(ValueError, match=row):
            mlp_fuser.moe_mlp(x.requires_grad_(), ids, wts, w_gu, b_gu, w_d, b_d, act).sum().backward()
        return
    leaves = [t.clone().requires_grad_() for t in (x, wts)]
    leaves += [torch.nn.Parameter(t.clone()) if t is not None else None for t in (w_gu, b_gu, w_d, b_d)]
    with poisoned_empty():
        mlp_fuser.moe_mlp(leaves[0], ids, *leaves[1:], act).backward(dy)
        xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
        mlp_fuser.moe_mlp(xg, ids, wg, w_gu, b_gu, w_d, b_d, act).backward(dy)
    dgrad = "grouped" if row == ROW_DX else "triton"
    assert calls == [(True, True, "grouped", dgrad), (True, False, "grouped", dgrad)]
    ref = grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy)
    check([t.grad if t is not None else None for t in leaves], ref, BAR[dtype])
    check([xg.grad, wg.grad], ref[:2], BAR[dtype])
    assert not leaves[2].grad[E - 1].any() and leaves[2].grad[0].abs().sum() > 0


def test_backward_op_through_the_row_opchecks(forced_row):
    """mlp_fuser::moe_mlp_backward through the row: its six gradients against float64, then torch.library.opcheck."""
    from mlp_fuser.ops import moe

    row, _ = forced_row
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES["gelu_interleaved_bias_transposed"]
    dtype = torch.float32 if KERNEL_DEVICE == "cpu" else torch.bfloat16
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, 32, I, dtype, gated, bias, transposed, seed=5)
    args = (dy, x, ids, wts, w_gu, b_gu, w_d, b_d, gate.activation, gate.interleaved, gate.limit, gate.clamp_after,
            gate.up_offset, True, True)
    op = torch.ops.mlp_fuser.moe_mlp_backward.default
    p = moe.experts.problem(x, ids, w_gu, w_d, b_gu, b_d, gate, True, True)
    if gw.why_not(x.device, dtype, E, 32, I) is not None:  # a GPU other than sm90: forcing it is refused
        with pytest.raises(ValueError, match=row):
            op(*args)
        return
    with poisoned_empty():
        out = op(*args)
    assert moe.experts.choose_backward(p, (x, ids, wts, w_gu, b_gu, w_d, b_d, gate)).name == row
    check(out, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[dtype])
    torch.library.opcheck(op, args)
