"""Probe: the MoE router's softmax → top-k → renorm → cast as one Triton kernel, against what Inductor makes of it.

    python benchmarks/probe_router_topk.py            # H200: checks, then CUDA-graph medians (µs), a table last
    python benchmarks/probe_router_topk.py --tiny     # CPU, Triton interpreter, fp32: the checks only

A Qwen3-MoE-style router (``Qwen3MoeTopKRouter.forward``: ``F.linear``, ``softmax(dtype=float)``, ``topk``, the
top-k weights divided by their sum, cast back) at decode sizes. In a static-cache decode step the top-k alone took
9.3 µs per layer (a gather and a bitonic sort kernel); the prediction for the fused kernel after cuBLAS's GEMV is
8–10 µs less per layer. Variants, each captured in a CUDA graph: ``eager`` (the aten ops), ``inductor``
(``torch.compile`` of the router, no CUDA graphs of its own), ``fused`` (``F.linear`` then the kernel below).
Checked against float64 top-k of the same logits: the k largest, in order, and the weights (relative 1e-5 in fp32;
bf16 outputs: their rounding).
"""

from __future__ import annotations

import os
import sys

TINY = "--tiny" in sys.argv
if TINY:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

# (H, E, k): Qwen3-30B-A3B, Mixtral-8x7B, DeepSeek-V3's shape (its sigmoid routing differs; the shape is what counts)
SIZES = {"qwen3-30b-a3b": (2048, 128, 8), "mixtral-8x7b": (4096, 8, 2), "e256-k8": (7168, 256, 8)}
TINY_SIZES = {"tiny-128": (64, 128, 8), "tiny-8": (32, 8, 2), "tiny-60": (48, 60, 4)}
DEV, DTYPE = ("cpu", torch.float32) if TINY else ("cuda", torch.bfloat16)


@triton.jit
def _router_topk_kernel(logits_ptr, wts_ptr, ids_ptr, T, E, stride_t,
                        K_TOP: tl.constexpr, RENORM: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr,
                        BLOCK_K: tl.constexpr):
    # BLOCK_T tokens per program, each row of E logits whole in registers; k passes of "take the largest".
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    cols = tl.arange(0, BLOCK_E)
    valid = (rows[:, None] < T) & (cols[None, :] < E)
    x = tl.load(logits_ptr + rows[:, None] * stride_t + cols[None, :], mask=valid, other=float("-inf")).to(tl.float32)
    x = tl.where(rows[:, None] < T, x, 0.0)  # rows past T: no -inf - -inf
    p = tl.exp(x - tl.max(x, 1)[:, None])
    p = tl.where(valid, p, 0.0)
    total = tl.sum(p, 1)
    p = p / tl.where(total > 0, total, 1.0)[:, None]  # rows past T sum to 0
    p = tl.where(valid, p, -1.0)  # below every probability: never taken
    slots = tl.arange(0, BLOCK_K)
    vals = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float32)
    idx = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int32)
    for j in tl.static_range(K_TOP):
        v = tl.max(p, 1)
        first = tl.min(tl.where(p == v[:, None], cols[None, :], BLOCK_E), 1)  # the first index holding the max
        vals = tl.where(slots[None, :] == j, v[:, None], vals)
        idx = tl.where(slots[None, :] == j, first[:, None], idx)
        p = tl.where(cols[None, :] == first[:, None], -1.0, p)
    if RENORM:
        vals = vals / tl.sum(vals, 1)[:, None]
    out = rows[:, None] * K_TOP + slots[None, :]
    keep = (rows[:, None] < T) & (slots[None, :] < K_TOP)
    tl.store(wts_ptr + out, vals.to(wts_ptr.dtype.element_ty), mask=keep)
    tl.store(ids_ptr + out, idx.to(tl.int64), mask=keep)


