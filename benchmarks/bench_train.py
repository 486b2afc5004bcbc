"""A training step, as people fine-tune: step time and peak memory of eager, torch.compile, the backend and patch.

    python3 benchmarks/bench_train.py --out DIR [--shapes 4x1024,1x4096] [--variants ...] [--steps 10]
    python3 benchmarks/bench_train.py --tiny --device cpu         # checks the script itself

Model: LLaMA (hidden 2048, intermediate 5632, 8 layers, 32 query / 4 KV heads, vocabulary 32000),
``LlamaForCausalLM`` from its config with random weights, bf16, SDPA attention, train mode. One step = forward
with ``labels`` (the loss) + backward; no optimizer; gradients set to None before each step.

Variants (``--variants``, in this order): ``eager``; ``compile`` (``torch.compile(model)``); ``backend-recompute``
and ``backend-save`` (``torch.compile(model, backend=mlp_fuser.make_backend(backward=...))``); ``patch-recompute``
and ``patch-save`` (``mlp_fuser.patch(model, backward=...)``, undone after); on request, ``patch-whole``
(``patch(model, per_module=False)``: the whole forward through Dynamo, the path of the first 2× slowdown).

Step time: the median of ``--steps`` steps after ``--warmup`` warm-up steps (compilation and the op's kernel choice
happen there), each step timed between torch.cuda.synchronize() calls. Peak: torch.cuda.max_memory_allocated()
during a step minus torch.cuda.memory_allocated() before it (peak stats reset before the step), the largest over
the timed steps. Each variant's first loss is compared with eager's. The table is printed last and written, with
the raw numbers, to OUT/train.md and OUT/train.json after every measurement.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time

import torch

MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
VARIANTS = ["eager", "compile", "backend-recompute", "backend-save", "patch-recompute", "patch-save"]
EXTRA = ["patch-whole"]  # on request only: patch(per_module=False), the whole forward through Dynamo (recompute)


def log(*a):
    print(*a, file=sys.stderr, flush=True)


class FusedCount(logging.Handler):
    """Counts the MLPs the backend's graph pass reports fused (its INFO record per graph)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.fused = 0

    def emit(self, record):
        msg = record.getMessage()
        if "chose" in msg:  # the dispatcher's choice per shape, with the candidates' times
            log("  " + msg)
        if ": fused " in msg:
            self.fused += int(msg.split(": fused ", 1)[1].split()[0])


def build(device, dtype, tiny):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(max_position_embeddings=4096, **(TINY if tiny else MODEL))
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).train()
    return model, cfg


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


def measure(model, forward, ids, device, warmup, steps, profile=None):
    """(median ms, peak bytes above the memory allocated before the step, first loss)"""
    def step():
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        return loss

    first = step().item()
    for _ in range(warmup - 1):
        step()
    times, peaks = [], []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)
        sync(device)
        if device == "cuda":
            torch.cuda.reset_peak_memory_stats()
            before = torch.cuda.memory_allocated()
        t0 = time.perf_counter()
        step()
        sync(device)
        times.append((time.perf_counter() - t0) * 1e3)
        if device == "cuda":
            peaks.append(torch.cuda.max_memory_allocated() - before)
    if profile and device == "cuda":
        profile_step(step, profile)
    model.zero_grad(set_to_none=True)
    return statistics.median(times), max(peaks) if peaks else 0, first


