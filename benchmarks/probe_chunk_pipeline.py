"""Probe (issue 10): the MLP in chunks of I, the down GEMM of chunk j on a second stream beside the gate/up GEMM of
chunk j + 1.

    python3 benchmarks/probe_chunk_pipeline.py [--ms 1,16,64,128,256,512] [--shapes 4096x11008,...,gelu4096x11008]
                                               [--chunks 2,3,4] [--budget-s 200] [--quack 128x128]
    python3 benchmarks/probe_chunk_pipeline.py --device cpu     # the script itself, without a GPU (one stream)

Why: at M = 64-128 what limits the MLP is the down GEMM (NOTES, sixteenth session): at 4096x11008 M = 128 its
32 output tiles of 128 x 128 leave most of 132 SMs idle, and every GEMM here (cuBLAS's split-K 30.6 µs, quack's
37.0, ours 52.7) sits at 42-72% of its 22.1-µs floor, while the gate/up half is at 83% of its own. The down GEMM is a
sum over I, so it can be split there and each part run as soon as its part of h exists: gate/up of chunk j + 1 and
down of chunk j side by side on two streams (two branches in a CUDA graph), so the down's idle SMs work on gate/up
and the MLP's time tends to its bytes over the GPU's bandwidth, not the sum of two badly filled GEMMs. The same split
may hide each kernel's tail at M <= 16, where the rows sit at 86-92% of the floor.

Each candidate, timed in CUDA graphs and plainly, in turns (``probe_two_streams.timed``), output checked against
float64 (within 1.25x ``seq``'s error; y accumulated in fp32 across the chunks, ``mm``'s ``out_dtype``, where the GPU's
torch has it, else in y's dtype, which the check then judges):
- ``seq``: cuBLAS's gate and up GEMMs, our act·mul kernel, cuBLAS's down GEMM (``cublas_act_mul``, separate weights);
- ``one``: the same with gate and up stored as one, one GEMM for both (``merge_gate_up``'s layout);
- ``pipeC``: C chunks of I, each chunk's gate and up in one batched GEMM (``bmm`` over the two halves of the one
  buffer, a batch stride of I x K: no re-layout), act·mul, then its down GEMM on the side stream accumulating y;
- ``pipeC-1s``: the same chunks on one stream (what the chunking costs without the overlap);
- ``quack``, ``qpipeC`` with ``--quack CONFIG`` where quack is importable: quack's gated GEMM for all of I, or per
  chunk over a blocked copy of the weights ([g_j; u_j] per chunk, the layout a merge could store), then cuBLAS's down.
GELU with biases (``gelu4096x11008``): the up GEMM with its bias, GELU, the down with its bias added by chunk 0.
A probe: nothing in mlp_fuser calls it; a dispatch candidate only if the whole MLP wins here.
"""
from __future__ import annotations

import argparse
import sys
import time

import torch
import torch.nn.functional as F

sys.path.insert(0, ".")
sys.path.insert(0, "benchmarks")
from probe_two_streams import rel, timed  # noqa: E402

from mlp_fuser.kernels import act_mul  # noqa: E402

FP32_ACC = True  # set False by main() where torch.mm has no out_dtype


def bounds(I: int, C: int) -> list[tuple[int, int]]:
    """C chunks of I, each a multiple of 64 columns (16-byte aligned rows for every dtype) but the last."""
    cuts = [0] + [round(I * j / C / 64) * 64 for j in range(1, C)] + [I]
    return [(a, b) for a, b in zip(cuts, cuts[1:])]


def down_part(h, wd_part, bd, y, first, acc32):
    """y (+)= h @ wd_partᵀ (+ bd on the first part); y is fp32 when ``acc32``."""
    if first:
        if acc32:
            torch.mm(h, wd_part.t(), out_dtype=torch.float32, out=y)
            if bd is not None:
                y += bd
        elif bd is None:
            torch.mm(h, wd_part.t(), out=y)
        else:
            torch.addmm(bd, h, wd_part.t(), out=y)
    elif acc32:
        torch.addmm(y, h, wd_part.t(), out_dtype=torch.float32, out=y)
    else:
        y.addmm_(h, wd_part.t())


