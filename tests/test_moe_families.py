"""Routed experts of transformers' MoE families, end to end on the CPU (fp32, tiny random models): the "mlp_fuser"
experts implementation, ``patch`` / ``unpatch``, the backend, ``explain`` and routing edge cases, each against
transformers' own output.
"""

from unittest import mock

import pytest
import torch
from _hf_models import count_ops

import mlp_fuser
from mlp_fuser.graph import fx_pass
from mlp_fuser.patch import experts, hf
from mlp_fuser.patch.modules import fused_mlp
from mlp_fuser.tools import models as _hf

MOE_OP = frozenset({"mlp_fuser::moe_mlp"})
CORE = ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe", "deepseek_v3", "gpt_oss"]
EXTRA = ["afmoe", "axk1", "axk2", "cohere2_moe", "deepseek_v2", "deepseek_v32", "deepseek_v4", "dots1", "ernie4_5_moe",
         "exaone_moe", "flex_olmo", "glm4_moe", "glm4_moe_lite", "glm_moe_dsa", "granitemoe", "granitemoe_swa",
         "granitemoeshared", "hunyuan_v1_moe", "hy_v3", "hy_v4", "inkling_text", "jamba", "kimi_linear", "laguna",
         "mellum", "mimo_v2_flash", "minimax", "minimax_m2", "minimax_m3_vl_text", "phimoe", "qwen3_5_moe_text",
         "qwen3_next", "solar_open", "gemma4_text", "lfm2_moe"]
OVERRIDES = {  # Gemma 4's experts are opt-in; LFM2-MoE's config leaves layer_types unset and two dense layers first
    "gemma4_text": {"enable_moe_block": True, "num_experts": 4, "top_k_experts": 2, "moe_intermediate_size": 64},
    "lfm2_moe": {"layer_types": ["conv", "full_attention"], "num_dense_layers": 1},
}
ATOL, RTOL = 2e-5, 1e-4


def toy(model_type, **overrides):
    """A tiny model whose experts weigh in: expert weights re-drawn at 1/sqrt(fan-in) (the toys' 0.02 would leave
    the experts' share of the logits below any tolerance), biases at 0.5."""
    model = _hf.tiny_model(model_type, **overrides)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for _, m in experts_modules(model):
            for name, p in m.named_parameters(recurse=False):
                std = 0.5 if "bias" in name else (1.0 / min(p.shape[1:]) ** 0.5)
                p.copy_(torch.randn(p.shape, generator=g) * std)
    return model, _hf.example_inputs(model, seq_len=6, batch=2)


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if experts.is_experts(m)]


def logits(model, inputs):
    with torch.no_grad():
        return model(*inputs).logits


def graphs_of(model, inputs, grad: bool) -> list:
    """The graphs Dynamo captures of one forward, with gradients recorded or not (nothing compiled)."""
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    with torch.set_grad_enabled(grad):
        torch.compile(model, backend=record)(*inputs)
    return graphs


def moe_calls(fn):
    return count_ops(fn, MOE_OP)


# ---- 6. the experts switch ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", CORE + EXTRA)
def test_experts_switch(model_type):
    model, inputs = toy(model_type, **OVERRIDES.get(model_type, {}))
    mods = experts_modules(model)
    assert mods
    for name, m in mods:
        assert experts.spec(m).ok, (name, experts.spec(m).reason)
    ref = logits(model, inputs)
    assert set(model.get_experts_implementation().values()) == {"grouped_mm"}
    model.set_experts_implementation("mlp_fuser")
    out = {}
    assert moe_calls(lambda: out.setdefault("y", logits(model, inputs))) == len(mods)
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_experts_switch_compiled(model_type):
    """The switch inside one full graph, compiled before any eager call (the spec is taken at trace time), as
    generate's compiled decode step and torch.compile(model.__call__) trace it: every experts module becomes the op,
    and a second call runs without recompiling."""
    model, inputs = toy(model_type)
    ref = logits(model, inputs)
    model.set_experts_implementation("mlp_fuser")
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    torch._dynamo.reset()
    compiled = torch.compile(model.__call__, backend=record, fullgraph=True)
    with torch.no_grad():
        out = compiled(*inputs).logits
        compiled(*inputs)
    assert len(graphs) == 1
    ops = [n for n in graphs[0].graph.nodes if n.op == "call_function" and "moe_mlp" in str(n.target)]
    assert len(ops) == len(experts_modules(model))
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=RTOL)


