"""merge_gate_up / split_gate_up and patch(merge_gate_up=True): gate and up re-stored as the halves of one buffer
(mlp_fuser/patch/api.py), so the op runs one GEMM for both, or quack's gated GEMM where it is installed."""

import inspect

import pytest
import torch
from _hf_models import build

import mlp_fuser
from mlp_fuser.dispatch import dense as dispatch
from mlp_fuser.kernels.common import stored_as_one


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _one(mlp) -> bool:
    g, u = mlp.gate_proj.weight, mlp.up_proj.weight
    return stored_as_one(g, u, g.data_ptr(), u.data_ptr())


def test_merge_keeps_each_parameter_and_the_outputs_and_split_undoes_it():
    model, inputs, n = build("llama")
    mlps = [layer.mlp for layer in model.model.layers]
    params = [(m.gate_proj.weight, m.up_proj.weight) for m in mlps]
    with torch.no_grad():
        ref = model(**inputs).logits
        assert not any(_one(m) for m in mlps)
        assert mlp_fuser.merge_gate_up(model) == [f"model.layers.{i}.mlp" for i in range(n)]
        assert all(_one(m) for m in mlps)
        assert [(m.gate_proj.weight, m.up_proj.weight) for m in mlps] == params  # the same Parameter objects
        assert all(m.gate_proj.weight.is_contiguous() and m.up_proj.weight.is_contiguous() for m in mlps)
        assert torch.equal(model(**inputs).logits, ref)
        assert mlp_fuser.merge_gate_up(model) == [f"model.layers.{i}.mlp" for i in range(n)]  # again: nothing moves
        assert mlp_fuser.split_gate_up(model) == [f"model.layers.{i}.mlp" for i in range(n)]
        assert not any(_one(m) for m in mlps)
        g = mlps[0].gate_proj.weight  # its own storage, not the merged buffer's twice its size
        assert g.untyped_storage().nbytes() == g.numel() * g.element_size()
        assert torch.equal(model(**inputs).logits, ref)


def test_filter_and_the_mlps_that_are_not_merged():
    model, inputs, _ = build("llama")
    assert mlp_fuser.merge_gate_up(model, lambda m, fqn: fqn.endswith("1.mlp")) == ["model.layers.1.mlp"]
    assert [_one(layer.mlp) for layer in model.model.layers] == [False, True]
    for family in ("gpt_neox", "phi3"):  # no gate (a plain MLP); gate and up already one weight, split in forward
        model, inputs, _ = build(family)
        assert mlp_fuser.merge_gate_up(model) == []


def test_a_gated_mlp_with_biases_is_not_merged():
    class BiasedGated(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj, self.up_proj = torch.nn.Linear(16, 24), torch.nn.Linear(16, 24)
            self.down_proj = torch.nn.Linear(24, 16, bias=False)

        def forward(self, x):
            return self.down_proj(torch.nn.functional.silu(self.gate_proj(x)) * self.up_proj(x))

    model = torch.nn.Sequential(BiasedGated())
    assert mlp_fuser.merge_gate_up(model) == []
    assert not _one(model[0])


def test_patch_merges_and_unpatch_splits_training_and_saving_still_work(tmp_path):
    from transformers import AutoModelForCausalLM

    model, inputs, n = build("llama")
    mlps = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        ref = model(**inputs).logits
    mlp_fuser.patch(model, merge_gate_up=True)
    assert all(_one(m) for m in mlps)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, ref, rtol=1e-5, atol=1e-5)
    # a training step: each half gets its own gradient, the optimizer updates the Parameters in the shared buffer
    model.train()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    before = [m.gate_proj.weight.detach().clone() for m in mlps]
    model(**inputs).logits.float().square().mean().backward()
    assert all(m.gate_proj.weight.grad is not None and m.up_proj.weight.grad is not None for m in mlps)
    opt.step()
    assert all(_one(m) for m in mlps)
    assert not any(torch.equal(b, m.gate_proj.weight) for b, m in zip(before, mlps))
    model.eval()
    with torch.no_grad():
        ref = model(**inputs).logits
    model.save_pretrained(tmp_path / "merged")  # transformers copies the shared buffer's halves apart
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        torch.testing.assert_close(loaded(**inputs).logits, ref, rtol=1e-5, atol=1e-5)
    mlp_fuser.unpatch(model)
    assert not any(_one(m) for m in mlps)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, ref, rtol=1e-5, atol=1e-5)


def test_to_gives_each_weight_its_own_storage_and_the_op_still_computes_the_same():
    model, inputs, _ = build("llama")
    mlp_fuser.patch(model, merge_gate_up=True)
    model.double()
    assert not _one(model.model.layers[0].mlp)  # .double() made new tensors: no longer one buffer
    with torch.no_grad():
        out = model(**inputs).logits
    mlp_fuser.unpatch(model)
    with torch.no_grad():
        assert torch.equal(model(**inputs).logits, out)


def test_the_op_tells_the_dispatcher_when_gate_and_up_are_stored_as_one(monkeypatch):
    seen = []
    resolve = dispatch.resolve

    def spy(*args, **kwargs):
        bound = inspect.signature(resolve).bind(*args, **kwargs).arguments
        seen.append((bound.get("activation"), bound.get("one_weight")))
        return resolve(*args, **kwargs)

    monkeypatch.setattr(dispatch, "resolve", spy)

    def call(*args):  # each call asks the dispatcher afresh: a cached choice for the same key would skip it
        dispatch._resolved.clear()
        return mlp_fuser.gated_mlp(*args)

    w = torch.randn(48, 16)
    x, wd = torch.randn(5, 16), torch.randn(16, 24)
    y = call(x, w[:24], None, w[24:], None, wd, None, "silu")
    call(x, w[:24].clone(), None, w[24:], None, wd, None, "silu")  # two storages
    call(x, w[:24], torch.zeros(24), w[24:], None, wd, None, "silu")  # a bias
    call(x, w[24:], None, w[:24], None, wd, None, "swish")  # up before gate
    assert seen == [("silu", True), ("silu", False), ("silu", False), ("swish", False)]
    ref = (torch.nn.functional.silu(x.double() @ w[:24].double().T) * (x.double() @ w[24:].double().T)) @ wd.double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_patch_whole_model_merges_what_its_options_fuse():
    model, inputs, n = build("llama")
    mlps = [layer.mlp for layer in model.model.layers]
    with torch.no_grad():
        ref = model(**inputs).logits
    mlp_fuser.patch(model, per_module=False, merge_gate_up=True)
    assert all(_one(m) for m in mlps)
    with torch.no_grad():
        torch.testing.assert_close(model(**inputs).logits, ref, rtol=1e-5, atol=1e-5)
    mlp_fuser.patch(model, per_module=False, merge_gate_up=True, activations=["gelu"])  # no silu site is fused
    assert not any(_one(m) for m in mlps)  # re-patching split them, and nothing it fuses is merged again
    mlp_fuser.unpatch(model)
