"""The training step's gradient errors over seeds: how far the fused backward's error against float64 strays from the
unfused model's, per parameter, for each way of patching (the question behind one failure of
tests/test_gpu.py::test_gpu_training_step_bf16_autocast_matches_unfused, run 19).

    python benchmarks/train_error_seeds.py [--seeds 0,1,2,3,4] [--ways patch-save,patch-recompute]

Per seed and way: the largest per-parameter ratio err(fused) / err(unfused) and its parameter, how many parameters
exceed 1.25, and the ratio over all gradients concatenated. Same tiny LLaMA and bf16 autocast as the test.
"""

import argparse
import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlp_fuser
from mlp_fuser.reference import rel_err


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seeds", default="0,1,2,3,4")
    ap.add_argument("--ways", default="patch-save,patch-recompute")
    args = ap.parse_args()
    cfg = LlamaConfig(vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    for seed in map(int, args.seeds.split(",")):
        torch.manual_seed(seed)
        base = LlamaForCausalLM(cfg).cuda().train()
        ids = torch.randint(0, 256, (2, 64), device="cuda")

        def step(model, forward, ids=ids):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                forward(input_ids=ids, labels=ids).loss.backward()
            return {n: p.grad for n, p in model.named_parameters()}

        ref64 = copy.deepcopy(base).double()
        ref64(input_ids=ids, labels=ids).loss.backward()
        ref = {n: p.grad for n, p in ref64.named_parameters()}
        want = step(*(2 * [copy.deepcopy(base)]))
        for way in args.ways.split(","):
            model = copy.deepcopy(base)
            forward = mlp_fuser.patch(model, backward=way.split("-")[1])
            got = step(model, forward)
            ratios = {n: rel_err(got[n], r) / rel_err(want[n], r) for n, r in ref.items()}
            worst = max(ratios, key=ratios.get)
            cat = lambda d, keys=list(ref): torch.cat([d[n].double().flatten() for n in keys])  # noqa: E731
            total = rel_err(cat(got), cat(ref)) / rel_err(cat(want), cat(ref))
            print(f"seed {seed} {way:16s} worst {ratios[worst]:.3f} ({worst}), over 1.25: "
                  f"{sum(v > 1.25 for v in ratios.values())}/{len(ratios)}, all gradients {total:.3f}", flush=True)


if __name__ == "__main__":
    main()
