"""Probe (issue 10): the down projection y = h @ w_downᵀ at M = 1-128 as a swap-AB split-K GEMM whose weight
tiles arrive by TMA, against cuBLAS and ``linear_splitk``, in one run (CUDA-graph medians, bf16 and fp16).

    python3 benchmarks/probe_down_tma.py [--ms 1,16,32,64,128] [--budget-s 120]
    TRITON_INTERPRET=1 python3 benchmarks/probe_down_tma.py --check     # the kernel against float64 on the CPU

Why: the two-launch MLP at M = 16-64 was held back by the down GEMM, cuBLAS at 73-80% of its floor (run 23), and 36
split-K configs of the old ``linear_splitk`` (h in the dot's M side) did not beat it. Here the weight rows take the
dot's M slot (acc[BLOCK_N, BLOCK_M] = w_tile @ h_tileᵀ, so Hopper's wgmma runs at M < 64), each program streams a K
range of BLOCK_N weight rows through a NUM_STAGES-deep TMA pipeline, and the last program of a column block sums the
fp32 partials in split order (deterministic). Run 33 timed it with a plain-load twin of the same schedule, which
was as fast: that twin is now ``linear_splitk`` itself (``mlp_fuser/kernels/splitk.py``), so this probe compares
TMA loads against it. The floor column uses a copy bandwidth measured by a clone inside a CUDA graph, which ran low
in run 33 (2.8 TB/s): read the ratios. A probe: nothing in mlp_fuser calls it.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor


@triton.jit
def _down_tma_kernel(w_desc, h_desc, y_ptr, parts_ptr, counters_ptr, M, N, K, K_PER_SPLIT, stride_ym,
                     SPLIT_K, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_K: tl.constexpr,
                     NUM_STAGES: tl.constexpr):
    pid_n = tl.program_id(0)  # BLOCK_N columns of y = rows of w
    split = tl.program_id(1)  # the K range
    pid_m = tl.program_id(2)  # BLOCK_M rows of y
    off_n, off_m = pid_n * BLOCK_N, pid_m * BLOCK_M
    k_lo = split * K_PER_SPLIT
    k_hi = tl.minimum(k_lo + K_PER_SPLIT, K)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for k in tl.range(k_lo, k_hi, BLOCK_K, num_stages=NUM_STAGES):  # K_PER_SPLIT is a multiple of BLOCK_K
        w = w_desc.load([off_n, k])  # [BLOCK_N, BLOCK_K]; past K: zeros
        h = h_desc.load([off_m, k])  # [BLOCK_M, BLOCK_K]; past M or K: zeros
        acc = tl.dot(w, h.T, acc)
    offs_n = off_n + tl.arange(0, BLOCK_N)
    offs_m = off_m + tl.arange(0, BLOCK_M)
    mask = (offs_n[:, None] < N) & (offs_m[None, :] < M)
    y_ptrs = y_ptr + offs_m[None, :] * stride_ym + offs_n[:, None]
    if SPLIT_K == 1:
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=mask)
    else:
        tile = pid_m * tl.num_programs(0) + pid_n
        part_ptrs = parts_ptr + offs_m[None, :] * N + offs_n[:, None]  # [split, M, N] fp32
        tl.store(part_ptrs + split * M * N, acc, mask=mask)
        tl.debug_barrier()
        done = tl.atomic_add(counters_ptr + tile, 1, sem="acq_rel")
        if done == SPLIT_K - 1:
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(SPLIT_K):
                total += tl.load(part_ptrs + s * M * N, mask=mask, other=0.0, cache_modifier=".cg")
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=mask)


def cdiv(a, b):
    return -(-a // b)


def block_m(M):
    """The tile's M side: the dot's N slot after the swap, 16 to 128."""
    return max(16, triton.next_power_of_2(min(M, 128)))


def down(h, w, cfg):
    """y = h @ wᵀ for h (M, K) and w (N, K), both contiguous. cfg = (BLOCK_N, BLOCK_K, SPLIT_K, warps, stages)."""
    M, K = h.shape
    N = w.shape[0]
    BN, BK, split, warps, stages = cfg
    BM = block_m(M)
    k_per_split = cdiv(cdiv(K, split), BK) * BK
    split = cdiv(K, k_per_split)
    grid = (cdiv(N, BN), split, cdiv(M, BM))
    y = torch.empty(M, N, device=h.device, dtype=h.dtype)
    parts = torch.empty(split * M * N if split > 1 else 1, device=h.device, dtype=torch.float32)
    counters = torch.zeros(grid[0] * grid[2], device=h.device, dtype=torch.int32)
    _down_tma_kernel[grid](TensorDescriptor.from_tensor(w, [BN, BK]), TensorDescriptor.from_tensor(h, [BM, BK]),
                           y, parts, counters, M, N, K, k_per_split, y.stride(0), SPLIT_K=split, BLOCK_N=BN,
                           BLOCK_M=BM, BLOCK_K=BK, NUM_STAGES=stages, num_warps=warps)
    return y


def check():
    """Against float64 on fresh random inputs, the output poisoned first (NaN where a store is missing)."""
    torch.manual_seed(0)
    bad = 0
    for (M, N, K) in [(1, 64, 96), (5, 40, 200), (17, 64, 256), (33, 72, 160)]:
        for cfg in [(32, 32, 1, 4, 1), (32, 32, 3, 4, 1), (64, 32, 2, 4, 2)]:
            h = torch.randn(M, K, dtype=torch.float32)
            w = torch.randn(N, K, dtype=torch.float32)
            y = down(h, w, cfg)
            ref = (h.double() @ w.double().T)
            err = ((y.double() - ref).norm() / ref.norm()).item()
            ok = torch.isfinite(y).all().item() and err < 1e-5  # fp32 in the interpreter: exact products
            bad += not ok
            print(f"M={M} N={N} K={K} cfg={cfg}: rel err {err:.1e} {'ok' if ok else 'WRONG'}")
    return bad


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--check", action="store_true")
    ap.add_argument("--ms", default="1,16,32,64,128")
    ap.add_argument("--shapes", default="4096x11008,4096x14336,3584x18944,8192x3584", help="N x K of w_down")
    ap.add_argument("--dtypes", default="bf16,fp16")
    ap.add_argument("--budget-s", type=float, default=120)
    ap.add_argument("--device", default="cuda", help="cpu: the script itself, under TRITON_INTERPRET=1 (tiny shapes)")
    args = ap.parse_args()
    if args.check:
        sys.exit(1 if check() else 0)
    import torch.nn.functional as F

    sys.path.insert(0, ".")
    from mlp_fuser.kernels.splitk import linear_splitk

    t_start, dev = time.perf_counter(), args.device
    big = torch.empty(1 << (30 if dev == "cuda" else 20), dtype=torch.uint8, device=dev)
    copy_bw = 2 * big.numel() / graph_us(lambda b=big: b.clone(), reps=5) * 1e-6  # TB/s, read + write
    del big
    print(f"{torch.cuda.get_device_name() if dev == 'cuda' else dev}, torch {torch.__version__}, triton "
          f"{triton.__version__}; copy bandwidth {copy_bw:.2f} TB/s", flush=True)
    rows = []
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dname]
        for shape in args.shapes.split(","):
            N, K = map(int, shape.split("x"))
            w = torch.randn(N, K, device=dev, dtype=dtype) / K ** 0.5
            for M in map(int, args.ms.split(",")):
                if time.perf_counter() - t_start > args.budget_s:
                    print(f"budget spent: stop before {dname} {shape} M={M}", flush=True)
                    return report(rows)
                h = torch.randn(M, K, device=dev, dtype=dtype)
                ref = h.double() @ w.double().T
                floor = (N * K + M * K + M * N) * 2 / copy_bw * 1e-6
                cands = {"cublas": lambda h=h, w=w: F.linear(h, w),
                         "splitk": lambda h=h, w=w: linear_splitk(h, w, None)}
                for BN in (64, 128):
                    for BK in (128, 256):
                        tiles = cdiv(N, BN) * cdiv(M, block_m(M))
                        for mult in (1, 2, 3):
                            split = max(1, min(cdiv(mult * 132, tiles), K // (2 * BK)))
                            for stages in (3, 4, 6):
                                if stages * (BN + block_m(M)) * BK * 2 > 200 * 1024:
                                    continue
                                cfg = (BN, BK, split, 4, stages)
                                cands[f"tma {cfg}"] = lambda cfg=cfg, h=h, w=w: down(h, w, cfg)
                res = {}
                for name, fn in cands.items():
                    try:
                        y = fn()
                        err = ((y.double() - ref).norm() / ref.norm()).item()
                        res[name] = (graph_us(fn), err)
                    except Exception as e:  # a config that does not compile or fit: named, not fatal
                        print(f"  {dname} {shape} M={M} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                cub_err = res["cublas"][1]
                best = min(((v[0], k) for k, v in res.items() if k.startswith("tma") and v[1] <= 1.25 * cub_err + 1e-3),
                           default=(float("inf"), "none"))
                row = dict(dtype=dname, shape=shape, M=M, floor=floor, cublas=res["cublas"][0],
                           splitk=res.get("splitk", (float("inf"),))[0], tma=best[0], tma_cfg=best[1],
                           err=res.get(best[1], (0, float("nan")))[1], cublas_err=cub_err)
                rows.append(row)
                print(f"{dname} {shape} M={M}: floor {floor:.1f} us; cublas {row['cublas']:.1f}, splitk "
                      f"{row['splitk']:.1f}, best tma {best[0]:.1f} {best[1]} (err {row['err']:.1e} vs cublas "
                      f"{cub_err:.1e})", flush=True)
    report(rows)


def graph_us(fn, reps=20, rounds=5):
    """Median µs per call of ``fn`` replayed in a CUDA graph of ``reps`` calls (on the CPU: plain calls)."""
    if not torch.cuda.is_available():
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        return (time.perf_counter() - t0) / reps * 1e6
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            fn()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=side):
            for _ in range(reps):
                fn()
    torch.cuda.current_stream().wait_stream(side)
    g.replay()
    torch.cuda.synchronize()
    ts = []
    for _ in range(rounds):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        g.replay()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e3 / reps)
    return statistics.median(ts)


def report(rows):
    print("| dtype | w_down N x K | M | floor us | cuBLAS us (% floor) | splitk us | best TMA us (% floor) | "
          "TMA vs cuBLAS | TMA config (BN, BK, split, warps, stages) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['dtype']} | {r['shape']} | {r['M']} | {r['floor']:.1f} | {r['cublas']:.1f} "
              f"({100 * r['floor'] / r['cublas']:.0f}%) | {r['splitk']:.1f} | {r['tma']:.1f} "
              f"({100 * r['floor'] / r['tma']:.0f}%) | {r['cublas'] / r['tma']:.3f}x | "
              f"{r['tma_cfg'][4:]} |")


if __name__ == "__main__":
    main()
