"""Run 35: the dispatcher's implementations alone at M = 1-64 after linear_splitk became swap-AB (the down half of
triton_gemm_splitk), beside the unfused module (eager), in turns, CUDA-graph medians (mlp_fuser.bench.ShapeSetup).

    python3 benchmarks/runs/2026-11-30-run35/impls_small_m.py [budget_s]
"""
import sys
import time

import torch

from mlp_fuser import dispatch
from mlp_fuser.bench import ShapeSetup
from mlp_fuser.reference import reference_mlp

budget = float(sys.argv[1]) if len(sys.argv) > 1 else 80
t0 = time.time()
names = ["triton_small_m", "triton_gemm", "triton_gemm_splitk", "cublas_act_mul", "eager"]
print("| shape | M | " + " | ".join(names) + " | splitk vs best other |")
print("|---" * (len(names) + 3) + "|")
for index in (0, 3, 4):
    setup = ShapeSetup(index, torch.bfloat16)
    for M in (1, 16, 32, 64):
        if time.time() - t0 > budget:
            print(f"budget spent before {setup.name} M={M}")
            sys.exit(0)
        p = dispatch.Problem("cuda", torch.bfloat16, M, setup.K, setup.I, setup.K, setup.gated)
        variants = {i.name: i.fn for i in dispatch.IMPLS if i.triton and i.why_not(p) is None}
        variants["eager"] = reference_mlp
        errs, times = setup.time(M, variants)
        us = {n: times[n][0] for n in variants}
        bad = {n for n in variants if errs[n] > 1.25 * errs["eager"]}
        others = {n: t for n, t in us.items() if n != "triton_gemm_splitk" and n not in bad}
        best = min(others, key=others.get)
        cells = [f"{us[n]:.1f}{'!' if n in bad else ''}" if n in us else "-" for n in names]
        print(f"| {setup.name} | {M} | " + " | ".join(cells) +
              f" | {others[best] / us['triton_gemm_splitk']:.3f}x ({best}) |", flush=True)
    del setup
    torch.cuda.empty_cache()
