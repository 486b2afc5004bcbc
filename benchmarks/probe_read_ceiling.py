"""Probe (issue 10, M <= 16): how close can a kernel that only reads the weights get to the copy-bandwidth floor, and
where do the MLP's two halves sit against that?

    python3 benchmarks/probe_read_ceiling.py [--ms 1,16] [--shapes 4096x11008,...,gelu4096x11008] [--budget-s 150]
    python3 benchmarks/probe_read_ceiling.py --down-sweep [--shapes 4096x11008,8192x3584,3584x18944] [--ms 1,16]
    TRITON_INTERPRET=1 python3 benchmarks/probe_read_ceiling.py --device cpu   # the script itself, without a GPU

Why: issue 10's M <= 16 target is 93% of a floor of weight bytes / 4.24 TB/s (a device copy's bytes read + written).
The rows that miss it (86-92%, run 75) are the smaller MLPs (GELU + biases 4096x11008, the 70B shard 8192x3584:
42 µs floors) and M = 16; the larger ones reach 94-96%. Over the floor, the small rows spend 5-6 µs, the large ones
3-3.5. Is that the two kernels' own overhead (each kernel's ramp and tail), or what any read of so many bytes costs?
Timed here in CUDA graphs, in turns: a streaming read kernel of the same bytes (the best of a few grids and block
sizes: the read ceiling), of the gate/up weights alone, of the down weight alone, and of all of them in one kernel;
the MLP's two halves as the op runs them (the swap-AB gate/up kernel, the swap-AB split-K down kernel) and the
dispatcher's candidates for the whole MLP. Outputs of the MLP candidates checked against float64 (1.25x the unfused
module's error). A probe: nothing in mlp_fuser calls it.

``--down-sweep`` (after run 81, where the split-K down kernel sat at 74-88% of its floor against a read of the same
bytes at 87-93%): the down GEMM alone, ``linear_splitk`` under configs around ``splitk_config``'s (BLOCK_K, stages,
warps, and the split: programs per SM), against cuBLAS and the read of its bytes, each output checked against
float64 (1.25x cuBLAS's error).
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from probe_two_streams import rel, timed  # noqa: E402

from mlp_fuser.dispatch import IMPLS_BY_NAME  # noqa: E402
from mlp_fuser.kernels.common import cdiv, k_loop_fits  # noqa: E402
from mlp_fuser.kernels.splitk import linear_splitk, splitk_config  # noqa: E402
from mlp_fuser.kernels.swapab import gate_up_act_swapab  # noqa: E402

COPY_TBS = 4.24  # run 46's device copy, bytes read + written per second


@triton.jit
def _read_kernel(a_ptr, n_a, b_ptr, n_b, out_ptr, BLOCK: tl.constexpr):
    """Each program sums every num_programs-th BLOCK of a, then of b (a grid-stride stream), and stores its sum."""
    pid, nprog = tl.program_id(0), tl.num_programs(0)
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for start in range(pid * BLOCK, n_a, nprog * BLOCK):
        acc += tl.load(a_ptr + start + offs, mask=start + offs < n_a, other=0.0).to(tl.float32)
    for start in range(pid * BLOCK, n_b, nprog * BLOCK):
        acc += tl.load(b_ptr + start + offs, mask=start + offs < n_b, other=0.0).to(tl.float32)
    tl.store(out_ptr + pid, tl.sum(acc, axis=0))


def read(a, b, programs, block, warps, out):
    """Reads every element of a and b (b may be a), once each."""
    n_b = b.numel() if b is not a else 0
    _read_kernel[(programs,)](a, a.numel(), b, n_b, out, BLOCK=block, num_warps=warps)
    return out


READ_CONFIGS = [(p, blk, w) for p in (1, 2, 4, 8) for blk, w in ((4096, 8), (8192, 8), (8192, 16))]


def mlp_row(x, mlp, dev):
    """({name: CUDA-graph µs}, [names whose output missed the bar]) for the MLP's candidates and its two halves."""
    wg, bg, wu, wd, bd, act, gated = mlp
    d64 = [None if t is None else t.double() for t in (x, wg, bg, wu, wd, bd)]
    g = F.linear(d64[0], d64[1], d64[2])
    h_ref = F.silu(g) * F.linear(d64[0], d64[3]) if gated else F.gelu(g)
    y_ref = F.linear(h_ref, d64[4], d64[5])
    h = gate_up_act_swapab(x, wg, bg, wu, None, act)
    cands = {name: (lambda fn=IMPLS_BY_NAME[name].fn: fn(x, wg, bg, wu, None, wd, bd, act))
             for name in ("triton_swapab", "triton_gemm_splitk", "triton_gemm", "cublas_act_mul")}
    errs = {k: rel(fn(), y_ref) for k, fn in cands.items()}
    ref_err = rel(IMPLS_BY_NAME["reference"].fn(x, wg, bg, wu, None, wd, bd, act), y_ref)
    bad = [k for k, e in errs.items() if not e <= 1.25 * ref_err + 1e-6]
    cands |= {"gu swapab": lambda: gate_up_act_swapab(x, wg, bg, wu, None, act),
              "down splitk": lambda: linear_splitk(h, wd, bd),
              "down cublas": lambda: F.linear(h, wd, bd)}
    return {k: v[0] for k, v in timed(cands, dev).items()}, bad


