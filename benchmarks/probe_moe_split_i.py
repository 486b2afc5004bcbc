"""Probe: the routed experts at decode (T = 1–4) as one kernel split over I, then a deterministic reduce.

    python3 benchmarks/probe_moe_split_i.py [--tiny]

Question: at Qwen3-30B-A3B T = 1 the op is at 65% of the floor (unsorted_pdl 26.9 µs against 17.6), its two GEMMs
at 12.1 + 6.5 µs and the rest launch gaps. Here program (pair, i-block) computes h[pair, i-block] over all of H and
multiplies it straight into Wd[e][:, i-block], storing a weighted fp32 partial y per (pair, i-block); a second
kernel sums a token's partials in a fixed order (deterministic, no atomics), launched by PDL. Every weight byte is
read once and h never leaves the SM. Predicted: ≈ 19.5 µs + the reduce's ≈ 2 = 21.5 µs (≥ 80% of the floor).
Variants: BLOCK_I × BLOCK_K × stages, the reduce with and without PDL; beside them the op's paths (unsorted,
unsorted_pdl, pairs, sorted). Each y checked against float64; CUDA-graph medians; the table is printed last.
"""

from __future__ import annotations

import math
import os
import sys
import time
from functools import partial

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait  # noqa: E402

from mlp_fuser.kernels import moe  # noqa: E402
from mlp_fuser.kernels.gemm import gate_up_acc  # noqa: E402
from mlp_fuser.reference import rel_err  # noqa: E402

DEV = "cpu" if TINY else "cuda"
DTYPE = torch.float16 if TINY else torch.bfloat16
BW = 4.3e12
SIZES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2), "tiny": (96, 80, 6, 3)}


@triton.jit
def _split_i(x_ptr, ids_ptr, wts_ptr, w_gu_ptr, w_d_ptr, part_ptr, K_TOP, E, H, I, N_I,
             BLOCK_M: tl.constexpr, BLOCK_I: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_O: tl.constexpr,
             PDL: tl.constexpr):
    # -- program (pair p, i-block b): expert e's gate/up rows [b·BLOCK_I, +BLOCK_I) over all of H -------------
    pid = tl.program_id(0)
    if PDL:  # the reduce may start its prologue; its gdc_wait waits for all of this grid
        gdc_launch_dependents()
    p = pid // N_I
    b = pid % N_I
    t = p // K_TOP
    e = tl.load(ids_ptr + p).to(tl.int64)
    if (e < 0) | (e >= E):
        return
    rows = tl.arange(0, BLOCK_M)
    mask_m = rows == 0  # one live row: the pair's token
    tokens = tl.where(mask_m, t, 0)
    offs_i = b * BLOCK_I + tl.arange(0, BLOCK_I)
    mask_i = offs_i < I
    w_e = w_gu_ptr + e * 2 * I * H
    acc_g, acc_u = gate_up_acc(x_ptr, w_e, w_e + I * H, tokens, offs_i, mask_m, mask_i, H,
                               H, 1, H, 1, H, 1, True, "ieee", BLOCK_M, BLOCK_I, BLOCK_K)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    h = tl.where(mask_i[None, :], h, 0.0).to(w_d_ptr.dtype.element_ty)
    w = tl.load(wts_ptr + p).to(tl.float32)

    # -- partial[p, b, :] = w · h @ Wd[e][:, i-block]ᵀ, BLOCK_O output columns at a time -------------------
    offs_o = tl.arange(0, BLOCK_O)
    wd_ptrs = w_d_ptr + e * H * I + offs_i[:, None] + offs_o[None, :] * I  # (BLOCK_I, BLOCK_O)
    out_ptrs = part_ptr + pid.to(tl.int64) * H + offs_o
    for o in range(0, tl.cdiv(H, BLOCK_O)):
        mask_o = offs_o < H - o * BLOCK_O
        wd = tl.load(wd_ptrs, mask=mask_i[:, None] & mask_o[None, :], other=0.0)
        y = tl.dot(h, wd)  # (BLOCK_M, BLOCK_O), row 0 live
        y = tl.sum(tl.where(mask_m[:, None], y, 0.0), axis=0) * w
        tl.store(out_ptrs, y, mask=mask_o)
        wd_ptrs += BLOCK_O * I
        out_ptrs += BLOCK_O