def gate_up_part(x, w, b, I, a, e, act, gated):
    """h for columns a:e of I; ``w``: the (2I, K) buffer [gate; up] (gated) or the (I, K) up weight."""
    if not gated:
        return act_mul(F.linear(x, w[a:e], None if b is None else b[a:e]), None, act)
    both = w.view(2, I, w.shape[1])[:, a:e]  # (2, e - a, K): gate rows a:e and up rows a:e, batch stride I x K
    gu = torch.bmm(x.expand(2, *x.shape), both.transpose(1, 2))  # (2, M, e - a), each half contiguous
    return act_mul(gu[0], gu[1], act)


def pipelined(x, w, b, wd, bd, I, act, gated, parts, side, part_fn=gate_up_part):
    """The MLP over ``parts`` of I; the down GEMM of part j on ``side`` (None: one stream) after part j's h."""
    here = torch.cuda.current_stream() if side is not None else None
    acc32 = FP32_ACC and x.is_cuda
    y = torch.empty((x.shape[0], wd.shape[0]), device=x.device, dtype=torch.float32 if acc32 else x.dtype)
    hs = []  # every h kept alive until the join, so the allocator cannot hand one to a later part while side reads it
    for j, (a, e) in enumerate(parts):
        hs.append(part_fn(x, w, b, I, a, e, act, gated) if part_fn is gate_up_part else part_fn(x, j, act))
        if side is None:
            down_part(hs[-1], wd[:, a:e], bd, y, j == 0, acc32)
            continue
        ready = torch.cuda.Event()
        ready.record(here)
        side.wait_event(ready)
        with torch.cuda.stream(side):
            down_part(hs[-1], wd[:, a:e], bd, y, j == 0, acc32)
    if side is not None:
        here.wait_stream(side)
    return y.to(x.dtype) if acc32 else y


def sequential(x, w, b, wd, bd, I, act, gated, one):
    if not gated:
        return F.linear(act_mul(F.linear(x, w, b), None, act), wd, bd)
    if one:
        gu = F.linear(x, w)
        return F.linear(act_mul(gu[:, :I], gu[:, I:], act), wd, bd)
    return F.linear(act_mul(F.linear(x, w[:I]), F.linear(x, w[I:]), act), wd, bd)


def candidates(x, mlp, side, chunks, quack, blocked, M):
    """{name: the MLP on x as that candidate}; ``mlp``: (w, b, wd, bd, I, act, gated)."""
    w, b, wd, bd, I, act, gated = mlp
    cands = {"seq": lambda: sequential(x, *mlp, False)}
    if gated:
        cands["one"] = lambda: sequential(x, *mlp, True)
    for C in chunks:
        parts = bounds(I, C)
        cands[f"pipe{C}"] = lambda p=parts: pipelined(x, *mlp, p, side)
        cands[f"pipe{C}-1s"] = lambda p=parts: pipelined(x, *mlp, p, None)
    if quack and gated and M > 16:
        from mlp_fuser.kernels import quack_gated
        cands["quack"] = lambda: F.linear(quack_gated.gated_act(x, w, act, quack), wd)
        for C in chunks:
            parts = bounds(I, C)
            if C not in blocked:
                blocked[C] = [torch.cat([w[a:e], w[I + a:I + e]]) for a, e in parts]
            cands[f"qpipe{C}"] = lambda p=parts, blk=blocked[C]: pipelined(
                x, *mlp, p, side, part_fn=lambda x, j, act: quack_gated.gated_act(x, blk[j], act, quack))
    return cands