def router_topk(logits, k, renorm=True):
    """(weights (T, k) in the logits' dtype, ids (T, k) int64): softmax in fp32, top k, renormalised."""
    T, E = logits.shape
    wts = torch.empty((T, k), dtype=logits.dtype, device=logits.device)
    ids = torch.empty((T, k), dtype=torch.int64, device=logits.device)
    BLOCK_E = triton.next_power_of_2(E)
    BLOCK_T = max(1, min(triton.next_power_of_2(T), 4096 // BLOCK_E))
    _router_topk_kernel[(triton.cdiv(T, BLOCK_T),)](logits, wts, ids, T, E, logits.stride(0), K_TOP=k, RENORM=renorm,
                                                    BLOCK_T=BLOCK_T, BLOCK_E=BLOCK_E,
                                                    BLOCK_K=triton.next_power_of_2(k), num_warps=4)
    return wts, ids


def router_torch(x, w, k, renorm=True):
    """transformers' Qwen3MoeTopKRouter.forward, without the module."""
    logits = F.linear(x, w)
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, k, dim=-1)
    if renorm:
        top = top / top.sum(dim=-1, keepdim=True)
    return top.to(logits.dtype), ids


def router_fused(x, w, k, renorm=True):
    return router_topk(F.linear(x, w), k, renorm)


def check(name, fn, x, w, k, exact=True):
    """Relative error of ``fn``'s weights against float64 top-k of the same logits (``F.linear`` as every variant
    runs it, so only what comes after it is compared). ``exact``: the ids must pick the k largest logits, in order
    (among equal logits any one, as torch.topk); else (Inductor, whose GEMM may round otherwise) only the weights."""
    wts, ids = fn(x, w, k)
    logits = F.linear(x, w).double()
    top, _ = torch.topk(logits, k, dim=-1)
    ref = torch.topk(torch.softmax(logits, -1), k, dim=-1).values
    ref = ref / ref.sum(-1, keepdim=True)
    if exact:
        assert torch.equal(logits.gather(1, ids), top), f"{name}: not the k largest logits in order"
        assert (ids.sort(1).values.diff(dim=1) != 0).all(), f"{name}: an expert taken twice"
    err = ((wts.double() - ref).abs().max() / ref.abs().max()).item()
    bar = (1e-5 if wts.dtype == torch.float32 else 8e-3) * (1 if exact else 2)
    assert err < bar, f"{name}: weights off by {err:.1e}"
    return err


def main() -> int:
    torch._dynamo.config.recompile_limit = 64  # one compiled router per shape
    rows = []
    for size, (H, E, k) in (TINY_SIZES if TINY else SIZES).items():
        for T in (1, 3, 8) if TINY else (1, 8, 32, 128):
            gen = torch.Generator().manual_seed(T * 1000 + E)
            x = torch.randn(T, H, generator=gen).to(DTYPE).to(DEV)
            w = (torch.randn(E, H, generator=gen) / H**0.5).to(DTYPE).to(DEV)
            fns = {"eager": router_torch, "fused": router_fused}
            if not TINY:
                fns["inductor"] = torch.compile(router_torch, fullgraph=True, dynamic=False)
            errs = {n: check(n, f, x, w, k, exact=n != "inductor") for n, f in fns.items()}
            times = {}
            if not TINY:
                from triton.testing import do_bench_cudagraph

                calls = {n: (lambda f=f, x=x, w=w, k=k: f(x, w, k)) for n, f in fns.items()}
                calls["linear alone"] = lambda x=x, w=w: F.linear(x, w)
                for n, call in calls.items():
                    times[n] = do_bench_cudagraph(call, rep=50, return_mode="median") * 1e3
            rows.append((size, T, times, errs))
            print(f"{size} T={T}: " + ", ".join(f"{n} {t:.1f} µs" for n, t in times.items())
                  + "; errors " + ", ".join(f"{n} {e:.1e}" for n, e in errs.items()), flush=True)
    if not TINY:
        print("\n| size | T | eager | inductor | fused | linear alone | inductor / fused |")
        print("|---|---|---|---|---|---|---|")
        for size, T, t, _ in rows:
            print(f"| {size} | {T} | {t['eager']:.1f} | {t['inductor']:.1f} | {t['fused']:.1f} | "
                  f"{t['linear alone']:.1f} | {t['inductor'] / t['fused']:.2f}× |")
    print("router top-k probe: every variant checked against float64")
    return 0


if __name__ == "__main__":
    sys.exit(main())
