# ruff: noqa: B008, B023, E501, F821  (a probe: deleted once its finding is in NOTES)
"""Probe (kept until its GPU run): the one-launch FP8 experts kernel (mlp_fuser/kernels/moe_one.py, the dispatcher's row
fp8_moe_one_launch) at ONE token on CUDA, against the two-launch row unsorted_pdl (W8A8 and W8A16), our bf16 op
(mlp_fuser::moe_mlp on the dequantized weights) and the FP8 op as the dispatcher chooses; Qwen3-30B-A3B and
Mixtral-8x7B experts, 128 x 128 block scales, bf16 x; plus a BLOCK_I x warps (x stages) grid of the new kernel.

    cd <repo>; ln -sfn $PWD/patterns mlp_fuser/patterns; MLP_FUSER_FP8_ONE_LAUNCH=1 PYTHONPATH=$PWD \
        python benchmarks/probe_fp8_one.py [--quick]     (the env: the op's own choice may take the row)
    TRITON_INTERPRET=1 .venv/bin/python benchmarks/probe_fp8_one.py --cpu-check   # the script's logic

Times: triton.testing.do_bench_cudagraph medians, µs per call. "cold": each timed replay runs R routings of distinct
experts one after the other (a decode step's layers never find their weights in L2); "1 set": one routing replayed
(as bench_fp8 times it: Qwen3's 37.7 MB touched fit the 50 MB L2). Errors: max |y - ref| / max |ref| against float64
on the dequantized weights. Floor: the touched experts' float8 bytes at 4.8 TB/s (H200; H100 3.35).
Runs in about a minute (compiles included).
"""

from __future__ import annotations

import os
import sys
import time

import torch
from triton.testing import do_bench_cudagraph

import mlp_fuser  # noqa: F401  (registers the ops)
from mlp_fuser import config
from mlp_fuser.dispatch import fp8_experts
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe_one
from mlp_fuser.ops import quant_moe
from mlp_fuser.reference import Gate

MODELS = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "Mixtral-8x7B": (4096, 14336, 8, 2)}  # H, I, E, k
CPU_CHECK = "--cpu-check" in sys.argv  # tiny shapes under the interpreter, fp16 x, no timing: the script's logic
if CPU_CHECK:
    assert os.environ.get("TRITON_INTERPRET") == "1", "--cpu-check runs under TRITON_INTERPRET=1"
    config.triton_on_cpu = True
    MODELS = {"Qwen3-30B-A3B": (200, 160, 6, 3), "Mixtral-8x7B": (256, 128, 4, 2)}
if "--mixtral" in sys.argv:  # Mixtral's rows and grid alone
    MODELS = {"Mixtral-8x7B": MODELS["Mixtral-8x7B"]}
DEV = "cpu" if CPU_CHECK else "cuda"
XDTYPE = torch.float16 if CPU_CHECK else torch.bfloat16  # the interpreter's bf16 is not right
BLOCK = (128, 128)
R = 8  # routings per cold replay
t_start = time.time()


def log(*a):
    print(f"[{time.time() - t_start:5.1f}s]", *a, flush=True)


def setup(H, I, E, k, g):
    dev = DEV
    wgu = torch.randn(E, 2 * I, H, device=dev, generator=g) / H ** 0.5 * 2
    qgu, sgu = K8.quantize_blocks(wgu, BLOCK)
    del wgu
    wd = torch.randn(E, H, I, device=dev, generator=g) / I ** 0.5
    qd, sd = K8.quantize_blocks(wd, BLOCK)
    del wd
    fgu, fd = K8.fp8_experts(qgu, sgu, BLOCK, gated=True), K8.fp8_experts(qd, sd, BLOCK)
    sets = []
    for _ in range(R):
        x = torch.randn(1, H, device=dev, generator=g).to(XDTYPE)
        ids = torch.randperm(E, device=dev, generator=g)[:k][None].clone()
        wts = torch.softmax(torch.randn(1, k, device=dev, generator=g), -1)
        sets.append((x, ids, wts))
    return fgu, fd, sets


def reference64(x, ids, wts, fgu, fd):
    y = torch.zeros(x.shape[1], dtype=torch.float64, device=x.device)
    for j in range(ids.shape[1]):
        e = int(ids[0, j])
        wgu = (fgu.w[e].double() * fgu.scale[e].double().repeat_interleave(128, 0)[:fgu.w.shape[1]]
               .repeat_interleave(128, 1)[:, :fgu.w.shape[2]])
        wd = (fd.w[e].double() * fd.scale[e].double().repeat_interleave(128, 0)[:fd.w.shape[1]]
              .repeat_interleave(128, 1)[:, :fd.w.shape[2]])
        g, u = (wgu @ x[0].double()).chunk(2)
        y += float(wts[0, j]) * (wd @ (torch.nn.functional.silu(g) * u))
    return y[None]


def err(y, ref):
    return ((y.double() - ref).abs().max() / ref.abs().max()).item()


def time_us(fn, sets, cold):
    use = sets if cold else sets[:1]
    if CPU_CHECK:
        t0 = time.perf_counter()
        for s in use:
            fn(*s)
        return (time.perf_counter() - t0) / len(use) * 1e6

    def work():
        for s in use:
            fn(*s)
    return do_bench_cudagraph(work, rep=60, return_mode="median") * 1e3 / len(use)


