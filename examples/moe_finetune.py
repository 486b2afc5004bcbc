"""Fine-tuning a mixture of experts through mlp_fuser: full fine-tuning, then LoRA on the experts' 3-D weights.

    python examples/moe_finetune.py [--device cuda] [--steps 30]

A tiny random Qwen3-MoE learns a synthetic task (each next token is a fixed permutation of the one before) with
AdamW and gradient checkpointing. Its routed experts train through mlp_fuser::moe_mlp, whose backward runs Triton
kernels on a GPU (chosen per shape against grouped_mm) and the aten math elsewhere, saving only the experts' inputs:

1. full fine-tuning with transformers' experts switch, ``model.set_experts_implementation("mlp_fuser")``;
2. LoRA on the frozen experts: a low-rank update per expert of ``gate_up_proj`` (E, 2I, H) and ``down_proj``
   (E, H, I) through ``torch.nn.utils.parametrize``, as PEFT's ``LoraConfig(target_parameters=[...])`` adapts 3-D
   parameters (PEFT itself is not needed here), run with ``mlp_fuser.patch(model)`` (routers fused too).

Each run's loss curve is checked against the same run with transformers' own experts (grouped_mm).
Under ``torch.compile(model, backend=mlp_fuser.backend)`` a training graph leaves the experts to Inductor's
grouped_mm, which stepped faster there (README, Fine-tuning); the dense MLPs are still fused. Eager mode, as here, is
where the experts' own backward runs.
"""

import argparse
import collections
import copy

import torch
from torch.nn.utils import parametrize
from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

import mlp_fuser

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--steps", type=int, default=12)
ap.add_argument("--rank", type=int, default=4, help="LoRA rank")
args = ap.parse_args()
device = torch.device(args.device)

config = Qwen3MoeConfig(
    vocab_size=128, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
    max_position_embeddings=64, router_aux_loss_coef=0.0,
)  # fmt: skip
torch.manual_seed(0)
base = Qwen3MoeForCausalLM(config).to(device).train()
with torch.no_grad():  # experts at 1/sqrt(fan-in), as trained ones weigh (the random init's 0.02 leaves them silent)
    for layer in base.model.layers:
        for w in (layer.mlp.experts.gate_up_proj, layer.mlp.experts.down_proj):
            w.normal_(0, w.shape[-1] ** -0.5)

# the task: x[i+1] = perm[x[i]]; labels are the inputs (transformers shifts them)
perm = torch.randperm(config.vocab_size, device=device)
g = torch.Generator(device=device).manual_seed(1)
batches = []
for _ in range(4):
    x = [torch.randint(0, config.vocab_size, (8,), generator=g, device=device)]
    for _ in range(31):
        x.append(perm[x[-1]])
    batches.append(torch.stack(x, 1))


def train(model, forward=None, steps=args.steps, lr=1e-2):
    """AdamW over the trainable parameters with gradient checkpointing; the loss of each step."""
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=lr)
    losses = []
    for step in range(steps):
        ids = batches[step % len(batches)]
        loss = (forward or model)(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def ops_in_one_step(model):
    """{op: calls} of mlp_fuser's ops in one training step, under the profiler."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(model, steps=1, lr=0.0)
    return collections.Counter(e.name for e in prof.events() if e.name.startswith("mlp_fuser::"))


def report(title, ours, theirs):
    shown = sorted({0, len(ours) // 3, 2 * len(ours) // 3, len(ours) - 1})
    print(f"{title}: loss " + ", ".join(f"step {i} {ours[i]:.3f}" for i in shown))
    worst = max(abs(a - b) for a, b in zip(ours, theirs))
    print(f"  transformers' grouped_mm experts: the same curve within {worst:.1e}")
    assert ours[-1] < 0.9 * ours[0], ours  # it learns
    assert worst < 1e-4 * ours[0], worst  # the same gradients: fp32 rounding (another expert's gradient: 0.4)


# 1. full fine-tuning through transformers' experts switch
reference = copy.deepcopy(base)
theirs = train(reference)
model = copy.deepcopy(base)
model.set_experts_implementation("mlp_fuser")  # or from_pretrained(..., experts_implementation="mlp_fuser")
calls = ops_in_one_step(copy.deepcopy(model))
print(f"one step: mlp_fuser::moe_mlp {calls['mlp_fuser::moe_mlp']} calls (each layer's forward and its recompute "
      f"under gradient checkpointing), mlp_fuser::moe_mlp_backward {calls['mlp_fuser::moe_mlp_backward']}")
assert calls["mlp_fuser::moe_mlp"] == 2 * calls["mlp_fuser::moe_mlp_backward"] == 2 * config.num_hidden_layers, calls
report('full fine-tuning, set_experts_implementation("mlp_fuser")', train(model), theirs)


# 2. LoRA on the experts' 3-D weights, the base frozen
class ExpertLoRA(torch.nn.Module):
    """W_e + (alpha / r) · B_e A_e for each expert e of a (E, out, in) weight; B starts at zero, as PEFT's does."""

    def __init__(self, w, rank, alpha=8.0):
        super().__init__()
        E, out, inp = w.shape
        self.A = torch.nn.Parameter(torch.randn(E, rank, inp, device=w.device) / inp**0.5)
        self.B = torch.nn.Parameter(torch.zeros(E, out, rank, device=w.device))
        self.scale = alpha / rank

    def forward(self, w):
        return w + self.scale * (self.B @ self.A)


def with_expert_lora(model, rank):
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(2)
    for layer in model.model.layers:
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):  # PEFT: LoraConfig(target_parameters=[...]) on these
            parametrize.register_parametrization(experts, name, ExpertLoRA(getattr(experts, name), rank))
    return model


theirs = train(with_expert_lora(copy.deepcopy(base), args.rank), lr=3e-2)
model = with_expert_lora(copy.deepcopy(base), args.rank)
trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
print(f"LoRA rank {args.rank} on the experts: {trainable} trainable parameters of "
      f"{sum(p.numel() for p in base.parameters())}")
forward = mlp_fuser.patch(model)
fused = [s.path for s in mlp_fuser.explain(model, batches[0]).fused]
print(f"patched with LoRA on: fused {', '.join(fused)}")
assert len(fused) == config.num_hidden_layers, fused  # the op reads the adapted weights: the experts still fuse
report("LoRA on the experts, mlp_fuser.patch", train(model, forward, lr=3e-2), theirs)
print("mixture of experts fine-tuned through mlp_fuser: OK")
