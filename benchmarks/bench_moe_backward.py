"""The routed experts' Triton backward on the GPU against autograd through the aten path (torch._grouped_mm).

    python benchmarks/bench_moe_backward.py [--backward] [--profile] [--sweep] [--save] [--T 1024,4096] [--tiny]
        [--fp8]

Qwen3-30B-A3B's experts (H 2048, I 768, E 128, k 8, silu, gate|up concatenated), bf16, random top-k routing.
For each T: ours = ``moe_experts_autograd`` (the sorted Triton forward, ``moe_backward``); theirs = autograd through
``mlp_fuser.ops.moe.reference`` (torch._grouped_mm both ways). Timed as CUDA-graph medians: the training step of the
experts (forward + backward) and, with ``--backward``, the backward alone as well, and ours with its weight
gradients by grouped_mm (``moe_backward(wgrad="grouped")``, the row ``triton_moe_backward_grouped_wgrad``), with dx
by grouped_mm too (``dgrad="grouped"``, the row ``triton_moe_backward_grouped``; both modes' gradients checked too),
and frozen experts' (dx and dwts only) with dx by our down kernel or by grouped_mm; ``--profile``: each backward
once under torch.profiler, GPU time per kernel; peak memory of one step above what the inputs hold; with
``--sweep``, the backward alone over a few tile configs of each of its kernels (the others at their defaults), the
fastest printed. ``--save``: the backward "save" mode too (the forward's gate/up kernel keeps g and u, (T·k, 2I),
and the backward reads them instead of recomputing that GEMM): its step, its forward alone against the recomputing
one's (the cost of the extra store), its peak, and with ``--backward`` / ``--profile`` its backward alone three ways
(dW by our kernel, by grouped_mm, dW and dx by it). Every gradient checked against float64 autograd
(‖out − ref‖ / ‖ref‖, both sides' errors).
Results go to $OUT/moe_backward.json when OUT is set; a short table is printed last.
``--fp8``: frozen float8 experts (the same weights quantized in 128 × 128 blocks, LoRA on an FP8 base): the
training step of ``quant_moe_mlp`` with x and topk_weights needing gradients (FP8 forward kernels, the Triton
backward on the float8 weights) against the old path (autograd through the reference on the weights dequantized
per call, ``fp8_experts.dequantized``) and our bf16 op on the dequantized weights, frozen; dx and dwts checked
against float64; ``--backward`` / ``--profile`` as above; $OUT/moe_backward_fp8.json.
``--tiny``: small shapes on the CPU under the Triton interpreter (fp32, wall clock): a smoke test of the script.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mlp_fuser.kernels import moe  # noqa: E402
from mlp_fuser.kernels.moe import ExpertAct  # noqa: E402
from mlp_fuser.kernels.moe_backward import moe_backward, moe_experts_autograd  # noqa: E402
from mlp_fuser.ops.moe import Gate, reference  # noqa: E402
from mlp_fuser.reference import rel_err  # noqa: E402

SIZE = (64, 40, 8, 4) if TINY else (2048, 768, 128, 8)  # H, I, E, k
DEV = "cpu" if TINY else "cuda"
DTYPE = torch.float32 if TINY else torch.bfloat16
NAMES = ("dx", "dwts", "dw_gu", "dw_d")
ONLY = sys.argv[sys.argv.index("--only") + 1].split(",") if "--only" in sys.argv else None


def _cfg(bn, bk, warps, stages):
    return {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


SWEEP = {  # each fits shared memory in bf16 at BLOCK_M = 128; wgrad's loop is 1-2 blocks deep at 64 pairs an expert,
    # so its tiles and stages decide how many CTAs hide each other's latency
    "act": [_cfg(64, 64, 4, 3), _cfg(64, 64, 8, 3), _cfg(128, 64, 8, 2), _cfg(32, 64, 4, 4), _cfg(64, 32, 4, 4),
            _cfg(64, 128, 4, 2), _cfg(64, 128, 8, 2), _cfg(128, 128, 8, 2), _cfg(128, 64, 8, 3), _cfg(32, 128, 4, 3)],
    "wgrad": [_cfg(128, 128, 4, 2), _cfg(128, 256, 8, 2), dict(_cfg(128, 128, 4, 2), EXPERT_MAJOR=False)]
    + [dict(_cfg(*c), PERSISTENT=p, FLATTEN=f) for c, p, f in (
        ((128, 256, 8, 2), 1, False), ((128, 256, 8, 2), 1, True), ((128, 128, 4, 2), 2, False),
        ((128, 128, 4, 2), 2, True), ((128, 128, 4, 2), 3, False))],
}


def timed(fn) -> tuple[float, str]:
    """(µs, how): the CUDA-graph median; plain launches where the capture fails; one wall-clock call on the CPU."""
    fn()
    if TINY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6, "wall"
    from triton.testing import do_bench, do_bench_cudagraph

    try:
        return do_bench_cudagraph(fn, rep=20, return_mode="median") * 1e3, "graph"
    except Exception as exc:  # noqa: BLE001  (a path that cannot be captured is still timed)
        print(f"  no CUDA graph ({type(exc).__name__}: {str(exc)[:80]}): plain launches", flush=True)
        torch.cuda.synchronize()
        return do_bench(fn, rep=50, return_mode="median") * 1e3, "eager"


def peak_mib(fn) -> float:
    """MiB allocated at the peak of one call above what was allocated before it."""
    if TINY:
        return math.nan
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    out = fn()
    torch.cuda.synchronize()
    del out
    return (torch.cuda.max_memory_allocated() - base) / 2 ** 20


def grads64(x, ids, wts, w_gu, w_d, dy, frozen=False):
    """(dx, dwts, dw_gu, dw_d) by float64 autograd, expert by expert (rows by torch.where: a benchmark may sync);
    ``frozen``: (dx, dwts) alone."""
    E, H, I = w_d.shape
    leaves = [t.detach().double().requires_grad_(i < 2 or not frozen) for i, t in enumerate((x, wts, w_gu, w_d))]
    xx, ww, wgu, wd = leaves
    y = torch.zeros((x.shape[0], H), dtype=torch.float64, device=x.device)
    for e in range(E):
        tok, j = torch.where(ids == e)
        if tok.numel():
            gu = xx[tok] @ wgu[e].T
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y = y.index_add(0, tok, (h @ wd[e].T) * ww[tok, j][:, None])
    return torch.autograd.grad(y, leaves[:2] if frozen else leaves, dy.double())


def profile_kernels(fn, label: str) -> dict:
    """{kernel: µs} of one call of ``fn`` under torch.profiler (after a warm-up call); the largest printed."""
    if TINY:
        return {}
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    kernels = {e.key: e.self_device_time_total for e in prof.key_averages() if e.device_type.name == "CUDA"}
    print(f"  profile {label}: {sum(kernels.values()):.0f} µs of kernels", flush=True)
    for key, us in sorted(kernels.items(), key=lambda kv: -kv[1])[:8]:
        print(f"    {us:8.0f}  {key[:100]}", flush=True)
    return kernels


def sweep(row, x, ids, wts, w_gu, w_d, dy, act) -> None:
    """The backward alone per candidate config of one kernel kind, the others at their defaults."""
    H, I, E, k = SIZE
    cands = dict(SWEEP, dx=[dict(c) for c in moe.CONFIGS["down"][moe.rows_bucket(x.shape[0], k, E)]])
    if TINY:
        cands = {kind: cs[:2] for kind, cs in cands.items()}
    if ONLY:
        cands = {kind: cs for kind, cs in cands.items() if kind in ONLY}
    row["sweep"] = {}
    for kind, cs in cands.items():
        times = []
        for c in cs:
            try:
                us, _ = timed(lambda c=c, kind=kind: moe_backward(x, ids, wts, w_gu, None, w_d, None, act, False, dy,
                                                       configs={kind: c}))
            except Exception as exc:  # noqa: BLE001  (a config that does not compile here is skipped)
                print(f"  {kind} {c}: {type(exc).__name__}", flush=True)
                us = math.nan
            times.append((us, c))
            row["sweep"][f"{kind} {c}"] = us
        us, best = min((t for t in times if t[0] == t[0]), key=lambda t: t[0], default=(math.nan, None))
        print(f"  T={x.shape[0]} {kind}: best {us:.0f} µs with {best}", flush=True)


class KeptGateUp(torch.autograd.Function):
    """``moe_experts_autograd`` in the backward "save" mode: the sorted forward keeps gu, the backward reads it."""

    @staticmethod
    def forward(ctx, x, ids, wts, w_gu, w_d, act):
        gu = torch.empty((ids.numel(), w_gu.shape[1]), dtype=x.dtype, device=x.device)
        y = moe.moe_experts(x, ids, wts, w_gu, None, w_d, None, act, False, "sorted", gu=gu)
        ctx.save_for_backward(x, ids, wts, w_gu, w_d, gu)
        ctx.act = act
        return y

    @staticmethod
    def backward(ctx, dy):
        x, ids, wts, w_gu, w_d, gu = ctx.saved_tensors
        dx, dwts, dw_gu, _, dw_d, _ = moe_backward(x, ids, wts, w_gu, None, w_d, None, ctx.act, False, dy, gu=gu)
        return dx, None, dwts, dw_gu, dw_d, None


def run_save(row, leaves, ids, dy, act, ref, backward_alone, profile) -> None:
    """The backward "save" mode's step, forward, peak and (optionally) backward alone, into ``row``."""
    def step():
        y = KeptGateUp.apply(leaves[0], ids, leaves[1], leaves[2], leaves[3], act)
        return torch.autograd.grad(y, leaves, dy)

    out = step()
    row["save_err"] = {n: rel_err(o.detach(), r) for n, o, r in zip(NAMES, out, ref)}
    if not all(row["save_err"][n] <= 3 * row["grouped_mm_err"][n] + 1e-2 for n in NAMES):
        print(f"  WRONG T={row['T']} save: {row['save_err']}", flush=True)
    row["save_step_us"], row["save_how"] = timed(step)
    row["save_peak_mib"] = peak_mib(step)
    xd, wd_, wgud, wdd = (t.detach() for t in leaves)
    gu = torch.empty((ids.numel(), wgud.shape[1]), dtype=xd.dtype, device=xd.device)
    for name, keep in (("fwd", None), ("fwd_save", gu)):
        row[f"{name}_us"], _ = timed(lambda keep=keep: moe.moe_experts(xd, ids, wd_, wgud, None, wdd, None, act, False,
                                                                      "sorted", gu=keep))
    bwds = {"save": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, gu=gu),
            "save_gw": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, wgrad="grouped",
                                            gu=gu),
            "save_gx": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, wgrad="grouped",
                                            dgrad="grouped", gu=gu)}
    for name, fn in bwds.items():
        if backward_alone:
            row[f"{name}_bwd_us"], row[f"{name}_bwd_how"] = timed(fn)
        if profile:
            row[f"{name}_bwd_kernels"] = profile_kernels(fn, f"T={row['T']} backward {name}")


