"""Probe: wall, host and GPU time of eager, an untouched copy of it (twin) and patch, taken in turns (H200).
    python benchmarks/probe_host_split.py prefill|train|mlp  (NO_PACKED_SYNC=0 keeps transformers' per-forward sync)
mlp: one LLaMA MLP (2048/5632, 4 x 1024 tokens, bf16) forward + backward: eager, patch, patch without plans.
Findings: benchmarks/RESULTS.md (end to end, fine-tuning) and NOTES.md (launch plans and host time
the backward).
host = CPU seconds to queue the work while the GPU sleeps; gpu = event time of the queued work behind the sleep."""
import copy
import json
import os
import statistics
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlp_fuser

what = sys.argv[1]
if os.environ.get("NO_PACKED_SYNC", "1") == "1":  # transformers' packed-sequence check syncs the host each forward
    import transformers.masking_utils as mu
    mu.find_packed_sequence_indices = lambda position_ids: None
OUT = os.environ.get("OUT", "/tmp")
dev = "cuda"


def measure(fns, iters=15):
    for f in fns.values():
        f()
        f()
    torch.cuda.synchronize()
    res = {k: {"wall": [], "host": [], "gpu": []} for k in fns}
    for i in range(iters):
        items = list(fns.items()) if i % 2 == 0 else list(reversed(fns.items()))
        for k, f in items:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize()
            a.record()
            f()
            b.record()
            b.synchronize()
            res[k]["wall"].append(a.elapsed_time(b))
            torch.cuda._sleep(int(1.98e9 * 0.12))  # ~120 ms of GPU spin: the host runs ahead
            a.record()
            t0 = time.perf_counter()
            f()
            t1 = time.perf_counter()
            b.record()
            b.synchronize()
            res[k]["host"].append((t1 - t0) * 1e3)
            res[k]["gpu"].append(a.elapsed_time(b))
    return res


def report(title, res, base="eager"):
    print(f"== {title}")
    for k, r in res.items():
        med = {m: statistics.median(v) for m, v in r.items()}
        paired = statistics.median([b / x for b, x in zip(res[base]["wall"], r["wall"])])
        print(f"  {k:8s} wall {med['wall']:8.3f}  host {med['host']:8.3f}  gpu {med['gpu']:8.3f} ms   "
              f"paired wall vs {base} {paired:.3f}x  (wall min {min(r['wall']):.3f})")
    json.dump(res, open(f"{OUT}/split_{title}.json", "w"))


if what == "prefill":
    cfg = LlamaConfig(max_position_embeddings=4096, hidden_size=2048, intermediate_size=5632, num_hidden_layers=16,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    torch.manual_seed(0)
    with torch.device(dev):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).eval()
    tw, pa = copy.deepcopy(m), copy.deepcopy(m)
    mlp_fuser.patch(pa)
    ids = torch.randint(0, 32000, (1, 2048), device=dev)
    fns = {}
    for k, mod in (("eager", m), ("twin", tw), ("patch", pa)):
        def fwd(mod=mod):
            with torch.no_grad():
                return mod(ids, use_cache=False).logits
        fns[k] = fwd
    for rnd in range(3):
        report(f"prefill{rnd}", measure(fns))
elif what == "mlp":
    from transformers.models.llama.modeling_llama import LlamaMLP

    from mlp_fuser import config
    cfg = LlamaConfig(hidden_size=2048, intermediate_size=5632)
    torch.manual_seed(0)
    m = LlamaMLP(cfg).to(dev, torch.bfloat16)
    pa = mlp_fuser.patch(copy.deepcopy(m))
    x = torch.randn(4, 1024, 2048, device=dev, dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn_like(x)

    def fb(mod, planned=True):
        def f():
            config.plans = planned
            mod(x).backward(dy)
            config.plans = True
        return f
    for rnd in range(2):
        report(f"mlp{rnd}", measure({"eager": fb(m), "patch": fb(pa), "noplans": fb(pa, False)}, iters=20))
elif what == "train":
    cfg = LlamaConfig(max_position_embeddings=4096, hidden_size=2048, intermediate_size=5632, num_hidden_layers=8,
                      num_attention_heads=32, num_key_value_heads=4, vocab_size=32000)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(dev):
        m = LlamaForCausalLM(cfg).to(torch.bfloat16).train()
    tw, pa = copy.deepcopy(m), copy.deepcopy(m)
    mlp_fuser.patch(pa)
    ids = torch.randint(0, 32000, (4, 1024), device=dev)

    def stepper(mod):
        def step():
            mod.zero_grad(set_to_none=True)
            mod(input_ids=ids, labels=ids).loss.backward()
        return step
    fns = {k: stepper(mod) for k, mod in (("eager", m), ("twin", tw), ("patch", pa))}
    for rnd in range(2):
        report(f"train{rnd}", measure(fns, iters=12))
