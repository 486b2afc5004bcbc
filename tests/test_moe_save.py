"""Routed experts' backward "save" (``mlp_fuser::moe_mlp_save``): the forward's gate/up kernel keeps g and u per pair
and the Triton backward reads them instead of recomputing that grouped GEMM. In fp32 under the interpreter the kept
values are the recomputed ones, so y and every gradient equal the recompute mode's bit for bit; in fp16 (g and u
rounded before the activation, forward and backward alike) both modes against float64 autograd."""

from __future__ import annotations

import pytest
import torch
from conftest import KERNEL_DEVICE, poisoned_empty
from test_moe_backward import BAR, CASES, NAMES, check, grads64, make_case

from mlp_fuser.kernels import moe_backward as kbwd
from mlp_fuser.kernels.moe import moe_experts
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
                ("one_token_many_experts", "unsorted", "triton")]


@pytest.mark.parametrize(("name", "path", "wgrad"), KERNEL_CASES, ids=["-".join(c) for c in KERNEL_CASES])
def test_kept_gate_up_gives_the_recomputed_gradients(name, path, wgrad):
    """fp32: the forward that keeps gu gives y bit for bit, and the backward reading gu every gradient bit for bit,
    as the recomputing ones (each against float64 too); sentinel ids and an expert without tokens included."""
    T, k, E, H, I, act, gate, gated, inter, bias, transposed = CASES[name]
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(T, k, E, H, I, torch.float32, gated, bias, transposed, seed=9)
    with poisoned_empty():
        y, gu = kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path)
        y0 = moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, path)
        got = kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad=wgrad, gu=gu)
        want = kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, inter, dy, wgrad=wgrad)
    check(got, grads64(x, ids, wts, w_gu, b_gu, w_d, b_d, gate, dy), BAR[torch.float32])
    if BITWISE:
        assert torch.equal(y, y0)
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


def test_kept_gate_up_checked():
    x, ids, wts, w_gu, b_gu, w_d, b_d, dy = make_case(6, 2, 4, 16, 8, torch.float32)
    act = CASES["silu_concat"][5]
    for bad in (torch.empty(11, 16), torch.empty(12, 16, dtype=torch.float16), torch.empty(16, 12).t()):
        with pytest.raises(ValueError, match="gu"):
            kbwd.moe_backward(x, ids, wts, w_gu, b_gu, w_d, b_d, act, False, dy, gu=bad.to(KERNEL_DEVICE))
    with pytest.raises(ValueError, match="keeps no pre-activations"):
        kept(x, ids, wts, w_gu, b_gu, w_d, b_d, act, False, "pairs")
