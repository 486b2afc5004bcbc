"""Each implementation of the op timed on its own (no dispatcher), beside the eager and compiled peers.

    python benchmarks/bench_impls.py [--shape 0] [--ms 1,16,128]

For tuning: shows where each implementation wins, so the dispatcher's candidates and caps can be set from
measurements. CUDA-graph medians in µs; weights rotated when they fit in L2; each output checked.
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))
from bench_mlp import L2_BYTES, MS, SHAPES, make_weights  # noqa: E402

from mlp_fuser.reference import reference_mlp, rel_err  # noqa: E402


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--shapes", default="0", help="indexes into the harness's SHAPES, or KxI for a SwiGLU shape")
    ap.add_argument("--ms", default=",".join(map(str, MS)))
    args = ap.parse_args(argv)
    from triton.testing import do_bench_cudagraph

    from mlp_fuser import dispatch

    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    impls = [i for i in dispatch.IMPLS if i.triton]
    lines = []
    for spec in args.shapes.split(","):
        if "x" in spec:  # K x I: a SwiGLU shape outside the harness's list, e.g. 2048x5632 (1B class)
            K, I = map(int, spec.split("x"))
            name, gated, act, biases, dtype = f"SwiGLU {spec}", True, "silu", False, torch.bfloat16
        else:
            name, gated, act, biases, K, I, dtype = SHAPES[int(spec)]
        esize = torch.finfo(dtype).bits // 8
        w_bytes = (3 if gated else 2) * K * I * esize
        n_sets = max(1, math.ceil(2.5 * L2_BYTES / w_bytes))
        g = torch.Generator(device="cuda").manual_seed(0)
        weights = make_weights(gated, biases, K, I, dtype, n_sets, g)
        compiled = torch.compile(reference_mlp, dynamic=False)
        head = f"{name} {dtype}".ljust(30) + "".join(f"{i.name:>20}" for i in impls) + f"{'eager':>10}{'compile':>10}"
        print(head, flush=True)
        lines.append(head)
        for M in map(int, args.ms.split(",")):
            xs = [torch.randn(M, K, device="cuda", generator=g).to(dtype) for _ in range(n_sets)]
            ref = reference_mlp(xs[0].float(), *[None if t is None else t.float() for t in weights[0]], act)
            eager_err = rel_err(reference_mlp(xs[0], *weights[0], act), ref)
            cells = []
            fns = [(i.name, i.fn, i) for i in impls] + [("eager", reference_mlp, None), ("compile", compiled, None)]
            for vname, fn, impl in fns:
                p = dispatch.Problem("cuda", dtype, M, K, I, K, gated)
                if impl is not None and impl.why_not(p):
                    cells.append("-")
                    continue
                try:
                    out = fn(xs[0], *weights[0], act)
                    err = rel_err(out, ref)

                    def run(fn=fn, xs=xs, n_sets=n_sets, weights=weights, act=act):
                        for s in range(n_sets):
                            fn(xs[s], *weights[s], act)

                    run()
                    us = do_bench_cudagraph(run, rep=50, return_mode="median") / n_sets * 1e3
                    flag = "" if err <= 1.25 * eager_err + 1e-4 else "!"
                    cells.append(f"{us:.1f}{flag}")
                except Exception as e:  # report and go on: one broken variant must not hide the others
                    cells.append("ERR")
                    print(f"  {vname} M={M}: {type(e).__name__}: {str(e)[:300]}", file=sys.stderr)
            widths = [20] * len(impls) + [10, 10]
            line = f"M={M}".ljust(30) + "".join(c.rjust(w) for c, w in zip(cells, widths))
            print(line, flush=True)
            lines.append(line)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