def test_gpt_oss_spec():
    model, _ = toy("gpt_oss")
    s = experts.spec(experts_modules(model)[0][1])
    assert s.ok and s.transposed and s.biases
    g = s.gate
    assert (g.activation, g.gated, g.interleaved, g.limit, g.clamp_after, g.up_offset) == (
        "quick_gelu", True, True, 7.0, False, 1.0)


def test_deepseek_v3_grouped_routing_dense_first_layer():
    """n_group/topk_group routing over 8 experts in 4 groups, a dense first layer and shared experts."""
    model, inputs = toy("deepseek_v3", n_routed_experts=8, n_group=4, topk_group=2, num_experts_per_tok=2)
    assert not experts.is_experts(getattr(model.model.layers[0].mlp, "experts", None) or torch.nn.Module())
    assert hasattr(model.model.layers[1].mlp, "shared_experts")
    ref = logits(model, inputs)
    model.set_experts_implementation("mlp_fuser")
    assert moe_calls(lambda: logits(model, inputs)) == 1
    torch.testing.assert_close(logits(model, inputs), ref, atol=ATOL, rtol=RTOL)


def test_experts_matter():
    """The comparison can fail: different expert weights move the logits far beyond the tolerance."""
    model, inputs = toy("qwen3_moe")
    ref = logits(model, inputs)
    with torch.no_grad():
        experts_modules(model)[0][1].down_proj.mul_(1.01)
    assert (logits(model, inputs) - ref).abs().max() > 100 * ATOL


def test_generate_keeps_mlp_fuser():
    model, inputs = toy("qwen3_moe")
    model.set_experts_implementation("mlp_fuser")
    n = moe_calls(lambda: model.generate(inputs[0], max_new_tokens=3, do_sample=False))
    assert n == 3 * len(experts_modules(model))  # prefill and two decode steps, each layer through the op
    assert set(model.get_experts_implementation().values()) == {"mlp_fuser"}
    # off the CPU, generate swaps grouped_mm for batched_mm while decoding, and leaves "mlp_fuser" alone
    with mock.patch.object(type(model), "device", property(lambda self: torch.device("cuda"))):
        with model._optimize_model_for_decode():
            assert set(model.get_experts_implementation().values()) == {"mlp_fuser"}
        model.set_experts_implementation("grouped_mm")
        with model._optimize_model_for_decode():
            assert set(model.get_experts_implementation().values()) == {"batched_mm"}


def test_spec_rejects_with_reason():
    """An experts module the op cannot run: named, and the switch falls back to transformers' grouped_mm."""
    model, inputs = toy("qwen3_moe")
    ref = logits(model, inputs)
    mods = experts_modules(model)
    odd = mods[0][1]
    odd.act_fn = torch.nn.Tanh()  # tanh is no registry activation
    s = experts.spec(odd)
    assert not s.ok and "_apply_gate computes none of the op's gated activations" in s.reason
    with torch.no_grad():
        q = experts_modules(toy("qwen3_moe")[0])[0][1]
        q.down_proj = torch.nn.Parameter(q.down_proj.to(torch.int8), requires_grad=False)
    assert "dtype torch.int8 (quantized experts)" in experts.spec(q).reason
    model.set_experts_implementation("mlp_fuser")
    out = {}
    assert moe_calls(lambda: out.setdefault("y", logits(model, inputs))) == len(mods) - 1
    assert not torch.allclose(out["y"], ref, atol=1e-3)  # tanh is what the module computes now
    model.set_experts_implementation("grouped_mm")
    torch.testing.assert_close(out["y"], logits(model, inputs), atol=ATOL, rtol=RTOL)


