"""1B prefill (2048 tokens): eager vs an untouched copy vs patch, paired, gc on/off, host and GPU time per call,
and where a forward synchronises (sync debug mode). One process; run several."""
import copy, gc, json, os, statistics, sys, time, traceback, warnings
import torch
sys.path.insert(0, "benchmarks")
import bench_generate as bg
import mlp_fuser

out = os.environ.get("OUT", ".")
tag = sys.argv[1] if len(sys.argv) > 1 else "p"
torch.backends.cuda.matmul.allow_tf32 = True
DEV = "cuda" if torch.cuda.is_available() else "cpu"
m = bg.build("1b", DEV, torch.bfloat16 if DEV == "cuda" else torch.float32, DEV == "cpu")
import transformers.masking_utils as mu
find_packed = mu.find_packed_sequence_indices
models = {"eager": m, "copy": copy.deepcopy(m), "patch": copy.deepcopy(m), "merged": copy.deepcopy(m)}
mlp_fuser.patch(models["patch"])
mlp_fuser.patch(models["merged"], merge_gate_up=True)
g = torch.Generator(device=DEV).manual_seed(1)
ids = torch.randint(0, 256 if DEV == "cpu" else 32000, (1, 64 if DEV == "cpu" else 2048), device=DEV, generator=g)
fwds = {k: (lambda ids, mm=mm: mm(ids, use_cache=False).logits) for k, mm in models.items()}
with torch.inference_mode():
    for f in fwds.values():
        for _ in range(3):
            f(ids)
    if DEV == "cuda":
        torch.cuda.synchronize()
    # where does a forward wait on the GPU?
    syncs = {}
    for k, f in fwds.items():
        seen = []
        old = warnings.showwarning
        def show(msg, cat, fn, ln, file=None, line=None):
            st = [fr for fr in traceback.extract_stack()[:-2] if "warnings" not in fr.filename]
            seen.append(" <- ".join(f"{os.path.basename(fr.filename)}:{fr.lineno}:{fr.name}" for fr in st[-4:][::-1]))
        warnings.showwarning = show
        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = show
            torch.cuda.set_sync_debug_mode(1)
            f(ids)
            torch.cuda.set_sync_debug_mode(0)
        warnings.showwarning = old
        torch.cuda.synchronize()
        syncs[k] = seen
    res = {"syncs": syncs}
    names = list(fwds)
    for cond in ("gc_on", "gc_off", "nosync"):
        if cond == "gc_off":
            gc.collect(); gc.disable()
        mu.find_packed_sequence_indices = (lambda pid: None) if cond == "nosync" else find_packed
        gpu = {k: [] for k in names}; host = {k: [] for k in names}
        for i in range(30):
            order = names[i % len(names):] + names[:i % len(names)]
            if (i // len(names)) % 2:
                order = order[::-1]
            for k in order:
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                a.record(); t0 = time.perf_counter()
                fwds[k](ids)
                t1 = time.perf_counter(); b.record(); b.synchronize()
                gpu[k].append(a.elapsed_time(b)); host[k].append((t1 - t0) * 1e3)
        gc.enable()
        r = {}
        for k in names:
            r[k] = dict(gpu=statistics.median(gpu[k]), host=statistics.median(host[k]),
                        paired=statistics.median(e / p for e, p in zip(gpu["eager"], gpu[k])))
        # pure GPU time: each forward queued behind a long spin, so the host is out of it
        res[cond] = r
    mu.find_packed_sequence_indices = lambda pid: None  # no sync: the forward queues behind the spin
    spin = {}
    for k in names:
        ts = []
        for _ in range(5):
            torch.cuda._sleep(int(2e8))  # ~100 ms of GPU spin: the forward queues behind it
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record(); fwds[k](ids); b.record(); b.synchronize()
            ts.append(a.elapsed_time(b))
        spin[k] = statistics.median(ts)
    res["gpu_only"] = spin
json.dump(res, open(f"{out}/prefill_{tag}.json", "w"), indent=1)
print(f"== {tag} impl={os.environ.get('MLP_FUSER_IMPL')}")
for k, v in syncs.items():
    print(f"  syncs {k}: {len(v)}: {v[:3]}")
for cond in ("gc_on", "gc_off", "nosync"):
    print("  " + cond + "  " + "  ".join(f"{k}: gpu {v['gpu']:.2f} host {v['host']:.2f} x{v['paired']:.3f}"
                                        for k, v in res[cond].items()))
print("  gpu_only " + "  ".join(f"{k} {v:.2f}" for k, v in spin.items()))
