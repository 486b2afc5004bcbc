"""The split-K down-projection kernel (kernels/splitk.py): float64 reference, poisoned output, determinism."""

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES

from mlp_fuser.kernels import splitk
from mlp_fuser.reference import rel_err


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("M,K,N,config", [
    (1, 1, 1, None), (17, 130, 127, None), (3, 300, 5, (16, 32, 32, 4, 4, 1)), (33, 257, 129, (16, 16, 16, 5, 4, 1)),
])
def test_linear_splitk(M, K, N, config, dtype):
    for bias in (True, False):
        h = torch.randn(M, 2 * K, device=KERNEL_DEVICE).to(dtype)[:, ::2]  # non-contiguous rows
        w_t = (torch.randn(K, N, device=KERNEL_DEVICE) * K**-0.5).to(dtype)  # Conv1D-like storage
        w = w_t.t() if bias else w_t.t().contiguous()
        b = torch.randn(N, device=KERNEL_DEVICE).to(dtype) if bias else None
        ref = h.double() @ w.double().t() + (b.double() if bias else 0)
        y = torch.full((M, N), float("nan"), device=KERNEL_DEVICE, dtype=dtype)  # poison: all must be written
        splitk.linear_splitk(h, w, b, config, out=y)
        err = rel_err(y, ref)
        if dtype == torch.float32:
            assert err <= 1e-5
        else:  # one rounding of the fp32 result, as F.linear does
            assert err <= 1.25 * rel_err(torch.nn.functional.linear(h, w, b), ref) + 1e-6
        assert torch.equal(y, splitk.linear_splitk(h, w, b, config)), "split-K sum must be deterministic"


def test_calls_of_different_shapes_interleaved():
    """Each call has its own workspace: a call with more tiles or splits between two others changes nothing."""
    shapes = [(4, 200, 30, (16, 16, 32, 4, 4, 1)), (20, 300, 70, (16, 16, 32, 3, 4, 1)), (4, 200, 30, None)]
    for M, K, N, config in shapes * 2:
        h = torch.randn(M, K, device=KERNEL_DEVICE)
        w = torch.randn(N, K, device=KERNEL_DEVICE) * K**-0.5
        y = splitk.linear_splitk(h, w, None, config)
        assert rel_err(y, h.double() @ w.double().t()) <= 1e-5


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("impl", ["triton_gemm_splitk", "triton_swapab"])
def test_counters_zeroed_by_the_gate_up_kernel(impl, dtype, monkeypatch):
    """The two launches of triton_gemm_splitk and triton_swapab: their gate/up kernel zeroes the split-K kernel's
    arrival counters, which start as garbage here (poisoned), so a counter left unzeroed leaves tiles unwritten or
    reduced twice."""
    from mlp_fuser.dispatch import dense as dispatch
    from mlp_fuser.runtime import dense as runtime_dense

    M, K, I, O = 5, 48, 1024, 40  # I long enough for the default config to split it, on the GPU and the CPU
    assert splitk._plan(M, O, I, splitk.splitk_config(M, O, I, dtype.itemsize, torch.device(KERNEL_DEVICE)))[1] > 1
    made, real = [], splitk.splitk_counters

    def poisoned(*args):
        counters = real(*args)
        counters.fill_(-7)
        made.append(counters)
        return counters

    monkeypatch.setattr(runtime_dense, "splitk_counters", poisoned)
    x = torch.randn(M, K, device=KERNEL_DEVICE).to(dtype)
    wg, wu = ((torch.randn(I, K, device=KERNEL_DEVICE) * K**-0.5).to(dtype) for _ in range(2))
    wd = (torch.randn(O, I, device=KERNEL_DEVICE) * I**-0.5).to(dtype)
    ref = torch.nn.functional.silu(x.double() @ wg.double().t()) * (x.double() @ wu.double().t()) @ wd.double().t()
    y = dispatch.IMPLS_BY_NAME[impl].fn(x, wg, None, wu, None, wd, None, "silu")
    assert len(made) == 1
    F = torch.nn.functional
    unfused = F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)
    assert rel_err(y, ref) <= 1.25 * rel_err(unfused, ref) + 1e-6
