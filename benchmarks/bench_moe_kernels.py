"""Routed-experts kernels on the GPU: every path and config checked against float64, then timed.

    python benchmarks/bench_moe_kernels.py [--tiny] [--T 1,8,32] [--sizes qwen3-30b-a3b]

For Qwen3-30B-A3B's experts (H 2048, I 768, E 128, k 8) and Mixtral-8x7B's (4096, 14336, 8, 2), bf16, at each T:
every candidate of mlp_fuser.kernels.moe.CONFIGS for the kernels of that M bucket, alone (the down kernel also with
its combine, and at T <= 32 both kernels with every pair its own block); then each path of moe.PATHS end to end
with the fastest ones (routing included; the fused paths also as their "_nomemset" and "_pdl" variants), beside
transformers' grouped_mm and batched_mm experts forwards on a Qwen3MoeExperts module holding the same weights.
CUDA-graph medians (``do_bench_cudagraph``); floor = max(bytes of the distinct experts the routing touches + x + y
at 4.3 TB/s, FLOPs at 790 TFLOP/s). Errors: ‖out − ref‖∞ / ‖ref‖∞ against float64. Results go to
$OUT/bench_moe_kernels.json when OUT is set; the summary table is printed last.
``--tiny``: small shapes on the CPU under the Triton interpreter (fp32, one wall-clock call): a smoke test.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from functools import partial

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

from mlp_fuser.kernels import moe  # noqa: E402
from mlp_fuser.kernels.moe_routing import moe_align  # noqa: E402
from mlp_fuser.reference import rel_err  # noqa: E402

BANDWIDTH, PEAK = 4.3e12, 790e12
SIZES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "mixtral-8x7b": (4096, 14336, 8, 2)}
TINY_SIZES = {"tiny-many": (64, 48, 16, 4), "tiny-few": (48, 80, 4, 2)}
DEV = "cpu" if TINY else "cuda"
DTYPE = torch.float32 if TINY else torch.bfloat16


def candidates(kind: str, bucket: int) -> list[dict]:
    """CONFIGS[kind][bucket]; under the interpreter only the first (the run is a smoke test)."""
    return moe.CONFIGS[kind][bucket][:1] if TINY else moe.CONFIGS[kind][bucket]


def timed(fn, rep=20) -> float:
    """µs: the CUDA-graph median on the GPU; one wall-clock call under the interpreter."""
    fn()
    if TINY:
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1e6
    from triton.testing import do_bench_cudagraph

    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def reference64(x, ids, wts, w_gu, w_d):
    """y in float64, expert by expert (silu, gate|up concatenated)."""
    E, H, I = w_d.shape
    y = torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in range(E):
        tok, j = torch.where(ids == e)
        if tok.numel():
            gu = x[tok].double() @ w_gu[e].double().T
            h = torch.nn.functional.silu(gu[:, :I]) * gu[:, I:]
            y.index_add_(0, tok, (h @ w_d[e].double().T) * wts[tok, j].double()[:, None])
    return y


def hf_experts(w_gu, w_d, k):
    """transformers' Qwen3MoeExperts holding these weights (no copy)."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

    E, H, I = w_d.shape
    cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k,
                         hidden_act="silu")
    with torch.device("meta"):
        mod = Qwen3MoeExperts(cfg)
    mod.gate_up_proj = torch.nn.Parameter(w_gu, requires_grad=False)
    mod.down_proj = torch.nn.Parameter(w_d, requires_grad=False)
    return mod


def floor_us(ids, E, H, I, k):
    T = ids.shape[0]
    touched = int(torch.unique(ids[ids < E]).numel())
    nbytes = (touched * 3 * H * I + 2 * T * H) * torch.empty((), dtype=DTYPE).element_size()
    return max(nbytes / BANDWIDTH, 2 * T * k * 3 * H * I / PEAK) * 1e6


def run_size(name, H, I, E, k, Ts, rows):
    g = torch.Generator(device=DEV).manual_seed(0)
    w_gu = (torch.randn((E, 2 * I, H), generator=g, device=DEV) / H ** 0.5).to(DTYPE)
    w_d = (torch.randn((E, H, I), generator=g, device=DEV) / I ** 0.5).to(DTYPE)
    mod = hf_experts(w_gu, w_d, k)
    for T in Ts:
        rows.append(run_tokens(name, H, I, E, k, T, w_gu, w_d, mod, g))


