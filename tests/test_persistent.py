"""The persistent whole-MLP kernel (kernels/persistent.py) against float64: ragged M, K, I and O, several m-blocks and
chunks, one chunk, chunks that are not a whole number of BLOCK_Ks, strided x, transposed-stride weights, every bias on
and off; poisoned workspace and output; bitwise determinism; the counters' final values; a piece that waits for its
chunk. The interpreter runs programs one after another (program 0 claims every item, all of phase A first), so the
wait is tested by a second thread that finishes a chunk while the kernel spins; the GPU suite sees real races."""

import threading
import time
import zlib

import pytest
import torch
import torch.nn.functional as F
from conftest import HAS_CUDA, KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty, requires_cuda
from test_kernels import Shape, _f64, check, make_inputs

from mlp_fuser.kernels import persistent
from mlp_fuser.kernels.common import cdiv, k_loop_fits
from mlp_fuser.reference import reference_gate_up, reference_mlp

# (BLOCK_M, BLOCK_N, BLOCK_K, BLOCK_O, CHUNK_TILES, PROGRAMS_PER_SM, num_warps, num_stages)
TWO_K = (16, 32, 32, 32, 2, 1, 4, 1)  # chunks of 64 columns: two BLOCK_Ks
RAGGED = (32, 16, 32, 16, 3, 1, 4, 1)  # chunks of 48 columns: a part BLOCK_K in every chunk
MANY = (16, 16, 16, 32, 1, 2, 4, 1)  # a chunk per tile of h
ONE = (16, 32, 32, 32, 64, 1, 4, 1)  # one chunk: y stored by the piece itself, no partials

CASES = [
    (Shape(1, 45, 100, 37, "silu", True, (True, True, True), "linear", "strided"), TWO_K),
    (Shape(5, 130, 127, 70, "gelu_tanh", False, (True, False, False), "conv1d", "contiguous"), RAGGED),
    (Shape(37, 64, 130, 70, "silu", True, (False, True, True), "mixed", "strided"), TWO_K),
    (Shape(70, 33, 95, 20, "gelu_tanh", True, (False, False, False), "merged", "transposed"), RAGGED),
    (Shape(37, 50, 77, 45, "silu", False, (False, False, True), "padded", "contiguous"), MANY),
    (Shape(17, 130, 127, 70, "gelu_tanh", True, (True, True, True), "conv1d", "strided"), ONE),
    (Shape(37, 70, 130, 50, "silu", True, (True, False, True), "linear", "strided"), None),
]


def chunks_of(s: Shape, config) -> tuple[int, int]:
    """(chunks, m-blocks) of a case."""
    BM, BN, _, _, chunk_tiles = config[:5]
    return cdiv(cdiv(s.I, BN), chunk_tiles), cdiv(s.M, BM)


def test_cases_cover_the_schedule():
    """Several chunks with several m-blocks, one chunk, ragged last chunks, chunks not a whole number of BLOCK_Ks."""
    kinds = set()
    for s, config in CASES:
        if config is None:
            continue
        chunks, num_m = chunks_of(s, config)
        BM, BN, BK, BO, chunk_tiles = config[:5]
        kinds.add("one chunk" if chunks == 1 else "several chunks, m-blocks" if num_m > 1 else "several chunks")
        if cdiv(s.I, BN) % chunk_tiles:
            kinds.add("short last chunk")
        if (chunk_tiles * BN) % BK:
            kinds.add("part BLOCK_K in a chunk")
        if s.M % BM and s.I % BN and s.O % BO and s.K % BK:
            kinds.add("ragged M, I, O, K")
    assert kinds == {"one chunk", "several chunks", "several chunks, m-blocks", "short last chunk",
                     "part BLOCK_K in a chunk", "ragged M, I, O, K"}


