"""Qwen3-MoE 12 layers, prefill 2048 through patch: TMA path on/off in one process; forward time and the kernels'
GPU time under the profiler."""
import statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import bench_generate as bg
import mlp_fuser
from mlp_fuser import config
from torch.profiler import ProfilerActivity, profile

import transformers.masking_utils as mu
mu.find_packed_sequence_indices = lambda pid: None  # no sync per forward (no packed sequences here)
m = bg.build_moe("qwen3moe", "cuda", torch.bfloat16, False, layers=12)
mlp_fuser.patch(m)
ids = torch.randint(0, 151936, (1, 2048), device="cuda")
with torch.inference_mode():
    for tma in (True, False, True):
        config.moe_tma = tma
        for _ in range(3):
            m(ids, use_cache=False)
        torch.cuda.synchronize()
        ts = []
        for _ in range(10):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); m(ids, use_cache=False); b.record(); b.synchronize(); ts.append(a.elapsed_time(b))
        host = []
        for _ in range(5):
            torch.cuda._sleep(int(1e9))
            t0 = time.perf_counter(); m(ids, use_cache=False); host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
            m(ids, use_cache=False)
            torch.cuda.synchronize()
        print(f"=== tma={tma}: forward {statistics.median(ts):.2f} ms; host with the GPU asleep {statistics.median(host):.2f} ms")
        print(prof.key_averages().table(sort_by="self_cuda_time_total", row_limit=12, max_name_column_width=60)[:4000])
