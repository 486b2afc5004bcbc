"""Probe (issue 10): at M = 32-512, cuBLAS's gate and up GEMMs on two streams at once, against one after the other.

    python3 benchmarks/probe_two_streams.py [--ms 32,64,128,256,512] [--shapes 4096x11008,...] [--budget-s 150]
    python3 benchmarks/probe_two_streams.py --device cpu     # the script itself, without a GPU (no second stream)

Why: from M = 64 the dispatcher takes ``cublas_act_mul`` (gate GEMM, up GEMM, the act·mul kernel, down GEMM) and
those rows sit at 70-84% of the floor (run 46). Each of the two gate/up GEMMs alone is small for the GPU (at M = 128
and I = 11008, 86 output tiles of 128 x 128 against 132 SMs; at the 70B shard's I = 3584, 28), so each may leave SMs
idle that the other could use; on two streams they can run side by side (in a CUDA graph: two branches). The down
projection depends on both and stays after them. Timed here, in CUDA graphs and without, in turns: the whole MLP
both ways, and the gate/up half alone both ways; every output checked against float64 (1.25x the sequential path's
error). A probe: nothing in mlp_fuser calls it; a new dispatch candidate only if the whole MLP wins here.
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
from mlp_fuser.kernels import act_mul  # noqa: E402


def sequential(x, wg, wu, wd):
    return F.linear(act_mul(F.linear(x, wg), F.linear(x, wu), "silu"), wd)


def gate_up_sequential(x, wg, wu):
    return act_mul(F.linear(x, wg), F.linear(x, wu), "silu")


def gate_up_two_streams(x, wg, wu, side):
    """g on the current stream, u on ``side`` at the same time; u's memory is the current stream's, so the caching
    allocator never sees it used on another stream after it is freed."""
    if side is None:  # the CPU: no streams
        return gate_up_sequential(x, wg, wu)
    here = torch.cuda.current_stream()
    u = torch.empty((x.shape[0], wu.shape[0]), device=x.device, dtype=x.dtype)
    side.wait_stream(here)  # x and u's memory are ready on the side stream
    with torch.cuda.stream(side):
        torch.matmul(x, wu.t(), out=u)
    g = F.linear(x, wg)
    here.wait_stream(side)
    return act_mul(g, u, "silu")


def two_streams(x, wg, wu, wd, side):
    return F.linear(gate_up_two_streams(x, wg, wu, side), wd)


def timed(cands, device, rounds=20, reps=10):
    """{name: (CUDA-graph µs, plain µs)}, the candidates in turns (order rotated per round), medians."""
    if device != "cuda":
        return {k: (0.0, 0.0) for k in cands}
    graphs, capture = {}, torch.cuda.Stream()
    capture.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(capture):
        for name, fn in cands.items():
            for _ in range(3):
                fn()
            graphs[name] = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graphs[name], stream=capture):
                for _ in range(reps):
                    fn()
    torch.cuda.current_stream().wait_stream(capture)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def ms(work):
        a.record()
        work()
        b.record()
        b.synchronize()
        return a.elapsed_time(b)

    names, g_ms, p_ms = list(cands), {k: [] for k in cands}, {k: [] for k in cands}
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            g_ms[name].append(ms(graphs[name].replay) / reps)
            p_ms[name].append(ms(lambda fn=cands[name]: [fn() for _ in range(reps)]) / reps)
    return {k: (statistics.median(g_ms[k]) * 1e3, statistics.median(p_ms[k]) * 1e3) for k in names}


def rel(out, ref):
    return ((out.double() - ref).norm() / ref.norm()).item()


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="32,64,128,256,512")
    ap.add_argument("--shapes", default="4096x11008,4096x14336,3584x18944,8192x3584", help="K x I (SwiGLU)")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--budget-s", type=float, default=150)
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    side = torch.cuda.Stream() if dev == "cuda" else None
    t0, rows = time.perf_counter(), []
    print(torch.cuda.get_device_name() if dev == "cuda" else dev, torch.__version__, flush=True)
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname] if dev == "cuda" else torch.float32
        for shape in args.shapes.split(","):
            K, I = map(int, shape.split("x")) if dev == "cuda" else (64, 96)
            wg, wu = (torch.randn(2, I, K, device=dev) * K ** -0.5).to(dtype)
            wd = (torch.randn(K, I, device=dev) * I ** -0.5).to(dtype)
            for M in map(int, args.ms.split(",")):
                if time.perf_counter() - t0 > args.budget_s:
                    print(f"budget spent: stop before {dname} {shape} M={M}", flush=True)
                    return report(rows)
                x = torch.randn(M, K, device=dev).to(dtype)
                xd, wgd, wud, wdd = x.double(), wg.double(), wu.double(), wd.double()
                h_ref = F.silu(xd @ wgd.t()) * (xd @ wud.t())
                y_ref = h_ref @ wdd.t()
                cands = {"mlp seq": lambda x=x, w=(wg, wu, wd): sequential(x, *w),
                         "mlp 2s": lambda x=x, w=(wg, wu, wd): two_streams(x, *w, side),
                         "gu seq": lambda x=x, w=(wg, wu): gate_up_sequential(x, *w),
                         "gu 2s": lambda x=x, w=(wg, wu): gate_up_two_streams(x, *w, side)}
                errs = {k: rel(fn(), y_ref if k.startswith("mlp") else h_ref) for k, fn in cands.items()}
                ok = errs["mlp 2s"] <= 1.25 * errs["mlp seq"] + 1e-6 and errs["gu 2s"] <= 1.25 * errs["gu seq"] + 1e-6
                t = timed(cands, dev)
                floor = (3 * I * K + 2 * M * K) * x.element_size() / 4.24e12 * 1e6  # run 46's copy bandwidth
                rows.append((dname, shape, M, floor, t, ok))
                print(dname, shape, M, {k: tuple(round(v, 1) for v in vs) for k, vs in t.items()},
                      "ok" if ok else f"WRONG {errs}", flush=True)
    report(rows)


def report(rows):
    print("| dtype | K x I | M | MLP: one stream | two streams (graph speed-up) | plain: one / two | gate/up: one | "
          "two | check |")
    print("|---|---|---|---|---|---|---|---|---|")
    for d, shape, M, floor, t, ok in rows:
        (ms_g, ms_p), (m2_g, m2_p) = t["mlp seq"], t["mlp 2s"]
        sp = ms_g / m2_g if m2_g else 0.0
        def pct(us, floor=floor):
            return f"{100 * floor / us:.0f}%" if us else "-"

        print(f"| {d} | {shape} | {M} | {ms_g:.1f} ({pct(ms_g)}) | {m2_g:.1f} ({pct(m2_g)}, {sp:.3f}x) | "
              f"{ms_p:.1f} / {m2_p:.1f} | {t['gu seq'][0]:.1f} | {t['gu 2s'][0]:.1f} | {'ok' if ok else 'WRONG'} |")


if __name__ == "__main__":
    main()
