"""The MLP benchmark: the mlp_fuser op against its peers, side by side, in one run on one GPU.

    python -m mlp_fuser bench [--quick] [--out DIR]        (or: python benchmarks/bench_mlp.py)

Without a CUDA GPU it prints why and exits with status 2 (Triton is imported only after that check).

For every shape and token count M it times, with CUDA-graph medians and plain medians:
  fused        the mlp_fuser op (its dispatcher picks the implementation; the name is reported)
  eager        the unfused nn.Linear computation (F.linear, activation, product, F.linear)
  compile      torch.compile of the same, default mode, static shapes
  max-autotune torch.compile mode="max-autotune-no-cudagraphs", at a few M
It checks every timed variant against an fp32 reference in the same run, measures the ceilings (a large
bf16 matmul and a device copy) and reports the floor, % of floor and the speed-up over the best peer.
Weights that fit in L2 are rotated among several copies so that no variant times the cache.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from datetime import datetime, timezone

import torch

from . import dispatch
from .reference import reference_mlp, rel_err

MS = [1, 16, 64, 128, 512, 2048, 8192]
# (name, gated, activation, biases, K, I, dtype)
SHAPES = [
    ("SwiGLU 4096x11008", True, "silu", False, 4096, 11008, torch.bfloat16),
    ("SwiGLU 4096x14336", True, "silu", False, 4096, 14336, torch.bfloat16),
    ("SwiGLU 576x1536", True, "silu", False, 576, 1536, torch.bfloat16),
    ("GELU+bias 4096x11008", False, "gelu", True, 4096, 11008, torch.bfloat16),
    ("SwiGLU 4096x11008", True, "silu", False, 4096, 11008, torch.float16),
]
MAX_AUTOTUNE = {("SwiGLU 4096x11008", torch.bfloat16): (16, 2048)}
FP16_MS = (1, 16, 128, 2048)  # the fp16 shape is timed at these M only (device time)
L2_BYTES = 50e6


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def fused(x, wg, bg, wu, bu, wd, bd, act):
    if wu is None:
        return torch.ops.mlp_fuser.mlp.default(x, wg, bg, wd, bd, act)
    return torch.ops.mlp_fuser.gated_mlp.default(x, wg, bg, wu, bu, wd, bd, act)


def measure_ceilings():
    from triton.testing import do_bench

    n = 8192
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    ms = do_bench(lambda: a @ b, warmup=100, rep=400, return_mode="median")
    tflops = 2 * n**3 / ms / 1e9
    src = torch.randn(2**28, device="cuda", dtype=torch.float32)  # 1 GiB
    dst = torch.empty_like(src)
    ms = do_bench(lambda: dst.copy_(src), warmup=50, rep=300, return_mode="median")
    tbps = 2 * src.numel() * 4 / ms / 1e9
    return tflops, tbps


def make_weights(gated, biases, K, I, dtype, n_sets, g):
    sets = []
    for _ in range(n_sets):
        def rnd(*s, scale):
            return (torch.randn(*s, device="cuda", generator=g) * scale).to(dtype)
        wg = rnd(I, K, scale=K**-0.5)
        wu = rnd(I, K, scale=K**-0.5) if gated else None
        wd = rnd(K, I, scale=I**-0.5)
        bg = rnd(I, scale=0.1) if biases else None
        bu = rnd(I, scale=0.1) if biases and gated else None
        bd = rnd(K, scale=0.1) if biases else None
        sets.append((wg, bg, wu, bu, wd, bd))
    return sets


def bench_shape(name, gated, act, biases, K, I, dtype, ms_list, tflops, tbps, max_autotune_ms, rows, on_row):
    from triton.testing import do_bench, do_bench_cudagraph

    g = torch.Generator(device="cuda").manual_seed(0)
    esize = torch.finfo(dtype).bits // 8
    w_bytes = (3 if gated else 2) * K * I * esize + ((2 * I + K) * esize if biases else 0)
    n_sets = max(1, math.ceil(2.5 * L2_BYTES / w_bytes))
    weights = make_weights(gated, biases, K, I, dtype, n_sets, g)
    compiled = torch.compile(reference_mlp, dynamic=False)
    tuned = torch.compile(reference_mlp, dynamic=False, mode="max-autotune-no-cudagraphs")
    for M in ms_list:
        xs = [(torch.randn(M, K, device="cuda", generator=g)).to(dtype) for _ in range(n_sets)]
        flops = 2 * M * K * I * (3 if gated else 2)
        min_bytes = w_bytes + 2 * M * K * esize
        floor_us = max(flops / (tflops * 1e12), min_bytes / (tbps * 1e12)) * 1e6
        bound = "compute" if flops / (tflops * 1e12) > min_bytes / (tbps * 1e12) else "mem"
        variants = {"fused": fused, "eager": reference_mlp, "compile": compiled}
        if M in max_autotune_ms:
            variants["max-autotune"] = tuned
        # correctness of every variant against an fp32 reference, on set 0
        w0 = weights[0]
        ref = reference_mlp(xs[0].float(), *[None if t is None else t.float() for t in w0], act)
        errs, times = {}, {}
        for vname, fn in variants.items():
            t0 = time.time()
            out = fn(xs[0], *w0, act)  # compiles / autotunes here, before any graph capture
            torch.cuda.synchronize()
            errs[vname] = rel_err(out, ref)
            if time.time() - t0 > 5:
                log(f"  {vname}: first call {time.time() - t0:.0f} s")

            def run(fn=fn, xs=xs):
                for s in range(n_sets):
                    fn(xs[s], *weights[s], act)

            run()
            graph_ms = do_bench_cudagraph(run, rep=60, return_mode="median") / n_sets
            plain_ms = do_bench(run, warmup=10, rep=60, return_mode="median") / n_sets
            times[vname] = (graph_ms * 1e3, plain_ms * 1e3)
        p = dispatch.Problem("cuda", dtype, M, K, I, K, gated)
        impl = dispatch.chosen(p)
        peers = {k: v[0] for k, v in times.items() if k != "fused"}
        best_peer = min(peers, key=peers.get)
        ok = errs["fused"] <= 1.25 * errs["eager"] + 1e-4
        row = dict(shape=name, dtype=str(dtype).removeprefix("torch."), M=M, bound=bound, floor_us=floor_us,
                   impl=impl, errors=errs, fused_ok=ok, n_weight_sets=n_sets,
                   graph_us={k: v[0] for k, v in times.items()}, plain_us={k: v[1] for k, v in times.items()},
                   best_peer=best_peer, speedup=peers[best_peer] / times["fused"][0],
                   pct_floor=100 * floor_us / times["fused"][0])
        rows.append(row)
        log(format_row(row))
        on_row()


def format_row(r):
    g = r["graph_us"]
    mat = f"{g['max-autotune']:8.1f}" if "max-autotune" in g else "       –"
    return (f"| {r['shape']:<21} | {r['dtype']:<8} | {r['M']:>5} | {r['floor_us']:8.1f} {r['bound']:<7} | "
            f"{g['fused']:8.1f} | {r['impl']:<15} | {g['eager']:8.1f} | {g['compile']:8.1f} | {mat} | "
            f"{r['plain_us']['fused']:8.1f} | {r['plain_us']['eager']:8.1f} | {r['speedup']:5.2f}x | "
            f"{r['pct_floor']:5.1f}% | {'ok' if r['fused_ok'] else 'WRONG'} {r['errors']['fused']:.1e} |")


HEADER = ("| shape | dtype | M | floor µs | fused µs | impl | eager µs | compile µs | max-autotune µs | "
          "fused plain µs | eager plain µs | speed-up vs best peer | % of floor | fused check, rel err |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlp_fuser bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rows only (M=1, 16, 2048 on the first shape)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for results.json/results.md")
    ap.add_argument("--shapes", default="", help="comma-separated indexes into SHAPES (default: all)")
    ap.add_argument("--ms", default="", help=f"comma-separated token counts (default: {MS})")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mlp_fuser bench: no CUDA GPU found. The benchmark times the Triton kernels, which run on CUDA;\n"
              "run it on a machine with an NVIDIA GPU. (On this machine, `python -m mlp_fuser demo` shows the\n"
              "fusion on a real model with the CPU reference path.)", file=sys.stderr)
        return 2
    import triton

    torch._dynamo.config.cache_size_limit = 512
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = 512
    torch.backends.cuda.matmul.allow_tf32 = False
    log("measuring ceilings ...")
    tflops, tbps = measure_ceilings()
    log(f"ceilings: bf16 matmul {tflops:.0f} TFLOP/s, device copy {tbps:.2f} TB/s")
    shapes = [SHAPES[int(i)] for i in args.shapes.split(",")] if args.shapes else SHAPES
    ms_list = [int(m) for m in args.ms.split(",")] if args.ms else MS
    if args.quick:
        shapes, ms_list = shapes[:1], [1, 16, 2048]
    rows = []
    log(HEADER)
    t0 = time.time()
    command = "python -m mlp_fuser bench " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, command=command.strip(),
                ceilings=dict(matmul_tflops=tflops, copy_tbps=tbps))
    for name, gated, act, biases, K, I, dtype in shapes:
        mat = MAX_AUTOTUNE.get((name, dtype), ())
        shape_ms = [m for m in ms_list if m in FP16_MS] if dtype == torch.float16 else ms_list
        bench_shape(name, gated, act, biases, K, I, dtype, shape_ms, tflops, tbps, mat, rows,
                    on_row=lambda: write_results(args.out, dict(meta, seconds=time.time() - t0), rows))
        torch.cuda.empty_cache()
    print("\n".join(write_results(args.out, dict(meta, seconds=time.time() - t0), rows)))
    return 0 if all(r["fused_ok"] for r in rows) else 1


def write_results(out, meta, rows):
    """results.json and results.md in out/, rewritten after every row (a cut-short run keeps its rows)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    c = meta["ceilings"]
    md = [f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · ceilings "
          f"{c['matmul_tflops']:.0f} TFLOP/s bf16, {c['copy_tbps']:.2f} TB/s · `{meta['command']}`", "", HEADER]
    md += [format_row(r) for r in rows]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


if __name__ == "__main__":
    sys.exit(main())
