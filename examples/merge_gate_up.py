"""Gate and up as one weight: mlp_fuser.merge_gate_up, then patch or compile as usual.

    python examples/merge_gate_up.py

A tiny random LLaMA stands in for your model (no download). merge_gate_up re-stores each MLP's gate_proj and
up_proj weights as the two halves of one buffer (the same Parameter objects, the same outputs), so the fused op can
run one GEMM over both, and quack's gated GEMM where quack-kernels is installed on a Hopper GPU. On the GPU it
prints the path the dispatcher chose per shape; on the CPU the op runs its reference path and the point is only
that nothing changes: the same tokens, a save/load round trip, and split_gate_up giving the storage back.
"""

import logging
import tempfile

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlp_fuser
from mlp_fuser.kernels.common import stored_as_one

device = "cuda" if torch.cuda.is_available() else "cpu"
dtype = torch.bfloat16 if device == "cuda" else torch.float32
config = LlamaConfig(
    vocab_size=512, hidden_size=256, intermediate_size=768, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
model = LlamaForCausalLM(config).to(device, dtype).eval()
input_ids = torch.randint(0, config.vocab_size, (2, 16), device=device)
with torch.no_grad():
    reference = model.generate(input_ids, max_new_tokens=8, do_sample=False)

if device == "cuda":
    logging.basicConfig()
    logging.getLogger("mlp_fuser").setLevel(logging.INFO)  # the dispatcher's choice per shape, with its timings

# ---- the two lines ----
mlp_fuser.patch(model, merge_gate_up=True)      # or: mlp_fuser.merge_gate_up(model), then torch.compile(backend=...)
with torch.no_grad():
    tokens = model.generate(input_ids, max_new_tokens=8, do_sample=False)
# -----------------------

mlp = model.model.layers[0].mlp
g, u = mlp.gate_proj.weight, mlp.up_proj.weight
print(f"gate and up stored as one: {stored_as_one(g, u, g.data_ptr(), u.data_ptr())}")
print(f"tokens equal to the unpatched model's: {torch.equal(tokens, reference)}")
assert stored_as_one(g, u, g.data_ptr(), u.data_ptr())
if device == "cpu":  # the reference path computes what the modules do; on a GPU bf16 kernels round differently
    assert torch.equal(tokens, reference)

with tempfile.TemporaryDirectory() as folder:  # save_pretrained copies the halves apart; the saved model loads as usual
    model.save_pretrained(folder)
    loaded = LlamaForCausalLM.from_pretrained(folder, dtype=dtype).to(device).eval()
    with torch.no_grad():
        same = torch.equal(loaded.model.layers[0].mlp.up_proj.weight, u)
print(f"save_pretrained / from_pretrained round trip keeps the weights: {same}")
assert same

mlp_fuser.unpatch(model)  # the forwards back, and each weight in a storage of its own again
assert not stored_as_one(g, u, g.data_ptr(), u.data_ptr())
print("merge_gate_up: OK")