# ---- 7. patch ------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "deepseek_v3", "gpt_oss"])
def test_patch_unpatch(model_type):
    model, inputs = toy(model_type)
    ref = logits(model, inputs)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    mods = experts_modules(model)
    mlp_fuser.patch(model)
    assert set(model.get_experts_implementation().values()) == {"mlp_fuser"}  # through transformers' switch
    assert not any("forward" in m.__dict__ for _, m in mods)
    out = {}
    assert moe_calls(lambda: out.setdefault("y", logits(model, inputs))) == len(mods)
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)
    dense = {"qwen2_moe": ["model.layers.0.mlp.shared_expert", "model.layers.1.mlp.shared_expert"],
             "deepseek_v3": ["model.layers.0.mlp", "model.layers.1.mlp.shared_experts"]}.get(model_type, [])
    for path in dense:  # the dense and shared-expert MLPs are still fused
        assert fused_mlp(model.get_submodule(path)), path
    if dense:
        assert count_ops(lambda: logits(model, inputs)) == len(dense)
    mlp_fuser.unpatch(model)
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert set(model.get_experts_implementation().values()) == {"grouped_mm"}
    after = model.state_dict()
    assert list(after) == list(state)
    for k, v in state.items():
        assert torch.equal(after[k], v), k
    assert moe_calls(lambda: logits(model, inputs)) == 0


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_patch_follows_the_experts_switch(model_type):
    """patch selects "mlp_fuser" as set_experts_implementation does: a later switch to grouped_mm takes effect (the op
    is no longer called, the logits are grouped_mm's), patch selects it again, unpatch restores the user's choice."""
    model, inputs = toy(model_type)
    grouped = logits(model, inputs)
    model.set_experts_implementation("eager")  # the user's choice, which unpatch restores
    eager = logits(model, inputs)
    mods = experts_modules(model)
    mlp_fuser.patch(model)
    assert mlp_fuser.is_patched(model) and model.get_experts_implementation() == {"": "mlp_fuser"}
    out = {}
    assert moe_calls(lambda: out.setdefault("fused", logits(model, inputs))) == len(mods)
    torch.testing.assert_close(out["fused"], grouped, atol=ATOL, rtol=RTOL)
    model.set_experts_implementation("grouped_mm")
    assert moe_calls(lambda: out.setdefault("grouped", logits(model, inputs))) == 0
    assert torch.equal(out["grouped"], grouped) and not mlp_fuser.is_patched(model)
    mlp_fuser.patch(model)  # patched again: the experts are fused again
    assert moe_calls(lambda: logits(model, inputs)) == len(mods)
    mlp_fuser.unpatch(model)
    assert model.get_experts_implementation() == {"": "grouped_mm"}  # what the user had when patch was called
    model.set_experts_implementation("eager")
    mlp_fuser.patch(model)
    mlp_fuser.unpatch(model)
    assert model.get_experts_implementation() == {"": "eager"} and not any("forward" in m.__dict__ for _, m in mods)
    assert moe_calls(lambda: out.setdefault("unpatched", logits(model, inputs))) == 0
    assert torch.equal(out["unpatched"], eager)