def run(T: int, backward_alone: bool, do_sweep: bool = False, profile: bool = False, save: bool = False) -> dict:
    H, I, E, k = SIZE
    g = torch.Generator(device=DEV).manual_seed(T)
    w_gu = (torch.randn((E, 2 * I, H), generator=g, device=DEV) / H ** 0.5).to(DTYPE)
    w_d = (torch.randn((E, H, I), generator=g, device=DEV) / I ** 0.5).to(DTYPE)
    x = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    top, ids = torch.randn((T, E), generator=g, device=DEV).topk(k, dim=1)  # distinct experts per token
    wts = torch.softmax(top, dim=1).to(DTYPE)
    dy = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    act, gate = ExpertAct("silu"), Gate("silu")
    leaves = [t.requires_grad_() for t in (x, wts, w_gu, w_d)]

    def ours():
        y = moe_experts_autograd(leaves[0], ids, leaves[1], leaves[2], None, leaves[3], None, act)
        return torch.autograd.grad(y, leaves, dy)

    def theirs():
        y = reference(leaves[0], ids, leaves[1], leaves[2], None, leaves[3], None, gate)
        return torch.autograd.grad(y, leaves, dy)

    ref = grads64(x, ids, wts, w_gu, w_d, dy)
    row = {"T": T, "H": H, "I": I, "E": E, "k": k, "dtype": str(DTYPE)}
    for name, fn in (("ours", ours), ("grouped_mm", theirs)):
        out = fn()
        row[f"{name}_err"] = {n: rel_err(o.detach(), r) for n, o, r in zip(NAMES, out, ref)}
        row[f"{name}_step_us"], row[f"{name}_how"] = timed(fn)
        row[f"{name}_peak_mib"] = peak_mib(fn)
    for n in NAMES:
        if not row["ours_err"][n] <= 3 * row["grouped_mm_err"][n] + 1e-2:
            print(f"  WRONG T={T} {n}: ours {row['ours_err'][n]:.3g}, grouped_mm {row['grouped_mm_err'][n]:.3g}",
                  flush=True)
    if backward_alone or profile:  # the backward given the forward's saved state: ours from its inputs, theirs kept
        xd, wd_, wgud, wdd = (t.detach() for t in leaves)
        y = reference(leaves[0], ids, leaves[1], leaves[2], None, leaves[3], None, gate)
        bwds = {"ours": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy),
                "ours_gw": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, wgrad="grouped"),
                "ours_gx": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, wgrad="grouped",
                                                dgrad="grouped"),
                "frozen": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy, need_weights=False),
                "frozen_gx": lambda: moe_backward(xd, ids, wd_, wgud, None, wdd, None, act, False, dy,
                                                  need_weights=False, dgrad="grouped"),
                "grouped_mm": lambda: torch.autograd.grad(y, leaves, dy, retain_graph=True)}
        for mode in ("ours_gw", "ours_gx", "frozen_gx"):
            got = bwds[mode]()
            row[f"{mode}_err"] = {n: rel_err(o, r) for n, o, r in zip(NAMES, (got[0], got[1], got[2], got[4]), ref)
                                  if o is not None}
            if not all(row[f"{mode}_err"][n] <= 3 * row["grouped_mm_err"][n] + 1e-2 for n in row[f"{mode}_err"]):
                print(f"  WRONG T={T} {mode}: {row[f'{mode}_err']}", flush=True)
        for name, fn in bwds.items():
            if backward_alone:
                row[f"{name}_bwd_us"], row[f"{name}_bwd_how"] = timed(fn)
            if profile:
                row[f"{name}_bwd_kernels"] = profile_kernels(fn, f"T={T} backward {name}")
    if save:
        run_save(row, leaves, ids, dy, act, ref, backward_alone, profile)
    if do_sweep:
        sweep(row, *(t.detach() for t in (x, ids, wts, w_gu, w_d, dy)), act)
    print(f"T={T}: step ours {row['ours_step_us']:.0f} µs, grouped_mm {row['grouped_mm_step_us']:.0f} µs "
          f"({row['grouped_mm_step_us'] / row['ours_step_us']:.2f}x)", flush=True)
    return row


