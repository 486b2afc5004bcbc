"""mlp_fuser.explain on several HF families side by side (tiny random models, no download).

    python examples/explain_models.py [model_type ...]

For each family it builds ``AutoConfig.for_model(model_type)`` shrunk to a toy size (hidden 64, 2 layers),
prints the explain report, and ends with one summary line per family.
"""

import sys

import mlp_fuser
from mlp_fuser._hf import example_inputs, tiny_model

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
        summary.append((model_type, type(model).__name__, text.strip().splitlines()[0] if text.strip() else ""))
    print("==================== summary ====================")
    for model_type, cls, first in summary:
        print(f"{model_type:<10} {cls:<28} {first}")


if __name__ == "__main__":
    main(sys.argv[1:] or FAMILIES)
