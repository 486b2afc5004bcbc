"""What a patched model adds to the Dynamo guards of a compiled call: every call of a compiled model (a CUDA-graph
replay included) evaluates them on the host first. A Python ``LAMBDA_GUARD`` is what Dynamo installs where one object
is reached by two paths (a patched forward holding its module, one object shared by every layer): tens of them per
layer added to the host time of the FP8 Qwen3-MoE's static decode step (benchmarks/NOTES.md, FP8 weights)."""

from __future__ import annotations

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


def _per_layer(kind: str, fp8: bool, patched: bool) -> int:
    """How many guards of ``kind`` a layer adds: a 2-layer model's count less a 1-layer one's."""
    bg = _bench_generate()
    counts = []
    for layers in (1, 2):
        model = bg.build("qwen3moe", "cpu", torch.float32, True, layers)
        if fp8:
            model = bg.fp8_twin(model)  # every nn.Linear but lm_head transformers' FP8Linear, experts FP8Experts
        if patched:
            mlp_fuser.patch(model)
        counts.append(_guards(model).count(kind))
    return counts[1] - counts[0]


def test_patched_fp8_moe_adds_no_python_guard_per_layer():
    """Qwen3-MoE, attention's FP8Linear layers, the router and the FP8 experts patched: per layer, as many Python
    guards as the unpatched (fp32) model has (transformers' own config checks), none of ours."""
    ours, theirs = _per_layer("LAMBDA_GUARD", fp8=True, patched=True), _per_layer("LAMBDA_GUARD", False, False)
    assert ours == theirs, f"patched FP8: {ours} Python guards a layer, unpatched: {theirs}"
