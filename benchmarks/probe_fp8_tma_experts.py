# ruff: noqa: B008, B023, E501, F821  (a probe: deleted once its finding is in NOTES)
"""GPU probe: FP8 W8A8 routed experts, the pointer sorted kernels (row fp8_moe_sorted_w8a8) against the TMA ones
(row fp8_moe_sorted_tma_w8a8: float8 weight boxes), Qwen3-30B-A3B and Mixtral-8x7B at T = 512, 2048, 8192; then a
small config grid for each TMA kernel alone at T = 2048; each output checked against float64 of W8A8's semantics on
a sample of tokens. Run:  cd <repo>; ln -sfn $PWD/patterns mlp_fuser/patterns;
PYTHONPATH=$PWD python benchmarks/probe_fp8_tma_experts.py     (about 2 minutes at most: a time budget skips the rest)
"""
import itertools
import sys
import time

import torch
import torch.nn.functional as F
import triton

from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.kernels.moe_routing import moe_align

START = time.time()
BUDGET = 125.0  # seconds: grid points past it are skipped (the whole run must stay under 150 s)
MODELS = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "Mixtral-8x7B": (4096, 14336, 8, 2)}
TOKENS = (512, 2048, 8192)
dev = torch.device("cuda")
ACT = kmoe.ExpertAct()


def left() -> float:
    return BUDGET - (time.time() - START)


def experts(E, N, K, gen):
    w = (torch.randn(E, N, K, device=dev, generator=gen, dtype=torch.bfloat16) * 2).to(K8.FP8)
    s = torch.rand(E, -(-N // 128), -(-K // 128), device=dev, generator=gen) * 0.01 + 0.002
    return K8.fp8_experts(w, s, (128, 128), gated=False)


def dequant(fe, e):
    N, K = fe.w.shape[1:]
    s = fe.scale[e].double().repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]
    return fe.w[e].double() * s


def deq_rows(t):
    q, s = K8.quantize_rows_reference(t)
    return q.double() * s.double().repeat_interleave(128, 1)[:, :t.shape[1]]


def reference(x, ids, wts, fgu, fd, rows):
    """y[rows] in float64 as W8A8 computes it: x quantized per row and 128 columns, h rounded to bf16 and quantized."""
    E, H, I = fd.w.shape
    xd, ids_r, wts_r = deq_rows(x[rows]), ids[rows], wts[rows].double()
    y = torch.zeros(len(rows), H, dtype=torch.float64, device=dev)
    for e in ids_r.unique().tolist():
        t, j = torch.where(ids_r == e)
        g, u = (xd[t] @ dequant(fgu, e).T).chunk(2, dim=1)
        h = deq_rows((F.silu(g) * u).to(torch.bfloat16))
        y.index_add_(0, t, (h @ dequant(fd, e).T) * wts_r[t, j][:, None])
    return y


def err(y, ref, rows):
    return ((y[rows].double() - ref).abs().max() / ref.abs().max()).item()


def bench(fn):
    return triton.testing.do_bench_cudagraph(fn, rep=20) * 1e3  # µs


def case(H, I, E, k, T, gen):
    fgu, fd = experts(E, 2 * I, H, gen), experts(E, H, I, gen)
    x = torch.randn(T, H, device=dev, generator=gen, dtype=torch.bfloat16)
    logits = torch.randn(T, E, device=dev, generator=gen)
    wts, ids = torch.topk(torch.softmax(logits, -1), k)
    return x, ids.to(torch.int32), wts.to(torch.bfloat16), fgu, fd


def row(path, x, ids, wts, fgu, fd, configs=None):
    plan = kmoe.experts_plan(x, ids, wts, fgu.w, None, fd.w, None, ACT, False, path, configs, scales=(fgu, fd),
                             a8=True)
    return lambda: plan(x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))


