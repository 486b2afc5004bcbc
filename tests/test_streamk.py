"""The stream-K gate/up kernel (kernels/streamk.py) against float64: whole tiles, tiles shared by two and by three
programs, programs walking forwards and backwards, every weight layout of test_kernels' cases; poisoned outputs;
bitwise determinism. The interpreter runs programs one after another, so only the GPU suite sees other arrival
orders (the sum order does not depend on them)."""

import zlib

import pytest
import torch
from conftest import KERNEL_DEVICE, KERNEL_DTYPES
from test_kernels import SHAPES, Shape, _f64, check, make_inputs, poisoned_empty

from mlp_fuser.kernels import streamk
from mlp_fuser.kernels.common import cdiv
from mlp_fuser.reference import reference_gate_up

# (BLOCK_M, BLOCK_N, BLOCK_K, programs, num_warps, num_stages)
CONFIGS = [(16, 32, 16, 5, 4, 1), (16, 32, 16, 20, 4, 1), (32, 16, 32, 3, 4, 1), (16, 16, 16, 64, 4, 1),
           (16, 32, 32, 1, 4, 1)]


def schedule(M, N, K, config):
    """(programs launched, units per program, K steps per tile, the number of programs each tile is shared by)."""
    BM, BN, BK, programs = config[:4]
    tiles, k_iters = cdiv(M, BM) * cdiv(N, BN), cdiv(K, BK)
    iters = cdiv(tiles * k_iters, programs)
    grid = cdiv(tiles * k_iters, iters)
    shared_by = [len({u // iters for u in range(t * k_iters, (t + 1) * k_iters)}) for t in range(tiles)]
    return grid, iters, k_iters, shared_by


def test_the_cases_cover_every_kind_of_tile():
    """Whole tiles only, tiles split in two and in three or more, several tiles in one program: each occurs."""
    kinds = set()
    for M, N, K in [(17, 127, 130), (67, 130, 130), (1, 5, 3)]:
        for config in CONFIGS:
            grid, iters, k_iters, shared_by = schedule(M, N, K, config)
            kinds |= {min(n, 3) for n in shared_by}
            if iters > k_iters:
                kinds.add("several tiles")
    assert kinds == {1, 2, 3, "several tiles"}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s", SHAPES, ids=str)
def test_gate_up_act_streamk(s, dtype):
    config = CONFIGS[zlib.crc32(str(s).encode()) % len(CONFIGS)]
    x, wg, bg, wu, bu, _, _ = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()) + 1)
    with poisoned_empty():
        h = streamk.gate_up_act_streamk(x, wg, bg, wu, bu, s.act, config)
    ref = reference_gate_up(*_f64((x, wg, bg, wu, bu)), s.act)
    check(h, ref, reference_gate_up(x, wg, bg, wu, bu, s.act), ref.to(dtype), dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("config", CONFIGS, ids=str)
@pytest.mark.parametrize("gated", [True, False], ids=["gated", "plain"])
def test_shared_tiles(config, gated, dtype):
    """17x130 @ 130x127: 2 m-blocks, a ragged last n-block and K step; every config, fresh inputs each call."""
    s = Shape(17, 130, 127, 3, "silu" if gated else "gelu", gated, (True, gated, False), "mixed" if gated else
              "padded", "strided")
    for seed in (11, 12):
        x, wg, bg, wu, bu, _, _ = make_inputs(s, dtype, seed=seed)
        with poisoned_empty():
            h = streamk.gate_up_act_streamk(x, wg, bg, wu, bu, s.act, config)
        ref = reference_gate_up(*_f64((x, wg, bg, wu, bu)), s.act)
        check(h, ref, reference_gate_up(x, wg, bg, wu, bu, s.act), ref.to(dtype), dtype)
        assert torch.equal(h, streamk.gate_up_act_streamk(x, wg, bg, wu, bu, s.act, config)), "deterministic"


def test_default_config_and_empty():
    x = torch.randn(37, 70, device=KERNEL_DEVICE)
    w = torch.randn(50, 70, device=KERNEL_DEVICE) * 70**-0.5
    ref = reference_gate_up(x.double(), w.double(), None, w.double(), None, "silu")
    check(streamk.gate_up_act_streamk(x, w, None, w, None, "silu"), ref, None, None, torch.float32)
    assert streamk.gate_up_act_streamk(x[:0], w, None, w, None, "silu").shape == (0, 50)