def run_tokens(name, H, I, E, k, T, w_gu, w_d, mod, g):
    """One row: every config and path at T tokens, and transformers' implementations."""
    act = moe.ExpertAct()
    x = torch.randn((T, H), generator=g, device=DEV).to(DTYPE)
    scores = torch.randn((T, E), generator=g, device=DEV)
    top, ids = scores.topk(k, dim=1)  # distinct experts per token, as a router picks them
    wts = torch.softmax(top, dim=1).to(DTYPE)
    ref = reference64(x, ids, wts, w_gu, w_d)
    floor = floor_us(ids, E, H, I, k)
    row = {"size": name, "T": T, "floor_us": floor, "configs": {}, "paths": {}, "hf": {}}

    def check(y, label):
        err = rel_err(y, ref, math.inf)
        if not err < 0.05:  # bf16 outputs are about 1e-2 off at worst: far beyond that is a bug
            print(f"  WRONG {name} T={T} {label}: err {err:.3g}", flush=True)
        return err

    # -- each kernel's candidates alone (the sorted kernels on their own routing) ----------------
    bucket = moe.rows_bucket(T, k, E)
    best = {}
    routings = {}
    for c in candidates("gate_up", bucket):
        r = routings.setdefault(c["BLOCK_M"], moe_align(ids, E, c["BLOCK_M"]))
        us = timed(partial(moe.moe_gate_up, x, r, w_gu, None, act, I, False, c), rep=10)
        y = moe.moe_combine(moe.moe_down(moe.moe_gate_up(x, r, w_gu, None, act, I, False, c), r, wts, w_d,
                                         None, moe.default_config("down", T, k, E, H, I, DTYPE)), ids, E, DTYPE)
        row["configs"][f"gate_up {c}"] = (us, check(y, f"gate_up {c}"))
        if us < best.get("gate_up", (math.inf,))[0]:
            best["gate_up"] = (us, c)
    r = routings[best["gate_up"][1]["BLOCK_M"]]
    h = moe.moe_gate_up(x, r, w_gu, None, act, I, False, best["gate_up"][1])
    for c in candidates("down", bucket):  # BLOCK_M is the routing's
        us = timed(partial(moe.moe_down, h, r, wts, w_d, None, c), rep=10)
        row["configs"][f"down {c}"] = (us, check(moe.moe_combine(moe.moe_down(h, r, wts, w_d, None, c), ids, E,
                                                                 DTYPE), f"down {c}"))
        if us < best.get("down", (math.inf,))[0]:
            best["down"] = (us, c)
        us = timed(partial(moe.moe_down_combine, h, r, ids, wts, w_d, None, DTYPE, c), rep=10)
        y = moe.moe_down_combine(h, r, ids, wts, w_d, None, DTYPE, c)
        row["configs"][f"down_combine {c}"] = (us, check(y, f"down_combine {c}"))
    if T <= 32:  # every pair its own block (the unsorted path): the same candidates, BLOCK_M set by the kernels
        for c in candidates("gate_up", bucket):
            us = timed(partial(moe.moe_gate_up, x, None, w_gu, None, act, I, False, c, ids), rep=10)
            hp = moe.moe_gate_up(x, None, w_gu, None, act, I, False, c, ids)
            y = moe.moe_down_combine(hp, None, ids, wts, w_d, None, DTYPE)
            row["configs"][f"gate_up_per_pair {c}"] = (us, check(y, f"gate_up_per_pair {c}"))
        for c in candidates("down", bucket):
            us = timed(partial(moe.moe_down_combine, h, None, ids, wts, w_d, None, DTYPE, c), rep=10)
            y = moe.moe_down_combine(h, None, ids, wts, w_d, None, DTYPE, c)
            row["configs"][f"down_combine_per_pair {c}"] = (us, check(y, f"down_combine_per_pair {c}"))
    if T <= 32:  # the GEMV paths read an expert once per pair / token: for few tokens only
        for c in candidates("gate_up_pairs", 1):
            us = timed(partial(moe.moe_gate_up_pairs, x, ids, w_gu, None, act, I, False, c), rep=10)
            hp = moe.moe_gate_up_pairs(x, ids, w_gu, None, act, I, False, c)
            y = moe.moe_down_tokens(hp, ids, wts, w_d, None, DTYPE)
            row["configs"][f"gate_up_pairs {c}"] = (us, check(y, f"gate_up_pairs {c}"))
            if us < best.get("gate_up_pairs", (math.inf,))[0]:
                best["gate_up_pairs"] = (us, c)
        for c in candidates("down_tokens", 1):
            us = timed(partial(moe.moe_down_tokens, h, ids, wts, w_d, None, DTYPE, c), rep=10)
            row["configs"][f"down_tokens {c}"] = (us, check(moe.moe_down_tokens(h, ids, wts, w_d, None, DTYPE, c),
                                                            f"down_tokens {c}"))
            if us < best.get("down_tokens", (math.inf,))[0]:
                best["down_tokens"] = (us, c)

    # -- each path end to end with the fastest configs --------------------------------------------
    cfgs = {kind: c for kind, (_, c) in best.items()}
    for path in moe.PATHS:  # "pairs" and "unsorted*" read an expert once per pair: slow beyond a few tokens
        fn = partial(moe.moe_experts, x, ids, wts, w_gu, None, w_d, None, act, False, path, cfgs)
        row["paths"][path] = (timed(fn), check(fn(), path))
    row["best_configs"] = cfgs

    # -- transformers' experts on the same weights -------------------------------------------------
    for impl in ("grouped_mm", "batched_mm"):
        if impl == "batched_mm" and T * k * 3 * H * I * 2 > 16e9:  # it gathers a weight copy per pair
            continue
        mod.config._experts_implementation = impl
        try:
            fn = partial(mod, x, ids, wts)
            row["hf"][impl] = (timed(fn), rel_err(fn(), ref, math.inf))
        except Exception as exc:  # noqa: BLE001  (an implementation this torch lacks on this device)
            row["hf"][impl] = (math.nan, repr(exc)[:80])
    ours = min(row["paths"].items(), key=lambda kv: kv[1][0])
    gm = row["hf"].get("grouped_mm", (math.nan, math.nan))
    print(f"{name} T={T}: floor {floor:.1f} µs, ours {ours[0]} {ours[1][0]:.1f} µs, grouped_mm {gm[0]:.1f} µs",
          flush=True)
    return row


