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


def _skippable_roots(make, patched: bool) -> set[str]:
    """The modules whose whole guard subtree Dynamo skips while their dicts are unchanged (torch's recursive dict
    tags: on by default in torch 2.10-2.11, the GPU's), layer numbers dropped."""
    import re

    model = make(2)
    if patched:
        mlp_fuser.patch(model)
    text = _guards(model)
    return {re.sub(r"\['\d+'\]", "[N]", m) for m in re.findall(r"source=(\S+), accessed_by=\S+, type=<class '[^']*'>, "
                                                              r"tag_safe=\(True, True\)", text)}


@pytest.mark.skipif(not hasattr(torch._dynamo.config, "use_recursive_dict_tags_for_guards"),
                    reason="this torch has no recursive dict tags for guards")
@pytest.mark.parametrize("name,fp8", [("qwen3moe", True), ("1b", True), ("1b", False)])
def test_patched_layers_keep_their_guards_skippable(name, fp8):
    """Patched, each layer's attention and MLP are skipped whole while unchanged, as the unpatched model's are: the
    FP8 Qwen3-MoE's (FP8 q/k/v/o, router, FP8 experts), the LLaMA's (the dense MLP; FP8: q/k/v/o too). A forward
    object in a module's ``__dict__``, a ``torch.dtype`` in a constant or a module read through ``__dict__`` makes the
    layer's guards run on every call (on the H100 the FP8 step's host time then doubled: benchmarks/NOTES.md)."""
    with torch._dynamo.config.patch(use_recursive_dict_tags_for_guards=True):
        ours = _skippable_roots(_bench_model(name, fp8=fp8), True)
        theirs = _skippable_roots(_bench_model(name), False)
    layer = "L['model']._modules['model']._modules['layers']._modules[N]._modules"
    assert {f"{layer}['self_attn']", f"{layer}['mlp']"} <= theirs
    ours, theirs = ({r for r in roots if r.startswith(layer) and r.count("_modules[") == 4} for roots in (ours, theirs))
    assert ours == theirs, f"skippable patched: {sorted(ours - theirs)}; not: {sorted(theirs - ours)}"


def test_swapped_classes_copy_as_patched_and_pickle_as_unpatched():
    """Lone FP8 linears and routers get a class of their own: a deepcopy keeps it and its forward reads the copy's
    tensors; pickle (torch.save) writes the model's own classes (loaded: unpatched, the same outputs; patched again,
    swapped again); unpatch gives the classes back. (Unpatched, the FP8 model cannot run here: transformers' kernel
    does not load.)"""
    import copy
    import io

    from mlp_fuser.patch.modules import is_swapped

    model = _bench_model("qwen3moe", fp8=True)(2)
    layer = model.model.layers[0]
    classes = (type(layer.self_attn.q_proj), type(layer.mlp.gate))
    ids = torch.randint(3, 200, (1, 5), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        mlp_fuser.patch(model)
        assert is_swapped(layer.self_attn.q_proj) and is_swapped(layer.mlp.gate)
        assert repr(layer.self_attn.q_proj) == repr(copy.copy(layer.self_attn.q_proj))
        out = model(ids).logits
        twin = copy.deepcopy(model)
        assert mlp_fuser.is_patched(twin) and is_swapped(twin.model.layers[0].self_attn.q_proj)
        assert torch.equal(twin(ids).logits, out)
        twin.model.layers[0].self_attn.q_proj.weight_scale_inv.mul_(3)  # the copy's forwards read the copy's tensors
        twin.model.layers[0].mlp.gate.weight.mul_(-1)
        assert not torch.equal(twin(ids).logits, out) and torch.equal(model(ids).logits, out)
        mlp_fuser.unpatch(model)
        assert (type(layer.self_attn.q_proj), type(layer.mlp.gate)) == classes

        plain = _bench_model("qwen3moe")(2)  # bf16 weights: its routers swapped, nothing packed
        ref = plain(ids).logits
        mlp_fuser.patch(plain)
        assert is_swapped(plain.model.layers[0].mlp.gate)
        buf = io.BytesIO()
        torch.save(plain, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert type(loaded.model.layers[0].mlp.gate) is classes[1] and not mlp_fuser.is_patched(loaded)
        torch.testing.assert_close(loaded(ids).logits, ref, rtol=1e-5, atol=1e-6)
        mlp_fuser.patch(loaded)
        assert is_swapped(loaded.model.layers[0].mlp.gate) and mlp_fuser.is_patched(loaded)