def down_sweep(args, dev, dtype, sms, out):
    """The down GEMM y = h @ w_downᵀ alone: linear_splitk's configs against cuBLAS and a read of w_down's bytes."""
    t0, rows = time.perf_counter(), []
    for shape in args.shapes.split(","):
        K, I = map(int, shape.removeprefix("gelu").split("x")) if dev == "cuda" else (64, 320)
        wd = (torch.randn(K, I, device=dev) * I ** -0.5).to(dtype)
        t = timed({f"{p}x{blk}/{w}": (lambda p=p, blk=blk, w=w, wd=wd: read(wd, wd, p * sms, blk, w, out))
                   for p, blk, w in READ_CONFIGS}, dev, rounds=10)
        read_us = min(v[0] for v in t.values())
        for M in map(int, args.ms.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: stop before {shape} M={M}", flush=True)
                return report_sweep(rows)
            h = torch.randn(M, I, device=dev).to(dtype)
            ref = h.double() @ wd.double().t()
            base = splitk_config(M, K, I, h.element_size(), h.device)
            configs = {"rule": base}
            bm, bn, _, _, warps, _ = base
            tiles = cdiv(M, bm) * cdiv(K, bn)
            for bk in (128, 256):
                for stages in (3, 4, 6):
                    for per_sm in (1, 2, 3, 4):
                        if dev == "cuda" and not k_loop_fits(stages, bm, bk, bn, 1, h.element_size()):
                            continue
                        split = max(1, min(cdiv(per_sm * sms, tiles), cdiv(I, 2 * bk), 16))
                        configs[f"k{bk} s{stages} {per_sm}/SM"] = (bm, bn, bk, split, warps, stages)
            cands = {"cublas": lambda h=h, wd=wd: F.linear(h, wd)}
            cands |= {name: (lambda h=h, c=c, wd=wd: linear_splitk(h, wd, None, c)) for name, c in configs.items()}
            errs = {k: rel(fn(), ref) for k, fn in cands.items()}
            bad = [k for k, e in errs.items() if not e <= 1.25 * errs["cublas"] + 1e-6]
            t = {k: v[0] for k, v in timed(cands, dev, rounds=10).items()}
            floor = K * I * wd.element_size() / COPY_TBS / 1e6
            rows.append((shape, M, floor, read_us, t, configs, bad))
            best = min((k for k in t if k != "cublas"), key=lambda k: t[k])
            print(shape, M, f"floor {floor:.1f} read {read_us:.1f} cublas {t['cublas']:.1f} rule {t['rule']:.1f} "
                  f"best {best} {t[best]:.1f}", "ok" if not bad else f"WRONG {bad}", flush=True)
    report_sweep(rows)


def report_sweep(rows):
    print("| down GEMM (N x K) | M | floor µs | read of its bytes | cuBLAS | split-K, rule | best config | its µs | "
          "next two | check |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for shape, M, floor, read_us, t, configs, bad in rows:
        ranked = sorted((k for k in t if k != "cublas"), key=lambda k: t[k])

        def pct(us, floor=floor):
            return f"{us:.1f} ({100 * floor / us:.0f}%)" if us else "-"

        print(f"| {shape} | {M} | {floor:.1f} | {pct(read_us)} | {pct(t['cublas'])} | {pct(t['rule'])} "
              f"{configs['rule']} | {ranked[0]} {configs[ranked[0]]} | {pct(t[ranked[0]])} | "
              f"{', '.join(f'{k} {t[k]:.1f}' for k in ranked[1:3])} | "
              f"{'ok' if not bad else 'WRONG ' + ','.join(bad)} |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16")
    ap.add_argument("--shapes", default="gelu4096x11008,8192x3584,4096x11008,3584x18944,4096x14336",
                    help="K x I, SwiGLU; prefix gelu for GELU with biases")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--down-sweep", action="store_true", help="the down GEMM alone under linear_splitk's configs")
    args = ap.parse_args()
    dev = args.device
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    sms = torch.cuda.get_device_properties(dev).multi_processor_count if dev == "cuda" else 4
    out = torch.empty(16 * sms, device=dev)
    t0, rows = time.perf_counter(), []
    print(torch.cuda.get_device_name() if dev == "cuda" else dev, torch.__version__, triton.__version__, flush=True)
    if args.down_sweep:
        return down_sweep(args, dev, dtype, sms, out)
    for shape in args.shapes.split(","):
        gated = not shape.startswith("gelu")
        K, I = map(int, shape.removeprefix("gelu").split("x")) if dev == "cuda" else (64, 320)
        act = "silu" if gated else "gelu"
        wg = (torch.randn(I, K, device=dev) * K ** -0.5).to(dtype)
        wu = (torch.randn(I, K, device=dev) * K ** -0.5).to(dtype) if gated else None
        bg = None if gated else (torch.randn(I, device=dev) * 0.1).to(dtype)
        wd = (torch.randn(K, I, device=dev) * I ** -0.5).to(dtype)
        bd = None if gated else (torch.randn(K, device=dev) * 0.1).to(dtype)
        gu_bytes = (2 if gated else 1) * I * K * wg.element_size()
        d_bytes = K * I * wd.element_size()
        # the read ceiling: the best config per byte count (gate/up's weights, down's, all of them in one kernel)
        reads = {}
        for what, (a, b) in {"gu": (wg, wu if gated else wg), "down": (wd, wd), "all": (wg, wd)}.items():
            if what == "all" and gated:  # gate, up and down: one kernel reading three tensors = gate+up, then down
                both = torch.cat([wg.view(-1), wu.view(-1)])
                a, b = both, wd
            cands = {f"{what} {p}x{blk}/{w}": (lambda a=a, b=b, p=p, blk=blk, w=w: read(a, b, p * sms, blk, w, out))
                     for p, blk, w in READ_CONFIGS}
            t = timed(cands, dev, rounds=10)
            best = min(t, key=lambda k: t[k][0])
            reads[what] = (best, t[best][0])
            if what == "all" and gated:
                del both
        for M in map(int, args.ms.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: stop before {shape} M={M}", flush=True)
                return report(rows)
            t, bad = mlp_row(torch.randn(M, K, device=dev).to(dtype), (wg, bg, wu, wd, bd, act, gated), dev)
            rows.append((shape, M, gu_bytes, d_bytes, reads, t, bad))
            print(shape, M, {k: round(v, 1) for k, v in t.items()},
                  {k: (c, round(v, 1)) for k, (c, v) in reads.items()}, "ok" if not bad else f"WRONG {bad}", flush=True)
    report(rows)


def report(rows):
    """µs (CUDA graphs) and, in brackets, % of the copy floor of the same bytes."""
    def cell(us, nbytes):
        return f"{us:.1f} ({100 * nbytes / COPY_TBS / 1e6 / us:.0f}%)" if us else "-"

    print("| shape | M | read gate/up | gate/up kernel | read down | down split-K | down cuBLAS | "
          "read all (one kernel) | best MLP | its name | check |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for shape, M, gu_b, d_b, reads, t, bad in rows:
        mlp = min(("triton_swapab", "triton_gemm_splitk", "triton_gemm", "cublas_act_mul"), key=lambda k: t[k])
        print(f"| {shape} | {M} | {cell(reads['gu'][1], gu_b)} | {cell(t['gu swapab'], gu_b)} | "
              f"{cell(reads['down'][1], d_b)} | {cell(t['down splitk'], d_b)} | {cell(t['down cublas'], d_b)} | "
              f"{cell(reads['all'][1], gu_b + d_b)} | {cell(t[mlp], gu_b + d_b)} | {mlp} | "
              f"{'ok' if not bad else 'WRONG ' + ','.join(bad)} |")
    print("read configs (programs per SM x BLOCK / warps):",
          {f"{s} {M}": {k: c for k, (c, _) in r.items()} for s, M, _, _, r, _, _ in rows[:1]})


if __name__ == "__main__":
    main()
