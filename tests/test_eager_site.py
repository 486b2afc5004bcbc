"""patch.site.EagerSite: a patched module's call site runs a launch plan it saw before at once, where the tensor
guards, the pointers and the entry's rules all hold, and the entry otherwise.

Plans exist on CUDA only; here the site is told CPU calls are planned and the plan is a stand-in registered under the
call's own signature, which records its calls and computes the reference MLP.
"""

import pytest
import torch
from _mlp_cases import make_case

from mlp_fuser import compat, config
from mlp_fuser.dispatch import dense as dispatch
from mlp_fuser.ops import dense as ops
from mlp_fuser.patch import site as site_module
from mlp_fuser.reference import reference_mlp


@pytest.fixture
def site(monkeypatch):
    monkeypatch.setattr(site_module, "_plans_apply", lambda x: True)
    calls = []
    dispatch.clear_plans()

    def make(gated=True, bias=False, c=None):
        c = c or make_case(6, 32, 48, 16, gated=gated, bias=(bias,) * 3, lead=(2,))
        s = site_module.EagerSite(ops.eager_gated_mlp if gated else ops.eager_mlp)

        def plan(x, wg, bg, wu, bu, wd, bd):
            calls.append(x)
            return reference_mlp(x, wg, bg, wu, bu, wd, bd, "silu")

        sig = dispatch.signature(dispatch.MLPArgs(c.x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd, "silu"), True)
        dispatch.PLANS[sig] = plan
        return s, c

    yield make, calls
    dispatch.clear_plans()


def _args(c):
    return c.args()[1:]  # the op's operands after x, as the patched module's direct call passes them


def _fresh_x(c):
    return torch.randn_like(c.x)


@pytest.mark.parametrize("gated, bias", [(True, False), (True, True), (False, True)])
def test_a_seen_call_runs_its_plan_with_the_entrys_result(site, gated, bias):
    make, calls = site
    s, c = make(gated, bias)
    with torch.no_grad():
        first = s(c.x, *_args(c))
        assert calls == [], "the first call goes through the entry"
        x = _fresh_x(c)
        y = s(x, *_args(c))
    assert len(calls) == 1 and calls[0] is x
    torch.testing.assert_close(first, c.unfused())
    torch.testing.assert_close(y, reference_mlp(x, c.wg, c.bg, c.wu, c.bu, c.wd, c.bd, "silu"), rtol=0, atol=0)


def _changes(c):
    """Calls that must not run the seen call's plan: (name, x, operands, context)."""
    import contextlib

    from torch.overrides import TorchFunctionMode

    class Mode(TorchFunctionMode):
        def __torch_function__(self, f, types, a=(), k=None):
            return f(*a, **(k or {}))

    ops_ = list(_args(c))
    swapped = list(ops_)
    swapped[4] = ops_[4].clone()  # w_down: same metadata, another pointer (its .data replaced)
    strided = list(ops_)
    strided[0] = ops_[0].t().contiguous().t()
    buf = torch.empty(c.x.numel() + 1, dtype=c.x.dtype)[1:].view(c.x.shape)
    buf.copy_(c.x)
    none = contextlib.nullcontext
    return [
        ("x of another dtype", c.x.double(), [t.double() if isinstance(t, torch.Tensor) else t for t in ops_], none()),
        ("x transposed", c.x.transpose(0, 1).contiguous().transpose(0, 1), ops_, none()),
        ("x misaligned", buf, ops_, none()),
        ("x needs its gradient", c.x.clone().requires_grad_(), ops_, torch.enable_grad()),
        ("a weight swapped", c.x, swapped, none()),
        ("a weight's strides", c.x, strided, none()),
        ("autocast", c.x, ops_, torch.autocast("cpu", dtype=torch.bfloat16)),
        ("a torch function mode", c.x, ops_, Mode()),
    ]


@pytest.mark.parametrize("case", range(8))
def test_a_call_that_differs_takes_the_entry(site, case):
    make, calls = site
    s, c = make(True, False)
    with torch.no_grad():
        s(c.x, *_args(c))
        s(_fresh_x(c), *_args(c))
    assert len(calls) == 1  # seen, and planned
    name, x, operands, context = _changes(c)[case]
    calls.clear()
    with torch.no_grad(), context:
        y = s(x, *operands)
    assert calls == [], name
    with torch.no_grad():
        torch.testing.assert_close(y.float(), reference_mlp(x, *operands).float(), rtol=2e-2, atol=2e-2)


def test_weights_that_need_gradients_take_the_entry_with_gradients_on(site):
    make, calls = site
    s, c = make()
    wg = c.wg.clone().requires_grad_()
    operands = [wg, *_args(c)[1:]]
    with torch.no_grad():  # inference on trainable weights: learned, and planned under no_grad
        s(c.x, *operands)
        s(c.x, *operands)
    assert len(calls) == 1
    calls.clear()
    y = s(c.x, *operands)  # gradients on: the op's autograd
    assert calls == [] and y.requires_grad
    y.sum().backward()
    assert wg.grad is not None


def test_frozen_weights_run_the_plan_with_gradients_on(site):
    make, calls = site
    s, c = make()
    s(c.x, *_args(c))  # nothing requires grad: the entry's no-gradient path, then the plan
    s(c.x, *_args(c))
    assert len(calls) == 1


