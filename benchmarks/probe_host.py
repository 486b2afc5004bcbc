"""1B prefill 2048: where the patched forward's extra host time goes. Per-submodule host time in situ (hooks),
cProfile of one forward each, tight-loop MLP call cost."""
import copy, cProfile, io, os, pstats, statistics, sys, time
import torch
sys.path.insert(0, "benchmarks")
import bench_generate as bg
import mlp_fuser

m = bg.build("1b", "cuda", torch.bfloat16, False)
models = {"eager": m, "patch": copy.deepcopy(m)}
mlp_fuser.patch(models["patch"])
ids = torch.randint(0, 32000, (1, 2048), device="cuda")
acc = {k: {} for k in models}


def hook(mk, name):
    t = [0.0]
    def pre(mod, args):
        t[0] = time.perf_counter()
    def post(mod, args, out):
        acc[mk].setdefault(name, []).append(time.perf_counter() - t[0])
    return pre, post


with torch.inference_mode():
    for mk, mm in models.items():
        for _ in range(3):
            mm(ids, use_cache=False)
    torch.cuda.synchronize()
    # cProfile of one forward each
    for mk, mm in models.items():
        pr = cProfile.Profile()
        pr.enable(); mm(ids, use_cache=False); pr.disable()
        torch.cuda.synchronize()
        s = io.StringIO()
        pstats.Stats(pr, stream=s).sort_stats("tottime").print_stats(22)
        print(f"==== cProfile {mk}\n" + "\n".join(s.getvalue().splitlines()[4:40]))
    handles = []
    for mk, mm in models.items():
        for name in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"):
            for layer in mm.model.layers:
                pre, post = hook(mk, name)
                sub = getattr(layer, name)
                handles += [sub.register_forward_pre_hook(pre), sub.register_forward_hook(post)]
        pre, post = hook(mk, "layer")
        for layer in mm.model.layers:
            pre, post = hook(mk, "layer")
            handles += [layer.register_forward_pre_hook(pre), layer.register_forward_hook(post)]
        pre, post = hook(mk, "forward")
        handles += [mm.register_forward_pre_hook(pre), mm.register_forward_hook(post)]
    for mm in models.values():
        mm(ids, use_cache=False)
    torch.cuda.synchronize()
    for d in acc.values():
        d.clear()
    for i in range(20):
        for mk in (list(models) if i % 2 == 0 else list(models)[::-1]):
            models[mk](ids, use_cache=False)
            torch.cuda.synchronize()
    for h in handles:
        h.remove()
    print("host µs per call (median over calls in situ)")
    for name in acc["eager"]:
        e, p = statistics.median(acc["eager"][name]) * 1e6, statistics.median(acc["patch"][name]) * 1e6
        print(f"  {name:26s} eager {e:9.1f}  patch {p:9.1f}  diff {p - e:+8.1f}")
    # tight loop: one layer's MLP call
    x = torch.randn(1, 2048, 2048, device="cuda", dtype=torch.bfloat16)
    for mk, mm in models.items():
        mlp = mm.model.layers[3].mlp
        for _ in range(20):
            mlp(x)
        torch.cuda.synchronize()
        ts = []
        for _ in range(50):
            torch.cuda._sleep(int(3e6))
            t0 = time.perf_counter(); mlp(x); ts.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        print(f"  tight loop mlp {mk}: {statistics.median(ts) * 1e6:.1f} µs")
