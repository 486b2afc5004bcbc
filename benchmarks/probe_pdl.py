"""Programmatic dependent launch (PDL) in each mode and off, for each two-kernel implementation, timed in turns.

    python benchmarks/probe_pdl.py [--shapes 0,1,2,3,4] [--ms 1,8,16,32,64,128] [--modes start] [--impls ...]

Per row (a harness shape and M): each of ``triton_gemm_splitk``, ``triton_swapab`` (M <= 32) and ``triton_gemm``
forced through the op (``config.force_impl``, so calls run their launch plans), once per ``config.pdl`` mode in
``--modes`` and once off, the dispatcher's own choice with PDL off ("fused"), and torch.compile as the peer; all
variants of a row take turns (``mlp_fuser.bench.ShapeSetup.time``: CUDA-graph and plain medians, every output checked
against fp32). Prints the per-row table, then the summary: per implementation and mode, graph µs with PDL against
off, and the % of the floor.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp_fuser import config, dispatch  # noqa: E402
from mlp_fuser.bench import DTYPES, Budget, ShapeSetup, fused, measure_ceilings  # noqa: E402
from mlp_fuser.reference import reference_mlp  # noqa: E402

PAIRS = ["triton_gemm_splitk", "triton_swapab", "triton_gemm"]


def forced(impl: str | None, pdl: str):
    """The op with ``impl`` forced (None: the dispatcher's choice) and PDL in mode ``pdl``, for the duration of a
    call."""
    def run(*args):
        old = config.force_impl, config.pdl
        config.force_impl, config.pdl = impl, pdl
        try:
            return fused(*args)
        finally:
            config.force_impl, config.pdl = old
    return run


def main(argv=None) -> int:
    t0 = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1,2,3,4")
    ap.add_argument("--ms", default="1,8,16,32,64,128")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--budget-s", type=float, default=280.0, help="start no row past this many seconds")
    ap.add_argument("--modes", default="start", help="config.pdl modes timed against 'off'")
    ap.add_argument("--impls", default=",".join(PAIRS))
    args = ap.parse_args(argv)
    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = DTYPES[args.dtype]
    modes, impls = args.modes.split(","), args.impls.split(",")
    budget = Budget(args.budget_s, t0=t0)
    _, tbps = measure_ceilings()
    print(f"copy bandwidth {tbps:.2f} TB/s; config.pdl default {config.pdl}", flush=True)
    rows, row_s = [], []
    for s in map(int, args.shapes.split(",")):
        setup = ShapeSetup(s, dtype)
        compiled = torch.compile(reference_mlp, dynamic=False)
        for M in map(int, args.ms.split(",")):
            if not budget.fits(max(row_s[-3:], default=15.0), f"{setup.name} M={M}"):
                continue
            t_row = time.time()
            p = dispatch.Problem("cuda", dtype, M, setup.K, setup.I, setup.K, setup.gated)
            variants = {"fused": forced(None, "off"), "compile": compiled}
            for impl in impls:
                if dispatch.IMPLS_BY_NAME[impl].why_not(p) is None:
                    for mode in ["off", *modes]:
                        variants[f"{impl}/{mode}"] = forced(impl, mode)
            try:
                errs, times = setup.time(M, variants)
            except Exception as e:  # report and go on
                print(f"{setup.name} M={M}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                continue
            eager_err = setup.time(M, {"eager": reference_mlp}, rounds=1)[0]["eager"]
            floor = (setup.w_bytes + 2 * M * setup.K * setup.esize) / (tbps * 1e12) * 1e6
            chosen = dispatch.chosen(p)
            rows.append((setup.name, M, floor, chosen, times, errs, eager_err))
            cells = "  ".join(f"{v} {g:.1f}/{pl:.1f}{'!' if errs[v] > 1.25 * eager_err else ''}"
                              for v, (g, pl) in times.items())
            print(f"{setup.name} M={M} floor {floor:.1f} (fused = {chosen}): {cells}", flush=True)
            row_s.append(time.time() - t_row)
        del setup, compiled
        torch.cuda.empty_cache()

    print(f"\nPDL modes against off ({args.dtype}, µs: CUDA-graph median / plain median; % of the floor at "
          f"{tbps:.2f} TB/s; '!' = outside 1.25x the unfused module's error; {time.time() - t0:.0f} s; skipped: "
          f"{'; '.join(budget.skipped) or 'none'})")
    heads = " | ".join(f"{m}: graph (off/{m}) / plain" for m in modes)
    print(f"| shape | M | floor | impl | off: graph / plain | {heads} | fused (choice) | compile |")
    print("|---|---|---|---|---|" + "---|" * len(modes) + "---|---|")
    ratios = {m: [] for m in modes}
    for name, M, floor, chosen, times, errs, eager_err in rows:
        for impl in impls:
            if f"{impl}/off" not in times:
                continue
            bad = {v: "!" if e > 1.25 * eager_err else "" for v, e in errs.items()}
            goff, poff = times[f"{impl}/off"]
            cells = [f"{goff:.1f} ({100 * floor / goff:.0f}%){bad[f'{impl}/off']} / {poff:.1f}"]
            for m in modes:
                g, pl = times[f"{impl}/{m}"]
                ratios[m].append(goff / g)
                cells.append(f"{g:.1f} ({goff / g:.3f}x){bad[f'{impl}/{m}']} / {pl:.1f}")
            print(f"| {name} | {M} | {floor:.1f} | {impl} | " + " | ".join(cells) +
                  f" | {times['fused'][0]:.1f} ({chosen}, {100 * floor / times['fused'][0]:.0f}%) | "
                  f"{times['compile'][0]:.1f} |")
    for m, r in ratios.items():
        if r:
            print(f"graph speed-up of PDL mode {m}: median {statistics.median(r):.3f}x, min {min(r):.3f}x, "
                  f"max {max(r):.3f}x over {len(r)} pairs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
