"""transformers' fast decode path with mlp_fuser: a static KV cache, and the decode step compiled by ``generate``.

    python examples/static_cache_generate.py [--layers N --hidden H --intermediate I --tokens T]

``generate(cache_implementation="static", compile_config=CompileConfig(backend=mlp_fuser.backend))`` is the same
call as with Inductor alone; transformers compiles the decode step with mode "reduce-overhead" (CUDA graphs on
a GPU), and mlp_fuser's backend hands that mode to Inductor after fusing the MLPs. A random LLaMA stands in for
your model (no download). Both backends generate greedily from the same prompt; the tokens must be the same (in
float32; in bf16 greedy decoding may part after some tokens, as between any two kernel libraries), then the
decode time per token of each is printed. On the CPU transformers compiles only when told
(``_compile_all_devices``), and no CUDA graph is made: the timings there show nothing of the GPU path.
"""

import argparse
import time

import torch
from transformers import CompileConfig, LlamaConfig, LlamaForCausalLM

import mlp_fuser

ap = argparse.ArgumentParser()
ap.add_argument("--layers", type=int, default=2)
ap.add_argument("--hidden", type=int, default=64)
ap.add_argument("--intermediate", type=int, default=128)
ap.add_argument("--tokens", type=int, default=12)
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
config = LlamaConfig(vocab_size=512, hidden_size=args.hidden, intermediate_size=args.intermediate,
                     num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                     max_position_embeddings=256)
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device).eval()
model.generation_config.eos_token_id = None  # random weights: never stop early
model.generation_config.pad_token_id = 0
prompt = torch.randint(3, config.vocab_size, (2, 8), device=device)


def generate(backend):
    # ---- the call ----
    compile_config = CompileConfig(backend=backend)
    compile_config._compile_all_devices = device != "cuda"  # transformers compiles on the CPU only when told
    return model.generate(prompt, max_new_tokens=args.tokens, do_sample=False, cache_implementation="static",
                          compile_config=compile_config)
    # ------------------


results = {}
for name, backend in (("inductor", "inductor"), ("mlp_fuser.backend", mlp_fuser.backend)):
    torch._dynamo.reset()
    tokens = generate(backend)  # compiles
    generate(backend)
    times = []
    for n in (args.tokens, 1, args.tokens, 1):
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=n, do_sample=False, cache_implementation="static",
                             compile_config=model._last_compile_config)
        if device == "cuda":
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    long, short = min(times[0], times[2]), min(times[1], times[3])
    results[name] = (tokens, (long - short) / (args.tokens - 1) * 1e3)

(ref, ref_ms), (fused, fused_ms) = results["inductor"], results["mlp_fuser.backend"]
assert torch.equal(ref, fused), "the two backends generated different tokens"
print(f"{device}: both backends generated the same {args.tokens} tokens")
for name, (_, ms) in results.items():
    print(f"  {name:18} {ms:7.3f} ms/token decode")
print(f"  speed-up of mlp_fuser.backend: {ref_ms / fused_ms:.3f}x")
