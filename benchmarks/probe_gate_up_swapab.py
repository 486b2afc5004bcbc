"""Probe (issue 10): the gate/up half at M = 1-64 with the weight rows in the dot's M side (swap-AB), as run 33 found
for the down projection, against gate_up_act (autotuned, tokens in the M side), gate_up_act_splitk and cuBLAS's two
GEMMs + act·mul, in one run (CUDA-graph medians, bf16 and fp16).

    python3 benchmarks/probe_gate_up_swapab.py [--ms 1,16,32,64] [--budget-s 150]
    TRITON_INTERPRET=1 python3 benchmarks/probe_gate_up_swapab.py --check     # against float64 on the CPU

Why: at M = 16 the gate/up half reads 2·I·K weight bytes at ≈ 87% of the copy speed (run 35: 74.9 µs for the MLP at
4096/11008, 26.8 of them the down GEMM), while its tiles put the tokens in the dot's M side (BLOCK_M = 16: mma.sync).
For the down projection the same swap took the split-K kernel from 31.2 to 26.8 µs at M = 16 (run 33), which
refuted the earlier reading that the MMA shape does not matter while a kernel is memory-bound (NOTES, stream-K v1).
The kernel: program (n-block, split, m-block) keeps accᵀ_gate and accᵀ_up [BLOCK_N, BLOCK_M] = w[n-block] @
x[m-block]ᵀ over its K range; one x tile feeds both dots; a whole-K program applies act(g)·u and stores hᵀ's tile;
with SPLIT_K > 1 the last program of a tile (arrival counter) sums the fp32 partials in split order and does so.
A probe: nothing in mlp_fuser calls it; it earns a place only by beating the others here, in both dtypes.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from probe_down_tma import cdiv, graph_us  # the same CUDA-graph timer as the down projection's probe


@triton.jit
def _silu(x):
    return x / (1.0 + tl.exp(-x))


@triton.jit
def _gate_up_swapab_kernel(x_ptr, wg_ptr, wu_ptr, h_ptr, parts_ptr, counters_ptr, M, N, K, K_PER_SPLIT, stride_xm,
                           stride_wgn, stride_wun, SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
                           BLOCK_K: tl.constexpr):
    pid_n, split, pid_m = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)  # weight rows = columns of h
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)  # tokens
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.minimum(offs_n, N - 1)  # no mask along N: rows past N repeat the last (never stored)
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc_g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in range(k_lo, k_hi, BLOCK_K):
        kk = k + offs_k
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + kk[None, :],
                    mask=(offs_m[:, None] < M) & (kk[None, :] < k_hi), other=0.0)
        wg = tl.load(wg_ptr + rows[:, None] * stride_wgn + kk[None, :], mask=kk[None, :] < k_hi, other=0.0)
        wu = tl.load(wu_ptr + rows[:, None] * stride_wun + kk[None, :], mask=kk[None, :] < k_hi, other=0.0)
        acc_g = tl.dot(wg, x.T, acc_g)
        acc_u = tl.dot(wu, x.T, acc_u)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    h_ptrs = h_ptr + offs_m[None, :] * N + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(h_ptrs, (_silu(acc_g) * acc_u).to(h_ptr.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part_ptrs = parts_ptr + offs_m[None, :] * N + offs_n[:, None]  # [split, gate | up, M, N] fp32
        tl.store(part_ptrs + (2 * split) * M * N, acc_g, mask=mask)
        tl.store(part_ptrs + (2 * split + 1) * M * N, acc_u, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            g = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            u = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                g += tl.load(part_ptrs + (2 * s) * M * N, mask=mask, other=0.0, cache_modifier=".cg")
                u += tl.load(part_ptrs + (2 * s + 1) * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(h_ptrs, (_silu(g) * u).to(h_ptr.dtype.element_ty), mask=mask)


def gate_up_swapab(x, wg, wu, cfg):
    """h = silu(x @ wgᵀ) * (x @ wuᵀ) for x (M, K), wg and wu (N, K), unit stride along K. cfg = (BLOCK_N, BLOCK_K,
    SPLIT_K, warps, stages)."""
    M, K = x.shape
    N = wg.shape[0]
    BN, BK, split, warps, stages = cfg
    BM = max(16, triton.next_power_of_2(min(M, 64)))
    k_per_split = cdiv(cdiv(K, split), BK) * BK
    split = cdiv(K, k_per_split)
    grid = (cdiv(N, BN), split, cdiv(M, BM))
    h = torch.empty(M, N, device=x.device, dtype=x.dtype)
    parts = torch.empty(2 * split * M * N if split > 1 else 1, device=x.device, dtype=torch.float32)
    counters = torch.zeros(grid[0] * grid[2], device=x.device, dtype=torch.int32)
    _gate_up_swapab_kernel[grid](x, wg, wu, h, parts, counters, M, N, K, k_per_split, x.stride(0), wg.stride(0),
                                 wu.stride(0), split, BLOCK_N=BN, BLOCK_M=BM, BLOCK_K=BK, num_warps=warps,
                                 num_stages=stages)
    return h


def reference(x, wg, wu):
    x, wg, wu = x.double(), wg.double(), wu.double()
    return F.silu(x @ wg.T) * (x @ wu.T)


def rel(a, b):
    return ((a.double() - b).norm() / b.norm()).item()


def check():
    """Against float64 on fresh random inputs, the output poisoned (NaN where a store is missing)."""
    torch.manual_seed(0)
    bad = 0
    for (M, N, K) in [(1, 64, 96), (5, 40, 200), (17, 72, 256), (33, 64, 160)]:
        for cfg in [(32, 32, 1, 4, 1), (32, 32, 3, 4, 1), (64, 32, 2, 4, 1)]:
            x = torch.randn(M, K)
            wg, wu = torch.randn(N, K) / K ** 0.5, torch.randn(N, K) / K ** 0.5
            h = gate_up_swapab(x, wg, wu, cfg)
            err = rel(h, reference(x, wg, wu))
            ok = torch.isfinite(h).all().item() and err < 1e-5
            bad += not ok
            print(f"M={M} N={N} K={K} cfg={cfg}: rel err {err:.1e} {'ok' if ok else 'WRONG'}")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--ms", default="1,16,32,64")
    ap.add_argument("--shapes", default="4096x11008,3584x18944,4096x14336,8192x3584", help="K x I")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--device", default="cuda", help="cpu: the script itself, under TRITON_INTERPRET=1 (tiny shapes)")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check() else 0)
    sys.path.insert(0, ".")
    from mlp_fuser.kernels import act_mul, gate_up_act
    from mlp_fuser.kernels.splitk import gate_up_act_splitk

    t0, dev = time.perf_counter(), args.device
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else dev}, torch {torch.__version__}, triton "
          f"{triton.__version__}", flush=True)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
        for shape in args.shapes.split(","):
            K, N = map(int, shape.split("x"))
            wg = torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5
            wu = torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5
            for M in map(int, args.ms.split(",")):
                if time.perf_counter() - t0 > args.budget_s:
                    print(f"budget spent: stop before {dname} {shape} M={M}", flush=True)
                    return report(rows)
                x = torch.randn(M, K, device=dev, dtype=dtype)
                ref = reference(x, wg, wu)
                w = dict(wg=wg, wu=wu)
                cands = {"cublas": lambda x=x, w=w: act_mul(F.linear(x, w["wg"]), F.linear(x, w["wu"]), "silu"),
                         "gate_up_act": lambda x=x, w=w: gate_up_act(x, w["wg"], None, w["wu"], None, "silu"),
                         "gate_up_splitk": lambda x=x, w=w: gate_up_act_splitk(x, w["wg"], None, w["wu"], None,
                                                                               "silu")}
                for BN in (64, 128):
                    for BK in (64, 128):
                        tiles = cdiv(N, BN) * cdiv(M, 64)
                        for mult in (1, 2):
                            split = max(1, min(cdiv(mult * 132, tiles), K // (2 * BK)))
                            for stages in (3, 4):
                                if stages * (2 * BN + max(16, min(M, 64))) * BK * 2 > 200 * 1024:
                                    continue
                                cfg = (BN, BK, split, 4, stages)
                                cands[f"swapab {cfg}"] = (lambda cfg=cfg, x=x, w=w:
                                                          gate_up_swapab(x, w["wg"], w["wu"], cfg))
                res = {}
                for name, fn in cands.items():
                    try:
                        res[name] = (graph_us(fn), rel(fn(), ref))
                    except Exception as e:  # a config that does not compile or fit: named, not fatal
                        print(f"  {dname} {shape} M={M} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                bar = 1.25 * res["cublas"][1] + 1e-4
                best = min(((v[0], k) for k, v in res.items() if k.startswith("swapab") and v[1] <= bar),
                           default=(float("inf"), "none"))
                others = {k: v[0] for k, v in res.items() if not k.startswith("swapab") and v[1] <= bar}
                base = min(others, key=others.get)
                rows.append((dname, shape, M, res.get("cublas", (0,))[0], res.get("gate_up_act", (0,))[0],
                             res.get("gate_up_splitk", (0,))[0], best[0], best[1], others[base] / best[0], base))
                print(rows[-1], flush=True)
    report(rows)


def report(rows):
    print("| dtype | K x I | M | cuBLAS + act_mul | gate_up_act | gate_up_act_splitk | best swap-AB (config) | "
          "vs the best other |")
    print("|---|---|---|---|---|---|---|---|")
    for d, shape, M, cub, gua, guk, sw, cfg, ratio, base in rows:
        print(f"| {d} | {shape} | {M} | {cub:.1f} | {gua:.1f} | {guk:.1f} | {sw:.1f} {cfg[7:]} | {ratio:.3f}x "
              f"({base}) |")


if __name__ == "__main__":
    main()
