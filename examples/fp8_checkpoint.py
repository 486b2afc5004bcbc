"""An FP8 checkpoint (transformers' FineGrainedFP8 format) run offline through mlp_fuser.

    python examples/fp8_checkpoint.py [--device cuda] [--layers 2] [--tokens 8]

FP8 checkpoints such as Qwen3-30B-A3B-FP8 hold every linear as float8_e4m3fn with one fp32 scale per 128 x 128
block (``weight_scale_inv``); transformers loads them as ``FP8Linear`` and ``FP8Experts``, whose forward fetches a
Triton kernel from the Hub on first use: offline, that forward raises. ``mlp_fuser.patch(model)`` fuses the MLPs and
routed experts into mlp_fuser's FP8 ops and, where transformers' kernel cannot load, runs the other FP8 linears
(attention) through the same FP8 GEMM, so the model runs without the Hub.

No download here: a tiny random Qwen3-MoE (layer 0 a dense MLP, the others routed experts) is quantized as
transformers' FP8 quantizer stores it and saved with ``save_pretrained``. On a GPU ``from_pretrained`` loads it back
as FP8Linear / FP8Experts. On the CPU transformers 5.17 dequantizes FP8 checkpoints at load (plain Linears, fp32),
so there the example runs the FP8 model it built, the very modules and tensors a GPU load gives. The dequantized
load in float64 is the reference both FP8 forwards are measured against: transformers' own (its code on an aten
stand-in for its Hub kernel, ``transformers_fp8_in_aten`` from ``mlp_fuser.patch.hf_fp8``) and the patched model's.
"""

import argparse
import tempfile

import torch
from transformers import AutoModelForCausalLM, FineGrainedFP8Config, Qwen3MoeConfig, Qwen3MoeForCausalLM
from transformers.integrations.finegrained_fp8 import replace_with_fp8_linear

import mlp_fuser
from mlp_fuser.patch.hf_fp8 import transformers_fp8_in_aten

ap = argparse.ArgumentParser()
ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
ap.add_argument("--layers", type=int, default=2, help="layer 0 a dense MLP, the others routed experts")
ap.add_argument("--tokens", type=int, default=8, help="tokens to generate")
args = ap.parse_args()
if args.layers < 2:
    ap.error("--layers: at least 2 (a dense layer and an experts layer)")
device = torch.device(args.device)
dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
BLOCK = 128  # the released checkpoints' 128 x 128 blocks; every size below a multiple of it


def quantize(w):
    """w (..., N, K) as float8_e4m3fn and its per-block scale_inv (..., N/128, K/128), amax / 448 per block."""
    *lead, N, K = w.shape
    blocks = w.float().reshape(*lead, N // BLOCK, BLOCK, K // BLOCK, BLOCK)
    scale = blocks.abs().amax(dim=(-3, -1)).clamp(min=1e-12) / torch.finfo(torch.float8_e4m3fn).max
    q = (blocks / scale[..., :, None, :, None]).to(torch.float8_e4m3fn).reshape(w.shape)
    return q, scale


def make_fp8_checkpoint(model):
    """``model`` turned, in place, into what transformers' FP8 quantizer makes of it: every nn.Linear but lm_head an
    FP8Linear, every experts module FP8Experts, their weights float8 with a ``*_scale_inv`` beside each."""
    weights = {name: t.detach().clone() for name, t in model.state_dict().items()}
    qconfig = FineGrainedFP8Config(weight_block_size=[BLOCK, BLOCK], modules_to_not_convert=["lm_head"])
    replace_with_fp8_linear(model, ["lm_head"], quantization_config=qconfig, pre_quantized=True)  # on "meta"
    state = {}
    for name, t in model.state_dict().items():
        if t.dtype == torch.float8_e4m3fn:  # q_proj.weight_scale_inv, experts.down_proj_scale_inv, ...
            state[name], state[name + "_scale_inv"] = quantize(weights[name])
        elif name not in state:
            state[name] = weights[name]
    model.load_state_dict(state, assign=True)
    model.config.quantization_config = qconfig
    return model


config = Qwen3MoeConfig(
    vocab_size=512, hidden_size=256, intermediate_size=384, moe_intermediate_size=256, num_hidden_layers=args.layers,
    num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=8, num_experts_per_tok=2,
    mlp_only_layers=[0], max_position_embeddings=128,
)  # fmt: skip
torch.manual_seed(0)
fp8 = make_fp8_checkpoint(Qwen3MoeForCausalLM(config).eval())
with tempfile.TemporaryDirectory() as folder:
    fp8.save_pretrained(folder)  # the Hub's layout: per-expert float8 weights, each with its weight_scale_inv
    if device.type == "cuda":  # a GPU load keeps the float8 weights
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, device_map=device).eval()
    else:
        model = fp8
        print("on the CPU from_pretrained dequantizes FP8 checkpoints (transformers 5.17): the FP8 model as built runs")
    # the float64 reference: the same checkpoint dequantized at load
    reference = AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float64, quantization_config=FineGrainedFP8Config(dequantize=True)).to(device).eval()
