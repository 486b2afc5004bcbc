# ruff: noqa: B007, B023, E402, E501, E701, E702  (a probe: deleted once its finding is in NOTES)
"""Compiled prefill under no_grad, bf16 backend vs FP8 patched + backend: syncs, device mallocs, CUDA runtime calls."""
import statistics
import sys
import time
import warnings

sys.path.insert(0, "benchmarks")
import bench_generate as bg
import torch
from own_code import own_forward

import mlp_fuser

layers = int(sys.argv[1]) if len(sys.argv) > 1 else 16
torch.set_grad_enabled(False)
model = bg.build("qwen3moe", "cuda", torch.bfloat16, False, layers)
fp8 = bg.fp8_twin(model)
mlp_fuser.patch(fp8)
ids = torch.randint(3, 1000, (1, 2048), device="cuda")
fwds = {}
for name, m in (("backend", model), ("fp8_backend", fp8)):
    c = torch.compile(own_forward(m).forward, backend=mlp_fuser.backend)
    fwds[name] = lambda c=c: c(ids, use_cache=False, logits_to_keep=1).logits
    for _ in range(3):
        fwds[name]()
torch.cuda.synchronize()
for name, fwd in fwds.items():
    from mlp_fuser.kernels import common
    slow0 = common.Launcher.slow_calls
    s0 = torch.cuda.memory_stats()
    host, wall = [], []
    for i in range(10):
        torch.cuda.synchronize(); t0 = time.perf_counter(); fwd(); t1 = time.perf_counter()
        torch.cuda.synchronize(); host.append((t1 - t0) * 1e3); wall.append((time.perf_counter() - t0) * 1e3)
    s1 = torch.cuda.memory_stats()
    d = {k: s1.get(k, 0) - s0.get(k, 0) for k in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")}
    print(f"{name:12s} host {statistics.median(host):7.2f} wall {statistics.median(wall):7.2f} ms; over 10 calls {d}, slow launches {common.Launcher.slow_calls - slow0}", flush=True)
    torch.cuda.set_sync_debug_mode("warn")
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        fwd(); torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode(0)
    print(f"{name:12s} sync warnings: {len(w)}", flush=True)
    for x in w[:5]:
        print("   ", str(x.message)[:300], x.filename, x.lineno)
    from torch.profiler import ProfilerActivity, profile
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        fwd(); torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.key.startswith(("cuda", "cu"))]
    rows.sort(key=lambda e: -e.self_cpu_time_total)
    print(f"{name:12s} CUDA runtime calls (count, self CPU ms):")
    for e in rows[:12]:
        print(f"    {e.key:40s} {e.count:6d} {e.self_cpu_time_total / 1e3:8.2f}")
    top = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    print(f"{name:12s} top self CPU:")
    for e in top:
        print(f"    {e.key[:60]:60s} {e.count:6d} {e.self_cpu_time_total / 1e3:8.2f}")
    kern = sorted((e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA), key=lambda e: -e.self_device_time_total)
    print(f"{name:12s} GPU total {sum(e.self_device_time_total for e in kern) / 1e3:8.2f} ms; top kernels (count, ms):")
    for e in kern[:14]:
        print(f"    {e.key[:70]:70s} {e.count:6d} {e.self_device_time_total / 1e3:8.2f}")
import cProfile
import pstats

for name, fwd in fwds.items():
    torch.cuda.synchronize()
    p = cProfile.Profile(); p.enable()
    for _ in range(3):
        fwd()
    p.disable(); torch.cuda.synchronize()
    print(f"== {name}: 3 forwards under cProfile, by own time")
    pstats.Stats(p).sort_stats("tottime").print_stats(22)
