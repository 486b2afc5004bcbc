"""Whole HF models (tiny random configs, fp32, CPU): patch and the compiled backend both match the unfused model,
call the op once per MLP block, and give the same gradients in a training step."""

import copy
import math

import pytest
import torch
from _hf_models import EXTRA_FAMILIES, FAMILIES, build, count_ops, main_output

import mlp_fuser
from mlp_fuser.reference import rel_err

pytest.importorskip("transformers")

ALL = FAMILIES + EXTRA_FAMILIES
RTOL = 1e-4
ROUTED = {"deepseek_v3": 1}  # routed-experts modules (mlp_fuser::moe_mlp) beside the dense MLPs


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("family", ALL)
def test_patch(family):
    model, inputs, n_mlp = build(family)
    with torch.no_grad():
        ref = main_output(model(**inputs))
        report = mlp_fuser.explain(model, **inputs)
        mlp_fuser.patch(model)
        out = main_output(model(**inputs))
        ops = count_ops(lambda: model(**inputs))
        moe = count_ops(lambda: model(**inputs), frozenset({"mlp_fuser::moe_mlp"}))
    routed = [s for s in report.fused if s.pattern == "routed_experts"]
    assert len(report.fused) - len(routed) == n_mlp and not report.near_misses, str(report)
    assert len(routed) == moe == ROUTED.get(family, 0)
    assert ops == n_mlp
    assert rel_err(out, ref, ord=math.inf) <= RTOL
    mlp_fuser.unpatch(model)
    assert count_ops(lambda: model(**inputs)) == 0


# Inductor compiles the core families and the routed experts; the others' graphs through the same pass, run op by op
# (on the CPU Inductor calls the op whatever the family: its whole-model compile there is Inductor's own work).
INDUCTOR = FAMILIES + list(ROUTED)


@pytest.mark.parametrize("family", ALL)
def test_backend(family):
    model, inputs, n_mlp = build(family)
    backend = mlp_fuser.backend if family in INDUCTOR else mlp_fuser.make_backend(inductor=False)
    with torch.no_grad():
        ref = main_output(model(**inputs))
        compiled = torch.compile(model, backend=backend, fullgraph=family == "llama")
        out = main_output(compiled(**inputs))
        ops = count_ops(lambda: compiled(**inputs))
    assert ops == n_mlp
    assert rel_err(out, ref, ord=math.inf) <= RTOL


def _grads(model, inputs, call=None):
    model.zero_grad(set_to_none=True)
    main_output((model if call is None else call)(**inputs)).pow(2).mean().backward()
    return {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ALL)
def test_training_step_patch(family):
    model, inputs, n_mlp = build(family)
    model.train()  # dropout probabilities are 0 in these configs: active modules, inactive dropout
    fused = mlp_fuser.patch(copy.deepcopy(model))
    ref = _grads(model, inputs)
    ops = count_ops(lambda: _grads(fused, inputs))
    got = _grads(fused, inputs)
    # BLOOM's training-mode GELU is a custom autograd.Function: opaque, reported by explain, left alone.
    assert ops == (0 if family == "bloom" else n_mlp)
    assert ref.keys() == got.keys()
    scale = max(g.abs().max().item() for g in ref.values())
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=1e-6 * scale, msg=k)


def test_bloom_training_gelu_is_a_named_near_miss():
    model, inputs, _ = build("bloom")
    report = mlp_fuser.explain(model.train(), **inputs)
    assert not report.fused and report.checks_failed() == {"activation"}
    assert "autograd_function_apply" in str(report)


def test_apertus_xielu_is_a_named_near_miss_and_left_alone():
    """Apertus' MLP applies xIELU, an activation with learned scalars: explain names what it reads, patch leaves the
    model as it was."""
    from mlp_fuser.tools.models import example_inputs, tiny_model

    model = tiny_model("apertus")
    inputs = example_inputs(model)
    report = mlp_fuser.explain(model, *inputs)
    assert not report.fused and report.checks_failed() == {"activation"}, str(report)
    assert all(name in str(report) for name in ("alpha_p", "alpha_n")), str(report)
    with torch.no_grad():
        ref = main_output(model(*inputs))
        mlp_fuser.patch(model)
        assert count_ops(lambda: model(*inputs)) == 0
        torch.testing.assert_close(main_output(model(*inputs)), ref)