def test_patch_experts_outside_the_switch_get_a_class_of_their_own():
    """Experts modules the config cannot switch alone get a fused class of their own: some of its modules left out
    by filter_fn (the config stays the user's), or a class whose forward does not read the config."""
    model, inputs = toy("qwen3_moe")
    ref = logits(model, inputs)
    mods = experts_modules(model)
    mlp_fuser.patch(model, lambda m, path: path != mods[1][0])
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    assert experts.is_fused_experts(mods[0][1])
    assert not experts.is_fused_experts(mods[1][1]) and type(mods[1][1]) is type(mods[0][1]).__mro__[2]
    out = {}
    assert moe_calls(lambda: out.setdefault("y", logits(model, inputs))) == 1
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)
    mlp_fuser.unpatch(model)
    base = type(mods[0][1])
    own = type("OwnForward", (base,), {"forward": lambda self, h, i, w: base.forward(self, h, i, w)})
    for _, m in mods:
        m.__class__ = own
    assert not hf.follows_switch(mods[0][1]) and experts.spec(mods[0][1]).ok
    mlp_fuser.patch(model)
    assert model.get_experts_implementation() == {"": "grouped_mm"}
    assert all(experts.is_fused_experts(m) for _, m in mods)
    assert moe_calls(lambda: out.update(y=logits(model, inputs))) == len(mods)
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)
    mlp_fuser.unpatch(model)
    assert not any("forward" in m.__dict__ or experts.is_fused_experts(m) for _, m in mods)
    assert all(type(m) is own for _, m in mods)


# ---- 8. the backend ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
@pytest.mark.parametrize("model_type", ["qwen3_moe", "gpt_oss"])
def test_backend(model_type, impl):
    model, inputs = toy(model_type)
    model.set_experts_implementation(impl)
    ref = logits(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mlp_fuser.make_backend(inductor=False))
    out = {}
    assert moe_calls(lambda: out.setdefault("y", logits(compiled, inputs))) == len(experts_modules(model))
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm"])
def test_pass_report(impl):
    model, inputs = toy("qwen3_moe")
    model.set_experts_implementation(impl)
    fused = [s for gm in graphs_of(model, inputs, False) for s in fx_pass.fuse_mlps(gm, dry_run=True).fused]
    routed = [s for s in fused if s.pattern == "routed_experts"]
    assert [s.path for s in routed] == [n for n, _ in experts_modules(model)]


def test_training_graph_experts_left_to_inductor(monkeypatch):
    """In a training graph (the experts' output needs gradients) the pass leaves routed experts to the compiler when
    asked (the backend asks when Inductor compiles), naming the check "training"; the same graph without gradients,
    or the pass not asked, fuses them; the backend without Inductor (patch's way) still fuses them in training."""
    model, inputs = toy("qwen3_moe")
    paths = [n for n, _ in experts_modules(model)]

    def routed(reports):
        fused = [s.path for r in reports for s in r.fused if s.pattern == "routed_experts"]
        missed = [(m.path, m.check) for r in reports for m in r.near_misses if m.pattern == "routed_experts"]
        return fused, missed

    train = graphs_of(model, inputs, True)
    assert routed([fx_pass.fuse_mlps(gm, dry_run=True, leave_trained_experts=True) for gm in train]) == \
        ([], [(p, "training") for p in paths])
    assert routed([fx_pass.fuse_mlps(gm, dry_run=True) for gm in train]) == (paths, [])
    infer = graphs_of(model, inputs, False)
    assert routed([fx_pass.fuse_mlps(gm, dry_run=True, leave_trained_experts=True) for gm in infer]) == (paths, [])
    asked = []
    real = fx_pass.fuse_mlps
    monkeypatch.setattr(fx_pass, "fuse_mlps", lambda gm, **kw: asked.append(kw["leave_trained_experts"]) or
                        real(gm, **kw))
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mlp_fuser.make_backend(inductor=False))
    assert moe_calls(lambda: compiled(*inputs).logits.sum().backward()) == len(paths)
    assert asked and not any(asked)
    torch._dynamo.reset()


def test_backend_inductor():
    model, inputs = toy("qwen3_moe")
    ref = logits(model, inputs)
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=mlp_fuser.backend)
    torch.testing.assert_close(logits(compiled, inputs), ref, atol=ATOL, rtol=RTOL)
    assert moe_calls(lambda: logits(compiled, inputs)) == len(experts_modules(model))


