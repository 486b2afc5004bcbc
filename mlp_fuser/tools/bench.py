"""The MLP benchmark: the mlp_fuser op against its peers, side by side, in one run on one GPU.

    python -m mlp_fuser bench [--quick] [--out DIR] [--budget-s 480] [--shapes 0,3] [--ms 16,128] [--dtypes bf16]
                              [--merged]
    python -m mlp_fuser bench --moe ...   # routed experts: tools/bench_moe.py
    python -m mlp_fuser bench --fp8 ...   # FP8 weights, dense and experts: tools/bench_fp8.py

Without a CUDA GPU it prints why and exits with status 2 (Triton is imported only after that check).

For every shape, dtype and token count M it times, with CUDA-graph medians and plain medians, the variants of a
row taking turns (``ShapeSetup.time``):
  fused        the mlp_fuser op (its dispatcher picks the implementation; the name is reported)
  eager        the unfused nn.Linear computation (F.linear, activation, product, F.linear)
  compile      torch.compile of the same, default mode, static shapes
  max-autotune torch.compile mode="max-autotune-no-cudagraphs", bf16 at M >= 512 (where the peers are
               strongest), filled in last, as far as the time budget allows: the whole row again,
               in turns with max-autotune (it replaces the row timed without it)
It checks every timed variant against an fp32 reference in the same run (the fused row must be within 1.25x the
unfused module's error), measures the ceilings (a large bf16 matmul and a device copy) and reports the floor,
% of floor and the speed-up over the best peer.
Work runs in priority order (bf16, then fp16, then the max-autotune column) under a time budget: what would not
fit is skipped and listed, and results.json / results.md in --out are rewritten after every row.
Weights that fit in L2 are rotated among several copies so that no variant times the cache. ``--merged``: each gated
shape's gate and up weights are the two halves of one buffer for every variant, as in a model after
``mlp_fuser.merge_gate_up`` (or Phi-3's ``gate_up_proj``); the op can then run one GEMM over both, or quack's.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import statistics
import sys
import time
from datetime import datetime, timezone

import torch

from .. import compat
from ..dispatch import dense as dispatch
from ..reference import reference_mlp, rel_err

MS = [1, 16, 32, 64, 128, 256, 512, 2048, 8192]
# (name, gated, activation, biases, K, I)
SHAPES = [
    ("SwiGLU 4096x11008", True, "silu", False, 4096, 11008),  # LLaMA-2-7B
    ("SwiGLU 4096x14336", True, "silu", False, 4096, 14336),  # LLaMA-3-8B, Mistral-7B
    ("GELU+bias 4096x11008", False, "gelu", True, 4096, 11008),
    ("SwiGLU 3584x18944", True, "silu", False, 3584, 18944),  # Qwen2.5-7B
    ("SwiGLU 8192x3584", True, "silu", False, 8192, 3584),  # LLaMA-3-70B, one shard of 8-way tensor parallelism
    ("SwiGLU 576x1536", True, "silu", False, 576, 1536),  # SmolLM2-135M: not in the default run (--shapes 5)
]
DEFAULT_SHAPES = 5  # the first five: 7B to 70B-class shapes (SmolLM2's with --shapes 5)
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}
FP16_MS = (1, 16, 64, 128, 256, 2048)  # fp16 is timed at these M only (device time)
MAX_AUTOTUNE_MS = (2048, 512, 8192)  # bf16 rows that get the max-autotune peer, in this order, as time allows
QUICK = dict(shapes=[0], dtypes=["bf16"], ms=[1, 16, 128, 2048], max_autotune_ms=(2048,))
L2_BYTES = 50e6
ROUNDS = 20  # timing rounds per row, the variants taking turns in each (ShapeSetup.time)
TIMING_MS = 2.0  # about this much work per timing: one graph replay, or one run of plain calls
CHECK_FACTOR = 1.25  # a fused row is right when its error against fp32 is within 1.25x the unfused module's


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


def make_weights(gated, biases, K, I, dtype, n_sets, g, device="cuda", merged=False):
    """``n_sets`` weight sets (w_gate, b_gate, w_up, b_up, w_down, b_down); ``merged``: gate and up (gated) as the
    halves of one (2I, K) buffer."""
    sets = []
    for _ in range(n_sets):
        def rnd(*s, scale):
            return (torch.randn(*s, device=device, generator=g) * scale).to(dtype)
        if gated and merged:
            wg, wu = rnd(2 * I, K, scale=K**-0.5).split(I)
        else:
            wg = rnd(I, K, scale=K**-0.5)
            wu = rnd(I, K, scale=K**-0.5) if gated else None
        wd = rnd(K, I, scale=I**-0.5)
        bg = rnd(I, scale=0.1) if biases else None
        bu = rnd(I, scale=0.1) if biases and gated else None
        bd = rnd(K, scale=0.1) if biases else None
        sets.append((wg, bg, wu, bu, wd, bd))
    return sets


# ---- the plan and the time budget (plain Python: tested on CPU) ------------------------------------------


def plan(shapes: list[int], dtypes: list[str], ms: list[int], fp16_ms=FP16_MS, max_autotune_ms=MAX_AUTOTUNE_MS):
    """The work in priority order: sections (shape index, dtype name, [M, ...]) of rows timed with fused, eager and
    compile (bf16 first, then fp16 at ``fp16_ms``), then the (shape index, M) pairs that get the max-autotune peer
    (bf16, every shape at the first M of ``max_autotune_ms``, then the next M)."""
    sections = []
    for dt in dtypes:
        for s in shapes:
            row_ms = [m for m in ms if dt != "fp16" or m in fp16_ms]
            if row_ms:
                sections.append((s, dt, row_ms))
    tuned = [(s, m) for m in max_autotune_ms if m in ms and "bf16" in dtypes for s in shapes]
    return sections, tuned


class Budget:
    """Seconds left before ``budget_s`` from ``t0``; a step starts only if its estimate fits in what is left.
    Skipped steps are listed, never silently dropped."""

    def __init__(self, budget_s: float, t0: float | None = None, clock=time.time):
        self.budget_s, self.clock = budget_s, clock
        self.t0 = clock() if t0 is None else t0
        self.skipped: list[str] = []

    def elapsed(self) -> float:
        return self.clock() - self.t0

    def fits(self, estimate_s: float, what: str) -> bool:
        if self.elapsed() + estimate_s <= self.budget_s:
            return True
        self.skipped.append(what)
        log(f"[bench] skipped (budget {self.budget_s:.0f} s, {self.elapsed():.0f} s used, needs ~{estimate_s:.0f} s):"
            f" {what}")
        return False


def estimate(durations: list[float], default: float) -> float:
    """The next step's estimated seconds: the slowest of the last three of its kind (compile times vary)."""
    return max(durations[-3:]) if durations else default


