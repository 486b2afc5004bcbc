"""FP8 weights, the dense gated MLP: our FP8 kernels against our bf16 op and the unfused torch._scaled_mm peer.

    python benchmarks/bench_fp8.py [--shape 4096,14336] [--ms 1,16,64,128,512,2048,8192] [--sweep] [--out DIR]

LLaMA-3-8B's MLP by default, weights in 128 x 128 blocks of float8_e4m3fn as Qwen3/DeepSeek FP8 checkpoints store
them. Checks each path's error against float64 on the dequantized weights first (bf16 x), then times each path with
CUDA graphs (triton.testing.do_bench_cudagraph medians), all in one process and in turns. Floor = (FP8 weights +
scales + x + y) bytes at the device copy bandwidth measured in the same run. ``--sweep`` also times the decode
kernel's configs. Prints a table last; writes fp8.json under --out.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench, do_bench_cudagraph

import mlp_fuser  # noqa: F401 (registers the ops)
from mlp_fuser.kernels import fp8 as K8


def log(*a):
    print(*a, flush=True)


def block_quantize(w: torch.Tensor, block=128):
    """A bf16 weight as float8_e4m3fn with one fp32 scale per 128 x 128 block (how FP8 checkpoints are made)."""
    N, Kd = w.shape
    wp = F.pad(w.float(), (0, (-Kd) % block, 0, (-N) % block))
    b = wp.view(wp.shape[0] // block, block, wp.shape[1] // block, block)
    s = b.abs().amax(dim=(1, 3)).clamp(min=1e-12) / K8.FP8_MAX
    q = (b / s[:, None, :, None]).clamp(-448, 448).to(K8.FP8).view_as(wp)[:N, :Kd].contiguous()
    return q, s.contiguous()


def scaled_mm_peer(x, ws, mode):
    """The unfused FP8 MLP from torch._scaled_mm: x rows quantized, gate and up GEMMs, silu·mul, h quantized, down.
    ``mode`` rowwise: per-row scales on both sides (weights requantized per row from the block format)."""
    (gq, gs), (uq, us), (dq, ds) = ws

    def q_rows(t):
        s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
        return (t.float() / s).clamp(-448, 448).to(K8.FP8), s

    def mm(a, w, sw):
        aq, sa = q_rows(a)
        return torch._scaled_mm(aq, w.t(), scale_a=sa, scale_b=sw, out_dtype=torch.bfloat16)

    g = mm(x, gq, gs)
    u = mm(x, uq, us)
    return mm(F.silu(g) * u, dq, ds)


def rowwise(qw):
    """A (float8 weight, 128-block scales) pair requantized with one scale per output row, as _scaled_mm takes it."""
    q, s = qw
    N, Kd = q.shape
    deq = K8.dequantize(K8.fp8_weight(q, s, (128, 128)))
    sr = deq.abs().amax(-1, keepdim=True).clamp(min=1e-12) / 448.0
    return (deq / sr).clamp(-448, 448).to(K8.FP8), sr.t().contiguous()


def copy_bandwidth(dev) -> float:
    src = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median") * 1e-3)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", default="4096,14336")
    ap.add_argument("--ms", default="1,16,64,128,512,2048,8192")
    ap.add_argument("--sweep", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    args = ap.parse_args()
    Kd, I = map(int, args.shape.split(","))
    ms = [int(m) for m in args.ms.split(",")]
    dev = torch.device("cuda")
    torch.manual_seed(0)
    log(f"{torch.cuda.get_device_name()} torch {torch.__version__} shape K={Kd} I={I}")

    bw = copy_bandwidth(dev)
    log(f"copy bandwidth {bw / 1e12:.2f} TB/s")

    wg, wu = (torch.randn(I, Kd, device=dev) * Kd ** -0.5 for _ in range(2))
    wd = torch.randn(Kd, I, device=dev) * I ** -0.5
    q = [block_quantize(w) for w in (wg, wu, wd)]
    fw = [K8.fp8_weight(a, s, (128, 128)) for a, s in q]
    deq = [K8.dequantize(f, torch.bfloat16) for f in fw]  # the bf16 op runs the same (dequantized) weights
    deq64 = [K8.dequantize(f, torch.float64) for f in fw]
    rw = [rowwise(a) for a in q]

    def bf16_op(x):
        return torch.ops.mlp_fuser.gated_mlp(x, deq[0], None, deq[1], None, deq[2], None, "silu")

    def fp8(x, a8=False, cfg_up=None, cfg_down=None):
        h = K8.fp8_linear(x, fw[0], fw[1], activation="silu", a8=a8, config=cfg_up)
        return K8.fp8_linear(h, fw[2], a8=a8, config=cfg_down)

    paths = {
        "bf16_op": bf16_op,
        "fp8_w8a16": lambda x: fp8(x),
        "fp8_w8a8": lambda x: fp8(x, a8=True),
        "scaled_mm_rowwise": lambda x: scaled_mm_peer(x, rw, "rowwise"),
    }
    rows, errors = [], {}
    for M in ms:
        x = torch.randn(M, Kd, device=dev, dtype=torch.bfloat16)
        ref = (F.silu(x.double() @ deq64[0].T) * (x.double() @ deq64[1].T)) @ deq64[2].T
        row = {"M": M}
        for name, fn in paths.items():
            try:
                y = fn(x)
                torch.cuda.synchronize()
                err = ((y.double() - ref).norm() / ref.norm()).item()
                t = do_bench_cudagraph(lambda fn=fn, x=x: fn(x), rep=100, return_mode="median") * 1e3
                row[name] = round(t, 1)
                errors[(M, name)] = err
                log(f"M={M} {name}: {t:.1f} us  rel err {err:.2e}")
            except Exception as e:  # noqa: BLE001 (a probe: report and go on)
                row[name] = None
                log(f"M={M} {name}: FAILED {type(e).__name__}: {str(e)[:300]}")
        fbytes = 3 * I * Kd + 3 * 4 * (I // 128) * (Kd // 128) + 2 * M * Kd * 2
        row["floor_fp8"] = round(fbytes / bw * 1e6, 1)
        row["floor_bf16"] = round((3 * I * Kd * 2 + 2 * M * Kd * 2) / bw * 1e6, 1)
        if args.sweep and M <= 64:
            best = {}
            for which, (N_, K_, gated) in {"up": (I, Kd, True), "down": (Kd, I, False)}.items():
                a = torch.randn(M, K_, device=dev, dtype=torch.bfloat16)
                for bn in (32, 64, 128):
                    for bk in (128,):
                        for stages in (3, 4, 6):
                            for mult in (1, 2, 4):
                                base = K8.default_config(M, N_, K_, gated, False, dev)
                                cfg = base._replace(block_n=bn, block_k=bk, num_stages=stages,
                                                    split_k=max(1, base.split_k * mult // 2))
                                try:
                                    up = (fw[0], fw[1], "silu") if gated else (fw[2], None, None)
                                    t = do_bench_cudagraph(
                                        lambda cfg=cfg, a=a, up=up: K8.fp8_linear(a, up[0], up[1], activation=up[2],
                                                                                  config=cfg),
                                        rep=30, return_mode="median") * 1e3
                                except Exception as e:  # noqa: BLE001
                                    log(f"  sweep {which} {cfg}: {type(e).__name__}")
                                    continue
                                if which not in best or t < best[which][0]:
                                    best[which] = (t, cfg)
            for which, (t, cfg) in best.items():
                nkg = (I, Kd, True) if which == "up" else (Kd, I, False)
                log(f"  sweep M={M} {which}: best {t:.1f} us {tuple(cfg)} "
                    f"default {tuple(K8.default_config(M, *nkg, False, dev))}")
                row[f"best_{which}"] = [round(t, 1), list(cfg)]
        rows.append(row)

    with open(os.path.join(args.out, "fp8.json"), "w") as f:
        json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "bw": bw, "rows": rows,
                   "errors": {f"{m}:{n}": e for (m, n), e in errors.items()}, "date": time.strftime("%F")}, f)
    log("\n| M | floor fp8 | bf16 op | fp8 w8a16 | fp8 w8a8 | _scaled_mm rowwise | fp8 best / bf16 | % floor |")
    log("|---|---|---|---|---|---|---|---|")
    for r in rows:
        cands = [r[k] for k in ("fp8_w8a16", "fp8_w8a8") if r.get(k)]
        best = min(cands) if cands else None
        ratio = f"{r['bf16_op'] / best:.2f}x" if best and r.get("bf16_op") else "-"
        pct = f"{100 * r['floor_fp8'] / best:.0f}%" if best else "-"
        log(f"| {r['M']} | {r['floor_fp8']} | {r.get('bf16_op')} | {r.get('fp8_w8a16')} | {r.get('fp8_w8a8')} | "
            f"{r.get('scaled_mm_rowwise')} | {ratio} | {pct} |")


if __name__ == "__main__":
    main()
