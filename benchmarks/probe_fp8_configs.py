# ruff: noqa: B023  (each lambda runs inside its loop turn)
"""Probe (removed once its findings are in NOTES): FP8 tile configs where the defaults are far from their floors.

    python benchmarks/probe_fp8_configs.py [--parts dense,experts,pairs] [--budget-s 480]

dense: the LLaMA-3-8B MLP's gate/up (gated) and down GEMMs, W8A8, at M = 128 ... 8192: the split-K swap-AB kernel's
default against the TMA kernel's configs. experts: W8A8 sorted path, one config for gate/up and down (the same
BLOCK_M), Qwen3-30B-A3B and Mixtral dims. pairs: the pairs path (W8A16) against sorted at few tokens.
"""

import argparse
import time

import torch
from triton.testing import do_bench_cudagraph

from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe
from mlp_fuser.tools.bench_moe import routing

T0 = time.time()
DENSE = (4096, 14336)
EXPERTS = {"qwen3": ((2048, 768, 128, 8), (512, 2048)), "mixtral": ((4096, 14336, 8, 2), (128, 512, 2048))}


def us(fn):
    return do_bench_cudagraph(fn, rep=25, return_mode="median") * 1e3


def best(label, fns, budget):
    res = []
    for name, fn in fns:
        if time.time() - T0 > budget:
            print("budget spent", flush=True)
            break
        try:
            res.append((us(fn), name))
        except Exception as e:  # noqa: BLE001
            print(f"  {label} {name}: {type(e).__name__}: {str(e)[:80]}", flush=True)
    res.sort()
    print(f"{label}: " + "; ".join(f"{n} {t:.1f}" for t, n in res[:5]) + (f" ... worst {res[-1][1]} {res[-1][0]:.1f}"
                                                                           if len(res) > 5 else ""), flush=True)
    return res


def dense(ms, budget, dev):
    Kd, I = DENSE
    fw = [K8.fp8_weight(*K8.quantize_blocks(torch.randn(n, k, device=dev) * k ** -0.5), (128, 128))
          for n, k in ((I, Kd), (I, Kd), (Kd, I))]
    grids = {
        "up": [(64, 64, 4, 3), (64, 64, 4, 4), (64, 64, 4, 5), (128, 64, 8, 3), (128, 64, 8, 4), (64, 128, 4, 3),
               (64, 128, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4)],
        "down": [(64, 128, 4, 3), (64, 128, 4, 4), (64, 128, 4, 5), (128, 128, 8, 3), (128, 128, 8, 4),
                 (128, 64, 4, 4), (128, 256, 8, 3), (64, 256, 8, 3), (64, 64, 4, 4)],
    }
    for M in ms:
        for kind, (K_, ws, act) in {"up": (Kd, (fw[0], fw[1]), "silu"), "down": (I, (fw[2], None), None)}.items():
            a = torch.randn(M, K_, device=dev, dtype=torch.bfloat16)
            N_ = ws[0].w.shape[0]
            base = K8.default_config(M, N_, K_, kind == "up", True, dev)
            cands = [("default " + str(tuple(base)), base)]
            cands += [(f"tma{c}", K8.Config(c[0], c[1], 128, 1, c[2], c[3], 8, True)) for c in grids[kind]]
            g0 = grids[kind][0]
            cands += [(f"tma{g0}g32", K8.Config(*g0[:2], 128, 1, *g0[2:], 32, True))]
            best(f"M={M} {kind}", [(n, lambda c=c, a=a, ws=ws, act=act: K8.fp8_linear(a, ws[0], ws[1], activation=act,
                                                                                        a8=True, config=c))
                                   for n, c in cands], budget)


def experts(budget, dev, parts):
    g = torch.Generator(device=dev).manual_seed(0)
    for name, ((H, I, E, k), Ts) in EXPERTS.items():
        gq, gs = K8.quantize_blocks(torch.randn(E, 2 * I, H, device=dev) * H ** -0.5)
        dq, ds = K8.quantize_blocks(torch.randn(E, H, I, device=dev) * I ** -0.5)
        fgu, fd = K8.fp8_experts(gq, gs, (128, 128), gated=True), K8.fp8_experts(dq, ds, (128, 128))
        if "experts" in parts:
            for T in Ts:
                x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
                ids, wts = routing(T, E, k, torch.bfloat16, dev, g)
                cands = [("default", None)]
                for bm, bn_u, bn_d, w, st in [(64, 64, 128, 4, 3), (64, 128, 128, 4, 3), (128, 64, 128, 8, 3),
                                              (128, 128, 128, 8, 3), (64, 64, 64, 4, 4), (128, 128, 256, 8, 3),
                                              (32, 64, 128, 4, 4)]:
                    for bk in (128, 64):
                        cfg = {"gate_up": {"BLOCK_M": bm, "BLOCK_N": bn_u, "BLOCK_K": bk, "num_warps": w,
                                           "num_stages": st},
                               "down": {"BLOCK_M": bm, "BLOCK_N": bn_d, "BLOCK_K": bk, "num_warps": w,
                                        "num_stages": st}}
                        cands.append((f"{(bm, bn_u, bn_d, bk, w, st)}", cfg))
                best(f"{name} experts T={T} w8a8 sorted", [
                    (n, lambda c=c, x=x, ids=ids, wts=wts: moe.moe_experts(x, ids, wts, fgu.w, None, fd.w, None,
                                                                            path="sorted", configs=c,
                                                                            scales=(fgu, fd), a8=True))
                    for n, c in cands], budget)
        if "pairs" in parts:
            for T in (1, 4, 8, 16, 32):
                if T * k > 128:
                    continue
                x = torch.randn(T, H, device=dev, generator=g).to(torch.bfloat16)
                ids, wts = routing(T, E, k, torch.bfloat16, dev, g)
                fns = [(f"{p} a8={a8}", lambda p=p, a8=a8, x=x, ids=ids, wts=wts: moe.moe_experts(
                    x, ids, wts, fgu.w, None, fd.w, None, path=p, scales=(fgu, fd), a8=a8))
                    for p, a8 in (("pairs", False), ("sorted", False), ("sorted", True))]
                for c in moe.moe_tuning.H200["gate_up_pairs"][1]:
                    fns.append((f"pairs gu{(c['BLOCK_N'], c['BLOCK_K'], c['num_stages'])}",
                                lambda c=c, x=x, ids=ids, wts=wts: moe.moe_experts(
                                    x, ids, wts, fgu.w, None, fd.w, None, path="pairs", configs={"gate_up_pairs": c},
                                    scales=(fgu, fd))))
                best(f"{name} T={T} pairs/sorted", fns, budget)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--parts", default="dense,experts,pairs")
    ap.add_argument("--ms", default="128,512,2048,8192")
    ap.add_argument("--budget-s", type=float, default=480)
    args = ap.parse_args()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    parts = args.parts.split(",")
    if "dense" in parts:
        dense([int(m) for m in args.ms.split(",")], args.budget_s, dev)
    experts(args.budget_s, dev, parts)
    print(f"done in {time.time() - T0:.0f} s")


if __name__ == "__main__":
    main()