def test_deepseek_v4_clamped_shared_experts_are_named_near_misses_and_left_alone():
    """DeepSeek-V4's shared experts clamp gate and up to its swiglu_limit before act·mul: explain names both sites
    and the clamp, and patch leaves them as they were; its routed experts, whose clamped SwiGLU the experts op
    computes, are fused."""
    from mlp_fuser.tools.models import example_inputs, tiny_model

    model = tiny_model("deepseek_v4")
    inputs = example_inputs(model)
    report = mlp_fuser.explain(model, *inputs)
    assert [(s.path, s.pattern) for s in report.fused] == [
        (f"model.layers.{i}.mlp.experts", "routed_experts") for i in (0, 1)], report
    assert all("clamped at" in s.activation for s in report.fused), report
    assert report.checks_failed() == {"activation"}, report
    assert [m.path for m in report.near_misses] == [f"model.layers.{i}.mlp.shared_experts" for i in (0, 1)], report
    assert all("up's output is clamped" in m.reason for m in report.near_misses), report
    with torch.no_grad():
        ref = main_output(model(*inputs))
        mlp_fuser.patch(model)
        assert count_ops(lambda: model(*inputs)) == 0
        assert count_ops(lambda: model(*inputs), frozenset({"mlp_fuser::moe_mlp"})) == 2
        torch.testing.assert_close(main_output(model(*inputs)), ref)


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_training_step_backend(family):
    model, inputs, n_mlp = build(family)
    model.train()
    fused = copy.deepcopy(model)
    compiled = torch.compile(fused, backend=mlp_fuser.backend)
    ref = _grads(model, inputs)
    got = _grads(fused, inputs, compiled)
    # backward="save" (the default): under autograd each fused MLP's forward is cuBLAS gate/up, mlp_fuser::act_mul
    # and cuBLAS down in the compiled graph, so the MLPs are counted by their act_mul calls
    assert count_ops(lambda: compiled(**inputs), ops=frozenset({"mlp_fuser::act_mul"})) == n_mlp
    scale = max(g.abs().max().item() for g in ref.values())
    for k in ref:
        torch.testing.assert_close(got[k], ref[k], rtol=RTOL, atol=1e-6 * scale, msg=k)


def test_llama_fullgraph_no_graph_break():
    model, inputs, _ = build("llama")
    report = mlp_fuser.explain(model, **inputs)
    assert report.graphs == 1 and report.graph_breaks == 0


def test_dynamic_shapes_no_recompile():
    model, _, n_mlp = build("llama")
    graphs = []
    inner = mlp_fuser.make_backend()

    def backend(gm, example_inputs):
        graphs.append(gm)
        return inner(gm, example_inputs)

    compiled = torch.compile(model, backend=backend, dynamic=True)
    compiled_after_first = None
    with torch.no_grad():
        for batch, seq in ((2, 7), (3, 5), (2, 11)):  # batch 1 would specialize (Dynamo's 0/1 rule), not tested
            ids = torch.randint(1, 100, (batch, seq))
            out = compiled(input_ids=ids).logits
            compiled_after_first = compiled_after_first or len(graphs)
            assert count_ops(lambda ids=ids: compiled(input_ids=ids)) == n_mlp
            assert rel_err(out, model(input_ids=ids).logits, ord=math.inf) <= RTOL
    # Inductor may restart the first capture once (float-scalar tensorify); new shapes must not recompile.
    assert len(graphs) == compiled_after_first <= 2


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_generate_patched(family):
    model, inputs, _ = build(family)
    ids = inputs["input_ids"][:1]
    kw = dict(max_new_tokens=6, do_sample=False, pad_token_id=0)
    with torch.no_grad():
        ref = model.generate(ids, **kw)
        mlp_fuser.patch(model)
        got = model.generate(ids, **kw)
    assert torch.equal(got, ref)


def test_many_models_in_one_process():
    """Every HF forward is one decorated wrapper, so Dynamo's per-code cache (its recompile limit) is shared by all
    models; patch and explain start Dynamo at a code object of their own and keep working past that limit (lowered
    here from 8 to 2, so that five models pass it)."""
    with torch._dynamo.config.patch(recompile_limit=2):
        for family in ["llama", "gpt2", "bert", "opt", "t5"]:
            model, inputs, n_mlp = build(family)
            with torch.no_grad():
                assert len(mlp_fuser.explain(model, **inputs).fused) == n_mlp, family
                mlp_fuser.patch(model)
                assert count_ops(lambda model=model, inputs=inputs: model(**inputs)) == n_mlp, family
