"""Qwen3-MoE 12 layers, prefill 2048 through patch: host time per forward (GPU asleep) over many forwards, Triton's
slow launches, cProfile of 10 forwards; TMA on, then off."""
import cProfile, io, pstats, sys, time
import torch
sys.path.insert(0, "benchmarks")
import transformers.masking_utils as mu
mu.find_packed_sequence_indices = lambda pid: None
import bench_generate as bg
import mlp_fuser
from mlp_fuser import config
from mlp_fuser.kernels.common import Launcher

m = bg.build_moe("qwen3moe", "cuda", torch.bfloat16, False, layers=12)
mlp_fuser.patch(m)
ids = torch.randint(0, 151936, (1, 2048), device="cuda")
with torch.inference_mode():
    for tma in (True, False):
        config.moe_tma = tma
        for _ in range(3):
            m(ids, use_cache=False)
        torch.cuda.synchronize()
        s0 = Launcher.slow_calls
        host = []
        for _ in range(15):
            torch.cuda._sleep(int(2e8))
            t0 = time.perf_counter(); m(ids, use_cache=False); host.append((time.perf_counter() - t0) * 1e3)
            torch.cuda.synchronize()
        print(f"=== tma={tma}: slow launches in 15 forwards {Launcher.slow_calls - s0}; host ms per forward "
              + " ".join(f"{h:.1f}" for h in host))
        pr = cProfile.Profile()
        pr.enable()
        for _ in range(10):
            m(ids, use_cache=False)
        pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(28)
        print("\n".join(line[:190] for line in s.getvalue().splitlines()[3:40]))
