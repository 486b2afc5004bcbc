"""Host time of one MLP call inside a model's ``generate`` against the same module in a tight loop, eager and patched.

    python benchmarks/bench_insitu.py [--reps 6] [--device cpu|cuda]

A LLaMA small enough that compute is negligible (hidden 64, intermediate 128, 8 layers, fp32, one CPU thread), so
what is timed is the host's cost of a call: wall clock around each layer's MLP during one 32-token ``generate``,
and the same module called 3000 times in a row. The op's Python path costs more inside the model than in a loop
(benchmarks/NOTES.md, "The op on the host, in situ"); this measures that on any machine, the CPU included.
"""

from __future__ import annotations

import argparse
import time

import torch


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=6)
    ap.add_argument("--device", default="cpu")
    args = ap.parse_args(argv)
    from transformers import LlamaConfig, LlamaForCausalLM

    import mlp_fuser

    torch.set_num_threads(1)
    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=8, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to(args.device).eval()
    model.generation_config.eos_token_id = None
    model.generation_config.pad_token_id = 0
    ids = torch.randint(3, 256, (1, 8), device=args.device)
    x = torch.randn(1, 1, 64, device=args.device)
    spent = [0.0, 0]

    def gen(n):
        return model.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids))

    def timed_generate():
        wrapped = []
        for layer in model.model.layers:
            own = layer.mlp.__dict__.get("forward")

            def timed(*a, _f=own or layer.mlp.forward, **k):
                t0 = time.perf_counter()
                out = _f(*a, **k)
                spent[0] += time.perf_counter() - t0
                spent[1] += 1
                return out

            layer.mlp.forward = timed
            wrapped.append((layer.mlp, own))
        spent[:] = [0.0, 0]
        gen(32)
        for module, own in wrapped:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.forward = own
        return spent[0] / spent[1] * 1e6

    def loop(module, n=3000):
        best = float("inf")
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(n):
                module(x)
            best = min(best, (time.perf_counter() - t0) / n * 1e6)
        return best

    rows = {"eager": [], "patch": []}
    with torch.no_grad():
        for _ in range(args.reps):
            for path in rows:
                if path == "patch":
                    mlp_fuser.patch(model)
                gen(8)
                rows[path].append((timed_generate(), loop(model.model.layers[0].mlp)))
                if path == "patch":
                    mlp_fuser.unpatch(model)
    print(f"host µs per MLP call ({args.device}, {args.reps} repetitions): in situ min / median, loop min / median")
    for path, values in rows.items():
        situ, tight = sorted(v[0] for v in values), sorted(v[1] for v in values)
        print(f"  {path:6} in situ {situ[0]:6.1f} / {situ[len(situ) // 2]:6.1f}   loop {tight[0]:6.1f} / "
              f"{tight[len(tight) // 2]:6.1f}")


if __name__ == "__main__":
    main()
