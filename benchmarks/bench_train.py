"""A training step, as people fine-tune: step time and peak memory of eager, torch.compile, the backend and patch.

    python3 benchmarks/bench_train.py --out DIR [--shapes 4x1024,1x4096] [--variants ...] [--steps 10]
    python3 benchmarks/bench_train.py --tiny --device cpu         # checks the script itself
    python3 benchmarks/bench_train.py --model qwen3moe-small --out DIR [--shapes 1x1024,4x1024] [--adamw] [--budget-s S]
    python3 benchmarks/bench_train.py --model qwen3moe-small --tiny --device cpu
    python3 benchmarks/bench_train.py --model gptoss-small --shapes 4x2048 --out DIR

Model: LLaMA (hidden 2048, intermediate 5632, 8 layers, 32 query / 4 KV heads, vocabulary 32000),
``LlamaForCausalLM`` from its config with random weights, bf16, SDPA attention, train mode. One step = forward
with ``labels`` (the loss) + backward; no optimizer; gradients set to None before each step.

Variants (``--variants``, in this order): ``eager``; ``compile`` (``torch.compile(model)``); ``backend-recompute``
and ``backend-save`` (``torch.compile(model, backend=mlp_fuser.make_backend(backward=...))``); ``patch-recompute``
and ``patch-save`` (``mlp_fuser.patch(model, backward=...)``, undone after); on request, ``patch-whole``
(``patch(model, per_module=False)``: the whole forward through Dynamo, the path of the first 2× slowdown).

``--model qwen3moe-small``: Qwen3-MoE with Qwen3-30B-A3B's layer (hidden 2048, 32 query / 4 KV heads, head_dim 128,
128 experts of intermediate 768, top 8, vocabulary 151936), 8 layers (``--layers``), built on the meta device and
filled in place. Its default variants (``MOE_VARIANTS``): ``eager`` (transformers' default experts, grouped_mm),
``experts`` (``set_experts_implementation("mlp_fuser")``; with gradients the dispatcher's choice between the Triton
backward and autograd through grouped_mm, logged with both steps' times), ``patch-recompute``, ``compile``,
``compile-experts`` (torch.compile with the mlp_fuser experts: the op under Inductor) and ``backend-recompute``
(which leaves training graphs' experts to Inductor: near miss "training"); on request ``experts-aten``
(the experts switch with its grouped_mm rows forced, ``MLP_FUSER_IMPL=grouped_mm``: the op's path before its Triton
backward), ``experts-gw`` (the experts switch with the backward row ``triton_moe_backward_grouped_wgrad`` forced:
the Triton backward with its weight gradients by grouped_mm; on the CPU the aten rows, as ``experts-aten``),
``experts-gx`` (the same with ``triton_moe_backward_grouped`` forced: dx by grouped_mm too) and
``experts-save`` (the experts switch with ``config.moe_backward = "save"``: the forward keeps gate/up's output, T·k·2I
elements a layer, and the backward reads it instead of recomputing that grouped GEMM), ``compile-experts-save`` (the
same under torch.compile). ``patch-save`` on an MoE model
keeps the experts' gate/up output too (``patch(backward="save")`` reaches them); ``patch-recompute`` does not.
``experts-free`` and ``compile-free`` (on request): the experts replaced by one multiply (x times its routing weights'
sum, differentiable in both), eager and under torch.compile: the step as if the experts cost nothing, so eager ÷
``experts-free`` is the most any experts implementation can gain on that step.

``--model gptoss-small``: GPT-OSS with GPT-OSS-20B's layer (hidden 2880, 64 query / 8 KV heads of 64, 32 experts of
intermediate 2880, top 4, interleaved clamped SwiGLU with biases, sliding and full attention alternating, eager
attention for its sinks), 8 layers; the same variants as qwen3moe-small.

Step time: the median of ``--steps`` steps after ``--warmup`` warm-up steps (compilation and the op's kernel choice
happen there), each step timed between torch.cuda.synchronize() calls. Peak: torch.cuda.max_memory_allocated()
during a step minus torch.cuda.memory_allocated() before it (peak stats reset before the step), the largest over
the timed steps. ``--adamw``: each step also runs a fused AdamW step (the weights are restored after each
variant, so that every variant starts from the same ones). Each variant's first loss is compared with eager's. The
table is printed last and written, with the raw numbers, to OUT/train.md and OUT/train.json after every measurement.
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
from own_code import own_forward

MODEL = dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
             num_key_value_heads=4, vocab_size=32000)
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
MOE_MODEL = dict(hidden_size=2048, num_hidden_layers=8, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
                 moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, norm_topk_prob=True,
                 vocab_size=151936)
MOE_TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=256)
GPTOSS_MODEL = dict(hidden_size=2880, intermediate_size=2880, num_hidden_layers=8, num_attention_heads=64,
                    num_key_value_heads=8, head_dim=64, num_local_experts=32, num_experts_per_tok=4, vocab_size=201088)
GPTOSS_TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2, vocab_size=256)
MOE_FAMILIES = {  # --model: (config class, model class, attention, dims, tiny dims)
    "qwen3moe-small": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", "sdpa", MOE_MODEL, MOE_TINY),
    "gptoss-small": ("GptOssConfig", "GptOssForCausalLM", "eager", GPTOSS_MODEL, GPTOSS_TINY),  # sinks: no sdpa
}
VARIANTS = ["eager", "compile", "backend-recompute", "backend-save", "patch-recompute", "patch-save"]
MOE_VARIANTS = ["eager", "experts", "patch-recompute", "compile", "compile-experts", "backend-recompute"]
# the experts switch
EXPERTS_SWITCH = ("experts", "experts-aten", "experts-gw", "experts-gx", "experts-save", "compile-experts",
                  "compile-experts-save")
FREE = ("experts-free", "compile-free")  # the experts as one multiply: the ceiling of any experts implementation
FREE_NAME = "bench_free"


def free_experts(self, hidden_states, top_k_index, top_k_weights):
    """Experts that cost one multiply: x scaled by its routing weights' sum (so the router still gets gradients)."""
    return hidden_states * top_k_weights.sum(-1, keepdim=True).to(hidden_states.dtype)
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


