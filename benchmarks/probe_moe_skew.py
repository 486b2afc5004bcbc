"""Qwen3-30B-A3B experts at T = 2048: the op's paths on routings captured in situ (random-weight model, 4 layers)
against uniform and Zipf routings; GPU time (queued behind a spin) and wall (plain calls); TMA config sweep."""
import os, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import bench_generate as bg
from mlp_fuser.kernels import moe as kmoe

torch.manual_seed(0)
m = bg.build_moe("qwen3moe", "cuda", torch.bfloat16, False, layers=4)
T = 2048
ids_in = torch.randint(0, 151936, (1, T), device="cuda")
caught = {}
hooks = []
for li, layer in enumerate(m.model.layers):
    def pre(mod, args, li=li):
        caught[li] = [a.detach().clone() for a in args[:3]]
    hooks.append(layer.mlp.experts.register_forward_pre_hook(pre))
with torch.inference_mode():
    m(ids_in, use_cache=False)
for h in hooks:
    h.remove()
ex = m.model.layers[1].mlp.experts
w_gu, w_d = ex.gate_up_proj.detach(), ex.down_proj.detach()
E, k = w_gu.shape[0], 8
x0 = caught[1][0]
routings = {}
for li in (0, 1, 3):
    routings[f"layer{li}"] = (caught[li][0], caught[li][1], caught[li][2])
g = torch.Generator(device="cuda").manual_seed(1)
u = torch.rand(T, E, device="cuda", generator=g)
wts_u = torch.softmax(torch.randn(T, k, device="cuda", generator=g), -1).to(torch.bfloat16)
routings["uniform"] = (x0, u.topk(k, dim=-1).indices, wts_u)
zipf = 1.0 / torch.arange(1, E + 1, device="cuda", dtype=torch.float32)
z = torch.multinomial(zipf.expand(T, E).contiguous(), k, replacement=False, generator=g)
routings["zipf"] = (x0, z, wts_u)
act = kmoe.ExpertAct()


def timed(fn, n=20):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    gpu, wall = [], []
    for _ in range(n):
        torch.cuda._sleep(int(2e6))
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record(); fn(); b.record(); b.synchronize()
        gpu.append(a.elapsed_time(b) * 1e3)
    for _ in range(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter(); fn(); torch.cuda.synchronize(); wall.append((time.perf_counter() - t0) * 1e6)
    return statistics.median(gpu), statistics.median(wall)


rows = []
with torch.inference_mode():
    for rname, (x, ids, wts) in routings.items():
        x, ids, wts = x.contiguous(), ids.contiguous(), wts.contiguous()
        counts = torch.bincount(ids.flatten(), minlength=E)
        desc = f"max {counts.max().item()} rows, touched {(counts > 0).sum().item()}, top8 share " \
               f"{counts.sort(descending=True).values[:8].sum().item() / counts.sum().item():.2f}"
        ref = None
        res = {}
        res["grouped_mm"] = timed(lambda: ex(x, ids, wts))
        ref = ex(x, ids, wts).float()
        for path in ("sorted", "sorted_fused", "sorted_tma"):
            res[path] = timed(lambda: kmoe.moe_experts(x, ids, wts, w_gu, None, w_d, None, act, False, path))
            err = ((kmoe.moe_experts(x, ids, wts, w_gu, None, w_d, None, act, False, path).float() - ref).norm() / ref.norm()).item()
            res[path] = (*res[path], err)
        for path in ("sorted", "sorted_tma"):
            plan = kmoe.experts_plan(x, ids, wts, w_gu, None, w_d, None, act, False, path)
            res[path + "_plan"] = timed(lambda: plan(x, ids, wts, w_gu, None, w_d, None))
        best = None
        for cu in kmoe.CONFIGS["gate_up_tma"][128]:
            for cd in kmoe.CONFIGS["down_tma"][128]:
                if cd["BLOCK_M"] != cu["BLOCK_M"]:
                    continue
                cf = {"gate_up_tma": cu, "down_tma": cd}
                t = timed(lambda: kmoe.moe_experts(x, ids, wts, w_gu, None, w_d, None, act, False, "sorted_tma", cf), 10)
                if best is None or t[0] < best[0][0]:
                    best = (t, cu, cd)
        res["tma_best_cfg"] = best[0]
        print(f"== {rname}: {desc}; best TMA cfg up {best[1]} down {best[2]}")
        for p, v in res.items():
            print(f"   {p:16s} gpu {v[0]:8.1f} us  wall {v[1]:8.1f} us" + (f"  err {v[2]:.1e}" if len(v) > 2 else ""))
