"""Probe (issue 10): the down projection at M = 64-256, cuBLAS against quack's GEMM (CuTe DSL), split-K included.

    python3 benchmarks/probe_quack_down.py [--ms 64,128,256] [--shapes 4096x11008,...] [--budget-s 150]

Why: with gate and up stored as one, quack's gated GEMM takes the gate/up half to 1.09-1.16x cuBLAS at M = 128 (run
70), and the whole MLP stays at 77-82% of its floor there (run 72) because the down GEMM, y = h @ w_downᵀ with
K = I = 11008-18944 and N = 3584-8192, runs at about 65% of its own floor in cuBLAS (4096x11008 M = 128: 30.6 µs for
a 21-µs floor; run 70), and our Triton split-K down is slower still (52.7 µs). The down GEMM has few output tiles
(N = 4096 in 128-wide tiles: 32 tiles for 132 SMs at M <= 128), so it needs split-K or stream-K to fill the machine;
quack's sm90 GEMM has split-K (serial: the last split of a tile runs the epilogue, deterministic). Timed in CUDA
graphs, in turns (``probe_two_streams.timed``): cuBLAS, quack with its heuristic config (``tuned=False``), and quack
autotuned with the split factor left to its tuner (``tuned=True, split_k=None``: its config list, compiled once per
config, then timed per shape). Every output checked against float64 (within 1.25x cuBLAS's error). Needs quack and the
CuTe DSL (benchmarks/quack_wheels.sh); exits 2 without them.
"""

from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, "benchmarks")
from probe_two_streams import rel, timed  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--shapes", default="4096x11008,4096x14336,3584x18944,8192x3584", help="K x I (the MLP's)")
    ap.add_argument("--budget-s", type=float, default=150)
    args = ap.parse_args()
    try:
        from quack.gemm_interface import gemm
    except ImportError as e:
        print(f"probe_quack_down: quack and the CuTe DSL are needed ({type(e).__name__}: {e})", flush=True)
        return 2
    if not torch.cuda.is_available():
        print("probe_quack_down: needs a CUDA GPU (sm90)", flush=True)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    t0, rows = time.perf_counter(), []
    names = ["cuBLAS", "quack heuristic", "quack tuned, split-K free"]
    for shape in args.shapes.split(","):
        K, I = map(int, shape.split("x"))
        wd = (torch.randn(K, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        for M in map(int, args.ms.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: {shape} M={M} not timed", flush=True)
                continue
            h = torch.randn(M, I, device="cuda").to(torch.bfloat16)
            ref = h.double() @ wd.double().t()
            cands = {"cuBLAS": lambda h=h, wd=wd: F.linear(h, wd),
                     "quack heuristic": lambda h=h, wd=wd: gemm(h, wd.t(), tuned=False),
                     "quack tuned, split-K free": lambda h=h, wd=wd: gemm(h, wd.t(), tuned=True, split_k=None)}
            errs = {}
            for name, fn in list(cands.items()):
                try:
                    errs[name] = rel(fn(), ref)
                except Exception as e:  # a config the shape cannot take: say so, time the rest
                    print(f"{shape} M={M} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    del cands[name]
            ok = {n: errs[n] <= 1.25 * errs["cuBLAS"] for n in cands}
            t = {k: v[0] for k, v in timed(cands, "cuda").items()}
            floor = (K * I * 2 + M * (I + K) * 2) / 4.25e12 * 1e6  # bytes at run 72's measured copy bandwidth
            rows.append((shape, M, floor, t, ok))
            print(shape, M, {k: round(v, 1) for k, v in t.items()}, ok, f"{time.perf_counter() - t0:.0f} s", flush=True)
    print("Down GEMM (bf16, CUDA-graph µs; floor: bytes at 4.25 TB/s):")
    print("| K x I | M | floor µs | " + " | ".join(names) + " | best quack vs cuBLAS | checks |")
    print("|---|---|---|" + "---|" * (len(names) + 2))
    for shape, M, floor, t, ok in rows:
        quack = min((v for k, v in t.items() if k.startswith("quack")), default=float("nan"))
        cells = " | ".join(f"{t[k]:.1f}" if k in t else "–" for k in names)
        print(f"| {shape} | {M} | {floor:.1f} | {cells} | {t['cuBLAS'] / quack:.3f}x | "
              f"{'ok' if all(ok.values()) else 'WRONG ' + str(ok)} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
