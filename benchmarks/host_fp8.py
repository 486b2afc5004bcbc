"""Host time per call of the FP8 paths on a machine without a GPU: the Triton launches stubbed.

The kernels' launches keep their whole Python path (``Launcher`` / ``Prepared`` cache look-ups, argument building)
but the compiled launch is a no-op; the device checks say "a Hopper GPU". What remains is the Python and the torch
allocations a call does on the host. Qwen3-30B-A3B-sized shapes: attention's q_proj (2048 -> 4096) through
``patch``'s lone FP8 linear forward (``fp8_linear_forward``) and the routed experts (128 experts, I 768, top 8)
through ``eager_quant_moe_mlp``.

    python benchmarks/host_fp8.py [--profile linear|experts] [--rows 1,32,2048] [--cublas] [--quant-launches]

``--cublas``: the FP8 table's cuBLAS row runs every linear call, torch's scaled_mm stubbed instead (an output kept per
shape, as the CUDA caching allocator would hand out): the row's own Python is timed. It takes calls from 512 rows on
the GPU; at a few rows its aten copies (x's scales, a padded x) cost here about what their launch costs there, at
2048 rows the CPU's copying adds tens of µs. It adds a dense gated MLP of the experts' I (its silu · up run on the
CPU: tens of µs).
``--quant-launches``: the experts' x and h quantized by launches of their own at every size (their path before
the GEMMs quantized them at decode, ``moe.FUSED_QUANT_MAX_PAIRS``).
"""

from __future__ import annotations

import argparse
import cProfile
import os
import pstats
import time

os.environ.pop("TRITON_INTERPRET", None)

import torch  # noqa: E402
from torch import nn  # noqa: E402

from mlp_fuser import compat  # noqa: E402
from mlp_fuser.dispatch import fp8 as dfp8  # noqa: E402
from mlp_fuser.kernels import common, fp8, moe, moe_routing  # noqa: E402
from mlp_fuser.ops import moe as ops_moe  # noqa: E402
from mlp_fuser.ops import quant, quant_moe  # noqa: E402
from mlp_fuser.patch.fp8 import fp8_linear_forward  # noqa: E402
from mlp_fuser.patch.modules import swapped_class  # noqa: E402


def stub(cublas: bool = False) -> None:
    """No GPU: launches do nothing after their Python path; the device checks see an H100 (132 SMs, sm90)."""
    def call(self, key, grid, *args, **constexprs):
        hit = self.cache.get(key)
        if hit is not None and not compat.launch_hooks():
            hit[3](compat.current_stream(hit[2]), args)
            return
        common.Launcher.slow_calls += 1
        self.cache[key] = (None, grid, 0, lambda s, a: None)

    common.Launcher.__call__ = call
    compat.current_stream = lambda index: 0
    dfp8.why_not_kernels = lambda device, index: None
    torch.cuda.get_device_capability = lambda *a: (9, 0)
    fp8.num_sms = moe.num_sms = lambda device: 132
    for name in ("tma_why_not", "_tma_layout_why_not"):  # their whole Python, but for the device's type (cpu here)
        if hasattr(fp8, name):
            why_not = getattr(fp8, name)
            setattr(fp8, name, lambda *a, f=why_not: None if (r := f(*a)) == "TMA needs a Hopper or newer GPU" else r)
    moe._capability = lambda index: (9, 0)
    moe_routing._on_triton = lambda ids: ids.dtype in (torch.int32, torch.int64)
    try:  # cuBLAS' GEMMs run on the GPU: stubbed (--cublas), or the row stubbed off and the Triton rows timed
        from mlp_fuser.kernels import fp8_cublas
    except ImportError:
        fp8_cublas = None
    if fp8_cublas is not None and cublas:
        outs: dict = {}

        def scaled_mm(a, b, scale_a, scale_b, recipe, out_dtype):
            key = (a.shape[0], b.shape[1], out_dtype)
            y = outs.get(key)
            if y is None:
                y = outs[key] = torch.empty(key[:2], dtype=out_dtype)
            return y
        fp8_cublas.why_not_device = lambda index: None
        compat.scaled_mm = scaled_mm
        dfp8.CUBLAS_FROM_M = 1
    elif fp8_cublas is not None:
        fp8_cublas.why_not_device = lambda index: "stubbed: host_fp8 times the Triton rows"
    ops_moe._check_ids = lambda ids: None  # on CUDA it reads nothing (config.check_routing off)


