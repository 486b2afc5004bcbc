"""The routed-experts kernels (mlp_fuser.kernels.moe) against a float64 reference written here, on every path."""

import math

import pytest
import torch
from _moe_cases import expert_tensors, sentinels, stored_transposed
from conftest import KERNEL_DEVICE, poisoned_empty, requires_cuda

from mlp_fuser.kernels import common, moe
from mlp_fuser.kernels.moe import ExpertAct
from mlp_fuser.kernels.moe_routing import moe_align_atomic, moe_align_torch, moe_align_triton
from mlp_fuser.reference import rel_err

GPT_OSS = ExpertAct(alpha=1.702, limit=7.0, up_offset=1.0)
CLAMPED_SILU = ExpertAct("silu", limit=1.5)  # small, so that the clamps bite on these inputs
CLAMPED_AFTER = ExpertAct("silu", limit=0.5, clamp_after=True)


def random_ids(gen, T, k, E, dropped=0.15):
    """Top-k ids in [0, E) with duplicates across tokens, about ``dropped`` of them sentinels (>= E, every kind)."""
    ids = torch.randint(0, E, (T, k), generator=gen)
    drop = torch.rand((T, k), generator=gen) < dropped
    return torch.where(drop, sentinels(gen, (T, k), E), ids)


# ---- routing -----------------------------------------------------------------------------------------


def check_routing(r, ids, E, block_m):
    """The invariants, independently of either implementation: each valid pair once, in a block of its expert,
    ascending inside it; padding S; block_expert E past num_blocks; every expert's run as short as it can be."""
    S = ids.numel()
    flat = ids.reshape(-1).tolist()
    pairs, experts, n = r.sorted_pairs.tolist(), r.block_expert.tolist(), int(r.num_blocks[0])
    counts = [sum(1 for e in flat if e == x) for x in range(E)]
    assert n == sum(math.ceil(c / block_m) for c in counts)
    assert all(e == E for e in experts[n:]) and all(p == S for p in pairs[n * block_m:])
    seen = []
    for b in range(n):
        run = [p for p in pairs[b * block_m:(b + 1) * block_m] if p != S]
        assert run and all(flat[p] == experts[b] for p in run) and run == sorted(run)
        seen += run
    assert sorted(seen) == [p for p, e in enumerate(flat) if 0 <= e < E]
    assert experts[:n] == sorted(experts[:n])