def _check_mlp(y, args, act, dtype):
    x, wg, bg, wu, bu, wd, bd = _f64(args)
    ideal = F.linear(reference_gate_up(x, wg, bg, wu, bu, act).to(dtype).double(), wd, bd).to(dtype)
    check(y, reference_mlp(x, wg, bg, wu, bu, wd, bd, act), reference_mlp(*args, act), ideal, dtype)


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("s,config", CASES, ids=[f"{s}-{c}" for s, c in CASES])
def test_fused_mlp_persistent(s, config, dtype):
    """Output, h and partials all NaN before the call (poisoned torch.empty): each is written before it is read."""
    args = make_inputs(s, dtype, seed=zlib.crc32(str(s).encode()))
    with poisoned_empty():
        y = persistent.fused_mlp_persistent(*args, s.act, config)
    _check_mlp(y, args, s.act, dtype)
    assert torch.equal(y, persistent.fused_mlp_persistent(*args, s.act, config)), "must be deterministic"


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=str)
@pytest.mark.parametrize("bias", [(g, u, d) for g in (0, 1) for u in (0, 1) for d in (0, 1)], ids=str)
def test_each_bias(bias, dtype):
    s = Shape(5, 40, 70, 33, "silu", True, tuple(map(bool, bias)), "linear", "contiguous")
    args = make_inputs(s, dtype, seed=sum(bias) + 4 * bias[0] + 2 * bias[1])
    with poisoned_empty():
        y = persistent.fused_mlp_persistent(*args, s.act, TWO_K)
    _check_mlp(y, args, s.act, dtype)


def _capture_workspace(monkeypatch):
    made = []

    def capture(*a):
        made.append(real(*a))
        return made[-1]

    real = persistent._workspace
    monkeypatch.setattr(persistent, "_workspace", capture)
    return made


@pytest.mark.parametrize("s,config", [c for c in CASES if c[1] is not None], ids=str)
def test_workspace_after_a_call(s, config, monkeypatch):
    """After a call: every item claimed once (and one failed claim per program), each chunk's ready counters count
    its tiles, each tile of y counts one arrival per chunk; y is the fp32 partials summed in chunk order, plus
    b_down, rounded once: bitwise."""
    made = _capture_workspace(monkeypatch)
    args = make_inputs(s, torch.float32, seed=1)
    y = persistent.fused_mlp_persistent(*args, s.act, config)
    counters, _, partials = (t.cpu() for t in made[0])
    chunks, num_m = chunks_of(s, config)
    BM, BN, _, BO, chunk_tiles, per_sm = config[:6]
    n_tiles, num_o = cdiv(s.I, BN), cdiv(s.O, BO)
    items = num_m * n_tiles + chunks * num_m * num_o
    grid = min(persistent.num_sms(torch.device(KERNEL_DEVICE)) * per_sm, items)
    assert counters[0] == items + grid
    tiles = [min(chunk_tiles, n_tiles - c * chunk_tiles) for c in range(chunks)]
    assert counters[1:1 + chunks * num_m].tolist() == [t for t in tiles for _ in range(num_m)]
    assert counters[1 + chunks * num_m:].tolist() == [chunks if chunks > 1 else 0] * (num_m * num_o)
    if chunks > 1:
        total = torch.zeros(s.M, s.O)
        for part in partials.view(chunks, s.M, s.O):
            total = total + part
        bd = args[6]
        assert torch.equal(y.cpu(), total + bd.cpu() if bd is not None else total)


@pytest.mark.skipif(HAS_CUDA, reason="the interpreter's memory is the tensors' own: a host thread can race it")
def test_piece_waits_for_its_chunk(monkeypatch):
    """Phase B alone (work counter preset past phase A) on the h of a finished run, one tile of chunk 0 of m-block 0
    missing (NaN, its ready count one short): the kernel must spin until a second thread writes the tile and raises
    the counter, then give the first run's y bitwise."""
    s, config = Shape(20, 40, 100, 40, "silu", True, (True, True, True), "linear", "contiguous"), TWO_K
    args = make_inputs(s, torch.float32, seed=3)
    real = persistent._workspace
    made = _capture_workspace(monkeypatch)
    y_ok = persistent.fused_mlp_persistent(*args, s.act, config)
    ready_ok, h_ok = made[0][0].clone(), made[0][1].clone()
    chunks, num_m = chunks_of(s, config)
    BM, BN, chunk_tiles = config[0], config[1], config[4]
    late = slice((chunk_tiles - 1) * BN, chunk_tiles * BN)  # the last tile of chunk 0 (m-block 0: rows 0-15)

    def preset(*a):
        counters, h, partials = real(*a)
        counters[0] = num_m * cdiv(s.I, BN)  # phase A claimed and done
        counters[1:1 + chunks * num_m] = ready_ok[1:1 + chunks * num_m]
        counters[1] -= 1  # chunk 0, m-block 0: one tile short
        h.copy_(h_ok)
        h[:BM, late] = float("nan")
        partials.fill_(float("nan"))
        made.append((counters, h))
        return counters, h, partials

    monkeypatch.setattr(persistent, "_workspace", preset)
    out = {}
    worker = threading.Thread(target=lambda: out.setdefault("y", persistent.fused_mlp_persistent(*args, s.act, config)),
                              daemon=True)  # a kernel that never sees the tile must not keep pytest alive
    worker.start()
    time.sleep(2.0)
    assert worker.is_alive(), "the kernel went on without the missing tile"
    counters, h = made[1]
    h[:BM, late] = h_ok[:BM, late]
    counters[1] += 1  # the tile is released
    worker.join(timeout=120)
    assert not worker.is_alive(), "the kernel did not see the released tile"
    assert torch.equal(out["y"], y_ok)


