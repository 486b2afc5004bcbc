# ruff: noqa: B007, B023, E501, E702  (a probe: deleted once its finding is in NOTES)
"""Probe: a blockwise FP8 GEMM (x 1 x 128, w 128 x 128 scales) in Triton with Hopper warp specialization, against
the same kernel without it and cuBLAS' blockwise scaled_mm. y (M, N) bf16 = (xq * xs) @ (wq * ws)^T.
    python benchmarks/probe_fp8_ws.py            # GPU: check and time every variant, a table last
    python benchmarks/probe_fp8_ws.py --ptx      # CPU: compile each variant for sm_90a, print ptxas facts
"""
import sys

import torch
import triton
import triton.language as tl


@triton.jit
def _tile(tile, M, N, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
    grid_m = tl.cdiv(M, BLOCK_M)
    grid_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * grid_n
    group = tile // per_group
    first_m = group * GROUP_M
    size_m = tl.minimum(grid_m - first_m, GROUP_M)
    pid_m = first_m + (tile % per_group) % size_m
    pid_n = (tile % per_group) // size_m
    return pid_m, pid_n


@triton.jit
def fp8_gemm(x_desc, xs_ptr, w_desc, ws_ptr, y_desc, M, N, K,
             BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
             WS: tl.constexpr, STAGES: tl.constexpr):
    """One output tile a program; xs (K/128, M) fp32 column blocks, ws (N/128, K/128) fp32."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    kb = tl.cdiv(K, BLOCK_K)
    ws_row = ws_ptr + ((off_n + tl.arange(0, BLOCK_N)) // 128) * kb
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, kb, num_stages=STAGES, warp_specialize=WS):
        a = x_desc.load([off_m, k * BLOCK_K])
        b = w_desc.load([off_n, k * BLOCK_K])
        xs = tl.load(xs_ptr + k * M + offs_m, mask=offs_m < M, other=0.0)
        acc += tl.dot(a, b.T) * (xs[:, None] * tl.load(ws_row + k)[None, :])
    y_desc.store([off_m, off_n], acc.to(tl.bfloat16))


@triton.jit
def fp8_gemm_persistent(x_desc, xs_ptr, w_desc, ws_ptr, y_desc, M, N, K,
                        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                        WS: tl.constexpr, STAGES: tl.constexpr, NUM_SMS: tl.constexpr):
    """Persistent: program p takes tiles p, p + NUM_SMS, ...; the tile loop is the warp-specialized one."""
    kb = tl.cdiv(K, BLOCK_K)
    tiles = tl.cdiv(M, BLOCK_M) * tl.cdiv(N, BLOCK_N)
    for tile in tl.range(tl.program_id(0), tiles, NUM_SMS, flatten=False, warp_specialize=WS):
        pid_m, pid_n = _tile(tile, M, N, BLOCK_M, BLOCK_N, GROUP_M)
        off_m = pid_m * BLOCK_M
        off_n = pid_n * BLOCK_N
        offs_m = off_m + tl.arange(0, BLOCK_M)
        ws_row = ws_ptr + ((off_n + tl.arange(0, BLOCK_N)) // 128) * kb
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k in tl.range(0, kb, num_stages=STAGES):
            a = x_desc.load([off_m, k * BLOCK_K])
            b = w_desc.load([off_n, k * BLOCK_K])
            xs = tl.load(xs_ptr + k * M + offs_m, mask=offs_m < M, other=0.0)
            acc += tl.dot(a, b.T) * (xs[:, None] * tl.load(ws_row + k)[None, :])
        y_desc.store([off_m, off_n], acc.to(tl.bfloat16))


@triton.jit
def fp8_gated_quant(x_desc, xs_ptr, g_desc, gs_ptr, u_desc, us_ptr, q_desc, hs_ptr, M, N, K,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
                    WS: tl.constexpr, STAGES: tl.constexpr, QUANT: tl.constexpr = True):
    """h = silu(x Wg^T) * (x Wu^T), rounded to bf16, then quantized per token and 128 columns in the epilogue:
    q (M, N) fp8 by TMA, hs (N/128, M) fp32 (BLOCK_N 128: one scale block per row of the tile); without QUANT
    h is stored in bf16 through q_desc (any BLOCK_N dividing 128)."""
    pid_m, pid_n = _tile(tl.program_id(0), M, N, BLOCK_M, BLOCK_N, GROUP_M)
    off_m = pid_m * BLOCK_M
    off_n = pid_n * BLOCK_N
    offs_m = off_m + tl.arange(0, BLOCK_M)
    kb = tl.cdiv(K, BLOCK_K)
    acc_g = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    acc_u = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in tl.range(0, kb, num_stages=STAGES, warp_specialize=WS):
        a = x_desc.load([off_m, k * BLOCK_K])
        bg = g_desc.load([off_n, k * BLOCK_K])
        bu = u_desc.load([off_n, k * BLOCK_K])
        xs = tl.load(xs_ptr + k * M + offs_m, mask=offs_m < M, other=0.0)
        acc_g += tl.dot(a, bg.T) * (xs * tl.load(gs_ptr + (off_n // 128) * kb + k))[:, None]
        acc_u += tl.dot(a, bu.T) * (xs * tl.load(us_ptr + (off_n // 128) * kb + k))[:, None]
    g = acc_g.to(tl.bfloat16).to(tl.float32)
    u = acc_u.to(tl.bfloat16).to(tl.float32)
    h = (g / (1.0 + tl.exp(-g))).to(tl.bfloat16).to(tl.float32) * u
    if not QUANT:
        q_desc.store([off_m, off_n], h.to(tl.bfloat16))
        return
    h = h.to(tl.bfloat16).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(h), axis=1), 1e-12) / 448.0
    q = tl.minimum(tl.maximum(h / scale[:, None], -448.0), 448.0)
    q_desc.store([off_m, off_n], q.to(tl.float8e4nv))
    tl.store(hs_ptr + pid_n * M + offs_m, scale, mask=offs_m < M)


VARIANTS = [  # (name, persistent, WS, BLOCK_M, BLOCK_N, warps, stages): the ones that compile as asked on sm_90a
    (f"{'pers' if pers else 'tile'}{'+ws' if ws else ''} {bm}x128 w{warps} s{stages}", pers, ws, bm, 128, warps, stages)
    for pers, ws, bm, warps, stages_all in ((False, False, 64, 4, (3, 4)), (False, False, 128, 8, (3, 4)),
                                            (True, False, 128, 8, (3,)), (False, True, 64, 4, (3, 4)),
                                            (True, True, 64, 4, (3, 4)))
    for stages in stages_all]


def launch(v, xq, xs_t, wq, ws, y, num_sms):
    from triton.tools.tensor_descriptor import TensorDescriptor
    _, persistent, ws_on, bm, bn, warps, stages = v
    M, K = xq.shape
    N = wq.shape[0]
    xd = TensorDescriptor.from_tensor(xq, [bm, 128])
    wd = TensorDescriptor.from_tensor(wq, [bn, 128])
    yd = TensorDescriptor.from_tensor(y, [bm, bn])
    tiles = triton.cdiv(M, bm) * triton.cdiv(N, bn)
    if persistent:
        fp8_gemm_persistent[(min(num_sms, tiles),)](xd, xs_t, wd, ws, yd, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128,
                                                    GROUP_M=8, WS=ws_on, STAGES=stages, NUM_SMS=num_sms,
                                                    num_warps=warps)
    else:
        fp8_gemm[(tiles,)](xd, xs_t, wd, ws, yd, M, N, K, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, WS=ws_on,
                           STAGES=stages, num_warps=warps)


def ptx_check():
    from triton.backends.compiler import GPUTarget
    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    for v in VARIANTS:
        name, persistent, ws_on, bm, bn, warps, stages = v
        fn = fp8_gemm_persistent if persistent else fp8_gemm
        sig = {"x_desc": f"tensordesc<fp8e4nv[{bm}, 128]>", "xs_ptr": "*fp32", "w_desc": f"tensordesc<fp8e4nv[{bn}, 128]>",
               "ws_ptr": "*fp32", "y_desc": f"tensordesc<bf16[{bm}, {bn}]>", "M": "i32", "N": "i32", "K": "i32"}
        const = dict(BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, WS=ws_on, STAGES=stages)
        if persistent:
            const["NUM_SMS"] = 132
        for c in const:
            sig[c] = "constexpr"
        try:
            src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=const)
            k = triton.compile(src, target=target, options=backend.parse_options(dict(num_warps=warps)).__dict__)
            ptx = k.asm["ptx"]
            print(f"{name:28s} regs {k.n_regs if hasattr(k, 'n_regs') else '?'} wgmma {ptx.count('wgmma.mma_async')} "
                  f"wait {ptx.count('wgmma.wait_group')} setmaxnreg {ptx.count('setmaxnreg')} "
                  f"mbarrier {ptx.count('mbarrier.try_wait')} shared {k.metadata.shared}")
        except Exception as e:
            print(f"{name:28s} FAILED {type(e).__name__}: {str(e)[:200]}")


GATED = [(f"{'ws ' if ws else ''}{bm}x{bn} w{warps} s{stages}{'' if quant else ' h bf16'}", ws, bm, warps, stages, bn, quant)
         for ws, bm, warps, stages, bn, quant in ((False, 64, 4, 3, 128, True), (False, 128, 8, 3, 128, True),
                                                  (True, 64, 4, 3, 128, True), (True, 64, 4, 3, 64, False),
                                                  (True, 64, 4, 4, 64, False), (False, 128, 8, 3, 64, False))]


def gated_launch(v, xq, xs_t, g, gs, u, us, q, hs_t):
    from triton.tools.tensor_descriptor import TensorDescriptor
    _, ws_on, bm, warps, stages, bn, quant = v
    M, K = xq.shape
    N = g.shape[0]
    d = TensorDescriptor.from_tensor
    fp8_gated_quant[(triton.cdiv(M, bm) * triton.cdiv(N, bn),)](
        d(xq, [bm, 128]), xs_t, d(g, [bn, 128]), gs, d(u, [bn, 128]), us, d(q, [bm, bn]), hs_t, M, N, K,
        BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=128, GROUP_M=8, WS=ws_on, STAGES=stages, QUANT=quant, num_warps=warps)


def mlp_main(rows):
    """The LLaMA-3-8B MLP: cuBLAS' unfused blockwise path, bf16, and ours (x quantized, gated kernel with h's
    quantization in its epilogue, down on the best plain variant)."""
    from mlp_fuser.kernels import fp8_cublas
    from mlp_fuser.kernels.fp8 import fp8_weight, quantize_blocks, quantize_rows
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    H, I = 4096, 14336
    torch.manual_seed(0)
    wb = [torch.randn(n, k, device=dev, dtype=torch.bfloat16) * 0.02 for n, k in ((I, H), (I, H), (H, I))]
    q8 = [quantize_blocks(w) for w in wb]
    fws = [fp8_weight(q, s.contiguous(), (128, 128)) for q, s in q8]
    wdq = [(q.float() * s.repeat_interleave(128, 0).repeat_interleave(128, 1)).to(torch.bfloat16) for q, s in q8]
    for M in (512, 2048, 8192):
        x = torch.randn(M, H, device=dev, dtype=torch.bfloat16)

        def bf16():
            return torch.nn.functional.linear(torch.nn.functional.silu(torch.nn.functional.linear(x, wdq[0]))
                                              * torch.nn.functional.linear(x, wdq[1]), wdq[2])
        ref = bf16().double()

        def err(y):
            return ((y.double() - ref).norm() / ref.norm()).item()
        weights = [("gate", fws[0], None), ("up", fws[1], None), ("down", fws[2], None)]

        def cublas():
            return fp8_cublas.mlp(x, weights, "silu", True)
        t_bf = triton.testing.do_bench(bf16, warmup=50, rep=200)
        t_cb = triton.testing.do_bench(cublas, warmup=50, rep=200)
        rows.append((M, "bf16 aten", t_bf * 1e3, 1.0, err(bf16())))
        rows.append((M, "fp8 cuBLAS unfused", t_cb * 1e3, t_bf / t_cb, err(cublas())))
        print(rows[-2:], flush=True)
        q = torch.empty(M, I, device=dev, dtype=torch.float8_e4m3fn)
        hs_t = torch.empty(I // 128, M, device=dev, dtype=torch.float32)
        hb = torch.empty(M, I, device=dev, dtype=torch.bfloat16)
        for v in GATED:
            for dv in [d for d in VARIANTS if d[0] in ("tile 64x128 w4 s4", "tile+ws 64x128 w4 s4")]:
                y = torch.full((M, H), float("nan"), device=dev, dtype=torch.bfloat16)

                def ours():
                    xq, xs = quantize_rows(x)
                    xs_t = xs.t().contiguous()
                    gated_launch(v, xq, xs_t, q8[0][0], q8[0][1].contiguous(), q8[1][0], q8[1][1].contiguous(),
                                 q if v[6] else hb, hs_t)
                    if v[6]:
                        launch(dv, q, hs_t, q8[2][0], q8[2][1].contiguous(), y, num_sms)
                    else:
                        hq, hs = quantize_rows(hb)
                        launch(dv, hq, hs.t().contiguous(), q8[2][0], q8[2][1].contiguous(), y, num_sms)
                    return y
                try:
                    ours(); torch.cuda.synchronize()
                    e = err(y)
                    t = triton.testing.do_bench(ours, warmup=50, rep=200)
                    rows.append((M, f"ours gated {v[0]} + down {dv[0]}", t * 1e3, t_bf / t, e))
                except Exception as ex:
                    rows.append((M, f"ours gated {v[0]} + down {dv[0]}", float("nan"), 0, f"{type(ex).__name__}: {str(ex)[:100]}"))
                print(rows[-1], flush=True)


def main():
    if "--ptx" in sys.argv:
        return ptx_check()
    sys.path.insert(0, ".")
    if "--mlp" in sys.argv:
        mrows = []
        try:
            mlp_main(mrows)
        finally:
            print("\n| M | MLP path | µs | vs bf16 | error |\n|---|---|---|---|---|")
            for r in mrows:
                print(f"| {r[0]} | {r[1]} | {r[2]:.1f} | {r[3]:.3f}× | " + (f"{r[4]:.1e}" if isinstance(r[4], float) else r[4]) + " |")
        return
    from mlp_fuser import compat
    from mlp_fuser.kernels.fp8 import quantize_blocks, quantize_rows
    dev = torch.device("cuda")
    num_sms = torch.cuda.get_device_properties(dev).multi_processor_count
    print(torch.cuda.get_device_name(), torch.__version__, triton.__version__)
    rows = []
    for M, N, K in ((2048, 14336, 4096), (2048, 4096, 14336), (8192, 14336, 4096), (8192, 4096, 14336)):
        torch.manual_seed(0)
        x = torch.randn(M, K, device=dev, dtype=torch.bfloat16)
        wq, ws = quantize_blocks(torch.randn(N, K, device=dev, dtype=torch.bfloat16) * 0.02)
        ws = ws.contiguous()
        xq, xs = quantize_rows(x)
        xs_t = xs.t().contiguous()  # (K/128, M)
        ref = (xq.float() * xs.repeat_interleave(128, 1)[:, :K]) @ \
              (wq.float() * ws.repeat_interleave(128, 0)[:N].repeat_interleave(128, 1)[:, :K]).t()
        flops = 2 * M * N * K

        def err(y):
            return ((y.double() - ref).norm() / ref.norm()).item()
        y = compat.scaled_mm(xq, wq.t(), xs_t.t(), ws.t(), "blockwise", torch.bfloat16)
        t = triton.testing.do_bench(lambda: compat.scaled_mm(xq, wq.t(), xs_t.t(), ws.t(), "blockwise", torch.bfloat16),
                                    warmup=50, rep=200)
        base = t
        rows.append((M, N, K, "cublas blockwise", t * 1e3, flops / t / 1e9, 1.0, err(y)))
        print(rows[-1], flush=True)
        for v in VARIANTS:
            yv = torch.full((M, N), float("nan"), device=dev, dtype=torch.bfloat16)
            try:
                launch(v, xq, xs_t, wq, ws, yv, num_sms)
                torch.cuda.synchronize()
                e = err(yv)
                t = triton.testing.do_bench(lambda: launch(v, xq, xs_t, wq, ws, yv, num_sms), warmup=50, rep=200)
                rows.append((M, N, K, v[0], t * 1e3, flops / t / 1e9, base / t, e))
            except Exception as ex:
                rows.append((M, N, K, v[0], float("nan"), 0, 0, f"{type(ex).__name__}: {str(ex)[:120]}"))
            print(rows[-1], flush=True)
    print("\n| M | N | K | variant | µs | TFLOP/s | vs cuBLAS | error |\n|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r[0]} | {r[1]} | {r[2]} | {r[3]} | {r[4]:.1f} | {r[5]:.0f} | {r[6]:.3f}× | "
              + (f"{r[7]:.1e}" if isinstance(r[7], float) else r[7]) + " |")


if __name__ == "__main__":
    main()