# ---- 9. explain ----------------------------------------------------------------------------------------------------


def test_explain_lists_experts():
    model, inputs = toy("qwen3_moe")
    report = mlp_fuser.explain(model, *inputs)
    routed = [s.path for s in report.fused if s.pattern == "routed_experts"]
    assert routed == [n for n, _ in experts_modules(model)]


def test_explain_patched_model_lists_experts_fused():
    """A patched model's experts run the op whatever Dynamo makes of their forward: explain reports them fused."""
    model, inputs = toy("qwen3_moe")
    mlp_fuser.patch(model)
    report = mlp_fuser.explain(model, *inputs)
    routed = [s for s in report.fused if s.pattern == "routed_experts"]
    assert [s.path for s in routed] == [n for n, _ in experts_modules(model)]
    assert all("silu" in s.activation and "experts" in s.activation for s in routed)
    assert not [m for m in report.near_misses if m.pattern == "routed_experts"]


def test_explain_llama4_experts_named():
    model = _hf.tiny_model("llama4_text")
    inputs = _hf.example_inputs(model, seq_len=6)
    paths = [n for n, m in model.named_modules() if experts.is_routed_like(m)]
    assert paths
    report = mlp_fuser.explain(model, *inputs)
    misses = {m.path: m for m in report.near_misses if m.pattern == "routed_experts"}
    fused = {s.path for s in report.fused if s.pattern == "routed_experts"}
    for p in paths:
        assert p in fused or (p in misses and misses[p].reason), p


# ---- 10. routing edge cases end to end ----------------------------------------------------------------------------


def _switch_equal(model, inputs, n_calls=None):
    ref = logits(model, inputs)
    model.set_experts_implementation("mlp_fuser")
    out = {}
    n = moe_calls(lambda: out.setdefault("y", logits(model, inputs)))
    assert n == (len(experts_modules(model)) if n_calls is None else n_calls)
    model.set_experts_implementation("grouped_mm")
    torch.testing.assert_close(out["y"], ref, atol=ATOL, rtol=RTOL)


def test_one_token():
    model, _ = toy("qwen3_moe")
    _switch_equal(model, (torch.tensor([[7]]),))


def test_every_token_one_expert():
    model, inputs = toy("qwen3_moe")
    for layer in model.model.layers:
        router = layer.mlp.gate
        plain = router.forward

        def forced(h, plain=plain):
            logits_, w, ids = plain(h)
            return logits_, w, torch.stack([torch.full_like(ids[:, 0], 3), torch.full_like(ids[:, 1], 1)], -1)

        router.forward = forced
    _switch_equal(model, inputs)


def test_256_experts_top8():
    model, inputs = toy("qwen3_moe", num_experts=256, num_experts_per_tok=8, moe_intermediate_size=16)
    assert experts_modules(model)[0][1].gate_up_proj.shape[0] == 256
    _switch_equal(model, inputs)


def test_sentinels_through_the_module():
    """Expert-parallel sentinel ids (>= E) into an experts module: the same as transformers' grouped_mm."""
    from transformers.integrations.moe import grouped_mm_experts_forward

    model, _ = toy("qwen3_moe")
    m = experts_modules(model)[0][1]
    E, H = m.gate_up_proj.shape[0], m.gate_up_proj.shape[2]
    x = torch.randn(9, H)
    ids = torch.randint(0, E + 3, (9, 2))
    ids[0] = E
    w = torch.rand(9, 2)
    with torch.no_grad():
        y = experts.experts_forward(m, x, ids, w)
        ref = grouped_mm_experts_forward(m, x, ids, w)
    torch.testing.assert_close(y, ref, atol=ATOL, rtol=RTOL)
    assert torch.equal(y[0], torch.zeros(H))