def test_config_rules(monkeypatch):
    """persistent_config on an H200 (132 SMs) at the decode shapes: BLOCK_M by M, about 2 · 132 down-projection
    pieces, at most 16 chunks, each a whole number of BLOCK_Ks and at least 4 of them, a K loop that fits."""
    monkeypatch.setattr(persistent, "INTERPRET", False)
    monkeypatch.setattr(persistent, "num_sms", lambda device: 132)
    for K, I, O in [(4096, 11008, 4096), (8192, 3584, 8192), (4096, 14336, 4096), (256, 512, 64)]:
        for M in (1, 16, 17, 64, 128, 300):
            for itemsize in (2, 4):
                BM, BN, BK, BO, chunk_tiles, per_sm, warps, stages = persistent.persistent_config.__wrapped__(
                    M, K, I, O, itemsize, torch.device("cuda"))
                assert BM == (16 if M <= 16 else 32 if M <= 32 else 64) and BN == BO == 64
                assert BK == (128 if itemsize == 2 else 32) and k_loop_fits(stages, BM, BK, BN, 2, itemsize)
                n_tiles = cdiv(I, BN)
                chunks = cdiv(n_tiles, chunk_tiles)
                assert 1 <= chunks <= 16 and (chunk_tiles * BN) % BK == 0
                assert chunks == 1 or chunk_tiles * BN >= 4 * BK
                pieces = chunks * cdiv(M, BM) * cdiv(O, BO)
                if I >= 16 * 4 * BK:  # long enough for every chunk count the target asks for
                    assert 132 <= pieces <= 6 * 132 or chunks == 1, (M, K, I, O, itemsize, chunks, pieces)


def test_empty():
    x = torch.randn(3, 5, device=KERNEL_DEVICE)
    w, wd, bd = (torch.randn(*shape, device=KERNEL_DEVICE) for shape in ((7, 5), (4, 7), (4,)))
    assert persistent.fused_mlp_persistent(x[:0], w, None, w, None, wd, None, "silu").shape == (0, 4)
    y = persistent.fused_mlp_persistent(x, w[:0], None, w[:0], None, wd[:, :0], bd, "silu")  # I = 0: y = b_down
    assert torch.equal(y, bd.expand(3, 4))


@requires_cuda
@pytest.mark.parametrize("K,I,O,act,layout", [(4096, 11008, 4096, "silu", "linear"),
                                               (8192, 3584, 8192, "gelu_tanh", "merged")])
@pytest.mark.parametrize("M", [16, 64, 128])
def test_gpu_decode_shapes_bf16(M, K, I, O, act, layout):
    """The target shapes with the default config, in bf16: against float64, and 50 calls bitwise equal (programs
    race for items, pieces arrive in any order; the sum order is fixed)."""
    dtype = torch.bfloat16
    s = Shape(M, K, I, O, act, True, (False, False, True), layout, "contiguous")
    args = make_inputs(s, dtype, seed=M + K)
    y = persistent.fused_mlp_persistent(*args, act)
    _check_mlp(y, args, act, dtype)
    for _ in range(50):
        assert torch.equal(persistent.fused_mlp_persistent(*args, act), y), "must be deterministic"
