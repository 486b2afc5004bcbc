"""End to end: a LLaMA-architecture model with random weights, torch.compile default vs mlp_fuser.backend.

    python benchmarks/bench_generate.py [--out DIR] [--tiny --device cpu]

Models: a 1B-class config (hidden 2048, intermediate 5632, 22 layers) and 4 layers of LLaMA-7B dimensions.
- Prefill: one forward over 2048 tokens (no cache), median of CUDA-event timings.
- Decode: one token per sequence against a static KV cache, batch 1 and 16, the whole step captured in a CUDA
  graph (both variants alike) and replayed; tokens/s = batch / step time.
Both variants are compiled with Inductor (default mode); mlp_fuser's backend first replaces each MLP by the op.
Each variant's logits are checked against the eager model's on the same inputs.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch


def log(*a):
    print(*a, file=sys.stderr, flush=True)


CONFIGS = {
    "llama-1B (2048/5632, 22 layers)": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                            num_attention_heads=32, num_key_value_heads=4),
    "llama-7B dims, 4 layers": dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=4,
                                    num_attention_heads=32, num_key_value_heads=32),
}


def build(cfg_kwargs, device, dtype, tiny):
    from transformers import LlamaConfig, LlamaForCausalLM

    if tiny:
        cfg_kwargs = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                          num_key_value_heads=2)
    cfg = LlamaConfig(vocab_size=32000 if not tiny else 256, max_position_embeddings=4096, **cfg_kwargs)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    return model


def cuda_time(fn, iters, device):
    if device != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    times = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def profile(label, fn, iters=5, cpu=False):
    """Where the GPU time of ``fn`` goes: kernels by total CUDA time per call (``--profile``), to stderr; with
    ``cpu`` (``--profile-cpu``) also the CPU side: ops and CUDA runtime calls by self CPU time."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    fn()
    torch.cuda.synchronize()
    activities = [ProfilerActivity.CUDA] + ([ProfilerActivity.CPU] if cpu else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in events) / iters
    log(f"  profile {label}: {total:.0f} µs of kernels per call, {sum(e.count for e in events) / iters:.0f} launches")
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:12]:
        log(f"    {e.self_device_time_total / iters:9.1f} µs {e.count / iters:6.1f}x  {e.key[:90]}")
    if cpu:
        log(f"  CPU side of {label}, per call: self CPU µs, CPU total µs, calls")
        cpu_events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
        for e in sorted(cpu_events, key=lambda e: -e.self_cpu_time_total)[:25]:
            log(f"    {e.self_cpu_time_total / iters:9.1f} {e.cpu_time_total / iters:9.1f} {e.count / iters:7.1f}x  "
                f"{e.key[:80]}")


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def run_model(name, cfg_kwargs, args, results):
    from transformers import StaticCache

    import mlp_fuser

    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    model = build(cfg_kwargs, device, dtype, args.tiny)
    vocab = model.config.vocab_size
    prefill_len = 2048 if not args.tiny else 64
    g = torch.Generator(device=device).manual_seed(0)
    variants = {"compile": "inductor", "mlp_fuser": mlp_fuser.backend}
    with torch.no_grad():
        # ---- prefill ------------------------------------------------------------------------------------
        ids = torch.randint(0, vocab, (1, prefill_len), device=device, generator=g)
        ref = model(input_ids=ids, use_cache=False).logits if "prefill" in args.phases else None
        for vname, backend in variants.items() if "prefill" in args.phases else ():
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, backend=backend)
            t0 = time.time()
            out = fwd(input_ids=ids, use_cache=False).logits
            log(f"{name} prefill {vname}: compiled in {time.time() - t0:.0f} s, logits rel err {rel(out, ref):.2e}")
            ms = cuda_time(lambda fwd=fwd: fwd(input_ids=ids, use_cache=False), 10, device)
            results.append(dict(model=name, phase="prefill", tokens=prefill_len, variant=vname, ms=ms,
                                tokens_per_s=prefill_len / ms * 1e3, logits_rel_err=rel(out, ref)))
            log(f"  {ms:.2f} ms")
            if (args.profile or args.profile_cpu) and device == "cuda":
                profile(f"prefill {vname}", lambda fwd=fwd: fwd(input_ids=ids, use_cache=False), cpu=args.profile_cpu)
            write(results, args.out)
        # ---- decode ---------------------------------------------------------------------------------------
        for batch in map(int, args.batches.split(",")) if "decode" in args.phases else ():
            cache_len, pos = 512, 256
            step_ids = torch.randint(0, vocab, (batch, 1), device=device, generator=g)
            cache_position = torch.tensor([pos], device=device)
            eager_cache = StaticCache(config=model.config, max_cache_len=cache_len)
            ref = model(input_ids=step_ids, past_key_values=eager_cache, cache_position=cache_position).logits
            for vname, backend in variants.items():
                torch._dynamo.reset()
                cache = StaticCache(config=model.config, max_cache_len=cache_len)
                fwd = torch.compile(model.forward, backend=backend)

                def step(fwd=fwd, cache=cache, step_ids=step_ids, cache_position=cache_position):
                    return fwd(input_ids=step_ids, past_key_values=cache, cache_position=cache_position).logits

                t0 = time.time()
                for _ in range(3):
                    out = step()
                err = rel(out, ref)
                log(f"{name} decode b={batch} {vname}: compiled in {time.time() - t0:.0f} s, logits rel err {err:.2e}")
                if device == "cuda":
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph):
                        step()
                    fn = graph.replay
                else:
                    fn = step
                ms = cuda_time(fn, 50 if device == "cuda" else 3, device)
                results.append(dict(model=name, phase=f"decode b={batch}", tokens=batch, variant=vname, ms=ms,
                                    tokens_per_s=batch / ms * 1e3, logits_rel_err=err))
                log(f"  {ms:.3f} ms/step, {batch / ms * 1e3:.0f} tokens/s")
                if args.profile and device == "cuda":
                    profile(f"decode b={batch} {vname} (no graph)", step)
                    profile(f"decode b={batch} {vname} (graph replay)", fn)
                write(results, args.out)
    del model
    if device == "cuda":
        torch.cuda.empty_cache()


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the script itself, times nothing real")
    ap.add_argument("--models", default="", help="comma-separated indexes into CONFIGS (default: all)")
    ap.add_argument("--phases", default="prefill,decode", help="prefill, decode or both (default)")
    ap.add_argument("--batches", default="1,16", help="decode batch sizes (default: 1,16)")
    ap.add_argument("--profile", action="store_true", help="also print each variant's kernels by GPU time")
    ap.add_argument("--profile-cpu", action="store_true", help="with the prefill profile, its CPU side too")
    args = ap.parse_args(argv)
    import logging

    import mlp_fuser  # noqa: F401

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("mlp_fuser").setLevel(logging.INFO)  # one line per compiled graph: how many MLPs fused
    torch._dynamo.config.cache_size_limit = 64
    results = []
    names = list(CONFIGS)
    chosen = [names[int(i)] for i in args.models.split(",")] if args.models else names
    for name in chosen:
        try:
            run_model(name, CONFIGS[name], args, results)
        except Exception as e:  # report, keep the other model's numbers
            log(f"{name}: FAILED: {type(e).__name__}: {str(e)[:500]}")
    from mlp_fuser import dispatch

    log("dispatcher's choices:", {k[2:]: v for k, v in dispatch._choice_cache.items()})
    print("\n".join(write(results, args.out)))
    return 0


def write(results, out):
    """The table so far, to out/generate.md and out/generate.json (rewritten after every measurement)."""
    lines = ["| model | phase | variant | ms | tokens/s | speed-up vs compile | logits rel err |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        base = next((b for b in results if b["model"] == r["model"] and b["phase"] == r["phase"]
                     and b["variant"] == "compile"), None)
        sp = base["ms"] / r["ms"] if base else float("nan")
        lines.append(f"| {r['model']} | {r['phase']} | {r['variant']} | {r['ms']:.3f} | {r['tokens_per_s']:.0f} | "
                     f"{sp:.3f}x | {r['logits_rel_err']:.1e} |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "generate.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "generate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


if __name__ == "__main__":
    sys.exit(main())