def _cell(floor, v):
    return f"{v[0]:.1f} ({100 * floor / v[0]:.0f}%)" if v and v[0] == v[0] else "–"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--T", default="1,3" if TINY else "1,8,32,128,512,2048")
    ap.add_argument("--sizes", default=None, help="comma-separated names of the sizes to run (default: all)")
    args = ap.parse_args()
    Ts = [int(t) for t in args.T.split(",")]
    torch.backends.cuda.matmul.allow_tf32 = False
    rows: list[dict] = []
    t0 = time.time()
    sizes = TINY_SIZES if TINY else SIZES
    for name in args.sizes.split(",") if args.sizes else sizes:
        H, I, E, k = sizes[name]
        run_size(name, H, I, E, k, Ts, rows)
    if os.environ.get("OUT"):
        with open(os.path.join(os.environ["OUT"], "bench_moe_kernels.json"), "w") as f:
            json.dump(rows, f, indent=1, default=str)

    print(f"\n{DTYPE}, {'interpreter wall clock' if TINY else 'CUDA-graph medians'}, µs (% of floor); "
          f"err = ‖y − y64‖∞ / ‖y64‖∞ ({time.time() - t0:.0f} s)")
    print("| size | T | floor | ours: best path | " + " | ".join(moe.PATHS) + " | grouped_mm | batched_mm "
          "| ours / grouped_mm | err ours, grouped_mm |")
    print("|---" * (8 + len(moe.PATHS)) + "|")
    for r in rows:
        cell = partial(_cell, r["floor_us"])
        name, best = min(r["paths"].items(), key=lambda kv: kv[1][0])
        gm = r["hf"].get("grouped_mm")
        speed = f"{gm[0] / best[0]:.2f}×" if gm and gm[0] == gm[0] else "–"
        gerr = f"{gm[1]:.2g}" if gm and isinstance(gm[1], float) else "–"
        paths = " | ".join(cell(r["paths"].get(p)) for p in moe.PATHS)
        print(f"| {r['size']} | {r['T']} | {r['floor_us']:.1f} | {name} {cell(best)} | {paths} | {cell(gm)} | "
              f"{cell(r['hf'].get('batched_mm'))} | {speed} | {best[1]:.2g}, {gerr} |")


if __name__ == "__main__":
    main()