reference.set_experts_implementation("eager")  # grouped_mm takes no float64
layer0, layer1 = model.model.layers[0], model.model.layers[1]
print(f"the FP8 model: {type(layer0.mlp.gate_proj).__name__} {layer0.mlp.gate_proj.weight.dtype}, "
      f"{type(layer1.mlp.experts).__name__} {layer1.mlp.experts.gate_up_proj.dtype}")

prompt = torch.randint(0, config.vocab_size, (2, 16), device=device)
try:
    with torch.no_grad():
        model(prompt)
    print("transformers' FP8 forward runs here: its kernel loaded from the Hub")
except ImportError as e:  # offline, or no `kernels` package: the Hub kernel cannot load
    print(f"transformers' FP8 forward raised ImportError ({str(e).split(':')[0]}): mlp_fuser.patch runs it instead")
# What patch fuses (explain traces transformers' FP8 layers on an aten stand-in where the Hub kernel cannot load)
print(mlp_fuser.explain(model, prompt))


def run(model):
    with torch.no_grad():
        logits = model(prompt).logits.double()
        tokens = model.generate(prompt, max_new_tokens=args.tokens, do_sample=False)[:, prompt.shape[1]:]
    return logits, tokens


def rel(a, b):
    return ((a - b).norm() / b.norm()).item()


with torch.no_grad():
    ref_logits = reference(prompt).logits
with transformers_fp8_in_aten():  # transformers' FP8Linear / FP8Experts forward, its Hub kernel in aten
    theirs, their_tokens = run(model)
mlp_fuser.patch(model)
ours, our_tokens = run(model)

e_ours, e_theirs = rel(ours, ref_logits), rel(theirs, ref_logits)
print(f"logits error against float64 (dequantized weights): mlp_fuser.patch {e_ours:.2e}, "
      f"transformers' FP8 forward {e_theirs:.2e}; between the two {rel(ours, theirs):.2e}")
if device.type != "cuda":  # the ops' aten path; the CUDA kernels quantize x per token and 128 columns as transformers
    print("  (on the CPU the fused ops compute with the dequantized weights and unquantized activations)")
same = (our_tokens == their_tokens).all(dim=0)
first = int((~same).nonzero()[0]) if not same.all() else None
print(f"generate, {args.tokens} greedy tokens: " + ("the same tokens as transformers' FP8 forward" if first is None
      else f"first difference from transformers' FP8 forward at token {first} (FP8 rounding on a random model)"))
assert 0 < e_ours <= 1.25 * e_theirs, (e_ours, e_theirs)  # the FP8 issue's bar: as accurate as transformers' forward
print("FP8 checkpoint through mlp_fuser: OK")
