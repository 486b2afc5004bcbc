"""Probe (removed once its findings are in NOTES): the FP8 GEMM's tile configs per M, for gate/up (gated) and down,
in three modes: w8a8, w8a16 through bfloat16, w8a16 through float16. LLaMA-3-8B MLP, 128 x 128 block scales.

    python benchmarks/probe_fp8_configs.py [--ms 1,16,64,128,512,2048,8192]
"""

import argparse
import itertools
import time

import torch
from triton.testing import do_bench_cudagraph

from mlp_fuser.kernels import fp8 as K8


def grid(M):
    if M <= 16:
        return [K8.Config(16, bn, 128, sp, 4, st) for bn, sp, st in itertools.product((32, 64, 128), (0, 1, 2), (3, 4))]
    if M <= 128:
        return [K8.Config(bm, bn, 128, sp, 4, 3) for bm, bn, sp in itertools.product((32, 64), (64, 128), (0, 1))]
    return [K8.Config(bm, bn, 128, 1, w, st) for (bm, bn, w), st in itertools.product(
        ((64, 64, 4), (64, 128, 4), (128, 64, 8), (128, 128, 8), (64, 128, 8)), (3, 4))]


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ms", default="1,16,64,128,512,2048,8192")
    ap.add_argument("--budget-s", type=float, default=420)
    args = ap.parse_args()
    t0 = time.time()
    dev = torch.device("cuda")
    torch.manual_seed(0)
    Kd, I = 4096, 14336
    fw = [K8.fp8_weight(*K8.quantize_blocks(torch.randn(n, k, device=dev) * k ** -0.5), (128, 128))
          for n, k in ((I, Kd), (I, Kd), (Kd, I))]
    best = {}
    for M in map(int, args.ms.split(",")):
        for kind, (K_, ws, act) in {"up": (Kd, (fw[0], fw[1]), "silu"), "down": (I, (fw[2], None), None)}.items():
            a = torch.randn(M, K_, device=dev, dtype=torch.bfloat16)
            N_ = ws[0].w.shape[0]
            for mode in ("a8", "bf16", "f16"):
                if M >= 512 and mode != "a8":
                    continue
                if time.time() - t0 > args.budget_s:
                    print("budget spent", flush=True)
                    break
                base = K8.default_config(M, N_, K_, kind == "up", mode == "a8", dev)
                res = []
                for cfg in [base] + grid(M):
                    if cfg.split_k in (0, 1, 2) and M <= 128 and cfg is not base:
                        auto = K8.default_config(M, N_, K_, kind == "up", False, dev).split_k
                        cfg = cfg._replace(split_k=max(1, auto * (1, 2, 4)[cfg.split_k] // 2))
                    try:
                        t = do_bench_cudagraph(lambda cfg=cfg, a=a: K8.fp8_linear(
                            a, ws[0], ws[1], activation=act, a8=mode == "a8", f16=mode == "f16", config=cfg),  # noqa: B023
                            rep=25, return_mode="median") * 1e3
                    except Exception as e:  # noqa: BLE001
                        print(f"  M={M} {kind} {mode} {tuple(cfg)}: {type(e).__name__}", flush=True)
                        continue
                    res.append((t, cfg))
                res.sort(key=lambda r: r[0])
                if res:
                    best[(M, kind, mode)] = res[0]
                    print(f"M={M} {kind} {mode}: best {res[0][0]:.1f} us {tuple(res[0][1])}; default "
                          f"{next(t for t, c in res if c == base) if any(c == base for _, c in res) else 'fail'}"
                          f"; 2nd {tuple(res[1][1]) if len(res) > 1 else ''} {res[1][0] if len(res) > 1 else '':.5}",
                          flush=True)
    print("\n| M | mode | up best | down best | sum |")
    for (M, kind, mode), (t, cfg) in sorted(best.items()):
        if kind == "up" and (M, "down", mode) in best:
            d = best[(M, "down", mode)]
            print(f"| {M} | {mode} | {t:.1f} {tuple(cfg)} | {d[0]:.1f} {tuple(d[1])} | {t + d[0]:.1f} |")


if __name__ == "__main__":
    main()