@pytest.mark.parametrize("what", ["plans cleared", "a setting", "a launch hook", "a bias appears"])
def test_what_the_signature_holds_beyond_the_tensors(site, monkeypatch, what):
    make, calls = site
    s, c = make()
    with torch.no_grad():
        s(c.x, *_args(c))
        s(c.x, *_args(c))
    assert len(calls) == 1
    calls.clear()
    operands = list(_args(c))
    if what == "plans cleared":
        dispatch.clear_plans()
    elif what == "a setting":
        monkeypatch.setattr(config, "autotune", not config.autotune)
    elif what == "a launch hook":
        monkeypatch.setattr(compat, "launch_hooks", lambda: True)
    else:
        operands[1] = torch.randn(48)
    with torch.no_grad():
        s(c.x, *operands)
    assert calls == [], what


def test_gate_and_up_stored_as_one_must_still_share_a_storage(site):
    make, calls = site
    c = make_case(6, 32, 48, 16, bias=(False, False, False), lead=(2,))
    w = torch.cat([c.wg, c.wu])
    c.wg, c.wu = w[:48], w[48:]
    s, c = make(c=c)
    with torch.no_grad():
        s(c.x, *_args(c))
        s(c.x, *_args(c))
    assert len(calls) == 1
    hit = next(iter(s.seen.values()))
    assert hit.one == 1  # wu's place among the tensors (wg, wu, wd), whose storage is compared with wg's
    calls.clear()
    with torch.no_grad():
        s(c.x, *_args(c))
    assert len(calls) == 1  # still one storage: planned


def test_sites_switched_off_take_the_entry(site, monkeypatch):
    make, calls = site
    s, c = make()
    with torch.no_grad():
        s(c.x, *_args(c))
        monkeypatch.setattr(config, "sites", False)  # MLP_FUSER_SITES=0
        s(c.x, *_args(c))
    assert calls == []


def test_not_learned_on_the_public_path(site, monkeypatch):
    make, calls = site
    s, c = make()
    monkeypatch.setattr(compat, "tensor_guards", lambda tensors: None)
    with torch.no_grad():
        s(c.x, *_args(c))
        s(c.x, *_args(c))
    assert calls == [] and all(type(v) is site_module._Unplanned for v in s.seen.values())


def test_a_call_without_a_plan_is_learned_once(site, monkeypatch):
    """Where the entry's implementation has no plan, the site says so once and then hands such calls straight to the
    entry, without looking for a plan on every call."""
    make, calls = site
    s, c = make()
    dispatch.clear_plans()  # no plan under this signature
    looked = []
    real = dispatch.signature
    monkeypatch.setattr(dispatch, "signature", lambda *a: looked.append(1) or real(*a))
    with torch.no_grad():
        for _ in range(3):
            torch.testing.assert_close(s(c.x, *_args(c)), c.unfused())
    assert calls == [] and len(looked) == 1


def test_a_call_without_a_plan_is_looked_at_again_once_the_settings_change(site, monkeypatch):
    """A call that ran without a plan under one setting (another implementation forced) finds its plan once the
    setting is undone: the mark of an unplanned call holds only under the settings it was made in."""
    make, calls = site
    s, c = make()
    with torch.no_grad():
        monkeypatch.setattr(config, "force_impl", "reference")  # another signature: no plan under it
        s(c.x, *_args(c))
        s(c.x, *_args(c))
        assert calls == []
        monkeypatch.setattr(config, "force_impl", None)
        s(c.x, *_args(c))  # through the entry, and learned
        s(c.x, *_args(c))
    assert len(calls) == 1


def test_a_patched_module_calls_through_a_site():
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    import mlp_fuser

    mlp = LlamaMLP(LlamaConfig(hidden_size=32, intermediate_size=64))
    mlp_fuser.patch(mlp)
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        y = mlp(x)
    forward, _, direct = mlp.forward.graphs[False][:3]
    assert isinstance(direct.__globals__["op"], site_module.EagerSite)
    torch.testing.assert_close(y, LlamaMLP.forward(mlp, x))


def test_under_torch_compile_a_learned_site_gives_dynamo_the_op(site):
    """A patched model compiled after it ran eagerly: the site has a plan, but Dynamo must trace the registered op
    (a plan launches through integer pointers, which a traced graph has not)."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaMLP

    import mlp_fuser

    make, calls = site
    mlp = mlp_fuser.patch(LlamaMLP(LlamaConfig(hidden_size=64, intermediate_size=16, num_attention_heads=4)).eval())
    c = make_case(6, 64, 16, 64, bias=(False, False, False), lead=(2,))
    c.wg, c.wu, c.wd = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
    make(c=c)  # the stand-in plan under this call's signature
    with torch.no_grad():
        mlp(c.x)
        mlp(c.x)
        assert len(calls) == 1  # learned, and run eagerly
        explained = torch._dynamo.explain(mlp)(c.x)
    targets = [n.target for g in explained.graphs for n in g.graph.nodes if n.op == "call_function"]
    assert explained.graph_break_count == 0 and torch.ops.mlp_fuser.gated_mlp.default in targets, targets
    assert len(calls) == 1
