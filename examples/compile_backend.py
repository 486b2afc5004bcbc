"""The three-line use: compile any HF model with mlp_fuser's backend.

    python examples/compile_backend.py

A tiny random LLaMA stands in for your model (no download); its gated MLPs become mlp_fuser::gated_mlp in
the compiled graph, the rest goes to Inductor. The output is checked against the eager model.
"""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlp_fuser

config = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(config).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 16))

# ---- the three lines ----
compiled = torch.compile(model, backend=mlp_fuser.backend)
with torch.no_grad():
    logits = compiled(input_ids).logits
# -------------------------

with torch.no_grad():
    expected = model(input_ids).logits
err = (logits - expected).abs().max().item()
print(f"logits {tuple(logits.shape)}, max |compiled - eager| = {err:.2e}")
assert torch.allclose(logits, expected, atol=1e-4, rtol=1e-4), err
print("compiled with mlp_fuser.backend: OK")