@triton.jit
def _reduce(part_ptr, ids_ptr, y_ptr, E, H, N_I, K_TOP: tl.constexpr, BLOCK_R: tl.constexpr,
            BLOCK_O: tl.constexpr, PDL: tl.constexpr):
    # -- y[t, o-block] = Σ over the token's valid pairs and i-blocks of the partials, in a fixed order ----------
    t = tl.program_id(0)
    offs_o = tl.program_id(1) * BLOCK_O + tl.arange(0, BLOCK_O)
    mask_o = offs_o < H
    offs_r = tl.arange(0, BLOCK_R)
    n_rows = K_TOP * N_I
    if PDL:
        gdc_wait()
    acc = tl.zeros((BLOCK_O,), dtype=tl.float32)
    for r0 in range(0, n_rows, BLOCK_R):
        r = r0 + offs_r
        e = tl.load(ids_ptr + t * K_TOP + r // N_I, mask=r < n_rows, other=-1)
        ok = (r < n_rows) & (e >= 0) & (e < E)
        ptrs = part_ptr + (t * n_rows + r)[:, None].to(tl.int64) * H + offs_o[None, :]
        acc += tl.sum(tl.load(ptrs, mask=ok[:, None] & mask_o[None, :], other=0.0), axis=0)
    tl.store(y_ptr + t.to(tl.int64) * H + offs_o, acc.to(y_ptr.dtype.element_ty), mask=mask_o)


def split_i(x, ids, wts, w_gu, w_d, bi, bk, stages, pdl, bo=64, reduce_o=32):
    T, k = ids.shape
    E, H, I = w_d.shape
    n_i = triton.cdiv(I, bi)
    part = torch.empty((T * k * n_i, H), dtype=torch.float32, device=x.device)
    y = torch.empty((T, H), dtype=x.dtype, device=x.device)
    opts = {} if TINY else {"num_warps": 4, "num_stages": stages}
    _split_i[(T * k * n_i,)](x, ids, wts, w_gu, w_d, part, k, E, H, I, n_i, BLOCK_M=16, BLOCK_I=bi, BLOCK_K=bk,
                             BLOCK_O=bo, PDL=pdl and not TINY, **opts)
    extra = {"launch_pdl": True} if pdl and not TINY else {}
    _reduce[(T, triton.cdiv(H, reduce_o))](part, ids, y, E, H, n_i, K_TOP=k, BLOCK_R=32, BLOCK_O=reduce_o,
                                           PDL=pdl and not TINY, num_warps=4, **extra)
    return y


def timed(fn, rep=20) -> float:
    fn()
    if TINY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def reference64(x, ids, wts, w_gu, w_d):
    E, H, I = w_d.shape
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(E):
        tok, j = torch.where(ids == e)
        if tok.numel():
            gu = x[tok].double() @ w_gu[e].double().T
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y.index_add_(0, tok, (h @ w_d[e].double().T) * wts[tok, j].double()[:, None])
    return y


VARIANTS = [(16, 32, 3, 0), (16, 32, 3, 1)] if TINY else [
    (bi, bk, st, pdl) for bi, bk, st in ((32, 128, 4), (32, 256, 3), (16, 256, 4), (64, 128, 4), (32, 128, 6),
                                         (16, 128, 6), (64, 64, 6)) for pdl in (1, 0)]


def run(name, T, rows):
    H, I, E, k = SIZES[name]
    g = torch.Generator(device=DEV).manual_seed(T)
    w_gu = (torch.randn((E, 2 * I, H), generator=g, device=DEV) / H ** 0.5).to(DTYPE)
    w_d = (torch.randn((E, H, I), generator=g, device=DEV) / I ** 0.5).to(DTYPE)
    x = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    top, ids = torch.randn((T, E), generator=g, device=DEV).topk(k, dim=1)
    wts = torch.softmax(top, dim=1).to(DTYPE)
    if TINY:  # a dropped pair (expert-parallel sentinel) must contribute nothing
        ids[0, -1] = E
    ref = reference64(x, ids, wts, w_gu, w_d)
    touched = torch.unique(ids[ids < E]).numel()
    floor = (touched * 3 * H * I * w_d.element_size() + 2 * T * H * x.element_size()) / BW * 1e6

    def rec(label, fn):
        try:
            y = fn()
            err = rel_err(y, ref, math.inf)
            us = timed(fn)
        except Exception as exc:  # noqa: BLE001  (a variant this Triton cannot compile: report, go on)
            print(f"{name} T={T} {label}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
            return
        rows.append((name, T, label, us, floor / us, err))
        bad = "  WRONG" if not err < 0.05 else ""
        print(f"{name} T={T} {label}: {us:.1f} µs, {100 * floor / us:.0f}% of {floor:.1f}, err {err:.2g}{bad}",
              flush=True)

    for path in ("unsorted", "unsorted_pdl", "pairs", "sorted"):
        if path.startswith("unsorted") and T > 1:
            continue
        rec(f"op path {path}", partial(moe.moe_experts, x, ids, wts, w_gu, None, w_d, None, moe.ExpertAct(), False,
                                       path, None))
    for bi, bk, st, pdl in VARIANTS:
        rec(f"split_i BI{bi} BK{bk} s{st}{' pdl' if pdl else ''}",
            partial(split_i, x, ids, wts, w_gu, w_d, bi, bk, st, bool(pdl)))


def main():
    spec = "tiny:1,tiny:2" if TINY else "qwen3:1,mixtral:1,qwen3:2,qwen3:4"
    rows: list = []
    t0 = time.time()
    for item in spec.split(","):
        name, T = item.split(":")
        run(name, int(T), rows)
    print(f"\n{DTYPE}, CUDA-graph medians ({time.time() - t0:.0f} s); floor: touched experts + x + y at 4.3 TB/s")
    print("| size | T | variant | µs | % of floor | err |\n|---|---|---|---|---|---|")
    for name, T, label, us, frac, err in rows:
        print(f"| {name} | {T} | {label} | {us:.1f} | {100 * frac:.0f}% | {err:.2g} |")


if __name__ == "__main__":
    main()
