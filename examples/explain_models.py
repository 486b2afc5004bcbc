"""mlp_fuser.explain on several HF families side by side (tiny random models, no download).

    python examples/explain_models.py [model_type ...]

For each family it builds ``AutoConfig.for_model(model_type)`` shrunk to a toy size (hidden 64, 2 layers),
prints the explain report, and ends with one summary line per family.
"""

import sys

import torch

import mlp_fuser
from mlp_fuser.tools.models import example_inputs, tiny_model

FAMILIES = ["llama", "qwen3", "gemma2", "phi3", "gpt2", "opt", "gpt_neox", "bert"]


def main(families):
    summary = []
    for model_type in families:
        model = tiny_model(model_type)
        report = mlp_fuser.explain(model, *example_inputs(model))
        text = str(report)
        print(f"==================== {model_type} ({type(model).__name__}) ====================")
        print(text.rstrip())
        print()
        patterns = sorted({site.pattern for site in report.fused})
        activations = sorted({site.activation for site in report.fused})
        n_fused, n_missed = len(report.fused), len(report.near_misses)
        summary.append((model_type, type(model).__name__, n_fused, n_missed, patterns, activations))
        # Dynamo caches compiled frames per code object, and HF's forward wrappers are shared by every model
        # class: start each model afresh so that the recompile limit is never reached.
        torch._dynamo.reset()
    print("==================== summary ====================")
    print(f"{'family':<12} {'model class':<28} {'fused':>5} {'not fused':>9}  pattern(s) / activation(s)")
    for model_type, cls, n_fused, n_missed, patterns, activations in summary:
        kinds = f"{', '.join(patterns) or '-'} / {', '.join(activations) or '-'}"
        print(f"{model_type:<12} {cls:<28} {n_fused:>5} {n_missed:>9}  {kinds}")


if __name__ == "__main__":
    main(sys.argv[1:] or FAMILIES)
