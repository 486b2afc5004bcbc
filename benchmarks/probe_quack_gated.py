"""Probe (issue 10, for the next session): quack's sm90 gated GEMM (CuTe DSL) as the gate/up half at M = 64-256.

    python3 benchmarks/probe_quack_gated.py [--ms 64,128,256] [--shapes 4096x11008,...] [--configs default,...]
                                            [--budget-s 200]

Needs ``quack-kernels`` and the CuTe DSL (``nvidia-cutlass-dsl`` with its libraries) importable; the device machine
has neither, so they travel as wheels (benchmarks/NOTES.md, "Next"). Without them the script says so and exits 2.

Why: at M = 64-256 our rows sit at 70-84% of the floor, cuBLAS's gate/up at 73-76% of its own floor at M = 128, and
every Triton schedule tried is at or behind cuBLAS (NOTES). A warp-specialised Hopper GEMM (TMA producer warps, wgmma
consumer warp groups, a persistent tile scheduler) with act·mul in its epilogue is what is left; quack has one
(``gemm_act`` with a gated activation: h = silu(x @ w_gateᵀ) * (x @ w_upᵀ) in one kernel). Before writing our own,
this says whether such a kernel beats cuBLAS at these sizes at all.

Timed here in CUDA graphs, in turns (``probe_two_streams.timed``): the gate/up half as cuBLAS's two GEMMs + our act·mul
kernel, and as quack's gated GEMM with the weights concatenated ([gate; up], ``concat_layout``) and interleaved (the
layout a patch could prepare once); the whole MLP as ``cublas_act_mul``, ``cublas_two_streams`` and quack + cuBLAS's
down GEMM. Every output is checked against float64 (within 1.25x ``cublas_act_mul``'s error; the gate/up half against
h). Then, in second turns per row, the whole MLP with the row's best quack config and cuBLAS's or our split-K down GEMM
against ``cublas_act_mul`` and ``cublas_two_streams``, and the down GEMM alone (cuBLAS against ``linear_splitk``):
measured, where the first table's whole MLP with the best config is only the sum of parts. No autotuning (quack's sm90
list is 44 configs, each a CuTe DSL compile): its default config (``tuned=False``: 128x192 tiles, 2x1 clusters,
pingpong) and the explicit configs ``--configs`` names, as TILEMxTILEN-CLUSTERMxCLUSTERN-pingpong|coop, compiled on
their first call, outside the timing. Runs 57-58 (NOTES, fourteenth session): gate/up 1.09-1.16x cuBLAS at M = 128 with
the best config of the row; the default ``--configs`` are the six that won rows most often there (``WINNERS``).

``--ms 512,2048`` asks the M >= 512 question (issue 10: >= 1.03x the best peer there): compute-bound, the peers run
cuBLAS's gate and up, then an act·mul kernel that reads g and u back and writes h (at 4096x11008 M = 2048, 135 MB,
≈ 32 µs of a ≈ 850-µs MLP); a gated GEMM as fast as cuBLAS's, with act·mul in its epilogue, saves that kernel: ≈ 4%.
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

from mlp_fuser.dispatch import IMPLS_BY_NAME  # noqa: E402
from mlp_fuser.kernels import act_mul  # noqa: E402

# the configs that were the best of a row most often in runs 57-58
WINNERS = ["128x128-1x2-pingpong", "128x192-1x1-pingpong", "128x224-1x2-coop", "128x160-1x2-pingpong",
           "128x192-1x2-pingpong", "128x96-1x2-pingpong"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="64,128,256")
    ap.add_argument("--shapes", default="4096x11008,4096x14336,3584x18944,8192x3584", help="K x I (SwiGLU)")
    ap.add_argument("--configs", default=",".join(WINNERS),
                    help="quack configs for the concatenated layout: default, or e.g. 128x128-1x2-pingpong")
    ap.add_argument("--budget-s", type=float, default=200)
    ap.add_argument("--interleaved", action="store_true",
                    help="also the row-interleaved layout (g0, u0, g1, ...; no concat_layout) under each config, and "
                         "every gate/up candidate's plain-call µs (quack's warm fast path skips concat_layout calls)")
    args = ap.parse_args()
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_act
    except ImportError as e:
        print(f"probe_quack_gated: quack and the CuTe DSL are needed ({type(e).__name__}: {e})", flush=True)
        return 2
    if not torch.cuda.is_available():
        print("probe_quack_gated: needs a CUDA GPU (sm90)", flush=True)
        return 2
    torch.backends.cuda.matmul.allow_tf32 = False
    print(torch.cuda.get_device_name(), torch.__version__, flush=True)
    cublas, two = IMPLS_BY_NAME["cublas_act_mul"].fn, IMPLS_BY_NAME["cublas_two_streams"].fn
    configs = {c: None if c == "default" else parse_config(c, GemmConfig) for c in args.configs.split(",")}
    t0, rows, names, wholes = time.perf_counter(), [], [], []
    for shape in args.shapes.split(","):
        K, I = map(int, shape.split("x"))
        wg, wu = (torch.randn(2, I, K, device="cuda") * K ** -0.5).to(torch.bfloat16)
        wd = (torch.randn(K, I, device="cuda") * I ** -0.5).to(torch.bfloat16)
        w_cat = torch.cat([wg, wu])  # (2I, K): B = w_catᵀ is (K, 2I), its halves [gate; up] along N
        w_int = torch.stack([wg, wu], dim=1).flatten(0, 1)  # rows g0, u0, g1, u1, ...: quack's default layout

        def quack_gu(x, w_cat=w_cat, w_int=w_int, concat=True, config=None):
            pin = {"tuned": False} if config is None else {"config": config}
            if concat:
                return gemm_act(x, w_cat.t(), activation="swiglu", store_preact=False, concat_layout=("B",),
                                **pin)[1]
            return gemm_act(x, w_int.t(), activation="swiglu", store_preact=False, **pin)[1]

        interleaved = {f"gu quack int {c}": c for c in configs if c != "default"} if args.interleaved else {}

        for M in map(int, args.ms.split(",")):
            if time.perf_counter() - t0 > args.budget_s:
                print(f"budget spent: stop before {shape} M={M}", flush=True)
                return report(rows, names, wholes)
            x = torch.randn(M, K, device="cuda").to(torch.bfloat16)
            xd = x.double()
            h_ref = F.silu(xd @ wg.double().t()) * (xd @ wu.double().t())
            y_ref = h_ref @ wd.double().t()
            w = (wg, wu, wd)
            cands = {
                "gu cublas": lambda x=x, w=w: act_mul(F.linear(x, w[0]), F.linear(x, w[1]), "silu"),
                "gu quack int": lambda x=x, q=quack_gu: q(x, concat=False),
                **{f"gu quack {c}": lambda x=x, q=quack_gu, c=configs[c]: q(x, config=c) for c in configs},
                **{n: lambda x=x, q=quack_gu, c=configs[c]: q(x, concat=False, config=c)
                   for n, c in interleaved.items()},
                "mlp cublas_act_mul": lambda x=x, w=w: cublas(x, w[0], None, w[1], None, w[2], None, "silu"),
                "mlp cublas_two_streams": lambda x=x, w=w: two(x, w[0], None, w[1], None, w[2], None, "silu"),
                "mlp quack": lambda x=x, w=w, q=quack_gu: F.linear(q(x), w[2]),
            }
            names.extend(n for n in cands if n not in names)
            errs, bad = {}, []
            for name, fn in list(cands.items()):
                try:
                    errs[name] = rel(fn(), h_ref if name.startswith("gu") else y_ref)  # first call: quack tunes here
                except Exception as e:  # a layout quack rejects: say so, time the others
                    print(f"  {shape} M={M} {name}: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    del cands[name]
            for name, err in errs.items():
                bar = errs["gu cublas" if name.startswith("gu") else "mlp cublas_act_mul"]
                if not err <= 1.25 * bar + 1e-6:
                    bad.append(f"{name} {err:.2e} > 1.25 x {bar:.2e}")
            t = timed(cands, "cuda")
            rows.append((shape, M, {k: v[0] for k, v in t.items()}, bad))
            print(shape, M, {k: round(v[0], 1) for k, v in t.items()}, "ok" if not bad else f"WRONG {bad}", flush=True)
            if args.interleaved:  # plain calls: the host's time shows where it exceeds the GPU's
                print(f"  plain µs {shape} M={M}:", {k: round(v[1], 1) for k, v in t.items() if k.startswith("gu")},
                      flush=True)
            best = min((k for k in t if k.startswith("gu quack ") and not k.startswith("gu quack int")),
                       key=lambda k: t[k][0], default=None)
            if best is not None:
                wholes.append(whole_mlp(shape, M, x, w, configs[best.removeprefix("gu quack ")], best, quack_gu,
                                        errs["mlp cublas_act_mul"], y_ref, cublas, two))
    return report(rows, names, wholes)


def whole_mlp(shape, M, x, w, config, best, quack_gu, bar, y_ref, cublas, two):
    """Second turns of a row: the whole MLP with the row's best quack config, then cuBLAS's or our split-K down GEMM,
    against the faster of cublas_act_mul (what the op runs from M = 512) and cublas_two_streams (M = 32-256); and the
    down GEMM alone, cuBLAS against split-K, on one h. Measured, where the first table's MLP with quack is an
    estimate."""
    from mlp_fuser.kernels.splitk import linear_splitk

    wg, wu, wd = w
    h = act_mul(F.linear(x, wg), F.linear(x, wu), "silu")
    d_ref = h.double() @ wd.double().t()
    cands = {
        "mlp cublas_act_mul": lambda: cublas(x, wg, None, wu, None, wd, None, "silu"),
        "mlp cublas_two_streams": lambda: two(x, wg, None, wu, None, wd, None, "silu"),
        "mlp quack best + cuBLAS down": lambda: F.linear(quack_gu(x, config=config), wd),
        "mlp quack best + split-K down": lambda: linear_splitk(quack_gu(x, config=config), wd, None),
        "down cuBLAS": lambda: F.linear(h, wd),
        "down split-K": lambda: linear_splitk(h, wd, None),
    }
    errs = {k: rel(fn(), d_ref if k.startswith("down") else y_ref) for k, fn in cands.items()}
    bad = [f"{k} {e:.2e}" for k, e in errs.items()
           if not e <= 1.25 * (errs["down cuBLAS"] if k.startswith("down") else bar) + 1e-6]
    t = {k: v[0] for k, v in timed(cands, "cuda").items()}
    print(shape, M, best, {k: round(v, 1) for k, v in t.items()}, "ok" if not bad else f"WRONG {bad}", flush=True)
    return shape, M, best, t, bad


def parse_config(text: str, GemmConfig):
    """``128x192-1x2-pingpong`` -> GemmConfig(tile_m=128, tile_n=192, cluster_m=1, cluster_n=2, pingpong=True), sm90;
    ``...-coop``: cooperative."""
    tiles, cluster, kind = text.split("-")
    (tm, tn), (cm, cn) = map(int, tiles.split("x")), map(int, cluster.split("x"))
    if kind not in ("pingpong", "coop"):
        raise ValueError(f"--configs: {text!r} ends in {kind!r}, not pingpong or coop")
    return GemmConfig(tile_m=tm, tile_n=tn, cluster_m=cm, cluster_n=cn, pingpong=kind == "pingpong",
                      is_dynamic_persistent=False, device_capacity=9)


def report(rows, names, wholes) -> int:
    print("CUDA-graph µs (bf16, SwiGLU):")
    print("| K x I | M | " + " | ".join(names) + " | quack gate/up vs cuBLAS | check |")
    print("|---|---|" + "---|" * (len(names) + 2))
    for shape, M, t, bad in rows:
        quack = min((v for k, v in t.items() if k.startswith("gu quack")), default=float("nan"))
        cells = " | ".join(f"{t[k]:.1f}" if k in t else "–" for k in names)
        print(f"| {shape} | {M} | {cells} | {t['gu cublas'] / quack:.3f}x | {'ok' if not bad else 'WRONG'} |")
    cols = ["mlp cublas_act_mul", "mlp cublas_two_streams", "mlp quack best + cuBLAS down",
            "mlp quack best + split-K down", "down cuBLAS", "down split-K"]
    print("\nThe whole MLP with each row's best quack config, and the down GEMM alone (CUDA-graph µs, second turns):")
    print("| K x I | M | best quack config | " + " | ".join(cols) + " | best quack MLP vs best cuBLAS MLP | check |")
    print("|---|---|---|" + "---|" * (len(cols) + 2))
    for shape, M, best, t, bad in wholes:
        cells = " | ".join(f"{t[k]:.1f}" for k in cols)
        ratio = min(t[cols[0]], t[cols[1]]) / min(t[cols[2]], t[cols[3]])
        print(f"| {shape} | {M} | {best.removeprefix('gu quack ')} | {cells} | {ratio:.3f}x | "
              f"{'ok' if not bad else 'WRONG'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
