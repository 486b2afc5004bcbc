"""A fine-tuning step through the fused op, with gradients checked against the unfused model.

    python examples/training_step.py

Two copies of a tiny random LLaMA get the same batch: one as it is, one with its MLPs patched
(``mlp_fuser.patch``: each MLP block calls mlp_fuser::gated_mlp, which keeps the gate and up outputs for its
backward by default, ``backward="save"``, or with ``backward="recompute"`` recomputes them instead of saving
anything of the intermediate's size). The loss and every parameter's gradient must agree; then one AdamW step is
taken and the updated weights must agree too. The same is done through
``torch.compile(backend=mlp_fuser.make_backend(backward="save"))``.
"""

import copy

import torch
from transformers import LlamaConfig, LlamaForCausalLM

import mlp_fuser

config = LlamaConfig(
    vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
base = LlamaForCausalLM(config).train()
batch = torch.randint(0, config.vocab_size, (4, 32))


def train_step(model, forward=None):
    """One step: loss, backward, AdamW. Returns (loss, {name: grad}) before the update."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    loss = (model if forward is None else forward)(input_ids=batch, labels=batch).loss
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss.item(), grads


def fused_op_calls(step):
    """Run ``step()`` under the profiler; return it and how many times mlp_fuser's ops ran (forward and backward)."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        result = step()
    return result, sum(1 for e in prof.events() if e.name.startswith("mlp_fuser::"))


def compare(label, ref, got, atol=1e-5, rtol=1e-4):
    (ref_loss, ref_grads), (loss, grads) = ref, got
    assert grads.keys() == ref_grads.keys()
    worst = max(((g - ref_grads[n]).abs().max().item(), n) for n, g in grads.items())
    print(f"{label:<40} loss {loss:.6f} (unfused {ref_loss:.6f}), max grad diff {worst[0]:.2e} ({worst[1]})")
    assert abs(loss - ref_loss) <= atol + rtol * abs(ref_loss), (loss, ref_loss)
    for n, g in grads.items():
        torch.testing.assert_close(g, ref_grads[n], atol=atol, rtol=rtol, msg=lambda m, n=n: f"{n}: {m}")


unfused = copy.deepcopy(base)
reference = train_step(unfused)

for backward in ("recompute", "save"):  # what the op keeps for its backward: nothing of size (tokens, I), or g and u
    patched = copy.deepcopy(base)
    mlp_fuser.patch(patched, backward=backward)
    result, calls = fused_op_calls(lambda patched=patched: train_step(patched))
    assert calls >= config.num_hidden_layers, f"the fused op ran {calls} times, expected one per layer at least"
    compare(f"mlp_fuser.patch(backward={backward!r})", reference, result)
    for (n, p), q in zip(patched.named_parameters(), unfused.parameters()):
        torch.testing.assert_close(p, q, atol=1e-5, rtol=1e-4, msg=lambda m, n=n: f"after the step, {n}: {m}")

compiled_model = copy.deepcopy(base)
compiled = torch.compile(compiled_model, backend=mlp_fuser.make_backend(backward="save"))
result, calls = fused_op_calls(lambda: train_step(compiled_model, compiled))
assert calls >= config.num_hidden_layers, f"the fused op ran {calls} times, expected one per layer at least"
compare("torch.compile(backend=make_backend(backward='save'))", reference, result)

print("training step through the fused op: gradients match the unfused model")