FP8_PATHS = ("fp8", "dequantized", "bf16")


def run_fp8(T: int, backward_alone: bool, profile: bool = False) -> dict:
    """``--fp8``: one T's training step (and backward) of the three paths of frozen experts (the module docstring)."""
    from mlp_fuser import config
    from mlp_fuser.dispatch import fp8_experts
    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.ops.quant_moe import quant_moe_mlp

    if TINY:
        config.triton_on_cpu = True  # the kernels' rows on CPU tensors, under the interpreter
    H, I, E, k = SIZE
    block = (32, 32) if TINY else (128, 128)
    g = torch.Generator(device=DEV).manual_seed(T)
    qgu, sgu = K8.quantize_blocks(torch.randn((E, 2 * I, H), generator=g, device=DEV) / H ** 0.5, block)
    qd, sd = K8.quantize_blocks(torch.randn((E, H, I), generator=g, device=DEV) / I ** 0.5, block)
    fgu, fd = K8.fp8_experts(qgu, sgu, block, gated=True), K8.fp8_experts(qd, sd, block)
    w_gu, w_d = K8.dequantize_experts(fgu, DTYPE), K8.dequantize_experts(fd, DTYPE)  # the bf16 path's weights
    x = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    top, ids = torch.randn((T, E), generator=g, device=DEV).topk(k, dim=1)
    wts = torch.softmax(top, dim=1).to(DTYPE)
    dy = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    act, gate = ExpertAct("silu"), Gate("silu")
    xg, wg = x.clone().requires_grad_(), wts.clone().requires_grad_()
    forwards = {
        "fp8": lambda: quant_moe_mlp(xg, ids, wg, qgu, sgu, qd, sd, "silu", block=block),
        "dequantized": lambda: fp8_experts.dequantized(xg, ids, wg, fgu, fd, gate),  # the op's old path with grads
        "bf16": lambda: moe_experts_autograd(xg, ids, wg, w_gu, None, w_d, None, act),
    }
    steps = {name: (lambda f=f: torch.autograd.grad(f(), (xg, wg), dy)) for name, f in forwards.items()}
    ref = grads64(x, ids, wts, w_gu, w_d, dy, frozen=True)
    row = {"T": T, "H": H, "I": I, "E": E, "k": k, "dtype": str(DTYPE), "block": block}
    for name, fn in steps.items():
        row[f"{name}_err"] = {n: rel_err(o.detach().float(), r) for n, o, r in zip(NAMES, fn(), ref)}
        row[f"{name}_step_us"], row[f"{name}_how"] = timed(fn)
        row[f"{name}_peak_mib"] = peak_mib(fn)
    if backward_alone or profile:  # ours from the inputs; the old path's graph (and dequantized weights) kept
        y = forwards["dequantized"]()
        bwds = {"fp8": lambda: moe_backward(x, ids, wts, qgu, None, qd, None, act, False, dy, need_weights=False,
                                            scales=(fgu, fd)),
                "dequantized": lambda: torch.autograd.grad(y, (xg, wg), dy, retain_graph=True),
                "bf16": lambda: moe_backward(x, ids, wts, w_gu, None, w_d, None, act, False, dy, need_weights=False)}
        for name, fn in bwds.items():
            if backward_alone:
                row[f"{name}_bwd_us"], row[f"{name}_bwd_how"] = timed(fn)
            if profile:
                row[f"{name}_bwd_kernels"] = profile_kernels(fn, f"T={T} backward {name}")
    print(f"T={T}: step fp8 {row['fp8_step_us']:.0f} µs, dequantized {row['dequantized_step_us']:.0f}, bf16 "
          f"{row['bf16_step_us']:.0f}; peak MiB {row['fp8_peak_mib']:.0f} / {row['dequantized_peak_mib']:.0f} / "
          f"{row['bf16_peak_mib']:.0f}", flush=True)
    return row


