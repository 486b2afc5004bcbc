"""What a patched model adds to the Dynamo guards of a compiled call: every call of a compiled model (a CUDA-graph
replay included) evaluates them on the host first. A Python ``LAMBDA_GUARD`` is what Dynamo installs where one object
is reached by two paths (a patched forward holding its module, one object shared by every layer): tens of them per
layer added to the host time of the FP8 Qwen3-MoE's static decode step (benchmarks/NOTES.md, FP8 weights)."""

from __future__ import annotations

import pytest
import torch
from test_bench import _bench_generate

import mlp_fuser


def _guards(model) -> str:
    """The guard tree of the model's forward compiled whole (a backend that runs the graph as captured)."""
    ids = torch.randint(3, 200, (1, 4), generator=torch.Generator().manual_seed(0))

    def step(ids):
        return model(input_ids=ids, use_cache=False).logits

    torch._dynamo.reset()
    compiled = torch.compile(step, backend=lambda gm, example_inputs: gm.forward, fullgraph=True)
    with torch.no_grad():
        compiled(ids)
    entries = torch._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)
    assert len(entries) == 1
    text = str(entries[0].guard_manager)
    torch._dynamo.reset()
    return text


def _per_layer(kind: str, make, patched: bool) -> int:
    """How many guards of ``kind`` a layer adds: a 2-layer model's count less a 1-layer one's (``make(layers)``)."""
    counts = []
    for layers in (1, 2):
        model = make(layers)
        if patched:
            mlp_fuser.patch(model)
        counts.append(_guards(model).count(kind))
    return counts[1] - counts[0]


def _bench_model(name: str, fp8: bool = False):
    """bench_generate's tiny ``name`` (fp32, CPU), or its FP8 twin: every nn.Linear but lm_head transformers'
    FP8Linear, experts FP8Experts."""
    bg = _bench_generate()

    def make(layers):
        model = bg.build(name, "cpu", torch.float32, True, layers)
        return bg.fp8_twin(model) if fp8 else model

    return make


def _phi3(layers):
    """A tiny Phi-3: one merged gate_up weight, whose halves the op reads as views (the proof's graph, no direct)."""
    from transformers import Phi3Config, Phi3ForCausalLM

    torch.manual_seed(0)
    return Phi3ForCausalLM(Phi3Config(vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                      num_attention_heads=4, num_key_value_heads=2, pad_token_id=0)).eval()


def test_patched_fp8_moe_adds_no_python_guard_per_layer():
    """Qwen3-MoE, attention's FP8Linear layers, the router and the FP8 experts patched: per layer, as many Python
    guards as the unpatched (fp32) model has (transformers' own config checks), none of ours."""
    ours = _per_layer("LAMBDA_GUARD", _bench_model("qwen3moe", fp8=True), True)
    theirs = _per_layer("LAMBDA_GUARD", _bench_model("qwen3moe"), False)
    assert ours == theirs, f"patched FP8: {ours} Python guards a layer, unpatched: {theirs}"


@pytest.mark.parametrize("model", ["llama", "llama_fp8", "phi3"])
def test_patched_dense_mlps_add_no_python_guard_per_layer(model):
    """Dense MLPs patched (``FusedModuleForward``): LLaMA's through the generated direct call (FP8: attention's
    FP8Linear layers too), Phi-3's merged gate_up through the proof's graph. Per layer, as many Python guards as the
    unpatched model has."""
    make, plain = {"llama": (_bench_model("1b"), _bench_model("1b")),
                   "llama_fp8": (_bench_model("1b", fp8=True), _bench_model("1b")),
                   "phi3": (_phi3, _phi3)}[model]
    ours, theirs = _per_layer("LAMBDA_GUARD", make, True), _per_layer("LAMBDA_GUARD", plain, False)
    assert ours == theirs, f"patched {model}: {ours} Python guards a layer, unpatched: {theirs}"
