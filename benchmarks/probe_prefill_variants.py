"""Probe: the 1B prefill (16 layers, 2048 tokens, bf16) through patch's variants, in turns with two untouched copies
of eager (twin, twin2), H200: patch; lean (a per-module plan found by Dynamo's tensor guards instead of the entry's
checks and the signature: what ops.EagerSite became); ref (MLP_FUSER_IMPL=reference: eager's kernels through the
op's entry). Also `train` and `mlp` as benchmarks/probe_host_split.py (git history, 0c3d93d).
    python benchmarks/probe_prefill_variants.py prefill
host = CPU seconds to queue a forward while the GPU sleeps; gpu = event time of the queued work behind the sleep.
Findings: benchmarks/NOTES.md (launch plans and host time)."""
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
    from mlp_fuser import config
    tw, tw2, pa = copy.deepcopy(m), copy.deepcopy(m), copy.deepcopy(m)
    mlp_fuser.patch(pa)
    ids = torch.randint(0, 32000, (1, 2048), device=dev)
    fns = {}
    from torch._C._dynamo.guards import TensorGuards

    from mlp_fuser import compat, dispatch, plans
    le = copy.deepcopy(m)
    mlp_fuser.patch(le)
    C = torch._C

    class Lean:  # probe: a per-module plan found by TensorGuards instead of the signature and the entry's checks
        def __init__(self, module):
            self.m, self.fused, self.cache = module, module.forward, None

        def __call__(self, x):
            m = self.m._modules
            wg, wu, wd = (m["gate_proj"]._parameters["weight"], m["up_proj"]._parameters["weight"],
                          m["down_proj"]._parameters["weight"])
            c = self.cache
            if (c is not None and not torch.is_grad_enabled() and not torch.compiler.is_compiling()
                    and not compat.profiler_enabled() and not compat.any_autocast_enabled()
                    and not C._is_torch_function_mode_enabled() and not C._len_torch_dispatch_stack()
                    and not C._are_functorch_transforms_active() and c[0].check(x, wg, wu, wd)
                    and x.data_ptr() & 15 == c[2]):
                return c[1](x, wg, None, wu, None, wd, None)
            y = self.fused(x)
            plan = plans.PLANS.get(plans.signature(dispatch.new_args((x, wg, None, wu, None, wd, None, "silu")), True))
            if plan is not None and type(x) is torch.Tensor:
                ts = (x, wg, wu, wd)
                self.cache = (TensorGuards(*ts, dynamic_dims_sizes=[list(t.shape) for t in ts],
                                           dynamic_dims_strides=[list(t.stride()) for t in ts]), plan, x.data_ptr() & 15)  # noqa: E501
            return y
    for layer in le.model.layers:
        layer.mlp.forward = Lean(layer.mlp)
    for k, mod, setting in (("twin", tw, None), ("twin2", tw2, None), ("patch", pa, None),
                            ("lean", le, None), ("ref", pa, ("force_impl", "reference"))):
        def fwd(mod=mod, setting=setting):
            if setting:
                old = getattr(config, setting[0])
                setattr(config, setting[0], setting[1])
            with torch.no_grad():
                out = mod(ids, use_cache=False).logits
            if setting:
                setattr(config, setting[0], old)
            return out
        fns[k] = fwd
    with torch.no_grad():
        torch.testing.assert_close(fns["lean"](), fns["patch"](), rtol=0, atol=0)
    for rnd in range(3):
        report(f"prefill{rnd}", measure(fns), base="twin")
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
