"""Routed experts (mixture of experts) through mlp_fuser, the three ways in.

    python examples/moe_experts.py

A tiny random Qwen3-MoE stands in for your model (no download). Its experts modules run as mlp_fuser::moe_mlp:
through transformers' own switch (``set_experts_implementation("mlp_fuser")``, which ``generate`` keeps while
decoding), through ``mlp_fuser.patch``, and inside a graph compiled with ``mlp_fuser.backend``. Each is checked
against the model as transformers runs it; ``explain`` says what was fused.
"""

import torch
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import mlp_fuser

config = Qwen3MoeConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
model = Qwen3MoeForCausalLM(config).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 16))
with torch.no_grad():
    expected = model(input_ids).logits


def check(name, logits):
    err = ((logits - expected).abs().max() / expected.abs().max()).item()
    print(f"{name}: max |logits - transformers'| / max |logits| = {err:.1e}")
    assert err < 2e-6, (name, err)  # fp32 rounding (≈ 3e-7 here); an expert output 0.1% off reads ≈ 2e-5


# 1. transformers' experts switch (or from_pretrained(..., experts_implementation="mlp_fuser"))
default = model.config._experts_implementation  # transformers' own: "grouped_mm"
model.set_experts_implementation("mlp_fuser")
with torch.no_grad():
    check('set_experts_implementation("mlp_fuser")', model(input_ids).logits)
    tokens = model.generate(input_ids[:1], max_new_tokens=8, do_sample=False)
model.set_experts_implementation(default)
with torch.no_grad():
    assert torch.equal(tokens, model.generate(input_ids[:1], max_new_tokens=8, do_sample=False))
print("generate with the mlp_fuser experts: the same 8 tokens")

# 2. patch: the experts, and any dense or shared-expert MLPs, in place; unpatch undoes it
mlp_fuser.patch(model)
with torch.no_grad():
    check("mlp_fuser.patch", model(input_ids).logits)
mlp_fuser.unpatch(model)

# 3. the graph pass: transformers' grouped_mm experts become one op in the captured graph
compiled = torch.compile(model, backend=mlp_fuser.backend)
with torch.no_grad():
    check("torch.compile(backend=mlp_fuser.backend)", compiled(input_ids).logits)

report = mlp_fuser.explain(model, input_ids)
print(report)
assert len(report.fused) == config.num_hidden_layers, report  # every layer's experts, one op each
print("routed experts through mlp_fuser: OK")
