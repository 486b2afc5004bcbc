"""The swap-AB gate/up kernel (``kernels/swapab.py``) in configs its rule never picks, whole MLP, CUDA-graph µs.

    python3 benchmarks/probe_swapab_configs.py [--shapes 2,0] [--ms 1,16,32] [--block-n 32,64]
                                               [--steps 64x3,64x4,128x3,128x4,256x3,256x4] [--down splitk|cublas]
                                               [--block-m 0] [--warps 4] [--budget-s 150]

Questions it answers (twelfth session's "Next"; nothing here changes the dispatcher):
- A plain MLP (GELU + biases, ``--shapes 2``) streams one weight per program where a gated one streams two, so at the
  same blocks it keeps half the weight bytes in flight; ``swapab_config`` counts two weights either way. Does a
  deeper K step (BLOCK_K 256) or a thinner program (BLOCK_N 32: twice the programs) recover the bandwidth?
- M = 64-128 (``--ms 128 --block-m 128 --warps 8 --steps 64x3 --down cublas``): all the tokens in one block, so each
  weight tile is read once (run 40's two 64-token blocks read it twice and lost).
Each config is timed beside ``triton_gemm_splitk``, ``triton_gemm`` and ``cublas_act_mul`` (the dispatcher's
implementations), in turns (two passes, the lower median), and checked against float64 (1.25x the unfused module's
error; a config outside it is named and dropped). Prints one line per row, then a table: the best config against the
best implementation. On a CPU (``TRITON_INTERPRET=1``) it runs tiny shapes as a smoke test of the script.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from probe_down_tma import graph_us  # noqa: E402

from mlp_fuser import dispatch  # noqa: E402
from mlp_fuser.bench import SHAPES  # noqa: E402
from mlp_fuser.kernels.splitk import linear_splitk, splitk_config, splitk_counters  # noqa: E402
from mlp_fuser.kernels.swapab import gate_up_act_swapab, swapab_config  # noqa: E402
from mlp_fuser.reference import reference_mlp, rel_err  # noqa: E402

IMPLS = ("triton_gemm_splitk", "triton_gemm", "cublas_act_mul")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="2,0", help="indexes into mlp_fuser.bench.SHAPES")
    ap.add_argument("--ms", default="1,16,32")
    ap.add_argument("--block-n", default="32,64")
    ap.add_argument("--steps", default="64x3,64x4,128x3,128x4,256x3,256x4", help="BLOCK_K x stages")
    ap.add_argument("--block-m", type=int, default=0, help="0: the rule's (16 up to 64 tokens)")
    ap.add_argument("--warps", type=int, default=4)
    ap.add_argument("--down", default="splitk", choices=["splitk", "cublas"])
    ap.add_argument("--dtype", default="bf16", choices=["bf16", "fp16"])
    ap.add_argument("--budget-s", type=float, default=150.0)
    args = ap.parse_args(argv)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[args.dtype] if dev == "cuda" else torch.float16
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    steps = [tuple(int(v) for v in s.split("x")) for s in args.steps.split(",")]
    t0, rows = time.perf_counter(), []
    print(torch.cuda.get_device_name() if dev == "cuda" else dev, torch.__version__, flush=True)
    for s in ints(args.shapes):
        name, gated, act, biases, K, I = SHAPES[s]
        if dev == "cpu":  # the interpreter: a tiny shape of the same kind
            K, I = 64, 96
        g = torch.Generator(device=dev).manual_seed(K + I)
        def w(*shape, scale, g=g):
            return (torch.randn(*shape, device=dev, generator=g) * scale).to(dtype)

        wg, wd = w(I, K, scale=K**-0.5), w(K, I, scale=I**-0.5)
        wu = w(I, K, scale=K**-0.5) if gated else None
        bg, bd = (w(I, scale=0.5), w(K, scale=0.5)) if biases else (None, None)
        bu = w(I, scale=0.5) if biases and gated else None
        for M in ints(args.ms) if dev == "cuda" else (1, 17):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent before {name} M={M}", flush=True)
                break
            x = torch.randn(M, K, device=dev, generator=g).to(dtype)
            ws = (wg, bg, wu, bu, wd, bd)
            d = [None if t is None else t.double() for t in ws]
            ref = reference_mlp(x.double(), *d, act)
            bar = 1.25 * rel_err(reference_mlp(x, *ws, act), ref)
            dcfg = splitk_config(M, K, I, x.element_size(), x.device)
            counters = splitk_counters(M, K, I, dcfg, x.device) if args.down == "splitk" else None

            def swap(cfg, x=x, dcfg=dcfg, counters=counters, ws=ws, act=act):
                h = gate_up_act_swapab(x, ws[0], ws[1], ws[2], ws[3], act, zero=counters, config=cfg)
                if args.down == "cublas":
                    return F.linear(h, ws[4], ws[5])
                return linear_splitk(h, ws[4], ws[5], dcfg, counters=counters)

            cands = {}
            for impl in IMPLS:
                if dispatch.IMPLS_BY_NAME[impl].why_not(dispatch.Problem(dev, dtype, M, K, I, K, gated)) is None:
                    cands[impl] = lambda impl=impl, x=x, ws=ws, act=act: dispatch.IMPLS_BY_NAME[impl].fn(x, *ws, act)
            rule = swapab_config(M, I, x.element_size(), x.device, 2 if gated else 1)
            cands[f"rule {rule}"] = lambda swap=swap: swap(None)
            bm = args.block_m or rule[0]
            for bn in ints(args.block_n):
                for bk, st in steps:
                    cfg = (bm, bn, bk, args.warps, st)
                    cands[str(cfg)] = lambda cfg=cfg, swap=swap: swap(cfg)
            res = {}
            for _ in range(2):  # two passes, in turns; the lower of the two medians
                for cname, fn in cands.items():
                    try:
                        us = graph_us(fn) if dev == "cuda" else (fn(), 0.0)[1]
                    except Exception as e:  # noqa: BLE001 (a config that does not fit: named, not fatal)
                        print(f"  {cname}: {type(e).__name__}: {str(e)[:120]}", flush=True)
                        cands[cname] = None
                        continue
                    res[cname] = min(us, res.get(cname, float("inf")))
                cands = {k: v for k, v in cands.items() if v is not None}
            for cname in list(res):
                err = rel_err(cands[cname](), ref)
                if not err <= bar:
                    print(f"  {name} M={M} {cname}: error {err:.2e} > bar {bar:.2e}", flush=True)
                    del res[cname]
            configs = [k for k in res if k.startswith("(")]
            impls = [k for k in res if k in IMPLS]
            if not configs or not impls:
                continue
            best = min(configs, key=res.get)
            best_impl = min(impls, key=res.get)
            rule_key = next((k for k in res if k.startswith("rule")), None)
            rows.append((name, M, best_impl, res[best_impl], res.get(rule_key), best, res[best]))
            print(rows[-1][:2], {k: round(v, 1) for k, v in res.items()}, flush=True)
    print(f"\n{args.dtype}, CUDA-graph µs, down projection: {args.down}; {time.perf_counter() - t0:.0f} s")
    print("| shape | M | best implementation | swap-AB by its rule | best swap-AB config | best config vs best impl |")
    print("|---|---|---|---|---|---|")
    for name, M, bi, bius, rus, best, bus in rows:
        rule_cell = "-" if rus is None else f"{rus:.1f}"
        print(f"| {name} | {M} | {bi} {bius:.1f} | {rule_cell} | {best} {bus:.1f} | {bius / max(bus, 1e-9):.3f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