def linear_module(n: int, k: int) -> nn.Module:
    m = nn.Linear(k, n, bias=False, device="meta")
    m.weight = nn.Parameter(torch.empty((n, k), dtype=fp8.FP8), requires_grad=False)
    m.weight_scale_inv = nn.Parameter(torch.rand(n // 128, k // 128) + 0.5, requires_grad=False)
    m.block_size = (128, 128)
    return m


def timed(fn, n: int) -> float:
    """Least µs a call over 9 runs of n calls (the host is shared: the quietest run)."""
    fn()
    runs = []
    for _ in range(9):
        t = time.perf_counter_ns()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter_ns() - t) / n / 1e3)
    return min(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="1,32,2048")
    ap.add_argument("--profile", choices=("linear", "experts", "mlp", "linear_op", "experts_op"))
    ap.add_argument("-n", type=int, default=300)
    ap.add_argument("--cublas", action="store_true", help="the cuBLAS row runs its calls, scaled_mm stubbed")
    ap.add_argument("--quant-launches", action="store_true", help="the experts' x and h quantized by launches")
    args = ap.parse_args()
    stub(args.cublas)
    if args.quant_launches:
        moe.FUSED_QUANT_MAX_PAIRS = 0
    torch.set_grad_enabled(False)
    H, E, I, K_TOP = 2048, 128, 768, 8
    lin = linear_module(4096, H)
    lin.__class__ = swapped_class(type(lin), fp8_linear_forward((128, 128)))  # what patch does to a lone FP8Linear
    wgu = torch.empty((E, 2 * I, H), dtype=fp8.FP8)
    sgu = torch.rand(E, 2 * I // 128, H // 128) + 0.5
    wd = torch.empty((E, H, I), dtype=fp8.FP8)
    sd = torch.rand(E, H // 128, I // 128) + 0.5
    dense = [t for n, k in ((I, H), (I, H), (H, I))
             for t in (torch.empty((n, k), dtype=fp8.FP8), torch.rand(n // 128, k // 128) + 0.5, None)]
    for T in map(int, args.rows.split(",")):
        x = torch.randn(1, T, H, dtype=torch.bfloat16)
        x2 = x.view(T, H)
        ids = torch.randint(0, E, (T, K_TOP), dtype=torch.int32)
        wts = torch.rand(T, K_TOP)

        def linear(x=x):
            return lin(x)

        def experts(x2=x2, ids=ids, wts=wts):
            return quant_moe.eager_quant_moe_mlp(x2, ids, wts, wgu, sgu, wd, sd, "silu", "fp8_e4m3", [128, 128])

        def mlp(x2=x2):  # a dense gated MLP of the experts' I (down's K/128 = 6: its scales padded per call)
            return quant.quant_gated_mlp(x2, *dense, "silu", "fp8_e4m3", [128, 128])

        def linear_op(x=x, w=lin.weight, s=lin.weight_scale_inv):  # the registered op, as Inductor calls
            return torch.ops.mlp_fuser.quant_linear.default(x, w, s, None, "fp8_e4m3", [128, 128])

        def experts_op(x2=x2, ids=ids, wts=wts):
            return torch.ops.mlp_fuser.quant_moe_mlp.default(x2, ids, wts, wgu, sgu, wd, sd, "silu", "fp8_e4m3",
                                                             [128, 128])

        fns = {"linear": linear, "experts": experts, "mlp": mlp, "linear_op": linear_op, "experts_op": experts_op}
        if args.profile:
            fns[args.profile]()
            with cProfile.Profile() as p:
                for _ in range(args.n):
                    fns[args.profile]()
            print(f"== {args.profile}, T = {T}, {args.n} calls")
            pstats.Stats(p).sort_stats("tottime").print_stats(18)
            continue
        dense_mlp = f"   gated MLP {timed(mlp, args.n):6.1f} µs" if args.cublas else ""
        print(f"T = {T:5d}: FP8 linear {timed(linear, args.n):6.1f} µs (op {timed(linear_op, args.n):6.1f})   "
              f"quant_moe_mlp {timed(experts, args.n):6.1f} µs (op {timed(experts_op, args.n):6.1f}){dense_mlp}   "
              f"(slow launches so far {common.Launcher.slow_calls})")

if __name__ == "__main__":
    main()