def bench_model(model, H, I, E, k, g, tbps, quick, table):
    fgu, fd, sets = setup(H, I, E, k, g)
    floor = k * 3 * H * I / (tbps * 1e12) * 1e6
    log(f"{model}: weights ready; floor {floor:.1f} µs at {tbps} TB/s")
    refs = [reference64(*s, fgu, fd) for s in sets[:2]]
    gate = Gate("silu")
    rows = {}
    x0, ids0, wts0 = sets[0]

    def row(name):
        impl = fp8_experts.FP8_EXPERTS.by_name[name]
        plan = impl.plan((x0, ids0, wts0, fgu, fd, gate))
        return lambda x, ids, wts: plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))

    rows["one_launch (row)"] = ("default", row("fp8_moe_one_launch"))
    for name in ("fp8_moe_unsorted_pdl_w8a8", "fp8_moe_unsorted_pdl_w8a16", "fp8_moe_unsorted_w8a8"):
        rows[name.removeprefix("fp8_moe_")] = ("default", row(name))
    wgu16, wd16 = K8.dequantize_experts(fgu, XDTYPE), K8.dequantize_experts(fd, XDTYPE)
    rows["bf16 op (moe_mlp)"] = ("dispatcher", lambda x, ids, wts: torch.ops.mlp_fuser.moe_mlp(
        x, ids, wts, wgu16, None, wd16, None, "silu"))
    config.fp8_w8a8 = True
    rows["FP8 op (quant_moe_mlp)"] = ("dispatcher", lambda x, ids, wts: quant_moe.quant_moe_mlp(
        x, ids, wts, fgu.w, fgu.scale, fd.w, fd.scale, "silu", block=BLOCK))
    # Qwen3: BLOCK_I x warps at 4 stages, 6 stages at BLOCK_I 32; Mixtral (896 programs, 4096 atomics each at
    # BLOCK_I 32): wider slices, fewer atomics
    points = ([(bi, w, 4) for bi in (16, 32, 64) for w in (4, 8)] + [(32, 4, 6), (32, 8, 6)]
              if model == "Qwen3-30B-A3B" else [(64, 4, 4), (64, 8, 4), (32, 8, 4), (64, 4, 4, 128), (128, 8, 3, 128), (128, 4, 4, 64)])
    grid = [] if quick else [dict(moe_one.DEFAULT, BLOCK_I=bi, num_warps=w, num_stages=st, BLOCK_N=(bn or [256])[0])
                             for bi, w, st, *bn in points]
    for cfg in grid:
        if cfg == moe_one.DEFAULT:
            continue
        plan = moe_one.one_plan(x0, ids0, wts0, fgu, fd, config=cfg)
        rows[f"grid: one_launch {cfg['BLOCK_I']}/{cfg['BLOCK_N']}/{cfg['num_warps']}w/{cfg['num_stages']}st"] = (
            f"BI {cfg['BLOCK_I']}, {cfg['num_warps']} warps, {cfg['num_stages']} stages",
            lambda x, ids, wts, plan=plan: plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd)))
    got = {}
    for name, (cfg, fn) in rows.items():
        try:
            e = max(err(fn(*s), r) for s, r in zip(sets, refs))
            cold = time_us(fn, sets, True)
            one = time_us(fn, sets, False) if not name.startswith("grid") else float("nan")  # grid: cold only
        except Exception as ex:  # a config that does not compile or run: the table says so
            log(f"{model} {name}: {type(ex).__name__}: {str(ex)[:200]}")
            continue
        got[name] = (cfg, cold, one, e)
        log(f"{model} {name}: cold {cold:.1f} µs, 1 set {one:.1f} µs, err {e:.1e}")
    bf16 = got.get("bf16 op (moe_mlp)", (None, None))[1]
    for name, (cfg, cold, one, e) in got.items():
        vs = f"{bf16 / cold:.2f}x" if bf16 else "–"
        table.append(f"| {model} | {name} | {cfg} | {cold:.1f} | {one:.1f} | {vs} | {e:.1e} |")
    chosen = fp8_experts.chosen(fp8_experts.problem(x0, ids0, fgu, fd, gate))
    table.append(f"| {model} | (the dispatcher chose) | {chosen} | | | | |")
    table.append(f"| {model} | (FP8 floor, {tbps} TB/s) | | {floor:.1f} | | | |")


def main():
    quick = "--quick" in sys.argv
    if not (CPU_CHECK or torch.cuda.is_available()):
        raise SystemExit("needs CUDA (or --cpu-check under TRITON_INTERPRET=1)")
    g = torch.Generator(device=DEV).manual_seed(0)
    dev_name = "CPU interpreter (logic check, times meaningless)" if CPU_CHECK else torch.cuda.get_device_name()
    tbps = 4.8 if "H200" in dev_name else 3.35
    table = [f"{dev_name} · T = 1 · {XDTYPE} x · 128 x 128 block scales · CUDA-graph medians (µs per call)",
             "| model | row | config | cold µs | 1 set µs | vs bf16 op (cold) | rel. err vs float64 |",
             "|---|---|---|---|---|---|---|"]
    for model, (H, I, E, k) in MODELS.items():
        bench_model(model, H, I, E, k, g, tbps, quick, table)
        if not CPU_CHECK:
            torch.cuda.empty_cache()
    print("\n".join(table))
    log("done")


if __name__ == "__main__":
    main()
