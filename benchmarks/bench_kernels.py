"""Kernel-level sweeps on the GPU, each printed as a short table: the evidence behind a kernel's defaults.

    python benchmarks/bench_kernels.py [act_mul] [small_m] [graph_gap] [overhead]

- act_mul: the act·mul kernel (tiled v1, flat v2 over BLOCK x num_warps) against Inductor's kernel for
  ``silu(g) * u``, at prefill sizes; µs and GB/s of the 3·M·I·2 bytes moved.
- small_m: every candidate of the dispatcher at M = 1-16 (SwiGLU, three sizes), against torch.compile; µs.
- graph_gap: at large M, the op inside a CUDA graph and with plain launches, beside its kernels without the op.
- overhead: the op's CPU cost per call without CUDA graphs (plain eager), and where it goes (cProfile).
CUDA-graph medians (``triton.testing.do_bench_cudagraph``) unless said; every output is checked.
"""

from __future__ import annotations

import cProfile
import functools
import io
import pstats
import sys
import time

import torch
import torch.nn.functional as F
from triton.testing import do_bench_cudagraph


def _us(fn, rep=50):
    fn()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def act_mul_sweep():
    from mlp_fuser.kernels.act_mul import act_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    compiled = torch.compile(lambda a, b: F.silu(a) * b, dynamic=False)
    variants = [("tiled v1", None)] + [(f"flat {b}/{w}", dict(BLOCK=b, num_warps=w))
                                       for b in (1024, 2048, 4096) for w in (4, 8)]
    rows = ["act_mul (silu·mul, bf16): µs (GB/s); 'inductor' = torch.compile of silu(g) * u",
            f"{'M x I':>14}" + "".join(f"{n:>18}" for n, _ in variants) + f"{'inductor':>18}"]
    for M, I in ((512, 11008), (2048, 11008), (8192, 11008), (2048, 14336), (8192, 14336)):
        a = torch.randn(M, I, device="cuda", generator=g, dtype=torch.bfloat16)
        b = torch.randn(M, I, device="cuda", generator=g, dtype=torch.bfloat16)
        ref = F.silu(a.float()) * b.float()
        gb = 3 * M * I * 2 / 1e9
        cells = []
        for _, flat in variants:
            if flat is None:  # force the tiled kernel: a column-strided view of the same values
                a2 = torch.empty(M, 2 * I, device="cuda", dtype=a.dtype)[:, ::2]
                a2.copy_(a)
                fn = functools.partial(act_mul, a2, b, "silu")
            else:
                fn = functools.partial(act_mul, a, b, "silu", flat=flat)
            ok = (fn().float() - ref).abs().max().item() <= 0.01 * ref.abs().max().item()
            us = _us(fn)
            cells.append(f"{us:8.1f} ({gb / us * 1e6 / 1e3:4.0f}){'' if ok else '!'}")
        us = _us(functools.partial(compiled, a, b))
        cells.append(f"{us:8.1f} ({gb / us * 1e6 / 1e3:4.0f})")
        rows.append(f"{f'{M} x {I}':>14}" + "".join(f"{c:>18}" for c in cells))
        print(rows[-1], flush=True)
    return rows


