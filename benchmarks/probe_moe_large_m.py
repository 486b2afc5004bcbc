"""Probe: the routed experts' GEMMs at large M (Qwen3-30B-A3B T = 2048/8192, Mixtral-8x7B T = 512/2048).

    python3 benchmarks/probe_moe_large_m.py [--tiny] [--sizes qwen3:2048,mixtral:512]

Question: what keeps the sorted path's gate/up and down GEMMs at 50–60% of the bf16 peak there, and which of these
moves them: (1) weights through TMA descriptors (x rows still gathered by pointer), (2) x gathered once in sorted
order so that both operands load through TMA, h stored in sorted order so that down loads it through TMA too,
(3) the down kernel's per-pair rows stored in bf16 instead of fp32, (4) Triton's warp specialisation of the K loop,
(5) more tile configs than moe.CONFIGS holds. Beside them: the sorted path's kernels as they are, and
torch._grouped_mm (CUTLASS) on the same sorted rows without padding, each GEMM alone.
Every variant's y is checked against float64; CUDA-graph medians in µs; the table is printed last.
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
from triton.tools.tensor_descriptor import TensorDescriptor  # noqa: E402

from mlp_fuser.kernels import moe  # noqa: E402
from mlp_fuser.kernels.moe_routing import moe_align  # noqa: E402
from mlp_fuser.reference import rel_err  # noqa: E402

DEV = "cpu" if TINY else "cuda"
DTYPE = torch.float16 if TINY else torch.bfloat16
PEAK = 790e12
SIZES = {"qwen3": (2048, 768, 128, 8), "mixtral": (4096, 14336, 8, 2), "tiny": (128, 128, 4, 2)}


@triton.jit
def _gu_tma(x_ptr, xdesc, wdesc, h_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, S, K_TOP, I, H, stride_xm,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, X_TMA: tl.constexpr,
            H_SORTED: tl.constexpr, WS: tl.constexpr):
    # -- one expert's BLOCK_M sorted pairs, BLOCK_N columns of h; weights (E·2I, H) through TMA -------------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b)
    rows = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    mask_m = pairs < S
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = x_ptr + (pairs // K_TOP)[:, None].to(tl.int64) * stride_xm + offs_k[None, :]
    row_g = e * 2 * I + pid_n * BLOCK_N
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, H, BLOCK_K, warp_specialize=WS):
        if X_TMA:  # x gathered in sorted order beforehand: a plain 2-D tile
            x = xdesc.load([pid_b * BLOCK_M, k])
        else:
            x = tl.load(x_ptrs + k, mask=mask_m[:, None], other=0.0)
        acc_g = tl.dot(x, wdesc.load([row_g, k]).T, acc_g)
        acc_u = tl.dot(x, wdesc.load([row_g + I, k]).T, acc_u)
    h = acc_g * tl.sigmoid(acc_g) * acc_u
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    dest = rows if H_SORTED else pairs
    tl.store(h_ptr + dest[:, None].to(tl.int64) * I + offs_n[None, :], h.to(h_ptr.dtype.element_ty),
             mask=mask_m[:, None])


@triton.jit
def _down_tma(h_ptr, hdesc, wdesc, wts_ptr, out_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, S, K_TOP, I, H,
              BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, H_TMA: tl.constexpr,
              WS: tl.constexpr):
    # -- one expert's BLOCK_M sorted pairs, BLOCK_N columns of out; weights (E·H, I) through TMA -----------
    pid_b = tl.program_id(0)
    pid_n = tl.program_id(1)
    if pid_b >= tl.load(num_blocks_ptr):
        return
    e = tl.load(block_expert_ptr + pid_b)
    rows = pid_b * BLOCK_M + tl.arange(0, BLOCK_M)
    pairs = tl.load(sorted_ptr + rows)
    mask_m = pairs < S
    offs_k = tl.arange(0, BLOCK_K)
    h_ptrs = h_ptr + pairs[:, None].to(tl.int64) * I + offs_k[None, :]
    row_w = e * H + pid_n * BLOCK_N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, I, BLOCK_K, warp_specialize=WS):
        if H_TMA:  # h in sorted order: a plain 2-D tile
            h = hdesc.load([pid_b * BLOCK_M, k])
        else:
            h = tl.load(h_ptrs + k, mask=mask_m[:, None], other=0.0)
        acc = tl.dot(h, wdesc.load([row_w, k]).T, acc)
    wts = tl.load(wts_ptr + pairs, mask=mask_m, other=0.0).to(tl.float32)
    acc = acc * wts[:, None]
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    tl.store(out_ptr + pairs[:, None].to(tl.int64) * H + offs_n[None, :], acc.to(out_ptr.dtype.element_ty),
             mask=mask_m[:, None])


def gather_sorted(x, r, S, k):
    """x rows in the routing's sorted order (padding rows: token 0, never stored)."""
    return x[(r.sorted_pairs.clamp(max=S - 1) // k).long()]


def gu_tma(x, xs, r, w_gu, I, cfg, h_sorted, ws):
    T, H = x.shape
    S = T * r.k
    bm, bn, bk = r.block_m, cfg["BLOCK_N"], cfg["BLOCK_K"]
    assert I % bn == 0 and H % bk == 0
    E = w_gu.shape[0]
    wdesc = TensorDescriptor.from_tensor(w_gu.view(E * 2 * I, H), [bn, bk])
    xdesc = TensorDescriptor.from_tensor(xs, [bm, bk]) if xs is not None else wdesc
    h = torch.empty((r.sorted_pairs.numel() if h_sorted else S, I), dtype=x.dtype, device=x.device)
    grid = (r.block_expert.numel(), I // bn)
    _gu_tma[grid](x, xdesc, wdesc, h, r.sorted_pairs, r.block_expert, r.num_blocks, S, r.k, I, H, x.stride(0),
                  BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, X_TMA=xs is not None, H_SORTED=h_sorted, WS=ws,
                  num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return h


def down_tma(h, r, wts, w_d, cfg, h_sorted, out_dtype, ws):
    E, H, I = w_d.shape
    S = wts.numel()
    bm, bn, bk = r.block_m, cfg["BLOCK_N"], cfg["BLOCK_K"]
    assert H % bn == 0 and I % bk == 0
    wdesc = TensorDescriptor.from_tensor(w_d.view(E * H, I), [bn, bk])
    hdesc = TensorDescriptor.from_tensor(h, [bm, bk]) if h_sorted else wdesc
    out = torch.empty((S, H), dtype=out_dtype, device=h.device)
    grid = (r.block_expert.numel(), H // bn)
    _down_tma[grid](h, hdesc, wdesc, wts, out, r.sorted_pairs, r.block_expert, r.num_blocks, S, r.k, I, H,
                    BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, H_TMA=h_sorted, WS=ws,
                    num_warps=cfg["num_warps"], num_stages=cfg["num_stages"])
    return out


def timed(fn, rep=10) -> float:
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


C = moe._cfg
GU_CFGS = [C(128, 128, 64, 8, 3), C(128, 128, 64, 8, 4), C(128, 64, 64, 4, 4), C(128, 64, 128, 8, 3),
           C(64, 128, 64, 4, 4), C(64, 128, 64, 8, 4), C(64, 64, 128, 4, 4), C(64, 256, 64, 8, 3)]
DOWN_CFGS = [C(128, 256, 64, 8, 3), C(128, 128, 64, 8, 4), C(128, 128, 128, 8, 3), C(128, 64, 64, 4, 4),
             C(64, 256, 64, 8, 3), C(64, 128, 64, 4, 4), C(64, 128, 128, 4, 3)]
TINY_CFGS = [C(16, 32, 32, 4, 1)]


def run(name, T, rows):
    H, I, E, k = SIZES[name]
    g = torch.Generator(device=DEV).manual_seed(0)
    w_gu = (torch.randn((E, 2 * I, H), generator=g, device=DEV) / H ** 0.5).to(DTYPE)
    w_d = (torch.randn((E, H, I), generator=g, device=DEV) / I ** 0.5).to(DTYPE)
    x = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    top, ids = torch.randn((T, E), generator=g, device=DEV).topk(k, dim=1)
    wts = torch.softmax(top, dim=1).to(DTYPE)
    S = T * k
    ref = reference64(x, ids, wts, w_gu, w_d)
    act = moe.ExpertAct()
    gflop_gu, gflop_d = 2 * S * 2 * I * H, 2 * S * I * H

    def rec(label, us, y=None, flop=None):
        err = rel_err(y, ref, math.inf) if y is not None else float("nan")
        tf = flop / (us * 1e-6) / 1e12 if flop else float("nan")
        rows.append((name, T, label, us, tf, err))
        bad = "  WRONG" if y is not None and not err < 0.05 else ""
        print(f"{name} T={T} {label}: {us:.1f} µs, {tf:.0f} TFLOP/s, err {err:.2g}{bad}", flush=True)

    gu_cfgs = TINY_CFGS if TINY else GU_CFGS
    down_cfgs = TINY_CFGS if TINY else DOWN_CFGS
    routings = {bm: moe_align(ids, E, bm) for bm in sorted({c["BLOCK_M"] for c in gu_cfgs + down_cfgs})}
    wflat = wts.reshape(-1).contiguous()
    # -- the sorted path's kernels as they are, then the variants, per BLOCK_M ----------------------------------
    for bm, r in routings.items():
        nb = int(r.num_blocks.item())
        print(f"{name} T={T} BLOCK_M={bm}: {nb} blocks in use, {nb * bm / S:.2f}× the pairs' rows", flush=True)
        xs = gather_sorted(x, r, S, k)
        rec(f"gather x sorted bm{bm}", timed(partial(gather_sorted, x, r, S, k)))
        for c in [c for c in gu_cfgs if c["BLOCK_M"] == bm]:
            tag = f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
            h0 = moe.moe_gate_up(x, r, w_gu, None, act, I, False, c)
            y = moe.moe_combine(moe.moe_down(h0, r, wts, w_d, None, moe.default_config("down", T, k, E, H, I, DTYPE)),
                                ids, E, DTYPE)
            rec(f"gate_up now bm{bm} {tag}", timed(partial(moe.moe_gate_up, x, r, w_gu, None, act, I, False, c)), y,
                gflop_gu)
            for variant, xa, hs, ws in (("w tma", None, False, False), ("x+w tma, h sorted", xs, True, False),
                                        ("x+w tma, h sorted, ws", xs, True, True)):
                try:
                    h = gu_tma(x, xa, r, w_gu, I, c, hs, ws)
                    hp = h[: r.sorted_pairs.numel()]
                    if hs:  # back to pair order for the checking down
                        hp = torch.zeros((S, I), dtype=h.dtype, device=h.device)
                        keep = r.sorted_pairs < S
                        hp[r.sorted_pairs[keep].long()] = h[keep]
                    y = moe.moe_combine(moe.moe_down(hp, r, wts, w_d, None,
                                                     moe.default_config("down", T, k, E, H, I, DTYPE)), ids, E, DTYPE)
                    rec(f"gate_up {variant} bm{bm} {tag}", timed(partial(gu_tma, x, xa, r, w_gu, I, c, hs, ws)), y,
                        gflop_gu)
                except Exception as exc:  # noqa: BLE001  (a variant this Triton cannot compile)
                    print(f"  {variant} {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        c_gu = next(c for c in gu_cfgs if c["BLOCK_M"] == bm) if any(c["BLOCK_M"] == bm for c in gu_cfgs) else \
            dict(gu_cfgs[0], BLOCK_M=bm)
        h_pairs = moe.moe_gate_up(x, r, w_gu, None, act, I, False, c_gu)
        h_sorted = gu_tma(x, xs, r, w_gu, I, c_gu, True, False)
        for c in [c for c in down_cfgs if c["BLOCK_M"] == bm]:
            tag = f"{c['BLOCK_N']}x{c['BLOCK_K']} w{c['num_warps']} s{c['num_stages']}"
            y = moe.moe_combine(moe.moe_down(h_pairs, r, wts, w_d, None, c), ids, E, DTYPE)
            rec(f"down now bm{bm} {tag}", timed(partial(moe.moe_down, h_pairs, r, wts, w_d, None, c)), y, gflop_d)
            for variant, h, hs, od, ws in (("w tma", h_pairs, False, torch.float32, False),
                                           ("h+w tma", h_sorted, True, torch.float32, False),
                                           ("h+w tma, bf16 rows", h_sorted, True, DTYPE, False),
                                           ("h+w tma, ws", h_sorted, True, torch.float32, True)):
                try:
                    out = down_tma(h, r, wflat, w_d, c, hs, od, ws)
                    y = moe.moe_combine(out, ids, E, DTYPE)
                    rec(f"down {variant} bm{bm} {tag}", timed(partial(down_tma, h, r, wflat, w_d, c, hs, od, ws)), y,
                        gflop_d)
                except Exception as exc:  # noqa: BLE001
                    print(f"  {variant} {tag}: {type(exc).__name__}: {str(exc)[:200]}", flush=True)
        out = moe.moe_down(h_pairs, r, wts, w_d, None, moe.default_config("down", T, k, E, H, I, DTYPE))
        rec(f"combine fp32 rows bm{bm}", timed(partial(moe.moe_combine, out, ids, E, DTYPE)))
        out16 = out.to(DTYPE)
        rec(f"combine bf16 rows bm{bm}", timed(partial(moe.moe_combine, out16, ids, E, DTYPE)))
        rec(f"routing bm{bm}", timed(partial(moe_align, ids, E, bm)))
    # -- torch._grouped_mm on the sorted rows, no padding -----------------------------------------------------
    if not TINY and hasattr(torch, "_grouped_mm"):
        flat = ids.reshape(-1)
        order = torch.argsort(flat, stable=True)
        offs = torch.cumsum(torch.bincount(flat, minlength=E), 0).to(torch.int32)
        xs = x[order // k]
        hs = torch.randn((S, I), device=DEV).to(DTYPE)
        rec("grouped_mm gate_up GEMM alone", timed(lambda: torch._grouped_mm(xs, w_gu.transpose(1, 2), offs=offs)),
            None, gflop_gu)
        rec("grouped_mm down GEMM alone", timed(lambda: torch._grouped_mm(hs, w_d.transpose(1, 2), offs=offs)),
            None, gflop_d)
    for path in ("sorted", "sorted_fused"):
        fn = partial(moe.moe_experts, x, ids, wts, w_gu, None, w_d, None, act, False, path, None)
        rec(f"path {path} (default configs)", timed(fn), fn())


def main():
    spec = "tiny:64" if TINY else next((a.split("=", 1)[1] for a in sys.argv if a.startswith("--sizes=")),
                                       "qwen3:2048,mixtral:512,mixtral:2048,qwen3:8192")
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list = []
    t0 = time.time()
    for item in spec.split(","):
        name, T = item.split(":")
        try:
            run(name, int(T), rows)
        except Exception as exc:  # noqa: BLE001  (report and go on to the next size)
            print(f"{item}: {type(exc).__name__}: {str(exc)[:300]}", flush=True)
    print(f"\n{DTYPE}, CUDA-graph medians ({time.time() - t0:.0f} s); TFLOP/s on the pairs' rows (no padding)")
    print("| size | T | variant | µs | TFLOP/s | err |\n|---|---|---|---|---|---|")
    for name, T, label, us, tf, err in rows:
        print(f"| {name} | {T} | {label} | {us:.1f} | {tf:.0f} | {err:.2g} |")
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "probe_moe_large_m.txt"), "w") as f:
            for r in rows:
                f.write("\t".join(map(str, r)) + "\n")


if __name__ == "__main__":
    main()