@pytest.mark.parametrize("T,k,E,block_m", [
    (0, 2, 8, 16), (1, 1, 1, 16), (1, 8, 256, 16), (3, 4, 8, 16), (17, 8, 64, 16), (17, 2, 8, 64),
    (40, 8, 256, 64), (60, 8, 128, 16), (64, 4, 4, 128),
])
def test_align_triton_equals_torch(T, k, E, block_m):
    gen = torch.Generator().manual_seed(T * 1000 + k * 10 + E)
    ids = random_ids(gen, T, k, E).to(KERNEL_DEVICE)
    ids[:T // 2, 0] = 0  # one expert takes many tokens
    ref = moe_align_torch(ids, E, block_m)
    out = moe_align_triton(ids.int(), E, block_m)
    for a, b in zip(ref[:3], out[:3]):
        assert torch.equal(a.cpu(), b.cpu())
    check_routing(ref, ids.cpu(), E, block_m)


@pytest.mark.parametrize("T,k,E,block_m", [(300, 4, 8, 16), (129, 8, 64, 64), (700, 2, 256, 16), (2100, 1, 3, 128)])
def test_align_atomic(T, k, E, block_m):
    """The many-pairs routing: the invariants, with the order inside a block left to the atomics."""
    gen = torch.Generator().manual_seed(T + k + E)
    ids = random_ids(gen, T, k, E).to(KERNEL_DEVICE)
    ids[: T // 2, 0] = 1
    r = moe_align_atomic(ids, E, block_m)
    pairs = r.sorted_pairs.cpu().view(-1, block_m).sort(dim=1).values.reshape(-1)  # padding S sorts last
    check_routing(r._replace(sorted_pairs=pairs), ids.cpu(), E, block_m)


@pytest.mark.parametrize("align", [moe_align_triton, moe_align_atomic])
@pytest.mark.parametrize("E", [1, 8, 64])
def test_align_drops_sentinels_of_every_kind(align, E):
    """Sentinels just past E, past the sorting program's next_pow2(E + 1) histogram bins, and int32's largest."""
    bins = max(16, 1 << E.bit_length())
    gen = torch.Generator().manual_seed(E)
    ids = random_ids(gen, 24, 2, E, dropped=0.5)
    ids[:3] = torch.tensor([[E, bins], [2 * bins + 3, 2**31 - 1], [bins - 1, 0]])
    ids = ids.to(KERNEL_DEVICE)
    r = align(ids, E, 16)
    pairs = r.sorted_pairs.cpu().view(-1, 16).sort(dim=1).values.reshape(-1)  # the atomics' order inside a block
    check_routing(r._replace(sorted_pairs=pairs), ids.cpu(), E, 16)


def test_align_every_token_one_expert_and_all_dropped():
    ids = torch.full((9, 2), 5, device=KERNEL_DEVICE)
    check_routing(moe_align_triton(ids, 8, 16), ids.cpu(), 8, 16)
    ids = torch.full((3, 2), 8, device=KERNEL_DEVICE)
    r = moe_align_triton(ids, 8, 16)
    check_routing(r, ids.cpu(), 8, 16)
    assert int(r.num_blocks[0]) == 0


# ---- the experts, every path, against float64 -----------------------------------------------------


def act64(name, z):
    if name == "silu":
        return z / (1 + torch.exp(-z))
    if name == "gelu":
        return 0.5 * z * (1 + torch.erf(z / math.sqrt(2)))
    raise AssertionError(name)


def reference64(x, ids, wts, w_gu, b_gu, w_d, b_d, act, interleaved):
    """y in float64, one (token, j) pair at a time."""
    T, k = ids.shape
    E, H, I = w_d.shape
    y = torch.zeros((T, H), dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            if not 0 <= e < E:
                continue
            gu = w_gu[e].double() @ x[t].double() + (b_gu[e].double() if b_gu is not None else 0)
            if w_gu.shape[1] == I:
                h = act64(act.name, gu)
            else:
                g, u = (gu[0::2], gu[1::2]) if interleaved else (gu[:I], gu[I:])
                if act.limit is not None and not act.clamp_after:
                    g, u = g.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                a = g * torch.sigmoid(act.alpha * g) if act.alpha else act64(act.name, g)
                if act.limit is not None and act.clamp_after:
                    a, u = a.clamp(max=act.limit), u.clamp(-act.limit, act.limit)
                h = a * (u + act.up_offset)
            o = w_d[e].double() @ h + (b_d[e].double() if b_d is not None else 0)
            y[t] += float(wts[t, j]) * o
    return y


def make_case(T, k, E, H, I, dtype, gated=True, bias=False, transposed=False, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x, w_gu, b_gu, w_d, b_d = expert_tensors(gen, T, E, H, I, gated, bias)
    ids = random_ids(gen, T, k, E)
    wts = torch.rand((T, k), generator=gen)
    dev = KERNEL_DEVICE
    ts = [t.to(dtype) if t is not None else None for t in (x, w_gu, b_gu, w_d, b_d)]
    x, w_gu, b_gu, w_d, b_d = ts
    ref = (x, ids, wts.to(dtype), w_gu, b_gu, w_d, b_d)
    if transposed:
        w_gu, w_d = stored_transposed(w_gu, w_d)
    on_dev = [t.to(dev) if t is not None else None for t in (x, ids, wts.to(dtype), w_gu, b_gu, w_d, b_d)]
    return ref, on_dev


CASES = {  # T, k, E, H, I, dtype, extra
    "silu-E64-fp32": (3, 2, 64, 40, 36, torch.float32, {}),
    "gpt-oss-transposed-fp16": (9, 4, 16, 48, 40, torch.float16,
                                dict(act=GPT_OSS, interleaved=True, bias=True, transposed=True)),
    "clamped-silu-E256-k8-fp16": (1, 8, 256, 32, 48, torch.float16, dict(act=CLAMPED_SILU)),
    "clamped-after-k8-fp32": (3, 8, 8, 36, 20, torch.float32, dict(act=CLAMPED_AFTER, bias=True)),
    "plain-gelu-E1-fp32": (17, 1, 1, 40, 52, torch.float32, dict(act=ExpertAct("gelu"), gated=False, bias=True)),
    "one-expert-interleaved-fp16": (17, 2, 8, 33, 36, torch.float16, dict(interleaved=True, one_expert=True)),
    "empty": (0, 2, 8, 32, 32, torch.float32, {}),
}


# The _nomemset and _pdl variants change only how the combine's counters are zeroed and the down launch waits:
# test_fused_combine_* runs them on its shapes; the experts' cases run the base paths.
BASE_PATHS = tuple(p for p in moe.PATHS if not p.endswith(("_nomemset", "_pdl")))


@pytest.mark.parametrize("path", BASE_PATHS)
@pytest.mark.parametrize("case", list(CASES))
def test_experts_against_float64(case, path):
    T, k, E, H, I, dtype, extra = CASES[case]
    act, interleaved = extra.get("act", ExpertAct()), extra.get("interleaved", False)
    ref_args, args = make_case(T, k, E, H, I, dtype, extra.get("gated", True), extra.get("bias", False),
                               extra.get("transposed", False))
    if extra.get("one_expert"):  # every token to expert 3, the rest dropped: seven experts get nothing
        for ids in (ref_args[1], args[1]):
            ids[:, 0], ids[:, 1:] = 3, E
    with poisoned_empty():
        y = moe.moe_experts(*args, act=act, interleaved=interleaved, path=path)
    assert y.dtype == dtype and y.shape == (T, H)
    expected = reference64(*ref_args, act, interleaved)
    if T == 0:
        return
    assert expected.abs().max() > 0.1  # the inputs exercise the sum
    bar = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel_err(y.cpu(), expected, ord=math.inf) < bar, case
    assert rel_err(moe.moe_reference(*args, act=act, interleaved=interleaved).cpu(), expected, math.inf) < bar


@pytest.mark.parametrize("case", ["silu-E64-fp32", "clamped-after-k8-fp32", "plain-gelu-E1-fp32",
                                  "clamped-silu-E256-k8-fp16"])
def test_sorted_tma_reads_the_weights_through_tma(case, monkeypatch):
    """Where the layout allows it, sorted_tma runs its own kernels (boxes past an expert's rows, K tails), equal to
    float64; elsewhere ``tma_why_not`` names why and the pointer kernels run."""
    T, k, E, H, I, dtype, extra = CASES[case]
    act = extra.get("act", ExpertAct())
    ref_args, args = make_case(T, k, E, H, I, dtype, extra.get("gated", True), extra.get("bias", False))
    calls = []
    for name in ("moe_gate_up_tma", "moe_down_tma"):
        real = getattr(moe, name)
        monkeypatch.setattr(moe, name, lambda *a, real=real, name=name, **kw: calls.append(name) or real(*a, **kw))
    assert moe.tma_why_not(args[0], args[3], args[5], False) is None
    padded = torch.full((T, H + 8), math.nan, dtype=dtype, device=args[0].device)
    padded[:, :H] = args[0]  # x a view whose rows run on into NaN: K tails past H must be masked, not zero-weighted
    with poisoned_empty():
        y = moe.moe_experts(padded[:, :H], *args[1:], act=act, path="sorted_tma")
    assert calls == ["moe_gate_up_tma", "moe_down_tma"]
    bar = 1e-5 if dtype == torch.float32 else 5e-3
    assert rel_err(y.cpu(), reference64(*ref_args, act, False), ord=math.inf) < bar
    x, w_gu, w_d = args[0], args[3], args[5]
    assert "interleaved" in moe.tma_why_not(x, w_gu, w_d, True)
    assert "not contiguous" in moe.tma_why_not(x, w_gu.transpose(1, 2).contiguous().transpose(1, 2), w_d, False)
    assert "16-byte" in moe.tma_why_not(x, w_gu[..., 1:].contiguous(), w_d, False)  # rows of H - 1


def test_tma_descriptors_kept_per_weight_and_dropped_with_it():
    """A weight's descriptor is built once per box and reused; a weight whose memory moved gets a new one; once the
    weight is gone, so are its descriptors (they hold no reference to it)."""
    import gc
    import weakref

    w = torch.randn(4, 32, 48)
    cfg = dict(BLOCK_N=16, BLOCK_K=32)
    d = moe._desc(w, cfg)
    assert moe._desc(w, cfg) is d and d.base.data_ptr() == w.data_ptr() and tuple(d.block_shape) == (16, 32)
    assert tuple(d.shape) == (128, 48)
    assert moe._desc(w, dict(BLOCK_N=32, BLOCK_K=32)) is not d  # another box
    w.data = torch.randn(4, 32, 48)  # the same tensor object over new memory
    d2 = moe._desc(w, cfg)
    assert d2 is not d and d2.base.data_ptr() == w.data_ptr()
    gone, n = weakref.ref(w), id(w)
    del w, d, d2
    gc.collect()
    assert gone() is None and n not in common._DESCS


FUSED = tuple(p for p in moe.PATHS if p.startswith(("sorted_fused", "unsorted")))  # down combines the k rows


def drop_token(ids_pair, t, E):
    """Every pair of token t a sentinel: in no block, so y[t] = 0 falls to whoever handles empty tokens."""
    for ids in ids_pair:
        ids[t] = E + 1


COMBINE_SHAPES = {  # T, k, E, dtype, extra
    "T1-k8-E128": (1, 8, 128, torch.float16, {}),
    "T1-k1-bias": (1, 1, 4, torch.float32, dict(bias=True)),
    "T3-k2-drop": (3, 2, 8, torch.float32, dict(drop=1)),
    "T3-gpt-oss": (3, 8, 16, torch.float16, dict(act=GPT_OSS, interleaved=True, bias=True, transposed=True, drop=2)),
    "T17-k8": (17, 8, 16, torch.float16, dict(drop=5)),
    "T17-k2-E64": (17, 2, 64, torch.float32, dict(act=CLAMPED_SILU, bias=True, drop=0)),
}
# every fused path on every shape but the largest, which runs the two base paths (the slowest interpreter runs)
COMBINE_CASES = [(p, s) for s in COMBINE_SHAPES for p in FUSED if s != "T17-k8" or p in BASE_PATHS]


@pytest.mark.parametrize("path,shape", COMBINE_CASES, ids=[f"{s}-{p}" for p, s in COMBINE_CASES])
def test_fused_combine_against_float64(path, shape):
    """Sentinels among a token's pairs (random) and for every pair of one token (``drop``): that y row must be 0."""
    T, k, E, dtype, extra = COMBINE_SHAPES[shape]
    H, I = 40, 36
    act, interleaved = extra.get("act", ExpertAct()), extra.get("interleaved", False)
    ref_args, args = make_case(T, k, E, H, I, dtype, bias=extra.get("bias", False),
                               transposed=extra.get("transposed", False), seed=T + k + E)
    if "drop" in extra:
        drop_token((ref_args[1], args[1]), extra["drop"], E)
    with poisoned_empty():
        y = moe.moe_experts(*args, act=act, interleaved=interleaved, path=path)
    expected = reference64(*ref_args, act, interleaved)
    assert y.dtype == dtype and y.shape == (T, H) and expected.abs().max() > 0.1
    if "drop" in extra:
        assert (y[extra["drop"]] == 0).all()
    assert rel_err(y.cpu(), expected, ord=math.inf) < (1e-5 if dtype == torch.float32 else 5e-3)


@pytest.mark.parametrize("path", ["sorted", "sorted_fused", "unsorted_pdl"])
def test_pair_rows_in_x_dtype(path, monkeypatch):
    """config.moe_rows_lowp: the pairs' rows (down's output before the k-sum) in x's dtype, fp16 here: within fp16's
    bar of float64, not the fp32 rows' bits (the setting took), and the path's launch plan gives moe_experts' output
    bit for bit (both read the setting)."""
    from mlp_fuser import config

    ref_args, args = make_case(5, 4, 8, 40, 36, torch.float16, seed=3)
    act = ExpertAct()
    monkeypatch.setattr(config, "moe_rows_lowp", False)
    y32 = moe.moe_experts(*args, act=act, path=path)
    monkeypatch.setattr(config, "moe_rows_lowp", True)
    assert moe.rows_dtype(torch.float16) == torch.float16 and moe.rows_dtype(torch.float32) == torch.float32
    with poisoned_empty():
        y16 = moe.moe_experts(*args, act=act, path=path)
        planned = moe.experts_plan(*args, act, False, path)(*args)
    expected = reference64(*ref_args, act, False)
    assert rel_err(y16.cpu(), expected, ord=math.inf) < 5e-3
    assert torch.equal(planned, y16) and not torch.equal(y16, y32)


@pytest.mark.parametrize("path", FUSED)
@pytest.mark.parametrize("T", [0, 1, 4])
def test_fused_combine_every_pair_dropped(path, T):
    """No valid pair anywhere (no block at all in the sorted routing): y is all zeros, not the poisoned empty."""
    _, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(T, 2, 8, 32, 24, torch.float32, bias=True)
    ids.fill_(8)
    with poisoned_empty():
        y = moe.moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, path=path)
    assert y.shape == (T, 32) and (y == 0).all()


def test_fused_combine_deterministic():
    """The last arriver sums in j order: y is bitwise the same twice on each path, and sorted_fused's bitwise the
    sorted path's (the same fp32 rows, summed in the same order by a kernel of its own)."""
    _, args = make_case(9, 4, 8, 40, 36, torch.float32, bias=True, seed=11)  # fp32: y keeps the sum's bits
    for path in FUSED:
        assert torch.equal(moe.moe_experts(*args, path=path), moe.moe_experts(*args, path=path)), path
    assert torch.equal(moe.moe_experts(*args, path="sorted_fused"), moe.moe_experts(*args, path="sorted"))
    assert torch.equal(moe.moe_experts(*args, path="unsorted_pdl"), moe.moe_experts(*args, path="unsorted"))


@pytest.mark.parametrize("sorted_routing", [False, True], ids=["per-pair", "sorted"])
@pytest.mark.parametrize("T,k,H", [(1, 8, 40), (5, 2, 200), (17, 4, 72)])
def test_gate_up_zeroes_poisoned_counts(sorted_routing, T, k, H):
    """The memset-free combine: counters full of random ints, zeroed by the gate/up kernel alone (more counters
    than its programs where H is wide), give the float64 y; the combine's own rows still checked per token."""
    E, I = 8, 24
    ref_args, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(T, k, E, H, I, torch.float32, bias=True, seed=T + H)
    down = moe.default_config("down", T, k, E, H, I, x.dtype)
    up = moe.default_config("gate_up", T, k, E, H, I, x.dtype)
    routing = moe.moe_align(ids, E, up["BLOCK_M"]) if sorted_routing else None
    counts = moe.combine_counts(T, H, down, x.device)
    per_pair_ids = ids if routing is None else None

    def poison():
        counts.copy_(torch.randint(-2**31, 2**31 - 1, counts.shape, dtype=torch.int32))

    poison()
    moe.moe_gate_up(x, routing, w_gu, b_gu, ExpertAct(), I, False, up, per_pair_ids, counts)
    assert (counts == 0).all()
    poison()
    with poisoned_empty():  # back to back, as the PDL down launch needs
        h = moe.moe_gate_up(x, routing, w_gu, b_gu, ExpertAct(), I, False, up, per_pair_ids, counts, pdl=True)
        y = moe.moe_down_combine(h, routing, ids, wts, w_d, b_d, x.dtype, down, counts, pdl=True)
    expected = reference64(*ref_args, ExpertAct(), False)
    assert expected.abs().max() > 0.1 and rel_err(y.cpu(), expected, ord=math.inf) < 1e-5


@requires_cuda
def test_pdl_paths_launch_with_pdl():
    """On Hopper the _pdl paths' down kernel waits (griddepcontrol) and is compiled with launch_pdl, the flag our
    direct launcher hands the driver; the other paths' kernels have neither."""
    from mlp_fuser import compat
    from mlp_fuser.kernels.common import _LAUNCHERS

    if not moe.has_pdl(torch.device(KERNEL_DEVICE)) or not compat.PRIVATE:
        pytest.skip("needs an sm90+ GPU and the direct launcher")
    _, args = make_case(1, 8, 16, 64, 48, torch.bfloat16, seed=2)
    for path in ("unsorted", "unsorted_pdl", "sorted_fused_pdl"):
        moe.moe_experts(*args, path=path)
    for kernel, asm in ((moe._moe_down_kernel, "griddepcontrol.wait"),
                        (moe._moe_gate_up_kernel, "griddepcontrol.launch_dependents")):
        compiled = [hit[0] for hit in _LAUNCHERS[kernel].cache.values()]
        flagged = {asm in c.asm["ptx"] for c in compiled}
        assert flagged == {True, False}, kernel
        if kernel is moe._moe_down_kernel:
            assert all(c.metadata.launch_pdl == (asm in c.asm["ptx"]) for c in compiled)


def test_down_combine_counts_checked():
    _, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(3, 2, 4, 32, 24, torch.float32)
    h = moe.moe_gate_up(x, None, w_gu, b_gu, ExpertAct(), 24, ids=ids)
    with pytest.raises(ValueError, match="counts must be int32 of shape"):
        moe.moe_down_combine(h, None, ids, wts, w_d, b_d, x.dtype, counts=torch.zeros(2, 1, dtype=torch.int32))
    with pytest.raises(ValueError, match="counts must be a contiguous int32"):
        moe.moe_gate_up(x, None, w_gu, b_gu, ExpertAct(), 24, ids=ids, counts=torch.zeros(3, 2))


def test_down_and_combine_parts():
    """moe_down's per-pair rows are weighted expert outputs; dropped rows stay unwritten and combine skips them."""
    ref_args, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(5, 2, 4, 32, 24, torch.float32, bias=True, seed=3)
    ids.copy_(torch.tensor([[1, 4], [2, 0], [3, 3], [0, 1], [2, 2]]))  # pair 1 dropped
    routing = moe.moe_align(ids, 4, 16)
    with poisoned_empty():
        h = moe.moe_gate_up(x, routing, w_gu, b_gu, ExpertAct(), 24)
        out = moe.moe_down(h, routing, wts, w_d, b_d)
    assert out.dtype == torch.float32 and torch.isnan(out[1]).all() and torch.isfinite(out[[0, 2]]).all()
    e = int(ids[1, 0])
    row = (h[2].double() @ w_d[e].double().T + b_d[e].double()) * float(wts[1, 0])
    assert rel_err(out[2].cpu(), row.cpu(), math.inf) < 1e-5
    y = moe.moe_combine(out, ids, 4, x.dtype)
    assert rel_err(y[0].cpu(), out[0].cpu(), math.inf) == 0


def test_gate_up_layout_errors():
    _, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(2, 2, 4, 32, 24, torch.float32)
    with pytest.raises(ValueError, match="w_gate_up has 40 rows"):
        moe.moe_gate_up_pairs(x, ids, w_gu[:, :40], None, ExpertAct(), 24)
    with pytest.raises(ValueError, match="path must be one of"):
        moe.moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, path="dense")


def test_configs_fit_shared_memory():
    from mlp_fuser.kernels.common import k_loop_fits

    for kind, buckets in moe.CONFIGS.items():
        n_weights = 2 if kind in ("gate_up", "gate_up_tma") else 1
        for bucket, cands in buckets.items():
            assert 3 <= len(cands) <= 6
            for c in cands:
                assert c["BLOCK_M"] <= max(bucket, 16)
                if kind in ("gate_up", "down", "gate_up_tma", "down_tma"):
                    assert k_loop_fits(c["num_stages"], c["BLOCK_M"], c["BLOCK_K"], c["BLOCK_N"], n_weights, 2)
    assert moe.rows_bucket(1, 8, 128) == 16 and moe.rows_bucket(2048, 8, 128) == 128
    assert moe.rows_bucket(2048, 2, 8) == 128 and moe.rows_bucket(64, 8, 64) == 16


@requires_cuda
@pytest.mark.parametrize("T", [9, 600])  # 600 · 8 pairs: the torch routing (beyond one Triton program)
@pytest.mark.parametrize("path", moe.PATHS)
def test_paths_replay_in_cuda_graph(path, T):
    """Each path captured once in bf16, then replayed on other routing in the same buffers: nothing syncs the host
    or depends on the ids' values at capture."""
    k, E = 8, 16
    ref_args, (x, ids, wts, w_gu, b_gu, w_d, b_d) = make_case(T, k, E, 64, 48, torch.bfloat16, bias=True, seed=5)
    act, interleaved = (ExpertAct(), False) if path == "sorted_tma" else (GPT_OSS, True)  # TMA: rows not interleaved

    def fn():
        return moe.moe_experts(x, ids, wts, w_gu, b_gu, w_d, b_d, act=act, interleaved=interleaved, path=path)

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # compile and warm up outside the capture
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        y = fn()
    new_ids = random_ids(torch.Generator().manual_seed(7), T, k, E)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    expected = reference64(ref_args[0], new_ids, *ref_args[2:], act, interleaved)
    assert rel_err(y.cpu(), expected, math.inf) < 2e-2