def main():
    cap = torch.cuda.get_device_capability()
    print(f"# {torch.cuda.get_device_name()} sm_{cap[0]}{cap[1]}, torch {torch.__version__}, triton {triton.__version__}")
    gen = torch.Generator(device=dev).manual_seed(0)
    print(f"{'model':14s} {'T':>5s} {'rows/e':>6s} | {'pointer µs':>10s} {'TMA µs':>8s} {'speedup':>7s} | "
          f"{'bf16 µs':>8s} {'bf16/TMA':>8s} {'bf16/ptr':>8s} | {'err ptr':>8s} {'err TMA':>8s} {'ptr~TMA':>8s}")
    grid_cases = {}
    for (name, (H, I, E, k)), T in itertools.product(MODELS.items(), TOKENS):
        if left() < 0:
            print(f"{name:14s} {T:5d} skipped: over the time budget")
            continue
        x, ids, wts, fgu, fd = case(H, I, E, k, T, gen)
        assert kmoe.tma_why_not(x, fgu.w, fd.w, False) is None
        ptr, tma = row("sorted", x, ids, wts, fgu, fd), row("sorted_tma", x, ids, wts, fgu, fd)
        y_ptr, y_tma = ptr(), tma()
        rows = torch.randperm(T, device=dev, generator=gen)[:24]
        ref = reference(x, ids, wts, fgu, fd, rows)
        e_ptr, e_tma = err(y_ptr, ref, rows), err(y_tma, ref, rows)
        same = ((y_ptr.float() - y_tma.float()).abs().max() / y_ptr.float().abs().max()).item()
        t_ptr, t_tma = bench(ptr), bench(tma)
        # the bf16 experts op's two large-M rows (sorted, sorted_tma) on the weights the scales describe: the faster
        wgu, wd = K8.dequantize_experts(fgu, torch.bfloat16), K8.dequantize_experts(fd, torch.bfloat16)
        t_bf16 = min(bench(lambda plan=kmoe.experts_plan(x, ids, wts, wgu, None, wd, None, ACT, False, path):
                           plan(x, ids, wts, wgu, None, wd, None)) for path in ("sorted", "sorted_tma"))
        del wgu, wd
        flag = "" if max(e_ptr, e_tma) < 2e-2 else "  <-- ERROR above 2e-2"
        print(f"{name:14s} {T:5d} {T * k / min(E, T * k):6.0f} | {t_ptr:10.1f} {t_tma:8.1f} {t_ptr / t_tma:7.2f} | "
              f"{t_bf16:8.1f} {t_bf16 / t_tma:8.2f} {t_bf16 / t_ptr:8.2f} | {e_ptr:8.1e} {e_tma:8.1e} {same:8.1e}{flag}",
              flush=True)
        if T == 2048:
            grid_cases[name] = (x, ids, wts, fgu, fd)
        else:
            del x, ids, wts, fgu, fd
        torch.cuda.empty_cache()

    # -- each TMA kernel alone at T = 2048 over a small grid (BLOCK_K 128: one K step, one scale block) -----------
    combos = [(64, 128, 4, 3), (64, 128, 4, 4), (64, 64, 8, 3), (64, 64, 4, 3), (64, 128, 8, 3), (128, 64, 8, 3),
              (128, 128, 8, 3), (64, 64, 8, 4), (128, 64, 4, 3), (128, 128, 8, 4), (64, 128, 8, 4), (128, 64, 8, 4),
              (64, 64, 4, 4), (128, 64, 4, 4), (128, 128, 4, 3), (128, 128, 4, 4)]  # most promising first
    print("\n# each kernel alone, T = 2048 (µs; pointer: FP8_W8A8's config; err: the whole op with that tile vs "
          "float64)")
    for name, (x, ids, wts, fgu, fd) in grid_cases.items():
        E, H, I = fd.w.shape
        k = ids.shape[1]
        xq, xs = K8.quantize_rows(x)
        base = {}
        for bm in (64, 128):
            routing = moe_align(ids, E, bm)
            h = kmoe.moe_gate_up(xq, routing, fgu.w, None, ACT, I, False, {**kmoe.moe_tuning.FP8_W8A8["gate_up"],
                                 "BLOCK_M": bm}, scale=fgu, xs=xs, out_dtype=x.dtype)
            hq, hs = K8.quantize_rows(h)
            base[bm] = (routing, hq, hs)
        routing, hq, hs = base[64]
        pg = kmoe.moe_tuning.FP8_W8A8["gate_up"]
        pd = kmoe.moe_tuning.FP8_W8A8["down"]
        t_pg = bench(lambda: kmoe.moe_gate_up(xq, routing, fgu.w, None, ACT, I, False, pg, scale=fgu, xs=xs,
                                              out_dtype=x.dtype))
        t_pd = bench(lambda: kmoe.moe_down(hq, routing, wts, fd.w, None, pd, fd, hs))
        print(f"{name}: pointer gate/up {t_pg:.1f}, pointer down {t_pd:.1f}")
        print(f"  {'BM':>3s} {'BN':>3s} {'w':>1s} {'st':>2s} | {'gate/up':>8s} {'down':>8s} | {'err':>7s}")
        for bm, bn, w, st in combos:
            if left() < 0:
                print("  (rest of the grid skipped: over the time budget)")
                break
            cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": 128, "num_warps": w, "num_stages": st}
            routing, hq, hs = base[bm]
            try:
                t_g = bench(lambda: kmoe.moe_gate_up_tma(xq, routing, fgu.w, None, ACT, I, cfg, scale=fgu, xs=xs,
                                                         out_dtype=x.dtype))
                t_d = bench(lambda: kmoe.moe_down_tma(hq, routing, wts, fd.w, None, cfg, scale=fd, xs=hs))
                y = row("sorted_tma", x, ids, wts, fgu, fd, {"gate_up_tma": cfg, "down_tma": cfg})()
                rows = torch.arange(0, x.shape[0], 97, device=dev)
                e = err(y, reference(x, ids, wts, fgu, fd, rows), rows)
                print(f"  {bm:3d} {bn:3d} {w:1d} {st:2d} | {t_g:8.1f} {t_d:8.1f} | {e:7.1e}"
                      + ("  <-- ERROR" if e >= 2e-2 else ""), flush=True)
            except Exception as exc:  # e.g. out of shared memory
                print(f"  {bm:3d} {bn:3d} {w:1d} {st:2d} | failed: {type(exc).__name__}: {str(exc)[:80]}")
    print(f"# {time.time() - START:.0f} s")


if __name__ == "__main__":
    sys.exit(main())
