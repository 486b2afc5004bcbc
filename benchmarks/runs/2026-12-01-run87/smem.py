"""Run 87: shared memory each gate_up_act config asks on the GPU (compiled, not launched), against k_loop_bytes, in
fp32 (ieee and tf32) and bf16; then the op's gate_up_act at fp32 M = 1 and 16 with the configs it tunes over."""
import torch
import triton

from mlp_fuser.activations import get_activation
from mlp_fuser.kernels import gemm
from mlp_fuser.kernels.common import k_loop_bytes, m_bucket
from mlp_fuser.reference import reference_gate_up, rel_err

jit = gemm._gate_up_act_kernel.fn
limit = torch.cuda.get_device_properties(0).shared_memory_per_block_optin
print("smem limit per block", limit, "triton", triton.__version__, "torch", torch.__version__)
print("| dtype | precision | BM | BN | BK | stages | predicted | compiled | fits |")
for dtype, prec in ((torch.float32, "ieee"), (torch.bfloat16, "tf32")):
    M, N, K = 16, 256, 512
    x = torch.randn(M, K, device="cuda", dtype=dtype)
    w = torch.randn(N, K, device="cuda", dtype=dtype)
    h = torch.empty(M, N, device="cuda", dtype=dtype)
    for c in gemm._gate_up_act_kernel.configs:
        k = c.kwargs
        for stages in sorted({c.num_stages, (gemm.fewer_stages(c, dtype.itemsize) or c).num_stages}):
            pred = k_loop_bytes(stages, k["BLOCK_M"], k["BLOCK_K"], k["BLOCK_N"], 2, dtype.itemsize)
            try:
                ck = jit.warmup(x, w, w, w, w, h, h, M, N, K, 0, 16, *x.stride(), *w.stride(), *w.stride(), 1, 1,
                                ACT=get_activation("silu").triton_fn, HAS_UP=True, HAS_BG=False, HAS_BU=False,
                                PRECISION=prec, **k, num_warps=c.num_warps, num_stages=stages, grid=(1,))
                got = ck.metadata.shared
            except Exception as e:  # noqa: BLE001
                got = f"{type(e).__name__}"
            fits = isinstance(got, int) and got <= limit
            blocks = f"{k['BLOCK_M']} | {k['BLOCK_N']} | {k['BLOCK_K']}"
            print(f"| {dtype} | {prec} | {blocks} | {stages} | {pred} | {got} | {fits} |", flush=True)

for M in (1, 16, 40):
    torch.manual_seed(M)
    x = torch.randn(M, 512, device="cuda")
    wg, wu = torch.randn(384, 512, device="cuda") / 23, torch.randn(384, 512, device="cuda") / 23
    tuned = gemm.tuning_configs(gemm._gate_up_act_kernel.configs, 4, m_bucket(M))
    try:
        out = gemm.gate_up_act(x, wg, None, wu, None, "silu")
        err = rel_err(out, reference_gate_up(x.double(), wg.double(), None, wu.double(), None, "silu"))
        shown = [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.kwargs["BLOCK_K"], c.num_stages) for c in tuned]
        print(f"fp32 gate_up_act M={M}: tuned {shown}, rel err {err:.2e}", flush=True)
    except Exception as e:  # noqa: BLE001
        print(f"fp32 gate_up_act M={M}: {type(e).__name__}: {str(e)[:200]}", flush=True)