# ---- several GPUs: one worker process per GPU (also used by benchmarks/bench_generate.py) -------------------


def assign(units: list[str], cost, n: int) -> list[list[str]]:
    """``units`` split over ``n`` workers, the costliest first to the least loaded (``cost(unit)``: relative
    seconds); each worker's units in their original order; no empty workers."""
    load, parts = [0.0] * n, [[] for _ in range(n)]
    for u in sorted(units, key=lambda u: -cost(u)):
        k = load.index(min(load))
        load[k] += cost(u)
        parts[k].append(u)
    return [sorted(p, key=units.index) for p in parts if p]


def without(argv: list[str], flags: set[str]) -> list[str]:
    """argv less the given options and their values (``--flag value`` and ``--flag=value``)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a in flags:
            skip = True
        elif a.split("=", 1)[0] not in flags:
            out.append(a)
    return out


def run_workers(commands: list[list[str]], deadline_s: float | None = None, gpus: bool = True) -> list[int]:
    """Runs the commands at once, command k on the k-th GPU (of those CUDA_VISIBLE_DEVICES lists, if set, when
    ``gpus``) and on the k-th equal share of this process's CPU cores (Inductor's compile threads limited to it), their
    output streamed here line by line with a [gpu k] prefix (lines starting with "|", their tables, left out); a
    command still running ``deadline_s`` after the start is killed. Returns the exit codes (negative: killed by that
    signal)."""
    import subprocess
    import threading

    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
    share = len(cpus) // max(1, len(commands))
    t0, procs, threads = time.time(), [], []
    for k, cmd in enumerate(commands):
        env = dict(os.environ, **({"CUDA_VISIBLE_DEVICES": visible[k] if visible else str(k)} if gpus else {}))
        mine = cpus[k * share:(k + 1) * share] if share >= 2 else []  # the worker's own cores: one worker's compile
        if mine:  # threads must not slow another's host-bound timing
            env["TORCHINDUCTOR_COMPILE_THREADS"] = str(len(mine))
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                             preexec_fn=(lambda mine=mine: os.sched_setaffinity(0, mine)) if mine else None)

        def pump(p=p, k=k):
            for line in p.stdout:
                if not line.startswith("|"):
                    log(f"[gpu {k}] {line.rstrip()}")

        threads.append(threading.Thread(target=pump, daemon=True))
        threads[-1].start()
        procs.append(p)
    for k, p in enumerate(procs):
        try:
            p.wait(timeout=None if deadline_s is None else max(1.0, deadline_s - (time.time() - t0)))
        except subprocess.TimeoutExpired:
            log(f"[gpu {k}] past the deadline ({deadline_s:.0f} s): stopped")
            p.kill()
            p.wait()
    for t in threads:
        t.join(timeout=5)
    return [p.returncode for p in procs]


def spread(units: list[str], cost, n: int, command: list[str], argv: list[str], out: str, result_file: str,
           deadline_s: float | None = None, gpus: bool = True) -> list[tuple[list[str], str, int]]:
    """``units`` over ``n`` workers (``assign``), worker k running ``command`` with ``argv`` (less --gpus, --out,
    --units and --deadline-s) plus its ``--units`` and ``--out out/gpu<k>`` (an earlier run's ``result_file`` there is
    removed first), all at once (``run_workers``). Returns (units, folder, exit code) per worker."""
    parts = assign(units, cost, n)
    base = without(argv, {"--gpus", "--out", "--units", "--deadline-s"})
    subs = [os.path.join(out, f"gpu{k}") for k in range(len(parts))]
    for k, (part, sub) in enumerate(zip(parts, subs)):
        log(f"[gpu {k}] units {', '.join(part)}")
        if os.path.exists(os.path.join(sub, result_file)):  # an earlier run's rows are not this worker's
            os.remove(os.path.join(sub, result_file))
    codes = run_workers([[*command, *base, "--units", ",".join(part), "--out", sub] for part, sub in zip(parts, subs)],
                        deadline_s, gpus)
    return list(zip(parts, subs, codes))


# ---- timing ---------------------------------------------------------------------------------------------


class ShapeSetup:
    """One shape in one dtype: its weights (rotated copies when they fit in L2) and the inputs per M."""

    def __init__(self, index, dtype, merged=False):
        self.name, self.gated, self.act, self.biases, self.K, self.I = SHAPES[index]
        self.dtype = dtype
        self.merged = merged and self.gated and not self.biases  # gate and up stored as one
        esize = torch.finfo(dtype).bits // 8
        K, I = self.K, self.I
        self.w_bytes = (3 if self.gated else 2) * K * I * esize + ((2 * I + K) * esize if self.biases else 0)
        self.esize = esize
        self.n_sets = max(1, math.ceil(2.5 * L2_BYTES / self.w_bytes))
        g = torch.Generator(device="cuda").manual_seed(0)
        self.weights = make_weights(self.gated, self.biases, K, I, dtype, self.n_sets, g, merged=self.merged)

    def inputs(self, M):
        g = torch.Generator(device="cuda").manual_seed(1000 + M)  # the same x whenever a row is (re)timed
        return [torch.randn(M, self.K, device="cuda", generator=g).to(self.dtype) for _ in range(self.n_sets)]

    def time(self, M, variants, rounds=ROUNDS, reference=reference_mlp):
        """{name: rel. error against fp32}, {name: (CUDA-graph µs, plain µs)} for each variant fn(x, *w, act).
        ``reference(x, *w, act)``, run in fp32, is what the variants compute: the whole MLP unless told (a part of
        it, e.g. the gate/up half, for ``bench_impls.py``'s kernels of one half).

        The variants take turns: each of ``rounds`` rounds replays every variant's CUDA graph once and runs its plain
        calls once, in an order rotated per round, and a variant's time is its median over the rounds. So a drift of
        the GPU's clocks or of the host (a long compute-bound row heats the chip) weighs on every variant alike,
        not on whichever was timed then. Each timing covers about ``TIMING_MS`` of work: ``reps`` passes over the
        weight sets."""
        xs = self.inputs(M)
        w0 = self.weights[0]
        ref = reference(xs[0].float(), *[None if t is None else t.float() for t in w0], self.act)
        errs, runs = {}, {}
        for vname, fn in variants.items():
            t0 = time.time()
            out = fn(xs[0], *w0, self.act)  # compiles / autotunes here, before any graph capture
            torch.cuda.synchronize()
            errs[vname] = rel_err(out, ref)
            if time.time() - t0 > 5:
                log(f"  {vname}: first call {time.time() - t0:.0f} s")

            def run(fn=fn, xs=xs):
                for s in range(self.n_sets):
                    fn(xs[s], *self.weights[s], self.act)

            runs[vname] = run
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

        def elapsed_ms(work):
            start.record()
            work()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)

        graphs, reps = {}, {}
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):  # warm-up and capture off the default stream, as torch.cuda.graph wants
            for vname, run in runs.items():
                run()
                once = min(elapsed_ms(run) for _ in range(3))
                reps[vname] = n = max(1, round(TIMING_MS / max(once, 1e-3)))
                graphs[vname] = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graphs[vname], stream=side):
                    for _ in range(n):
                        run()
                graphs[vname].replay()
        torch.cuda.current_stream().wait_stream(side)
        torch.cuda.synchronize()
        names = list(runs)
        graph_ms, plain_ms = {v: [] for v in names}, {v: [] for v in names}
        for r in range(rounds):
            for vname in names[r % len(names):] + names[:r % len(names)]:
                n, run = reps[vname], runs[vname]
                graph_ms[vname].append(elapsed_ms(graphs[vname].replay) / (n * self.n_sets))
                plain_ms[vname].append(elapsed_ms(lambda n=n, run=run: [run() for _ in range(n)]) / (n * self.n_sets))
        del graphs
        times = {v: (statistics.median(graph_ms[v]) * 1e3, statistics.median(plain_ms[v]) * 1e3) for v in names}
        return errs, times


def make_row(setup, M, errs, times, tflops, tbps):
    flops = 2 * M * setup.K * setup.I * (3 if setup.gated else 2)
    min_bytes = setup.w_bytes + 2 * M * setup.K * setup.esize
    t_flops, t_bytes = flops / (tflops * 1e12), min_bytes / (tbps * 1e12)
    floor_us = max(t_flops, t_bytes) * 1e6
    p = dispatch.Problem("cuda", setup.dtype, M, setup.K, setup.I, setup.K, setup.gated, setup.act, setup.merged)
    row = dict(shape=setup.name, dtype=str(setup.dtype).removeprefix("torch."), M=M, merged=setup.merged,
               bound="compute" if t_flops > t_bytes else "mem", floor_us=floor_us, impl=dispatch.chosen(p),
               n_weight_sets=setup.n_sets, errors={}, graph_us={}, plain_us={})
    return update_row(row, errs, times)


def update_row(row, errs, times):
    """Adds timed variants to a row and recomputes the best peer, the speed-up, % of floor and the check."""
    row["errors"].update(errs)
    row["graph_us"].update({k: v[0] for k, v in times.items()})
    row["plain_us"].update({k: v[1] for k, v in times.items()})
    e, g = row["errors"], row["graph_us"]
    peers = {k: v for k, v in g.items() if k != "fused"}
    row["best_peer"] = min(peers, key=peers.get)
    row["speedup"] = peers[row["best_peer"]] / g["fused"]
    row["pct_floor"] = 100 * row["floor_us"] / g["fused"]
    row["err_ratio"] = e["fused"] / e["eager"]  # the fused error in units of the unfused module's
    row["fused_ok"] = row["err_ratio"] <= CHECK_FACTOR
    row["peers_ok"] = {k: e[k] / e["eager"] <= CHECK_FACTOR for k in peers}
    return row


# ---- output -----------------------------------------------------------------------------------------------


def format_row(r):
    g = r["graph_us"]
    mat = f"{g['max-autotune']:8.1f}" if "max-autotune" in g else "       –"
    check = f"{'ok' if r['fused_ok'] else 'WRONG'} {r['errors']['fused']:.1e} ({r['err_ratio']:.2f})"
    return (f"| {r['shape']:<21} | {r['dtype']:<8} | {r['M']:>5} | {r['floor_us']:8.1f} {r['bound']:<7} | "
            f"{g['fused']:8.1f} | {r['impl']:<18} | {g['eager']:8.1f} | {g['compile']:8.1f} | {mat} | "
            f"{r['plain_us']['fused']:8.1f} | {r['plain_us']['eager']:8.1f} | {r['speedup']:5.2f}x | "
            f"{r['pct_floor']:5.1f}% | {check} |")


HEADER = ("| shape | dtype | M | floor µs | fused µs | impl | eager µs | compile µs | max-autotune µs | "
          "fused plain µs | eager plain µs | speed-up vs best peer | % of floor | fused check, rel err (/ eager's) |\n"
          "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")


def write_results(out, meta, rows):
    """results.json and results.md in out/, rewritten after every row (a cut-short run keeps its rows)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    c = meta["ceilings"]
    md = [f"{meta['date']} · {meta['gpu']} · torch {meta['torch']} · triton {meta['triton']} · ceilings "
          f"{c['matmul_tflops']:.0f} TFLOP/s bf16, {c['copy_tbps']:.2f} TB/s · `{meta['command']}` · "
          f"{meta['seconds']:.0f} s" + (" · gate and up stored as one (--merged)" if meta.get("merged") else ""),
          "", HEADER]
    md += [format_row(r) for r in rows]
    sections = meta.get("sections", [])
    if sections:
        md += ["", "Time: " + "; ".join(f"{s['what']} {s['seconds']:.0f} s" for s in sections)]
    if meta.get("skipped"):
        md += ["", f"Skipped for the time budget ({meta['budget_s']:.0f} s): " + "; ".join(meta["skipped"])]
    with open(os.path.join(out, "results.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def merge_workers(outs: list[str], command: str, budget_s: float) -> tuple[dict, list[dict]] | None:
    """The meta and rows of the workers' results.json in ``outs`` (missing ones skipped; None if none), rows in the
    single-process order: bf16 before fp16, shapes in SHAPES order, M ascending; a row timed beside max-autotune
    replaces the row of the same shape, dtype and M timed without it."""
    metas, rows, replaced = [], {}, {}
    for out in outs:
        path = os.path.join(out, "results.json")
        if not os.path.exists(path):
            continue
        with open(path) as f:
            data = json.load(f)
        metas.append(data["meta"])
        for r in data["rows"]:
            key = (r["shape"], r["dtype"], r["M"])
            (replaced if "max-autotune" in r["graph_us"] else rows)[key] = r
    if not metas:
        return None
    rows.update(replaced)
    order = {name: i for i, (name, *_) in enumerate(SHAPES)}
    merged = sorted(rows.values(), key=lambda r: (r["dtype"] != "bfloat16", order[r["shape"]], r["M"]))
    ceil = [m["ceilings"] for m in metas]
    meta = dict(metas[0], command=command, budget_s=budget_s,
                ceilings=dict(matmul_tflops=statistics.mean(c["matmul_tflops"] for c in ceil),
                              copy_tbps=statistics.mean(c["copy_tbps"] for c in ceil)),
                ceilings_per_gpu=ceil, seconds=max(m["seconds"] for m in metas),
                sections=[dict(s, what=f"gpu {k}: {s['what']}") for k, m in enumerate(metas) for s in m["sections"]],
                skipped=[w for m in metas for w in m["skipped"]])
    return meta, merged


def run_parallel(args, argv, units, sections, tuned, n) -> int:
    """``main`` over ``n`` GPUs: the units (one shape in one dtype; one shape's max-autotune rows) split by their
    estimated seconds over one worker per GPU, each a ``python -m mlp_fuser bench --units ...`` with the same
    options; then their rows merged into one table (``merge_workers``). Each row's floor uses the ceilings its own
    GPU measured."""
    rows_of = {f"{s}:{dt}": len(row_ms) for s, dt, row_ms in sections}
    cost = lambda u: 60.0 * sum(s == int(u.split(":")[0]) for s, _ in tuned) if u.endswith(":mat") \
        else 6.0 * rows_of[u]  # noqa: E731 (measured seconds per row)
    workers = spread(units, cost, n, [sys.executable, "-m", "mlp_fuser", "bench"], argv, args.out, "results.json",
                     args.deadline_s)
    subs, codes = [w[1] for w in workers], [w[2] for w in workers]
    merged = merge_workers(subs, "python -m mlp_fuser bench " + " ".join(argv), args.budget_s)
    if merged is None:
        log("[bench] no worker wrote a result")
        return 1
    meta, rows = merged
    meta["exit_codes"] = codes
    print("\n".join(write_results(args.out, meta, rows)))
    return 0 if rows and all(r["fused_ok"] for r in rows) and not any(codes) else 1


# ---- main ---------------------------------------------------------------------------------------------


def main(argv=None) -> int:
    if "--moe" in (sys.argv[1:] if argv is None else argv):  # the routed-experts benchmark: tools/bench_moe.py
        from . import bench_moe
        return bench_moe.main([a for a in (sys.argv[1:] if argv is None else argv) if a != "--moe"])
    if "--fp8" in (sys.argv[1:] if argv is None else argv):  # the FP8 weights benchmark: tools/bench_fp8.py
        from . import bench_fp8
        return bench_fp8.main([a for a in (sys.argv[1:] if argv is None else argv) if a != "--fp8"])
    t_start = time.time()
    ap = argparse.ArgumentParser(prog="python -m mlp_fuser bench", description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="a few rows only (M=1, 16, 128, 2048, first shape, bf16)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for results.json/results.md")
    ap.add_argument("--shapes", default="", help=f"indexes into SHAPES (default: 0-{DEFAULT_SHAPES - 1})")
    ap.add_argument("--ms", default="", help=f"comma-separated token counts (default: {MS})")
    ap.add_argument("--dtypes", default="bf16,fp16", help="bf16, fp16 or both (fp16 rows at M in FP16_MS)")
    ap.add_argument("--fp16-ms", default=",".join(map(str, FP16_MS)), help="the M timed in fp16")
    ap.add_argument("--max-autotune-ms", default=",".join(map(str, MAX_AUTOTUNE_MS)),
                    help="bf16 M that get the max-autotune peer, in priority order ('' for none)")
    ap.add_argument("--budget-s", type=float, default=480.0,
                    help="start no step that would end past this many seconds from the start (skipped steps listed)")
    ap.add_argument("--gpus", default="1", help="spread the work over this many GPUs ('all': every visible one), one "
                    "worker process each; a unit of work is one shape in one dtype, or one shape's max-autotune rows")
    ap.add_argument("--deadline-s", type=float, default=None, help="with --gpus: stop the workers this many seconds "
                    "after they start and merge what they wrote")
    ap.add_argument("--merged", action="store_true", help="gate and up stored as one buffer (merge_gate_up's layout)")
    ap.add_argument("--units", default="", help="only these units, e.g. 0:bf16,3:fp16,4:mat (set by --gpus)")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("mlp_fuser bench: no CUDA GPU found. The benchmark times the Triton kernels, which run on CUDA;\n"
              "run it on a machine with an NVIDIA GPU. (On this machine, `python -m mlp_fuser demo` shows the\n"
              "fusion on a real model with the CPU reference path.)", file=sys.stderr)
        return 2
    import triton

    compat.set_recompile_limit(512)
    torch.backends.cuda.matmul.allow_tf32 = False
    if not logging.getLogger().handlers:
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("mlp_fuser").setLevel(logging.INFO)  # the dispatcher's candidates and their times, per bucket
    budget = Budget(args.budget_s, t0=t_start)
    ints = lambda s: [int(v) for v in s.split(",") if v]  # noqa: E731
    shapes = ints(args.shapes) or list(range(DEFAULT_SHAPES))
    dtypes = [d for d in args.dtypes.split(",") if d]
    ms_list = ints(args.ms) or MS
    mat_ms = ints(args.max_autotune_ms)
    if args.quick:
        shapes, dtypes, ms_list, mat_ms = QUICK["shapes"], QUICK["dtypes"], QUICK["ms"], QUICK["max_autotune_ms"]
    sections, tuned = plan(shapes, dtypes, ms_list, ints(args.fp16_ms), mat_ms)
    units = [f"{s}:{dt}" for s, dt, _ in sections] + [f"{s}:mat" for s in dict.fromkeys(s for s, _ in tuned)]
    n_gpus = torch.cuda.device_count() if args.gpus == "all" else int(args.gpus)
    if n_gpus > 1:
        return run_parallel(args, argv, units, sections, tuned, n_gpus)
    if args.units:
        keep = set(args.units.split(","))
        sections = [sec for sec in sections if f"{sec[0]}:{sec[1]}" in keep]
        tuned = [(s, M) for s, M in tuned if f"{s}:mat" in keep]
    log("measuring ceilings ...")
    tflops, tbps = measure_ceilings()
    log(f"ceilings: bf16 matmul {tflops:.0f} TFLOP/s, device copy {tbps:.2f} TB/s ({budget.elapsed():.0f} s)")
    command = "python -m mlp_fuser bench " + " ".join(argv)
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), gpu=torch.cuda.get_device_name(),
                torch=torch.__version__, triton=triton.__version__, command=command.strip(),
                ceilings=dict(matmul_tflops=tflops, copy_tbps=tbps), budget_s=args.budget_s, merged=args.merged,
                sections=[], skipped=budget.skipped)
    rows: list[dict] = []

    def save():
        return write_results(args.out, dict(meta, seconds=budget.elapsed()), rows)

    log(HEADER)
    row_s: list[float] = []
    for s, dt, row_ms in sections:
        t_section = time.time()
        setup = None
        for M in row_ms:
            what = f"{SHAPES[s][0]} {dt} M={M}"
            if not budget.fits(estimate(row_s, 15.0) + (10.0 if setup is None else 0.0), what):
                continue
            t_row = time.time()
            if setup is None:
                setup = ShapeSetup(s, DTYPES[dt], args.merged)
                compiled = torch.compile(reference_mlp, dynamic=False)
            errs, times = setup.time(M, {"fused": fused, "eager": reference_mlp, "compile": compiled})
            rows.append(make_row(setup, M, errs, times, tflops, tbps))
            row_s.append(time.time() - t_row)
            log(format_row(rows[-1]))
            save()
        if setup is not None:
            meta["sections"].append(dict(what=f"{SHAPES[s][0]} {dt}", seconds=time.time() - t_section))
            log(f"[bench] {SHAPES[s][0]} {dt}: {time.time() - t_section:.0f} s (total {budget.elapsed():.0f} s)")
            del setup, compiled
            torch.cuda.empty_cache()

    # The max-autotune peer, last: its compilations take the longest, and it changes only the M >= 512 verdicts.
    t_section, mat_s, setups = time.time(), [], {}
    by_key = {(r["shape"], r["dtype"], r["M"]): r for r in rows}
    for s, M in tuned:
        row = by_key.get((SHAPES[s][0], "bfloat16", M))
        if (row is None and not args.units) or not budget.fits(max(60.0, estimate(mat_s, 60.0)),
                                                               f"max-autotune {SHAPES[s][0]} M={M}"):
            continue  # (a worker of --gpus times the row here even without its bf16 section)
        t0 = time.time()
        if s not in setups:
            for old in list(setups):  # one shape's weights on the device at a time
                del setups[old]
            torch.cuda.empty_cache()
            setups[s] = (ShapeSetup(s, torch.bfloat16, args.merged), torch.compile(reference_mlp, dynamic=False),
                         torch.compile(reference_mlp, dynamic=False, mode="max-autotune-no-cudagraphs"))
        setup, compiled, tuned_fn = setups[s]
        # the whole row again, max-autotune taking turns with the others: it replaces the row timed without it
        errs, times = setup.time(M, {"fused": fused, "eager": reference_mlp, "compile": compiled,
                                     "max-autotune": tuned_fn})
        new = make_row(setup, M, errs, times, tflops, tbps)
        if row is None:
            rows.append(new)
        else:
            rows[rows.index(row)] = new
        mat_s.append(time.time() - t0)
        log(f"[bench] max-autotune {SHAPES[s][0]} M={M}: {times['max-autotune'][0]:.1f} µs, "
            f"{mat_s[-1]:.0f} s; row now {new['speedup']:.2f}x")
        save()
    if mat_s:
        meta["sections"].append(dict(what=f"max-autotune ({len(mat_s)} rows)", seconds=time.time() - t_section))
    log(f"[bench] done in {budget.elapsed():.0f} s; skipped {len(budget.skipped)}")
    print("\n".join(save()))
    return 0 if rows and all(r["fused_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
