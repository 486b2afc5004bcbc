"""Kernel-level sweeps on the GPU, each printed as a short table: the evidence behind a kernel's defaults.

    python benchmarks/bench_kernels.py [act_mul] [small_m] [graph_gap] [overhead] [down] [fp8_small]
        [fp8_experts[:T,...]] [fp8_experts_one[:T,...]] [fp8_experts_tma[:T,...]]

- act_mul: the act·mul kernel (tiled v1, flat v2 over BLOCK x num_warps) against Inductor's kernel for
  ``silu(g) * u``, at prefill sizes; µs and GB/s of the 3·M·I·2 bytes moved.
- small_m: every candidate of the dispatcher at M = 1-16 (SwiGLU, three sizes), against torch.compile; µs.
- graph_gap: at large M, the op inside a CUDA graph and with plain launches, beside its kernels without the op.
- overhead: the op's CPU cost per call without CUDA graphs (plain eager), and where it goes (cProfile).
- down: the down projection alone at M = 1-128 (y = h @ w_downᵀ, K = the MLP's I): cuBLAS (F.linear) against
  ``linear_splitk`` (swap-AB) with its default config and a grid of (BLOCK_N, BLOCK_K, SPLIT_K,
  stages); µs and % of the
  floor (w_down once at the measured copy bandwidth). Which config, if any, beats cuBLAS where the MLP's rows are
  furthest from the floor.
- fp8_experts[:T,...]: the FP8 routed experts' sorted grouped GEMMs (Qwen3-30B-A3B: H 2048, I 768, 128 experts,
  top 8, 128 × 128 block scales) at T = 8, 512, 2048 tokens, W8A8 and W8A16: the default configs against a grid of
  (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) for gate/up (down at its default) and for down (gate/up at its
  default); µs of the whole op (routing sort, both GEMMs, combine), each output checked against float64.
- fp8_experts_one[:T,...]: the same experts at one token (or the T given) through the dispatcher's one-token paths,
  unsorted and unsorted_pdl (every pair its own 16-row block, down+combine in one launch), W8A8 and W8A16: the
  default configs against a grid of (BLOCK_N, BLOCK_K, warps, stages) per launch, the other at its default; gate/up
  BLOCK_N 16/32/64, down 32/64/128, each with (BLOCK_K, warps) 128/4, 128/8 (and 64/4 for W8A16) and 3 or 6
  stages: 12 (W8A8) or 18 (W8A16) configs a launch, 124 timings a T (≈ 1 s each with its compile, as fp8_experts
  ran: ≈ 130 s on an H100 at T = 1); µs and % of the floor, each output checked against float64 as fp8_experts is.
- fp8_experts_tma[:T,...]: the FP8 experts' TMA GEMMs (sorted_tma, W8A8) each alone at T = 512 and 2048 tokens,
  Qwen3-30B-A3B's and Mixtral-8x7B's dims: per BLOCK_M (64 or 128, which the two launches share through the sort) the
  best of a few gate/up and down configs, their sum against the defaults' (``moe_tuning.fp8_tma_config``); and where
  the best gate/up tile is 128 columns, gate/up with h quantized in its epilogue (``config.fp8_fused_h``) against
  gate/up then ``quantize_rows``. µs; every output checked against the default config's (the fused h: its bits).
- fp8_small: the FP8 W8A8 split-K kernel at M = 1 and 16 (x quantized in the GEMM), LLaMA-3-8B's gate/up (gated,
  one launch) and down, 128 × 128 block scales: the default config against a grid of (BLOCK_N, SPLIT_K, warps,
  stages); µs and % of the floor (the float8 weights, scales, x and y once at the measured copy bandwidth).
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
from own_code import own_function
from triton.testing import do_bench_cudagraph


def _us(fn, rep=50):
    fn()
    return do_bench_cudagraph(fn, rep=rep, return_mode="median") * 1e3


def act_mul_sweep():
    from mlp_fuser.kernels.act_mul import act_mul

    g = torch.Generator(device="cuda").manual_seed(0)
    compiled = torch.compile(own_function(lambda a, b: F.silu(a) * b), dynamic=False)
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
    from mlp_fuser.dispatch import dense as dispatch
    g = torch.Generator(device="cuda").manual_seed(1)
    impls = [i for i in dispatch.IMPLS if i.triton]
    names = [i.name for i in impls] + ["compile"]
    rows = ["the dispatcher's candidates at small M (SwiGLU bf16): µs",
            f"{'K x I, M':>18}" + "".join(f"{n:>20}" for n in names)]
    unfused = lambda x, wg, wu, wd: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    compiled = torch.compile(own_function(unfused))
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

    from mlp_fuser import config
    from mlp_fuser.dispatch import dense as dispatch

    g = torch.Generator(device="cuda").manual_seed(3)
    K, I = 4096, 11008
    wg, wu = (torch.randn(I, K, device="cuda", generator=g, dtype=torch.bfloat16) / K**0.5 for _ in range(2))
    wd = torch.randn(K, I, device="cuda", generator=g, dtype=torch.bfloat16) / I**0.5
    unfused = lambda x: F.linear(F.silu(F.linear(x, wg)) * F.linear(x, wu), wd)  # noqa: E731
    compiled = torch.compile(own_function(unfused), dynamic=False)
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


def _host_times(module, patched, w, x):
    """(label, implementation chosen or "", host µs per call) for each variant of ``overhead`` at one shape and M."""
    import mlp_fuser
    from mlp_fuser import config
    from mlp_fuser.dispatch import dense as dispatch
    from mlp_fuser.kernels import common

    op = torch.ops.mlp_fuser.gated_mlp.default
    M, K, I = x.shape[0], x.shape[-1], w[0].shape[0]

    def unfused(x):
        return F.linear(F.silu(F.linear(x, w[0])) * F.linear(x, w[2]), w[4])

    compiled = torch.compile(own_function(unfused), dynamic=False)
    # the same function through mlp_fuser's backend: Inductor's code calls the op's entry directly, or (the direct
    # call off while it compiles, Inductor's cache off so the other graph's code cannot answer) the registered op;
    # each its own backend object and code object (own_code.py), so that Dynamo keeps their graphs apart
    fused = torch.compile(own_function(unfused), backend=mlp_fuser.make_backend(), dynamic=False)
    fused_dispatcher = torch.compile(own_function(unfused), backend=mlp_fuser.make_backend(), dynamic=False)

    def with_setting(name, value, fn):
        """``fn`` run with ``mlp_fuser.config.<name>`` set to ``value`` (restored after each call)."""
        def call():
            old = getattr(config, name)
            setattr(config, name, value)
            try:
                return fn()
            finally:
                setattr(config, name, old)
        return call

    def forced(impl):
        return with_setting("force_impl", impl, lambda: op(x, *w, "silu"))

    def no_plans(fn):
        return with_setting("plans", False, fn)

    out = []
    with torch.no_grad():
        op(x, *w, "silu")
        patched(x)
        fused(x)
        with torch._inductor.config.patch(fx_graph_cache=False):  # compiled here, with the direct call off
            with_setting("inductor_direct", False, lambda: fused_dispatcher(x))()
        p = dispatch.Problem("cuda", x.dtype, M, K, I, K, True, "silu")
        variants = [("module, unfused (3 nn.Linear, silu, mul)", "", lambda: module(x)),
                    ("module, patched", dispatch.chosen(p, eager=True), lambda: patched(x)),
                    ("module, patched, no launch plans", "", no_plans(lambda: patched(x))),
                    ("op via torch.ops", dispatch.chosen(p), lambda: op(x, *w, "silu")),
                    ("op via torch.ops, no launch plans", "", no_plans(lambda: op(x, *w, "silu"))),
                    ("unfused aten calls", "", lambda: unfused(x)),
                    ("unfused, torch.compile (guards included)", "", lambda: compiled(x)),
                    ("torch.compile, mlp_fuser backend (Inductor's code calls the op's entry)",
                     dispatch.chosen(p, eager=True), lambda: fused(x)),
                    ("torch.compile, mlp_fuser backend, through the dispatcher", "", lambda: fused_dispatcher(x))]
        # every implementation that can run this problem (quack's need gate and up stored as one, M > 64, ...)
        variants += [(f"op, forced {i.name}", "", forced(i.name)) for i in dispatch.IMPLS if i.why_not(p) is None]
        variants += [("module, patched, plans calling Triton's Python launcher", "", lambda: patched(x)),
                     ("module, patched (again, after the row above)", "", lambda: patched(x))]
        forms = common.compat.LAUNCH_FORMS
        for label, choice, fn in variants:
            if label.startswith(("module, patched, plans calling", "module, patched (again")):
                common.compat.LAUNCH_FORMS = {} if "Python launcher" in label else forms
                dispatch.clear_plans()  # rebuilt by the first call below, with or without the C launch function
            for _ in range(20):
                fn()
            samples = []
            for _ in range(7):
                torch.cuda.synchronize()
                torch.cuda._sleep(10_000_000)  # ~5 ms: longer than the host needs to queue 20 calls
                t0 = time.perf_counter()
                for _ in range(20):
                    fn()
                samples.append((time.perf_counter() - t0) / 20 * 1e6)
            torch.cuda.synchronize()
            out.append((label, choice, sorted(samples)[3]))
    common.compat.LAUNCH_FORMS = forms
    return out


def overhead(only: str = ""):
    """Host (CPU) time per call without CUDA graphs, for SmolLM2's, a 1B-class and LLaMA-3-8B's SwiGLU, bf16, at
    M = 1 and 8. Each sample queues 20 calls while the GPU sleeps on a spin kernel, so the host's time to issue them
    is measured whatever the GPU's (the 8B MLP takes the GPU longer than the host). Rows: the unfused module
    (nn.Linear x3, as in LLaMA), the same module patched (mlp_fuser.patch: the op's eager entry), the op through
    torch.ops (what torch.compile's code calls) with the dispatcher's choice and each implementation forced, the
    unfused aten calls and Inductor's code for them (a torch.compile'd function: Dynamo's guards included). Then
    cProfile and torch.profiler of the patched module at SmolLM2's size, M=1. ``only``: the shapes whose name starts
    with it (``overhead:SmolLM2``), and after an ``@`` the M values instead of 1 and 8 (``overhead:1B@2048``: the
    1B prefill's MLP call). The patched module is timed twice more: with its plans calling Triton's Python
    launcher instead of its C launch function (``kernels.common.launch_source`` without the forms it knows), and
    with the plans back as they are (so the two differ by that alone, in turns)."""
    from torch import nn

    import mlp_fuser

    class MLP(nn.Module):  # LlamaMLP's forward
        def __init__(self, K, I):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(K, I, bias=False), nn.Linear(K, I, bias=False)
            self.down_proj = nn.Linear(I, K, bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    torch._dynamo.config.recompile_limit = 64  # three compiled functions per shape and M share one code object
    op = torch.ops.mlp_fuser.gated_mlp.default
    shapes = [("SmolLM2 576x1536", 576, 1536), ("1B 2048x5632", 2048, 5632), ("8B 4096x14336", 4096, 14336)]
    only, _, ms = only.partition("@")
    shapes = [s for s in shapes if s[0].startswith(only)]
    table: dict[str, dict[str, float]] = {}
    cols, profiles = [], []  # profiles: SmolLM2's, where it is timed
    for name, K, I in shapes:
        torch.manual_seed(0)
        module = MLP(K, I).to("cuda", torch.bfloat16)
        patched = MLP(K, I).to("cuda", torch.bfloat16)
        patched.load_state_dict(module.state_dict())
        mlp_fuser.patch(patched)
        w = (module.gate_proj.weight, None, module.up_proj.weight, None, module.down_proj.weight, None)
        for M in [int(m) for m in ms.split(",")] if ms else (1, 8):
            col = f"{name.split()[0]} M={M}"
            cols.append(col)
            x = torch.randn(M, 1, K, device="cuda", dtype=torch.bfloat16)
            for label, choice, us in _host_times(module, patched, w, x):
                table.setdefault(label, {})[col] = us
                if choice:
                    table[label][col + " choice"] = choice
                print(f"  {col:12} {label:50} {us:7.1f} µs {choice}", flush=True)
        if name.startswith("SmolLM2"):
            x = torch.randn(1, 1, K, device="cuda", dtype=torch.bfloat16)
            with torch.no_grad():
                prof = cProfile.Profile()
                prof.enable()
                for _ in range(500):
                    patched(x)
                prof.disable()
                torch.cuda.synchronize()
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(14)
                from torch.profiler import ProfilerActivity, profile

                with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as tprof:
                    for _ in range(100):
                        op(x, *w, "silu")
                    torch.cuda.synchronize()
            profiles = [text.getvalue(), tprof.key_averages().table(sort_by="self_cpu_time_total", row_limit=14,
                                                                    max_name_column_width=50)]
    rows = ["host µs per call, no CUDA graph, bf16 SwiGLU, GPU asleep while the calls are queued (median of 7 x 20 "
            "calls); [the implementation chosen]", "| variant | " + " | ".join(cols) + " |",
            "|---|" + "---|" * len(cols)]
    for key, vals in table.items():
        cells = [f"{vals[c]:.1f}" + (f" [{vals[c + ' choice']}]" if c + " choice" in vals else "") if c in vals
                 else "" for c in cols]
        rows.append(f"| {key} | " + " | ".join(cells) + " |")
    return profiles + rows


def _splitk_us(h, w, ref, tol, config):
    """µs of ``linear_splitk(h, w)`` with ``config``, or None when its output (poisoned first) is not within
    ``tol`` of ``ref`` (float64) in relative error."""
    from mlp_fuser.kernels.splitk import linear_splitk
    from mlp_fuser.reference import rel_err

    y = torch.full((h.shape[0], w.shape[0]), float("nan"), device="cuda", dtype=h.dtype)
    fn = functools.partial(linear_splitk, h, w, None, config, out=y)
    fn()
    if not rel_err(y, ref) <= tol:
        return None
    return _us(fn)


def down_sweep(shapes=((4096, 11008), (3584, 18944), (8192, 3584)), ms=(1, 16, 32, 64, 128)):
    """The down projection: cuBLAS against linear_splitk's default and a grid of configs (see the module doc)."""
    from mlp_fuser.kernels.splitk import splitk_config
    from mlp_fuser.reference import rel_err
    from mlp_fuser.tools.bench import measure_ceilings

    _, tbps = measure_ceilings()
    g = torch.Generator(device="cuda").manual_seed(0)
    grid = [(bn, bk, split, stages) for bn in (64, 128) for bk in (128, 256) for split in (2, 4, 6, 8, 12, 16)
            for stages in (3, 4) if not (bk == 256 and stages == 4)]
    rows = [f"down projection, bf16, CUDA-graph µs (% of the floor: w_down once at {tbps:.2f} TB/s); best of "
            f"{len(grid)} configs (BLOCK_N, BLOCK_K, SPLIT_K, stages)",
            "| N, K | M | floor | cuBLAS | splitk default (config) | best splitk (config) | best / cuBLAS |",
            "|---|---|---|---|---|---|---|"]
    for N, K in shapes:
        w = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16) / K ** 0.5
        for M in ms:
            h = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
            ref = h.double() @ w.double().t()
            tol = 1.25 * rel_err(F.linear(h, w), ref) + 1e-6
            floor = (N * K + M * K + M * N) * 2 / (tbps * 1e12) * 1e6

            timed = functools.partial(_splitk_us, h, w, ref, tol)
            cublas = _us(functools.partial(F.linear, h, w))
            default = splitk_config(M, N, K, h.element_size(), h.device)
            d_us = timed(default)
            bm, warps = default[0], default[4]
            best = None
            for bn, bk, split, stages in grid:
                try:
                    us = timed((bm, bn, bk, split, warps, stages))
                except Exception as e:  # out of shared memory, ...: skip the config
                    print(f"  {N}x{K} M={M} {(bn, bk, split, stages)}: {type(e).__name__}", file=sys.stderr)
                    continue
                if us is not None and (best is None or us < best[0]):
                    best = (us, (bn, bk, split, stages))
            cell = "-" if d_us is None else f"{d_us:.1f} ({100 * floor / d_us:.0f}%)"
            b_cell = "-" if best is None else f"{best[0]:.1f} ({100 * floor / best[0]:.0f}%) {best[1]}"
            ratio = "-" if best is None else f"{cublas / best[0]:.3f}x"
            rows.append(f"| {N}, {K} | {M} | {floor:.1f} | {cublas:.1f} ({100 * floor / cublas:.0f}%) | {cell} "
                        f"{default[1:4]} | {b_cell} | {ratio} |")
            print(rows[-1], flush=True)
    return rows


def _default_vs_best(d_us, dflt, got, floor=None) -> str:
    """A sweep row's cells: the default's µs and config, the best of ``got`` [(µs, config)], their ratio, the next
    two; with ``floor`` (µs) each time's % of it too."""
    def us(t):
        return f"{t:.1f}" if floor is None else f"{t:.1f} ({100 * floor / t:.0f}%)"
    got = sorted(got)
    cell = "-" if d_us is None else f"{us(d_us)} {dflt}"
    best = "-" if not got else f"{us(got[0][0])} {got[0][1]}"
    ratio = "-" if not got or d_us is None else f"{d_us / got[0][0]:.3f}x"
    more = ", ".join(f"{u:.1f} {c}" for u, c in got[1:3])
    return f"{cell} | {best} | {ratio} | {more}"


def _fp8_cfg_us(x, w, up, act, ref, label, cfg):
    """µs of one FP8 W8A8 plan with ``cfg``, or None when its output is not within 2e-2 of ``ref`` (float64)."""
    from mlp_fuser.kernels import fp8
    from mlp_fuser.reference import rel_err

    plan = fp8.linear_plan(x, w, up, None, act, True, cfg)
    fn = functools.partial(plan, x, w, up, None)  # a fresh output each call
    if not (err := rel_err(fn(), ref)) <= 2e-2:
        print(f"  {label} {cfg}: error {err:.2e}", file=sys.stderr)
        return None
    return _us(fn)


def fp8_small_sweep(H=4096, I=14336, ms=(1, 16), device="cuda", limit=None):
    """The FP8 decode kernels' configs (see the module doc): the default against the grid, per launch and M."""
    from mlp_fuser.kernels import fp8
    from mlp_fuser.tools.bench_fp8 import copy_bandwidth

    tbps = copy_bandwidth(device) / 1e12
    g = torch.Generator(device=device).manual_seed(0)

    def weight(n, k):
        q, sc = fp8.quantize_blocks(torch.randn(n, k, device=device, generator=g) / k ** 0.5)
        return fp8.fp8_weight(q, sc, (128, 128))

    wg, wu, wd = weight(I, H), weight(I, H), weight(H, I)
    launches = {"gate_up": (H, wg, wu, "silu"), "down": (I, wd, None, None)}
    grid = {"gate_up": [(bn, split, warps, stages) for bn in (32, 64, 128) for split in (1, 2, 3)
                        for warps in (4, 8) for stages in (3, 4, 6) if not (bn == 128 and stages == 6)],
            "down": [(bn, split, warps, stages) for bn in (16, 32, 64, 128) for split in (2, 4, 6, 8, 12, 16)
                     for warps in (4,) for stages in (3, 4, 6) if not (bn == 128 and stages == 6)]}
    rows = [f"FP8 W8A8 decode kernels (LLaMA-3-8B MLP, 128 x 128 blocks), CUDA-graph µs (% of the floor at "
            f"{tbps:.2f} TB/s); configs (BLOCK_N, SPLIT_K, warps, stages)",
            "| launch | M | floor | default (config) | best (config) | best / default | 2nd, 3rd |",
            "|---|---|---|---|---|---|---|"]
    for name, (K, w, up, act) in launches.items():
        N = w.w.shape[0]
        for M in ms:
            x = torch.randn(M, K, device=device, generator=g, dtype=torch.bfloat16)
            xq, xs = fp8.quantize_rows_reference(x)
            xd = (xq.double().view(M, -1, 128) * xs.double()[..., None]).view(M, K)
            ref = xd @ fp8.dequantize(w, torch.float64).t()
            if up is not None:
                ref = torch.nn.functional.silu(ref) * (xd @ fp8.dequantize(up, torch.float64).t())
            nbytes = (1 + (up is not None)) * (N * K + w.scale.numel() * 4) + M * K * 2 + M * N * 2
            floor = nbytes / (tbps * 1e12) * 1e6
            default = fp8.default_config(M, N, K, up is not None, True, x.device)

            timed = functools.partial(_fp8_cfg_us, x, w, up, act, ref, f"{name} M={M}")
            d_us = timed(default)
            got = []
            for bn, split, warps, stages in grid[name][:limit]:
                cfg = default._replace(block_n=bn, split_k=split, num_warps=warps, num_stages=stages)
                try:
                    us = timed(cfg)
                except Exception as e:  # out of shared memory, ...: skip the config
                    print(f"  {name} M={M} {(bn, split, warps, stages)}: {type(e).__name__}", file=sys.stderr)
                    continue
                if us is not None:
                    got.append((us, (bn, split, warps, stages)))
            dflt = (default.block_n, default.split_k, default.num_warps, default.num_stages)
            rows.append(f"| {name} | {M} | {floor:.1f} | {_default_vs_best(d_us, dflt, got, floor)} |")
            print(rows[-1], flush=True)
    return rows


def _experts_grid(bucket: int, kind: str, a8: bool) -> list[tuple]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages) tried for a launch at a rows-per-expert bucket."""
    bms = {16: (16,), 64: (32, 64), 128: (64, 128)}[bucket]
    bns = (32, 64, 128) if kind == "gate_up" else (64, 128, 256)
    bks = (128,) if a8 else (64, 128)
    return [(bm, bn, bk, w, st) for bm in bms for bn in bns for bk in bks for w in (4, 8) for st in (3, 4, 5)
            if not (bm * bn >= 128 * 256 and st > 3) and not (bm <= 32 and w == 8)
            and not (bk == 128 and bn == 256 and st > 3)]


def _fp8_experts_setup(dims, device):
    """The FP8 experts sweeps' (setup, generator, timed): ``bench_fp8.Experts`` (bf16 on the GPU, fp16 under the
    interpreter) and ``timed(x, ids, wts, ref, path, configs, a8, label)``, µs of the op through ``path`` under
    ``configs``, or None where it fails or its error passes 1.2 x the first one's at its (T, a8) (the default
    configs', timed first)."""
    from mlp_fuser.dispatch.experts import expert_act
    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.kernels import moe as kmoe
    from mlp_fuser.reference import Gate, rel_err
    from mlp_fuser.tools.bench_fp8 import BLOCK, Experts

    g = torch.Generator(device=device).manual_seed(0)
    setup = Experts(dims, device, torch.bfloat16 if device == "cuda" else torch.float16, g)
    fgu = K8.fp8_experts(setup.wgu, setup.sgu, BLOCK, gated=True)
    fd = K8.fp8_experts(setup.wd, setup.sd, BLOCK)
    act = expert_act(Gate("silu"))
    tol = {}  # per (T, a8): 1.2 x the default configs' error against float64 (x's quantization dominates it)

    def timed(x, ids, wts, ref, path, configs, a8, label):
        key = (x.shape[0], a8)
        try:
            plan = kmoe.experts_plan(x, ids, wts, fgu.w, None, fd.w, None, act, False, path, configs,
                                     scales=(fgu, fd), a8=a8)
            fn = functools.partial(plan, x, ids, wts, fgu.w, None, fd.w, None, (fgu, fd))
            err = rel_err(fn(), ref)
            tol.setdefault(key, min(1.2 * err, 0.1))
            if not err <= tol[key]:
                print(f"  {label}: error {err:.2e} > {tol[key]:.2e}", file=sys.stderr)
                return None
            return _us(fn, rep=30)
        except Exception as e:  # out of shared memory, a shape the kernel refuses: skip the config
            print(f"  {label}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            return None

    return setup, g, timed


def _cfg_tuple(c: dict, keys=("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")) -> tuple:
    return tuple(c[k] for k in keys)


def _fp8_defaults(dims, a8: bool, T: int, x) -> dict:
    """The FP8 experts' default configs per launch ({"gate_up": ..., "down": ...}) at T tokens."""
    from mlp_fuser.kernels import moe as kmoe

    H, I, E, k = dims
    return {kind: kmoe._fp8_config(kind, None, a8, T, k, E, H, I, x) for kind in ("gate_up", "down")}


def fp8_experts_sweep(ts: str = "8,512,2048", device="cuda", dims=(2048, 768, 128, 8), limit=None):
    """The FP8 experts' grouped GEMM configs (see the module doc): the default against the grid, per launch, T, a8."""
    from mlp_fuser.kernels import moe as kmoe

    _, _, E, k = dims
    setup, g, timed = _fp8_experts_setup(dims, device)
    rows = ["FP8 routed experts, sorted grouped GEMMs (Qwen3-30B-A3B dims, 128 x 128 blocks), CUDA-graph µs of the "
            "whole op; configs (BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)",
            "| T | a8 | launch | default µs (config) | best µs (config) | best / default | 2nd, 3rd |",
            "|---|---|---|---|---|---|---|"]
    for T in (int(t) for t in ts.split(",")):
        x, ids, wts = setup.inputs(T, g)
        ref = setup.reference(x, ids, wts)
        bucket = kmoe.rows_bucket(T, k, E)
        for a8 in (True, False):
            defaults = _fp8_defaults(dims, a8, T, x)
            d_us = timed(x, ids, wts, ref, "sorted", defaults, a8, f"T={T} a8={a8} default")
            for kind in ("gate_up", "down"):
                got = []
                grid = _experts_grid(bucket, kind, a8)[:limit]
                if kind == "down":  # the sort's blocks are gate/up's BLOCK_M: down shares them
                    grid = [c for c in grid if c[0] == defaults["gate_up"]["BLOCK_M"]]
                for bm, bn, bk, warps, stages in grid:
                    cfg = {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}
                    other = "down" if kind == "gate_up" else "gate_up"
                    configs = {kind: cfg, other: {**defaults[other], "BLOCK_M": bm}}
                    us = timed(x, ids, wts, ref, "sorted", configs, a8, f"T={T} a8={a8} {kind} {cfg}")
                    if us is not None:
                        got.append((us, (bm, bn, bk, warps, stages)))
                rows.append(f"| {T} | {a8} | {kind} | {_default_vs_best(d_us, _cfg_tuple(defaults[kind]), got)} |")
                print(rows[-1], flush=True)
    return rows


def _one_token_grid(kind: str, a8: bool) -> list[tuple]:
    """(BLOCK_N, BLOCK_K, warps, stages) tried for a launch of the unsorted paths (their BLOCK_M is fixed: 16, one
    live row). BLOCK_K 64 for W8A16 only: under W8A8 it would quantize x or h in a launch of its own (QUANT_X
    takes one 128-column block a K step)."""
    bns = (16, 32, 64) if kind == "gate_up" else (32, 64, 128)
    steps = ((128, 4), (128, 8)) + (() if a8 else ((64, 4),))
    return [(bn, bk, warps, stages) for bn in bns for bk, warps in steps for stages in (3, 6)]


def fp8_experts_one(ts: str = "1", device="cuda", dims=(2048, 768, 128, 8), limit=None):
    """The FP8 experts' one-token paths (unsorted, unsorted_pdl; see the module doc): the default configs against
    ``_one_token_grid``, per T, path, a8 and launch, the other launch at its default."""
    from mlp_fuser.tools.bench_fp8 import copy_bandwidth

    setup, g, timed = _fp8_experts_setup(dims, device)
    bw = copy_bandwidth(device) if device == "cuda" else None  # the floor's bandwidth: the GPU's alone
    keys = ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
    rows = ["FP8 routed experts at one token, every pair its own block (Qwen3-30B-A3B dims, 128 x 128 blocks), "
            "CUDA-graph µs of the whole op (% of the floor: the touched experts' bytes once at the measured copy "
            "bandwidth); configs (BLOCK_N, BLOCK_K, warps, stages)",
            "| T | path | a8 | launch | floor | default µs (config) | best µs (config) | best / default | 2nd, 3rd |",
            "|---|---|---|---|---|---|---|---|---|"]
    for T in (int(t) for t in ts.split(",")):
        x, ids, wts = setup.inputs(T, g)
        ref = setup.reference(x, ids, wts)
        floor = setup.floor_bytes((x, ids, wts)) / bw * 1e6 if bw else None
        for path in ("unsorted", "unsorted_pdl"):
            for a8 in (True, False):
                defaults = _fp8_defaults(dims, a8, T, x)
                d_us = timed(x, ids, wts, ref, path, defaults, a8, f"T={T} {path} a8={a8} default")
                for kind, other in (("gate_up", "down"), ("down", "gate_up")):
                    got = []
                    for c in _one_token_grid(kind, a8)[:limit]:
                        cfg = {**defaults[kind], **dict(zip(keys, c))}
                        us = timed(x, ids, wts, ref, path, {kind: cfg, other: defaults[other]}, a8,
                                   f"T={T} {path} a8={a8} {kind} {c}")
                        if us is not None:
                            got.append((us, c))
                    cells = _default_vs_best(d_us, _cfg_tuple(defaults[kind], keys), got, floor)
                    rows.append(f"| {T} | {path} | {a8} | {kind} | {'-' if floor is None else f'{floor:.1f}'} | "
                                f"{cells} |")
                    print(rows[-1], flush=True)
    return rows


_TMA_GRID = {  # (BLOCK_N, warps, stages) per launch and BLOCK_M; BLOCK_K 128 (one scale block a step)
    ("gate_up", 64): [(64, 4, 3), (128, 4, 3), (128, 4, 2), (64, 4, 4)],
    ("gate_up", 128): [(128, 8, 3), (128, 8, 4), (64, 8, 3)],
    ("down", 64): [(128, 4, 3), (128, 4, 4), (64, 4, 3)],
    ("down", 128): [(128, 8, 3), (128, 8, 4), (64, 8, 4)],
}
TMA_DIMS = {"Qwen3-30B-A3B": (2048, 768, 128, 8), "Mixtral-8x7B": (4096, 14336, 8, 2)}


def fp8_experts_tma(ts: str = "512,2048", device="cuda", dims: dict | None = None, limit=None):
    """The FP8 experts' TMA GEMMs alone (see the module doc): per shape, T and BLOCK_M the best configs, their sum
    against the defaults', and h quantized by gate/up against gate/up then quantize_rows."""
    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.tools.bench_fp8 import BLOCK, Experts

    rows = ["FP8 routed experts' TMA GEMMs (W8A8, 128 x 128 blocks), each launch alone, µs (CUDA graphs); configs "
            "(BLOCK_M, BLOCK_N, BLOCK_K, warps, stages)",
            "| experts | T | rows/expert | defaults µs | BLOCK_M 64: gate/up + down | BLOCK_M 128: gate/up + down | "
            "fused h: gate/up + quantize_rows / gate/up quantizing |", "|---|---|---|---|---|---|---|"]
    g = torch.Generator(device=device).manual_seed(0)
    for label, shape in (dims or TMA_DIMS).items():
        setup = Experts(shape, device, torch.bfloat16 if device == "cuda" else torch.float16, g)
        weights = (K8.fp8_experts(setup.wgu, setup.sgu, BLOCK, gated=True), K8.fp8_experts(setup.wd, setup.sd, BLOCK))
        for T in (int(t) for t in ts.split(",")):
            rows.append(_tma_row(label, shape, weights, setup.inputs(T, g), g, limit))
            print(rows[-1], flush=True)
    return rows


def _tma_row(label: str, shape: tuple, weights: tuple, inputs: tuple, g, limit) -> str:
    """One row of ``fp8_experts_tma``: T tokens' inputs (x, ids, wts) on experts of ``shape`` (H, I, E, k)."""
    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.kernels import moe as kmoe
    from mlp_fuser.kernels import moe_tuning
    from mlp_fuser.kernels.moe_tuning import _cfg
    from mlp_fuser.reference import rel_err

    (_, I, E, k), (fgu, fd), (x, ids, wts) = shape, weights, inputs
    T = x.shape[0]
    xq, xs = K8.quantize_rows(x)
    hq, hs = K8.quantize_rows(torch.randn(T * k, I, generator=g, device=x.device).to(x.dtype))
    checks = {}

    def run(kind, cfg, quant_h=False):
        routing = kmoe.moe_align(ids, E, cfg["BLOCK_M"])
        if kind == "gate_up":
            return functools.partial(kmoe.moe_gate_up_tma, xq, routing, fgu.w, None, kmoe.ExpertAct(), I, cfg,
                                     scale=fgu, xs=xs, out_dtype=x.dtype, quant_h=quant_h)
        return functools.partial(kmoe.moe_down_tma, hq, routing, wts, fd.w, None, cfg, kmoe.rows_dtype(x.dtype), fd,
                                 hs)

    def timed(kind, cfg):
        try:
            fn = run(kind, cfg)
            out = fn().float()
            if rel_err(out, checks.setdefault(kind, out)) > 1e-2:  # against the default config's, timed first
                print(f"  {label} T={T} {kind} {_cfg_tuple(cfg)}: output off", file=sys.stderr)
                return None
            return _us(fn, rep=30)
        except Exception as e:  # shared memory, a refused shape: skip the config
            print(f"  {label} T={T} {kind} {_cfg_tuple(cfg)}: {type(e).__name__}: {str(e)[:120]}", file=sys.stderr)
            return None

    per_expert = T * k / min(E, T * k)
    d_us = [timed(kind, moe_tuning.fp8_tma_config(f"{kind}_tma", per_expert)) for kind in ("gate_up", "down")]
    cells, best_up = [], None
    for bm in (64, 128):
        best = {}
        for kind in ("gate_up", "down"):
            got = [(us, cfg) for cfg in (_cfg(bm, bn, 128, w, st) for bn, w, st in _TMA_GRID[kind, bm][:limit])
                   if (us := timed(kind, cfg)) is not None]
            best[kind] = min(got, key=lambda t: t[0]) if got else None
        if best["gate_up"] is None or best["down"] is None:
            cells.append("-")
            continue
        (up_us, up), (down_us, down) = best["gate_up"], best["down"]
        cells.append(f"{up_us + down_us:.1f} ({up_us:.1f} {_cfg_tuple(up)} + {down_us:.1f} {_cfg_tuple(down)})")
        if up["BLOCK_N"] == K8.A8_BLOCK and (best_up is None or up_us < best_up[0]):
            best_up = (up_us, up)
    fused = "-"
    if best_up is not None:
        plain, quantizing = run("gate_up", best_up[1]), run("gate_up", best_up[1], quant_h=True)
        (q8, s8), (q0, s0) = quantizing(), K8.quantize_rows(plain())
        routed = ((ids >= 0) & (ids < E)).reshape(-1)
        same = torch.equal(s8[routed], s0[routed]) and torch.equal(q8[routed].view(torch.uint8),
                                                                   q0[routed].view(torch.uint8))
        two = _us(lambda: K8.quantize_rows(plain()), rep=30)
        fused = f"{two:.1f} / {_us(quantizing, rep=30):.1f}" + ("" if same else " (bits differ)")
    d_cell = "-" if None in d_us else f"{sum(d_us):.1f}"
    return f"| {label} | {T} | {per_expert:.0f} | {d_cell} | {cells[0]} | {cells[1]} | {fused} |"


if __name__ == "__main__":
    steps = sys.argv[1:] or ["act_mul", "small_m", "overhead"]
    out = []
    for step in steps:
        try:
            steps_by_name = {"act_mul": act_mul_sweep, "small_m": small_m_sweep, "graph_gap": graph_gap,
                             "overhead": overhead, "down": down_sweep, "fp8_small": fp8_small_sweep,
                             "fp8_experts": fp8_experts_sweep, "fp8_experts_one": fp8_experts_one,
                             "fp8_experts_tma": fp8_experts_tma}
            name, _, arg = step.partition(":")  # overhead:SmolLM2 times that shape alone
            out += steps_by_name[name](arg) if arg else steps_by_name[name]()
        except Exception:  # report, keep the other steps' numbers
            import traceback

            traceback.print_exc()
            out.append(f"{step}: failed (traceback above)")
    print("\n".join(out))