def profile_step(step, label):
    """One step under torch.profiler: GPU time by kernel (the largest), and the total."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    log(f"  profile {label}: {sum(e.self_device_time_total for e in kernels) / 1e3:.2f} ms of kernels in "
        f"{sum(e.count for e in kernels)} launches; ms, count, kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        log(f"    {e.self_device_time_total / 1e3:7.2f} {e.count:5d}  {e.key[:100]}")


def run_variant(name, model, ids, args, counter):
    import mlp_fuser

    torch._dynamo.reset()
    counter.fused = 0
    if name == "eager":
        forward = model
    elif name == "compile":
        forward = torch.compile(model)
    elif name.startswith("backend-"):
        forward = torch.compile(model, backend=mlp_fuser.make_backend(backward=name.split("-")[1]))
    elif name == "patch-whole":
        forward = mlp_fuser.patch(model, per_module=False)
    else:
        forward = mlp_fuser.patch(model, backward=name.split("-")[1])
    try:
        ms, peak, loss = measure(model, forward, ids, args.device, args.warmup, args.steps,
                                 f"{tuple(ids.shape)} {name}" if args.profile else None)
        if name.startswith("patch-") and name != "patch-whole":
            fused = len(model.__dict__.get("_mlp_fuser_fused_modules", ()))
        else:
            fused = counter.fused
    finally:
        if name.startswith("patch-"):
            mlp_fuser.unpatch(model)
        torch._dynamo.reset()
    return dict(ms=ms, peak_gib=peak / 2**30, loss=loss, fused=fused)


def table(rows) -> str:
    lines = ["| B×T | variant | step ms | × eager | × compile | peak GiB | ÷ eager | ÷ compile | fused MLPs | loss |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        base = {v["variant"]: v for v in rows if v["shape"] == r["shape"]}
        e, c = base.get("eager"), base.get("compile")

        def speed(b, r=r):
            return f"{b['ms'] / r['ms']:.2f}×" if b else "–"

        def mem(b, r=r):
            return f"{r['peak_gib'] / b['peak_gib']:.2f}" if b and b["peak_gib"] else "–"

        lines.append(f"| {r['shape']} | {r['variant']} | {r['ms']:.1f} | {speed(e)} | {speed(c)} | "
                     f"{r['peak_gib']:.2f} | {mem(e)} | {mem(c)} | {r['fused']} | {r['loss']:.4f} |")
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--shapes", default="4x1024,1x4096", help="B×T pairs, comma-separated")
    ap.add_argument("--variants", default=",".join(VARIANTS))
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="profile one more step per variant: GPU time by kernel")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (checks the script, on any device)")
    ap.add_argument("--triton-backward", action="store_true",
                    help="let the dispatcher also time the Triton dh GEMM (mlp_fuser.config.triton_backward, opt-in)")
    args = ap.parse_args()
    variants = args.variants.split(",")
    if set(variants) - set(VARIANTS + EXTRA):
        ap.error(f"unknown variant(s) {sorted(set(variants) - set(VARIANTS + EXTRA))}; "
                 f"known: {', '.join(VARIANTS + EXTRA)}")
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    from mlp_fuser import config

    config.triton_backward = args.triton_backward
    counter = FusedCount()
    logging.getLogger("mlp_fuser").addHandler(counter)
    logging.getLogger("mlp_fuser").setLevel(logging.INFO)

    import transformers

    t_start = time.perf_counter()
    dtype = torch.bfloat16 if args.device == "cuda" else torch.float32
    model, cfg = build(args.device, dtype, args.tiny)
    env = dict(torch=torch.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               model=TINY if args.tiny else MODEL, dtype=str(dtype), steps=args.steps, warmup=args.warmup)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    log("bench_train:", env)
    os.makedirs(args.out, exist_ok=True)
    rows = []
    for B, T in shapes:
        g = torch.Generator().manual_seed(B * 10007 + T)
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(args.device)
        for name in variants:
            t0 = time.perf_counter()
            r = run_variant(name, model, ids, args, counter)
            r.update(shape=f"{B}×{T}", variant=name, wall_s=time.perf_counter() - t0)
            rows.append(r)
            log(f"{B}×{T} {name:<18} {r['ms']:7.1f} ms  peak {r['peak_gib']:.2f} GiB  fused {r['fused']}  "
                f"loss {r['loss']:.4f}  ({r['wall_s']:.0f} s with compilation)")
            with open(os.path.join(args.out, "train.json"), "w") as f:
                json.dump(dict(env=env, rows=rows), f, indent=1)
            with open(os.path.join(args.out, "train.md"), "w") as f:
                f.write(f"# Training step (bench_train.py)\n\n{env}\n\n{table(rows)}\n")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    print(table(rows))


if __name__ == "__main__":
    main()