def print_fp8(rows: list[dict]) -> None:
    H, I, E, k = SIZE
    print(f"\nfrozen FP8 experts (H {H}, I {I}, E {E}, k {k}, x {DTYPE}, {rows[0]['block']} blocks), µs "
          f"({rows[0]['fp8_how']}); peak MiB above the inputs; errors: max over (dx, dwts) against float64")
    print("| T | step fp8 | step dequantized | step bf16 | fp8 vs dequantized | fp8 vs bf16 | bwd fp8 "
          "| bwd dequantized | bwd bf16 | peak fp8 | peak dequantized | peak bf16 | err fp8 | err dequantized "
          "| err bf16 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        bwd = " | ".join(f"{r[n + '_bwd_us']:.0f}" if n + "_bwd_us" in r else "–" for n in FP8_PATHS)
        print(f"| {r['T']} | " + " | ".join(f"{r[n + '_step_us']:.0f}" for n in FP8_PATHS)
              + f" | {r['dequantized_step_us'] / r['fp8_step_us']:.2f}x | {r['bf16_step_us'] / r['fp8_step_us']:.2f}x"
              + f" | {bwd} | " + " | ".join(f"{r[n + '_peak_mib']:.0f}" for n in FP8_PATHS) + " | "
              + " | ".join(f"{max(r[n + '_err'].values()):.2e}" for n in FP8_PATHS) + " |")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--backward", action="store_true", help="also time the backward alone (ours both ways)")
    ap.add_argument("--profile", action="store_true", help="GPU time per kernel of each backward, once")
    ap.add_argument("--sweep", action="store_true", help="time the backward over a few configs per kernel")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--fp8", action="store_true", help="frozen float8 experts: the FP8 op against the old path")
    ap.add_argument("--only", default=None, help="with --sweep: only these kernel kinds (act, wgrad, dx)")
    ap.add_argument("--save", action="store_true", help="also the backward 'save' mode (gate/up kept by the forward)")
    ap.add_argument("--T", default="5,33" if TINY else "1024,4096")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = False
    t0 = time.time()
    if args.fp8:
        rows = [run_fp8(int(t), args.backward, args.profile) for t in args.T.split(",")]
        if os.environ.get("OUT"):
            with open(os.path.join(os.environ["OUT"], "moe_backward_fp8.json"), "w") as f:
                json.dump(rows, f, indent=1)
        print_fp8(rows)
        print(f"({time.time() - t0:.0f} s)")
        return
    rows = [run(int(t), args.backward, args.sweep, args.profile, args.save) for t in args.T.split(",")]
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "moe_backward.json"), "w") as f:
            json.dump(rows, f, indent=1)
    H, I, E, k = SIZE
    print(f"\nexperts H {H}, I {I}, E {E}, k {k}, {DTYPE}, µs ({rows[0]['ours_how']}); peak MiB above the inputs; "
          "errors: max over (dx, dwts, dw_gu, dw_d) of ‖out − ref‖/‖ref‖ against float64")
    print("| T | step ours | step grouped_mm | speedup | bwd ours | bwd ours, dW by grouped_mm | bwd ours, dW and dx "
          "by grouped_mm | bwd grouped_mm | bwd frozen ours | bwd frozen, dx by grouped_mm | peak ours "
          "| peak grouped_mm | err ours | err ours, dW by grouped_mm | err ours, dW and dx by grouped_mm "
          "| err grouped_mm |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    bwd_modes = ("ours", "ours_gw", "ours_gx", "grouped_mm", "frozen", "frozen_gx")
    for r in rows:
        bwd = (" | ".join(f"{r[n + '_bwd_us']:.0f} ({r[n + '_bwd_how']})" for n in bwd_modes)
               if "ours_bwd_us" in r else " | ".join("–" * len(bwd_modes)))
        print(f"| {r['T']} | {r['ours_step_us']:.0f} | {r['grouped_mm_step_us']:.0f} | "
              f"{r['grouped_mm_step_us'] / r['ours_step_us']:.2f}x | {bwd} | {r['ours_peak_mib']:.0f} | "
              f"{r['grouped_mm_peak_mib']:.0f} | {max(r['ours_err'].values()):.2e} | "
              f"{max(r['ours_gw_err'].values()) if 'ours_gw_err' in r else math.nan:.2e} | "
              f"{max(r['ours_gx_err'].values()) if 'ours_gx_err' in r else math.nan:.2e} | "
              f"{max(r['grouped_mm_err'].values()):.2e} |")
    if args.save:
        print("\nbackward 'save' (gate/up kept) against recompute, µs, peak MiB above the inputs")
        print("| T | step recompute | step save | fwd recompute | fwd save | bwd recompute | bwd save "
              "| bwd save, dW by grouped_mm | bwd save, dW and dx by grouped_mm | peak recompute | peak save "
              "| err save |")
        print("|---|---|---|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            bwd = (f"{r['ours_bwd_us']:.0f} | {r['save_bwd_us']:.0f} | {r['save_gw_bwd_us']:.0f} | "
                   f"{r['save_gx_bwd_us']:.0f}" if "save_bwd_us" in r else "– | – | – | –")
            print(f"| {r['T']} | {r['ours_step_us']:.0f} | {r['save_step_us']:.0f} | {r['fwd_us']:.0f} | "
                  f"{r['fwd_save_us']:.0f} | {bwd} | {r['ours_peak_mib']:.0f} | {r['save_peak_mib']:.0f} | "
                  f"{max(r['save_err'].values()):.2e} |")
    if not TINY:
        print_peak(rows)
    print(f"({time.time() - t0:.0f} s)")


def matmul_tflops(n: int = 8192) -> float:
    """The bf16 matmul peak measured now: TFLOP/s of an n × n × n torch.mm (cuBLAS), CUDA-graph median."""
    from triton.testing import do_bench_cudagraph

    # a generator of its own: a capture that failed above (a row timed eagerly) can leave the default one mid-capture
    g = torch.Generator(device="cuda").manual_seed(0)
    a, b = (torch.randn(n, n, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    return 2 * n ** 3 / (do_bench_cudagraph(lambda: a @ b, rep=200) * 1e-3) / 1e12


def print_peak(rows) -> None:
    """The experts' forward + backward against the bf16 matmul peak: model FLOPs 18·T·k·H·I (six GEMMs: the
    forward's two, the backward's four), the fastest step of the modes timed (a step, or a forward plus a backward
    timed apart)."""
    H, I, E, k = SIZE
    peak = matmul_tflops()
    print(f"\nexperts forward + backward against the bf16 matmul peak measured now ({peak:.0f} TFLOP/s, 8192³ mm)")
    print("| T | fastest step µs (how) | TFLOP/s | % of peak |")
    print("|---|---|---|---|")
    for r in rows:
        ways = {"step ours": r["ours_step_us"]}
        if "save_step_us" in r:
            ways["step save"] = r["save_step_us"]
        for fwd, name in (("fwd_us", "ours"), ("fwd_save_us", "save")):
            for bwd in ("", "_gw", "_gx"):
                if fwd in r and f"{name}{bwd}_bwd_us" in r:
                    ways[f"fwd {name} + bwd {name}{bwd}"] = r[fwd] + r[f"{name}{bwd}_bwd_us"]
        how, us = min(ways.items(), key=lambda kv: kv[1])
        tflops = 18 * r["T"] * k * H * I / (us * 1e-6) / 1e12
        print(f"| {r['T']} | {us:.0f} ({how}) | {tflops:.0f} | {100 * tflops / peak:.0f}% |")


if __name__ == "__main__":
    main()