def small_m_sweep():
    from mlp_fuser import dispatch
    g = torch.Generator(device="cuda").manual_seed(1)
    impls = [i for i in dispatch.IMPLS if i.triton]
    names = [i.name for i in impls] + ["compile"]
    rows = ["the dispatcher's candidates at small M (SwiGLU bf16): µs",
            f"{'K x I, M':>18}" + "".join(f"{n:>20}" for n in names)]
    unfused = lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    compiled = torch.compile(unfused)
    for K, I in ((4096, 11008), (4096, 14336), (2048, 5632)):
        wg, wu = (torch.randn(I, K, device="cuda", generator=g, dtype=torch.bfloat16) / K**0.5 for _ in range(2))
        wd = torch.randn(K, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
        for M in (1, 2, 4, 8, 16):
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = unfused(x.double(), wg.double(), wu.double(), wd.double())
            bar = 1.25 * ((unfused(x, wg, wu, wd).double() - ref).norm() / ref.norm()).item()
            cells = []
            args = (x, wg, None, wu, None, wd, None, "silu")
            fns = [functools.partial(i.fn, *args) for i in impls]
            fns += [functools.partial(compiled, x, wg, wu, wd)]
            for fn in fns:
                try:
                    err = ((fn().double() - ref).norm() / ref.norm()).item()
                    cells.append(f"{_us(fn):.1f}{'' if err <= bar else '!'}")
                except Exception as e:  # report, go on
                    cells.append(f"ERR {type(e).__name__}")
            rows.append(f"{f'{K}x{I}, {M}':>18}" + "".join(f"{c:>20}" for c in cells))
            print(rows[-1], flush=True)
    return rows


def graph_gap():
    """Large M: the op timed inside a CUDA graph against plain launches, beside the same kernels called without
    the op, to see whether the op's wrapper or the graph costs time (SwiGLU 4096x11008 bf16)."""
    from triton.testing import do_bench

    from mlp_fuser import config, dispatch

    g = torch.Generator(device="cuda").manual_seed(3)
    K, I = 4096, 11008
    wg, wu = (torch.randn(I, K, device="cuda", generator=g, dtype=torch.bfloat16) / K**0.5 for _ in range(2))
    wd = torch.randn(K, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
    unfused = lambda x: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    compiled = torch.compile(unfused, dynamic=False)
    rows = ["graph vs plain at large M (SwiGLU 4096x11008 bf16): µs, graph / plain"]
    old = config.force_impl
    config.force_impl = "cublas_act_mul"
    try:
        for M in (2048, 8192):
            x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            variants = {
                "op (cublas_act_mul)": functools.partial(torch.ops.mlp_fuser.gated_mlp, x, wg, None, wu, None, wd,
                                                         None, "silu"),
                "impl fn, no op": functools.partial(dispatch.IMPLS_BY_NAME["cublas_act_mul"].fn, x, wg, None, wu,
                                                    None, wd, None, "silu"),
                "eager unfused": functools.partial(unfused, x),
                "compile unfused": functools.partial(compiled, x),
            }
            for name, fn in variants.items():
                fn()
                plain = do_bench(fn, rep=100, return_mode="median") * 1e3
                rows.append(f"  M={M:5d} {name:22} {_us(fn, rep=100):8.1f} / {plain:8.1f}")
                print(rows[-1], flush=True)
    finally:
        config.force_impl = old
    return rows


def overhead():
    """Host (CPU) time per call without CUDA graphs, SwiGLU 576x1536 bf16 (SmolLM2), M=1: launch-bound, so a tight
    loop of calls measures what the host spends on each (the GPU finishes each call's kernels sooner). The op is
    timed through each implementation and through the dispatcher's choice, beside the unfused module's aten calls
    and Inductor's generated code for them; then cProfile and torch.profiler show where the op's time goes."""
    from mlp_fuser import config, dispatch

    g = torch.Generator(device="cuda").manual_seed(2)
    K, I = 576, 1536
    x = torch.randn(1, K, device="cuda", generator=g, dtype=torch.bfloat16)
    wg, wu = (torch.randn(I, K, device="cuda", generator=g, dtype=torch.bfloat16) / K**0.5 for _ in range(2))
    wd = torch.randn(K, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
    wg, wu, wd = (torch.nn.Parameter(w) for w in (wg, wu, wd))  # as in a model: the weights require grad
    op = torch.ops.mlp_fuser.gated_mlp.default

    def unfused(x):
        return F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)

    compiled = torch.compile(unfused, dynamic=False)

    def forced(impl):
        def call():
            old, config.force_impl = config.force_impl, impl
            try:
                return op(x, wg, None, wu, None, wd, None, "silu")
            finally:
                config.force_impl = old
        return call

    rows = ["host time per call, no CUDA graph (SwiGLU 576x1536 bf16, M=1, weights require grad, no_grad): µs"]
    with torch.no_grad():
        op(x, wg, None, wu, None, wd, None, "silu")  # the dispatcher chooses here
        choice = dispatch.chosen(dispatch.Problem("cuda", x.dtype, 1, K, I, K, True))
        variants = [("unfused eager (5 aten calls)", lambda: unfused(x)),
                    ("unfused, torch.compile", lambda: compiled(x)),
                    (f"op, dispatcher's choice ({choice})", lambda: op(x, wg, None, wu, None, wd, None, "silu"))]
        variants += [(f"op, forced {i.name}", forced(i.name)) for i in dispatch.IMPLS]
        for label, fn in variants:
            for _ in range(100):
                fn()
            torch.cuda.synchronize()
            best = float("inf")
            for _ in range(5):
                t0 = time.perf_counter()
                for _ in range(400):
                    fn()
                best = min(best, (time.perf_counter() - t0) / 400 * 1e6)
                torch.cuda.synchronize()
            rows.append(f"  {label:44} {best:7.1f}")
            print(rows[-1], flush=True)
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(500):
            op(x, wg, None, wu, None, wd, None, "silu")
        prof.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(14)
        rows.append(s.getvalue())
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
            for _ in range(100):
                op(x, wg, None, wu, None, wd, None, "silu")
            torch.cuda.synchronize()
    rows.append(tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=50))
    return rows


if __name__ == "__main__":
    steps = sys.argv[1:] or ["act_mul", "small_m", "overhead"]
    out = []
    for step in steps:
        try:
            steps_by_name = {"act_mul": act_mul_sweep, "small_m": small_m_sweep, "graph_gap": graph_gap,
                             "overhead": overhead}
            out += steps_by_name[step]()
        except Exception:  # report, keep the other steps' numbers
            import traceback

            traceback.print_exc()
            out.append(f"{step}: failed (traceback above)")
    print("\n".join(out))