def build_moe(device, dtype, tiny, layers=None, family="qwen3moe-small"):
    """The MoE family's model with random weights: built on the meta device, then filled in place (normal 0.02;
    1-D parameters: norms, sinks, router biases, 1)."""
    import transformers

    config_cls, model_cls, attention, full, small = MOE_FAMILIES[family]
    dims = dict(small if tiny else full, **({"num_hidden_layers": layers} if layers else {}))
    cfg = getattr(transformers, config_cls)(max_position_embeddings=4096, **dims)
    cfg._attn_implementation = attention
    with torch.device("meta"):
        model = getattr(transformers, model_cls)(cfg).to(dtype)
    model = model.to_empty(device=device).train()
    with torch.device(device):  # its buffers were left empty
        model.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(1.0) if p.dim() == 1 else p.normal_(0.0, 0.02, generator=g)
    return model, cfg


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


def measure(model, forward, ids, device, warmup, steps, profile=None, opt=None):
    """(median ms, peak bytes above the memory allocated before the step, first loss); ``opt``: an optimizer
    stepped in each step."""
    def step():
        model.zero_grad(set_to_none=True)
        loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        if opt is not None:
            opt.step()
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

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    log(f"  profile {label}: {sum(e.self_device_time_total for e in kernels) / 1e3:.2f} ms of kernels in "
        f"{sum(e.count for e in kernels)} launches; ms, count, kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        log(f"    {e.self_device_time_total / 1e3:7.2f} {e.count:5d}  {e.key[:100]}")
    # the copies (copy_, clone, contiguous, to) by input shapes: a layout conversion shows up here with its size
    copies = [e for e in prof.key_averages(group_by_input_shape=True)
              if e.key in ("aten::copy_", "aten::clone", "aten::contiguous", "aten::_to_copy")]
    log("  copies: GPU ms, count, op, input shapes")
    for e in sorted(copies, key=lambda e: -e.device_time_total)[:10]:
        log(f"    {e.device_time_total / 1e3:7.2f} {e.count:5d}  {e.key} {str(e.input_shapes)[:120]}")


def run_variant(name, model, ids, args, counter):
    import mlp_fuser
    from mlp_fuser import config
    from mlp_fuser.patch import experts

    torch._dynamo.reset()
    counter.fused = 0
    if name in EXPERTS_SWITCH:
        model.set_experts_implementation(experts.NAME)
    if name in FREE:
        from transformers.integrations.moe import ExpertsInterface
        ExpertsInterface.register(FREE_NAME, free_experts)
        model.set_experts_implementation(FREE_NAME)
    forced, moe_backward = config.force_impl, config.moe_backward
    if name in ("experts-save", "compile-experts-save"):  # gate/up's output kept: the backward reads no W_gu
        config.moe_backward = "save"
    if name == "experts-aten":
        config.force_impl = "grouped_mm" if args.device == "cuda" else "reference"  # the aten rows: CUDA's, CPU's
    grouped_rows = {"experts-gw": "triton_moe_backward_grouped_wgrad", "experts-gx": "triton_moe_backward_grouped"}
    if name in grouped_rows:
        config.force_impl = grouped_rows[name] if args.device == "cuda" else "reference"
    if name in ("eager", "experts", "experts-aten", "experts-gw", "experts-gx", "experts-save", "experts-free"):
        forward = model
    elif name in ("compile", "compile-experts", "compile-experts-save", "compile-free"):
        forward = torch.compile(own_forward(model))
    elif name.startswith("backend-"):
        forward = torch.compile(own_forward(model), backend=mlp_fuser.make_backend(backward=name.split("-")[1]))
    elif name == "patch-whole":
        forward = mlp_fuser.patch(model, per_module=False)
    else:
        forward = mlp_fuser.patch(model, backward=name.split("-")[1])
    saved = opt = None
    if args.adamw:  # the variants start from the same weights
        saved = {k: v.detach().clone() for k, v in model.state_dict().items()}
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5, fused=args.device == "cuda")
    try:
        ms, peak, loss = measure(model, forward, ids, args.device, args.warmup, args.steps,
                                 f"{tuple(ids.shape)} {name}" if args.profile else None, opt)
        if name.startswith("patch-") and name != "patch-whole":
            fused = len(model.__dict__.get("_mlp_fuser_fused_modules", ()))
        else:
            fused = counter.fused
    finally:
        if name.startswith("patch-"):
            mlp_fuser.unpatch(model)
        if name in EXPERTS_SWITCH + FREE:
            model.set_experts_implementation("grouped_mm")
        config.force_impl, config.moe_backward = forced, moe_backward
        if saved is not None:
            with torch.no_grad():
                model.load_state_dict(saved)
            del saved, opt
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


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--model", choices=["llama", *MOE_FAMILIES], default="llama")
    ap.add_argument("--layers", type=int, default=None, help="the MoE models: this many layers (default 8)")
    ap.add_argument("--shapes", default=None, help="B×T pairs, comma-separated (default 4x1024,1x4096; "
                    "qwen3moe-small 1x1024,4x1024)")
    ap.add_argument("--variants", default=None, help=f"default {','.join(VARIANTS)}; qwen3moe-small "
                    f"{','.join(MOE_VARIANTS)}")
    ap.add_argument("--adamw", action="store_true", help="each step also runs a fused AdamW step")
    ap.add_argument("--budget-s", type=float, default=None, help="start no variant that would end past this many "
                    "seconds (the last variant's seconds as the estimate); skipped ones are listed")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--profile", action="store_true", help="profile one more step per variant: GPU time by kernel")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer toy model (checks the script, on any device)")
    ap.add_argument("--triton-backward", action="store_true",
                    help="let the dispatcher also time the Triton dh GEMM (mlp_fuser.config.triton_backward, opt-in)")
    args = ap.parse_args(argv)
    moe = args.model in MOE_FAMILIES
    args.shapes = args.shapes or ("1x1024,4x1024" if moe else "4x1024,1x4096")
    variants = (args.variants or ",".join(MOE_VARIANTS if moe else VARIANTS)).split(",")
    known = VARIANTS + EXTRA + (list(EXPERTS_SWITCH + FREE) if moe else [])
    if set(variants) - set(known):
        ap.error(f"unknown variant(s) {sorted(set(variants) - set(known))}; known: {', '.join(known)}")
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
    model, cfg = (build_moe(args.device, dtype, args.tiny, args.layers, args.model) if moe
                  else build(args.device, dtype, args.tiny))
    dims = MOE_FAMILIES[args.model][4 if args.tiny else 3] if moe else (TINY if args.tiny else MODEL)
    env = dict(torch=torch.__version__, transformers=transformers.__version__,
               gpu=torch.cuda.get_device_name() if args.device == "cuda" else args.device,
               model=dict(dims, num_hidden_layers=cfg.num_hidden_layers), dtype=str(dtype), steps=args.steps,
               warmup=args.warmup, adamw=args.adamw)
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    log("bench_train:", env)
    os.makedirs(args.out, exist_ok=True)
    rows, skipped, last_s = [], [], 0.0
    for B, T in shapes:
        g = torch.Generator().manual_seed(B * 10007 + T)
        ids = torch.randint(0, cfg.vocab_size, (B, T), generator=g).to(args.device)
        for name in variants:
            if args.budget_s is not None and time.perf_counter() - t_start + last_s > args.budget_s:
                skipped.append(f"{B}×{T} {name}")
                log(f"{B}×{T} {name}: not started (--budget-s {args.budget_s:.0f})")
                continue
            t0 = time.perf_counter()
            r = run_variant(name, model, ids, args, counter)
            r.update(shape=f"{B}×{T}", variant=name, wall_s=time.perf_counter() - t0)
            rows.append(r)
            last_s = r["wall_s"]
            log(f"{B}×{T} {name:<18} {r['ms']:7.1f} ms  peak {r['peak_gib']:.2f} GiB  fused {r['fused']}  "
                f"loss {r['loss']:.4f}  ({r['wall_s']:.0f} s with compilation)")
            with open(os.path.join(args.out, "train.json"), "w") as f:
                json.dump(dict(env=env, rows=rows), f, indent=1)
            with open(os.path.join(args.out, "train.md"), "w") as f:
                f.write(f"# Training step (bench_train.py)\n\n{env}\n\n{table(rows)}\n")
    log(f"total {time.perf_counter() - t_start:.0f} s")
    note = f"\n\nNot run (--budget-s {args.budget_s:.0f}): {'; '.join(skipped)}" if skipped else ""
    with open(os.path.join(args.out, "train.md"), "w") as f:
        f.write(f"# Training step (bench_train.py)\n\n{env}\n\n{table(rows)}{note}\n")
    print(table(rows) + note)
    return 0


if __name__ == "__main__":
    sys.exit(main())