def main():
    global FP32_ACC
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,128,256,512")
    ap.add_argument("--shapes", default="4096x11008,4096x14336,3584x18944,8192x3584,gelu4096x11008",
                    help="K x I, SwiGLU; prefix gelu for GELU with biases")
    ap.add_argument("--chunks", default="2,3,4")
    ap.add_argument("--dtypes", default="bf16")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--quack", default="", help="a quack_gated config (e.g. 128x128) for quack and qpipeC")
    ap.add_argument("--device", default="cuda")
    args = ap.parse_args()
    dev = args.device
    torch.backends.cuda.matmul.allow_tf32 = False
    side = torch.cuda.Stream() if dev == "cuda" else None
    if dev == "cuda":
        try:
            torch.mm(torch.ones(8, 8, device=dev, dtype=torch.bfloat16), torch.ones(8, 8, device=dev,
                     dtype=torch.bfloat16), out_dtype=torch.float32)
        except (TypeError, RuntimeError, NotImplementedError) as e:
            print(f"no fp32 accumulation across chunks ({type(e).__name__}: {e}); y accumulates in its dtype")
            FP32_ACC = False
    quack = None
    if args.quack:
        from mlp_fuser.kernels import quack_gated
        why = quack_gated.why_not("silu", 64, 64) if dev == "cuda" else "no GPU"
        print(f"quack {args.quack}: {why or 'ready'}", flush=True)
        quack = None if why else args.quack
    chunks = [int(c) for c in args.chunks.split(",")]
    t0, rows = time.perf_counter(), []
    print(torch.cuda.get_device_name() if dev == "cuda" else dev, torch.__version__, flush=True)
    for dname in args.dtypes.split(","):
        dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[dname] if dev == "cuda" else torch.float32
        for shape in args.shapes.split(","):
            gated = not shape.startswith("gelu")
            K, I = map(int, shape.removeprefix("gelu").split("x")) if dev == "cuda" else (64, 320)
            act = "silu" if gated else "gelu"
            w = (torch.randn(2 * I if gated else I, K, device=dev) * K ** -0.5).to(dtype)
            b = None if gated else (torch.randn(I, device=dev) * 0.1).to(dtype)
            wd = (torch.randn(K, I, device=dev) * I ** -0.5).to(dtype)
            bd = None if gated else (torch.randn(K, device=dev) * 0.1).to(dtype)
            blocked = {}  # C -> the [g_j; u_j] blocks, for quack per chunk
            for M in map(int, args.ms.split(",")):
                if time.perf_counter() - t0 > args.budget_s:
                    print(f"budget spent: stop before {dname} {shape} M={M}", flush=True)
                    return report(rows, chunks)
                x = torch.randn(M, K, device=dev).to(dtype)
                xd, wdd = x.double(), wd.double()
                if gated:
                    h_ref = F.silu(xd @ w[:I].double().t()) * (xd @ w[I:].double().t())
                else:
                    h_ref = F.gelu(xd @ w.double().t() + b.double())
                y_ref = h_ref @ wdd.t() + (0 if bd is None else bd.double())
                cands = candidates(x, (w, b, wd, bd, I, act, gated), side, chunks, quack, blocked, M)
                errs = {k: rel(fn(), y_ref) for k, fn in cands.items()}
                bad = {k: e for k, e in errs.items() if e > 1.25 * errs["seq"] + 1e-6}
                t = timed(cands, dev)
                floor = ((3 if gated else 2) * I * K + 2 * M * K) * x.element_size() / 4.24e12 * 1e6
                flops = (3 if gated else 2) * 2 * M * I * K / 790e12 * 1e6
                floor = max(floor, flops)
                rows.append((dname, shape, M, floor, t, bad))
                print(dname, shape, M, f"floor {floor:.1f}", {k: tuple(round(v, 1) for v in vs) for k, vs in t.items()},
                      "ok" if not bad else f"WRONG {bad} (seq {errs['seq']:.2e})", flush=True)
    report(rows, chunks)


def report(rows, chunks):
    """One line per row: each candidate's CUDA-graph µs and % of the floor; the best pipe against the best unpiped."""
    names = ["seq", "one"] + [f"pipe{C}" for C in chunks] + [f"pipe{C}-1s" for C in chunks] + ["quack"] + \
        [f"qpipe{C}" for C in chunks]
    print("| dtype | shape | M | floor µs | " + " | ".join(names) + " | best pipe / best unpiped | check |")
    print("|---|---|---|---|" + "---|" * len(names) + "---|---|")
    for d, shape, M, floor, t, bad in rows:
        cells = [f"{t[n][0]:.1f} ({100 * floor / t[n][0]:.0f}%)" if n in t and t[n][0] else "-" for n in names]
        pipes = [t[n][0] for n in t if n.startswith(("pipe", "qpipe")) and not n.endswith("-1s")]
        plain = [t[n][0] for n in ("seq", "one", "quack") if n in t]
        ratio = f"{min(plain) / min(pipes):.3f}x" if pipes and min(pipes) else "-"
        print(f"| {d} | {shape} | {M} | {floor:.1f} | " + " | ".join(cells) + f" | {ratio} | "
              f"{'ok' if not bad else 'WRONG ' + ','.join(bad)} |")


if __name__ == "__main__":
    main()
