"""Each implementation of the op timed on its own (no dispatcher), beside the eager and compiled peers.

    python benchmarks/bench_impls.py [--shapes 0,1,2,3,4] [--ms 16,32,64,128,256] [--dtype bf16] [--budget-s 280]

For tuning: shows where each implementation wins, so the dispatcher's candidates and caps can be set from
measurements. CUDA-graph medians in µs; weights rotated when they fit in L2; each output checked against fp32
(a "!" marks one outside 1.25x the unfused module's error; the gate/up kernels below are checked against fp32 h,
with two F.linear + act_mul's error as the bar). Besides the whole-MLP implementations, the gate/up
kernels alone (`gu:gemm` = gate_up_act autotuned, `gu:streamk` = gate_up_act_streamk, `gu:splitk` =
gate_up_act_splitk, `gu:cublas` = two F.linear + act_mul) show which half of the MLP a difference comes from. The
last table: per row the fastest other implementation, the candidate under test (NEW) against it, and the % of the
floor (weights once at the measured copy bandwidth).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from mlp_fuser.bench import DTYPES, SHAPES, Budget, ShapeSetup, measure_ceilings  # noqa: E402
from mlp_fuser.reference import reference_gate_up, reference_mlp  # noqa: E402

NEW = "splitk+cublas"  # the candidate under test: split-K gate/up, then cuBLAS down (not in the dispatcher)


def gate_up_variants():
    from mlp_fuser.kernels import act_mul, gate_up_act
    from mlp_fuser.kernels.splitk import gate_up_act_splitk
    from mlp_fuser.kernels.streamk import gate_up_act_streamk

    def cublas(x, wg, bg, wu, bu, wd, bd, act):
        return act_mul(F.linear(x, wg, bg), None if wu is None else F.linear(x, wu, bu), act)

    return {"gu:gemm": lambda x, wg, bg, wu, bu, wd, bd, act: gate_up_act(x, wg, bg, wu, bu, act),
            "gu:streamk": lambda x, wg, bg, wu, bu, wd, bd, act: gate_up_act_streamk(x, wg, bg, wu, bu, act),
            "gu:splitk": lambda x, wg, bg, wu, bu, wd, bd, act: gate_up_act_splitk(x, wg, bg, wu, bu, act),
            "gu:cublas": cublas}


def gate_up_reference(x, wg, bg, wu, bu, wd, bd, act):
    """What the gu:* variants compute, h, in the harness's signature (w_down, b_down unused)."""
    return reference_gate_up(x, wg, bg, wu, bu, act)


def _splitk_cublas(x, wg, bg, wu, bu, wd, bd, act):
    from mlp_fuser.kernels.splitk import gate_up_act_splitk

    return F.linear(gate_up_act_splitk(x, wg, bg, wu, bu, act), wd, bd)


def main(argv=None):
    t0 = time.time()
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0,1,2,3,4", help="indexes into mlp_fuser.bench.SHAPES, or KxI (SwiGLU)")
    ap.add_argument("--ms", default="16,32,64,128,256")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--budget-s", type=float, default=280.0, help="start no row past this many seconds")
    args = ap.parse_args(argv)
    from mlp_fuser import dispatch

    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    torch.backends.cuda.matmul.allow_tf32 = False
    dtype = DTYPES[args.dtype]
    budget = Budget(args.budget_s, t0=t0)
    _, tbps = measure_ceilings()
    impls = [i for i in dispatch.IMPLS if i.triton]
    names = [i.name for i in impls] + [NEW, "eager", "compile"] + list(gate_up_variants())
    width = max(map(len, names)) + 2
    lines, summary, row_s = [], [], []
    for spec in args.shapes.split(","):
        if "x" in spec:  # K x I: a SwiGLU shape outside the harness's list, e.g. 2048x5632 (1B class)
            K, I = map(int, spec.split("x"))
            SHAPES.append((f"SwiGLU {spec}", True, "silu", False, K, I))
            spec = str(len(SHAPES) - 1)
        setup = ShapeSetup(int(spec), dtype)
        compiled = torch.compile(reference_mlp, dynamic=False)
        head = f"{setup.name} {args.dtype}".ljust(26) + "".join(n.rjust(width) for n in names)
        print(head, flush=True)
        lines.append(head)
        for M in map(int, args.ms.split(",")):
            if not budget.fits(max(row_s[-3:], default=10.0), f"{setup.name} M={M}"):
                continue
            t_row = time.time()
            p = dispatch.Problem("cuda", dtype, M, setup.K, setup.I, setup.K, setup.gated)
            variants = {i.name: i.fn for i in impls if i.why_not(p) is None}
            variants[NEW] = _splitk_cublas
            variants["compile"] = compiled
            mlp_names = {"eager", *variants}
            variants.update(gate_up_variants())
            errs, times = setup.time(M, {"eager": reference_mlp})
            # the gate/up kernels are checked against fp32 h, with two F.linear + act·mul's error as the bar
            errs["gu"] = setup.time(M, {"gu": gate_up_variants()["gu:cublas"]}, rounds=1,
                                    reference=gate_up_reference)[0]["gu"]
            us = {"eager": times["eager"][0]}  # name -> CUDA-graph µs, None when it failed
            wrong = set()
            for vname, fn in variants.items():
                half = vname not in mlp_names
                try:
                    e, t = setup.time(M, {vname: fn}, reference=gate_up_reference if half else reference_mlp)
                except Exception as ex:  # report and go on: one broken variant must not hide the others
                    print(f"  {vname} M={M}: {type(ex).__name__}: {str(ex)[:300]}", file=sys.stderr)
                    us[vname] = None
                    continue
                us[vname] = t[vname][0]
                if e[vname] > 1.25 * errs["gu" if half else "eager"]:
                    wrong.add(vname)
            cells = ["-" if us.get(n) is None else f"{us[n]:.1f}{'!' if n in wrong else ''}" for n in names]
            line = f"M={M}".ljust(26) + "".join(c.rjust(width) for c in cells)
            print(line, flush=True)
            lines.append(line)
            floor = (setup.w_bytes + 2 * M * setup.K * setup.esize) / (tbps * 1e12) * 1e6
            old = {n: us[n] for n in mlp_names if us.get(n) and n != NEW and n not in wrong}
            best = min(old, key=old.get)
            new = us.get(NEW)
            new_cell = "-" if new is None else f"{new:.1f}{' WRONG' if NEW in wrong else ''}"
            ratio = "-" if new is None else f"{old[best] / new:.3f}x ({100 * floor / new:.0f}%)"
            summary.append(f"| {setup.name} | {M} | {floor:.1f} | {best} {old[best]:.1f} "
                           f"({100 * floor / old[best]:.0f}%) | {new_cell} | {ratio} |")
            row_s.append(time.time() - t_row)
        del setup, compiled
        torch.cuda.empty_cache()
    print("\n".join(lines))
    print(f"\n{NEW} against the fastest existing path ({args.dtype}, CUDA-graph µs, floor = weights once at "
          f"{tbps:.2f} TB/s; {time.time() - t0:.0f} s; skipped: {'; '.join(budget.skipped) or 'none'})")
    print(f"| shape | M | floor µs | fastest existing (% of floor) | {NEW} µs | speed-up (% of floor) |")
    print("|---|---|---|---|---|---|")
    print("\n".join(summary))


if __name__ == "__main__":
    main()
