"""Run 31 (tenth session): controls for the 1b prefill gap (patch 0.897-0.920x eager in runs 29-30).

Every variant on its own copy of one random-weight 1b LLaMA (bf16, 2048 tokens, use_cache=False), timed in turns
(median of 20 after warm-ups): wall (CUDA events around the forward) and the host's time to queue it (perf_counter,
no synchronisation inside). Then one layer's MLP alone at M = 2048: host us per call, unfused module vs the patched
forward vs the op's planned call, and GPU us per call.

    eager       the model as built            eager_copy  a deepcopy (the bench times patch on a deepcopy)
    patch       patch on a deepcopy           patch_noplan  the same with mlp_fuser.config.plans off
    eager_nogc / patch_nogc: the same as eager_copy / patch with Python's garbage collector disabled during the call
"""
import copy
import gc
import statistics
import sys
import time

import torch

sys.path.insert(0, "benchmarks")
import bench_generate as bg  # noqa: E402

import mlp_fuser  # noqa: E402
from mlp_fuser import config  # noqa: E402

model = bg.build("1b", "cuda", torch.bfloat16, False)
ids = torch.randint(3, 32000, (1, 2048), device="cuda", generator=torch.Generator("cuda").manual_seed(0))
models = {"eager": model, "eager_copy": copy.deepcopy(model)}
for name in ("patch", "patch_noplan"):
    models[name] = mlp_fuser.patch(copy.deepcopy(model))
models["eager_nogc"], models["patch_nogc"] = models["eager_copy"], models["patch"]


def run(name):
    m = models[name]
    nogc, noplan = name.endswith("_nogc"), name == "patch_noplan"
    if nogc:
        gc.disable()
    if noplan:
        config.plans = False
    try:
        return m(ids, use_cache=False).logits
    finally:
        if nogc:
            gc.enable()
        if noplan:
            config.plans = True


with torch.no_grad():
    ref = run("eager").float()
    for name in models:
        for _ in range(3):
            out = run(name)
        print(f"{name}: logits rel err {((out.float() - ref).norm() / ref.norm()).item():.1e}", flush=True)
    torch.cuda.synchronize()
    wall, host = {n: [] for n in models}, {n: [] for n in models}
    for _ in range(20):
        for name in models:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            t0 = time.perf_counter()
            run(name)
            host[name].append((time.perf_counter() - t0) * 1e3)
            b.record()
            b.synchronize()
            wall[name].append(a.elapsed_time(b))
    print("| variant | wall ms (median of 20) | vs eager | host ms to queue | min..max wall |")
    print("|---|---|---|---|---|")
    e = statistics.median(wall["eager"])
    for name in models:
        w = statistics.median(wall[name])
        print(f"| {name} | {w:.3f} | {e / w:.3f}x | {statistics.median(host[name]):.3f} | "
              f"{min(wall[name]):.2f}..{max(wall[name]):.2f} |")

    # One layer's MLP at M = 2048, alone: host us per call (synchronised before, not inside), GPU us per call.
    x = torch.randn(1, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    plain = models["eager"].model.layers[0].mlp
    fused = models["patch"].model.layers[0].mlp
    mlp = fused
    calls = {"unfused module": lambda: plain(x), "patched module": lambda: fused(x),
             "op (eager entry)": lambda: torch.ops.mlp_fuser.gated_mlp(
                 x, mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None, "silu")}
    print("| MLP call, M=2048 | host us per call (median of 50) | GPU us per call (20 back to back) |")
    print("|---|---|---|")
    for name, fn in calls.items():
        for _ in range(5):
            fn()
        hs = []
        for _ in range(50):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            fn()
            hs.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(20):
            fn()
        b.record()
        b.synchronize()
        print(f"| {name} | {statistics.median(hs):.1f} | {a.elapsed_time(b) / 20 * 1e3:.1f} |")
