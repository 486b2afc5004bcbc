# ruff: noqa: B007, E501, E701, E702  (a probe: deleted once its finding is in NOTES)
"""Host µs per call of the FP8 prefill's ops at 2048 tokens (Qwen3-30B-A3B dims) against bf16's, the GPU kept busy
ahead so that no call waits for it; then each FP8 call under cProfile (its Python by own time)."""
import cProfile
import pstats
import time

import torch

from mlp_fuser.kernels.fp8 import quantize_blocks
from mlp_fuser.ops import moe as ops_moe
from mlp_fuser.ops import quant, quant_moe

torch.set_grad_enabled(False)
dev, T, H, E, I, K = "cuda", 2048, 2048, 128, 768, 8
g = torch.Generator(device=dev).manual_seed(0)
x = torch.randn(T, H, device=dev, dtype=torch.bfloat16, generator=g)
wq = torch.randn(5120, H, device=dev, generator=g) * 0.02
w8, s8 = quantize_blocks(wq, (128, 128))
wb = wq.bfloat16()
wgu = torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02
wd = torch.randn(E, H, I, device=dev, generator=g) * 0.02
gu8, sgu = torch.stack([quantize_blocks(w, (128, 128))[0] for w in wgu]), torch.stack([quantize_blocks(w, (128, 128))[1] for w in wgu])
d8, sd = torch.stack([quantize_blocks(w, (128, 128))[0] for w in wd]), torch.stack([quantize_blocks(w, (128, 128))[1] for w in wd])
wgub, wdb = wgu.bfloat16(), wd.bfloat16()
ids = torch.stack([torch.randperm(E, device=dev, generator=g)[:K] for _ in range(T)]).int()
wts = torch.rand(T, K, device=dev, generator=g)
calls = {
    "bf16 mm (5120)": lambda: torch.mm(x, wb.t()),
    "fp8 quant_linear entry": lambda: quant._ENTRIES["quant_linear"](x, w8, s8, None, "fp8_e4m3", [128, 128]),
    "fp8 quant_linear op": lambda: torch.ops.mlp_fuser.quant_linear.default(x, w8, s8, None, "fp8_e4m3", [128, 128]),
    "bf16 moe_mlp eager": lambda: ops_moe.eager_moe_mlp(x, ids, wts, wgub, None, wdb, None, "silu"),
    "fp8 quant_moe_mlp eager": lambda: quant_moe.eager_quant_moe_mlp(x, ids, wts, gu8, sgu, d8, sd, "silu", "fp8_e4m3", [128, 128]),
}
for name, fn in calls.items():
    for _ in range(3): fn()
torch.cuda.synchronize()
rows = {}
for rnd in range(3):
    for name, fn in calls.items():
        torch.cuda._sleep(200_000_000); n = 20
        t0 = time.perf_counter()
        for _ in range(n): fn()
        t = (time.perf_counter() - t0) / n * 1e6
        torch.cuda.synchronize()
        rows[name] = min(rows.get(name, 1e9), t)
for name, t in rows.items():
    print(f"{name:28s} host {t:8.1f} us a call")
for name in ("fp8 quant_linear entry", "fp8 quant_moe_mlp eager", "bf16 moe_mlp eager"):
    fn = calls[name]
    torch.cuda._sleep(200_000_000)
    p = cProfile.Profile(); p.enable()
    for _ in range(20): fn()
    p.disable(); torch.cuda.synchronize()
    print(f"== {name}: 20 calls, by own time")
    pstats.Stats(p).sort_stats("tottime").print_stats(16)
