"""The MoE router's top-k as one op (``mlp_fuser::moe_router_topk``): its kernel against float64, the op against
transformers' routers, the graph pattern that finds the chain, and the backend end to end."""

import copy
import operator

import pytest
import torch
import torch.nn.functional as F
from _hf_models import count_ops
from conftest import KERNEL_DEVICE, KERNEL_DTYPES, poisoned_empty
from mlp_fuser.patterns import router_topk

import mlp_fuser
from mlp_fuser import config
from mlp_fuser.graph import fx_pass
from mlp_fuser.kernels import router as kernel
from mlp_fuser.ops import router
from mlp_fuser.patch.modules import is_swapped
from mlp_fuser.patch.router import fuse_router, is_fused_router
from mlp_fuser.tools import models as _hf

ROUTER_OP = frozenset({"mlp_fuser::moe_router_topk"})


def float64_topk(logits: torch.Tensor, k: int, renorm: bool):
    p = torch.softmax(logits.double(), dim=-1)
    top, ids = torch.topk(p, k, dim=-1)
    return (top / top.sum(-1, keepdim=True) if renorm else top), ids


@pytest.mark.parametrize("dtype", KERNEL_DTYPES)
@pytest.mark.parametrize("T,E,k", [(1, 128, 8), (5, 8, 2), (37, 60, 4), (3, 256, 8), (9, 4, 1), (2, 6, 6)])
@pytest.mark.parametrize("renorm", [True, False])
def test_kernel_against_float64(dtype, T, E, k, renorm):
    g = torch.Generator().manual_seed(T * 1000 + E * 10 + k)
    logits = (torch.randn(T, E, generator=g) * 3).to(dtype).to(KERNEL_DEVICE)
    with poisoned_empty():
        wts, ids = kernel.router_topk(logits, k, renorm, torch.float32)
    ref, ref_ids = float64_topk(logits.cpu(), k, renorm)
    assert ids.dtype == torch.int64 and wts.dtype == torch.float32 and wts.shape == ids.shape == (T, k)
    # the k largest logits in order; among equal logits (bf16 has many) any of them, each expert once
    assert torch.equal(logits.cpu().gather(1, ids.cpu()), logits.cpu().gather(1, ref_ids)), "not the k largest"
    assert (ids.sort(1).values.diff(dim=1) != 0).all(), "an expert taken twice"
    torch.testing.assert_close(wts.cpu().double(), ref, rtol=2e-6, atol=0)


def test_kernel_output_dtype_and_strided_rows():
    """Rows of a wider tensor (a unit last stride, a row stride of its own) and a bf16-style narrow output."""
    g = torch.Generator().manual_seed(3)
    wide = torch.randn(7, 40, generator=g).to(KERNEL_DEVICE)
    logits = wide[:, 3:35]
    wts, ids = kernel.router_topk(logits, 3, True, torch.float16)
    ref, ref_ids = float64_topk(logits.cpu(), 3, True)
    assert wts.dtype == torch.float16 and torch.equal(ids.cpu(), ref_ids)
    torch.testing.assert_close(wts.cpu().double(), ref, rtol=1e-3, atol=0)


def test_kernel_ties_take_the_lowest_index_first():
    logits = torch.zeros(2, 16, device=KERNEL_DEVICE)
    logits[1, 5] = logits[1, 9] = 1.0
    wts, ids = kernel.router_topk(logits, 3, True, torch.float32)
    assert ids.tolist() == [[0, 1, 2], [5, 9, 0]]
    torch.testing.assert_close(wts[0].cpu(), torch.full((3,), 1 / 3))


def test_kernel_limits_are_said():
    assert kernel.why_not(128, 8) is None
    assert "experts" in kernel.why_not(kernel.MAX_E + 1, 2)
    assert "top-k" in kernel.why_not(8, 9) and "top-k" in kernel.why_not(8, 0)


def test_op_on_the_cpu_is_transformers_router_exactly():
    """The aten path computes what Qwen3MoeTopKRouter.forward computes after its GEMM, bit for bit."""
    from transformers import Qwen3MoeConfig
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeTopKRouter

    for renorm in (True, False):
        cfg = Qwen3MoeConfig(hidden_size=32, num_experts=12, num_experts_per_tok=3, norm_topk_prob=renorm)
        r = Qwen3MoeTopKRouter(cfg)
        torch.nn.init.normal_(r.weight)
        x = torch.randn(9, 32)
        with torch.no_grad():
            logits, wts, ids = r(x)
        ours = mlp_fuser.moe_router_topk(logits, 3, renorm)
        assert torch.equal(ours[0], wts) and torch.equal(ours[1], ids)


def test_op_through_the_kernel_matches_the_aten_path(monkeypatch):
    monkeypatch.setattr(config, "triton_on_cpu", True)
    logits = torch.randn(6, 20, device=KERNEL_DEVICE)
    assert router.uses_kernel(logits, 4)
    wts, ids = mlp_fuser.moe_router_topk(logits, 4)
    ref_w, ref_i = router.reference(logits, 4, True, logits.dtype)
    assert torch.equal(ids, ref_i)
    torch.testing.assert_close(wts, ref_w, rtol=2e-6, atol=0)


def test_op_errors_name_what_was_wrong():
    with pytest.raises(ValueError, match="2-D floating"):
        mlp_fuser.moe_router_topk(torch.randn(2, 3, 8), 2)
    with pytest.raises(ValueError, match="2-D floating"):
        mlp_fuser.moe_router_topk(torch.ones(3, 8, dtype=torch.int64), 2)
    with pytest.raises(ValueError, match="k=9 outside 1..8"):
        mlp_fuser.moe_router_topk(torch.randn(3, 8), 9)
    with pytest.raises(ValueError, match="no backward"):
        mlp_fuser.moe_router_topk(torch.randn(3, 8, requires_grad=True), 2)


# ---- the pattern ----------------------------------------------------------------------------------------------


def _graph(fn, *args):
    gms = []

    def record(gm, example_inputs):
        gms.append(gm)
        return gm.forward

    torch._dynamo.reset()
    torch.compile(fn, backend=record, fullgraph=True)(*args)
    return gms[0]


def _qwen_router(logits):
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, 2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top.to(torch.float16), ids


def _mixtral_router(logits):
    top, ids = torch.topk(F.softmax(logits.float(), dim=-1), 2, dim=-1)
    top /= top.sum(dim=-1, keepdim=True)
    return top, ids * 1


@pytest.mark.parametrize("fn,renorm,out_dtype", [(_qwen_router, True, torch.float16),
                                                 (_mixtral_router, True, torch.float32)])
def test_the_pattern_matches_and_the_rewrite_computes_the_same(fn, renorm, out_dtype):
    logits = torch.randn(5, 8, dtype=torch.float16)
    gm = _graph(fn, logits)
    [c] = router_topk.find(gm.graph)
    assert (c.k, c.renorm, c.out_dtype) == (2, renorm, out_dtype)
    router_topk.rewrite(gm.graph, c)
    gm.graph.lint()
    gm.recompile()
    targets = [n.target for n in gm.graph.nodes if n.op in ("call_function", "call_method")]
    assert torch.ops.mlp_fuser.moe_router_topk.default in targets
    assert not {torch.topk, F.softmax, "float", "sum", operator.itruediv} & set(targets)
    ref = fn(logits)
    out = gm(logits)
    assert torch.equal(out[1], ref[1]) and out[0].dtype == ref[0].dtype
    torch.testing.assert_close(out[0], ref[0], rtol=0, atol=0)


def _probs_used_twice(logits):
    probs = F.softmax(logits, dtype=torch.float, dim=-1)
    top, ids = torch.topk(probs, 2, dim=-1)
    return top, ids, probs.mean()


def _softmax_over_tokens(logits):
    return torch.topk(F.softmax(logits, dtype=torch.float, dim=0), 2, dim=-1)


def _smallest(logits):
    return torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), 2, dim=-1, largest=False)


def _sum_not_kept(logits):
    top, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), 2, dim=-1)
    return top / top.sum(dim=-1), ids


@pytest.mark.parametrize("fn", [_probs_used_twice, _softmax_over_tokens, _smallest, _sum_not_kept])
def test_what_the_pattern_leaves_alone(fn):
    assert router_topk.find(_graph(fn, torch.randn(2, 8)).graph) == []  # 2 tokens: the unkept sum broadcasts


def test_values_read_elsewhere_too_stay_the_ops_plain_top_k():
    """Top-k values that feed more than the renormalisation: the op gives them as they are (no renorm, fp32) and
    what read them reads the op's."""
    def fn(logits):
        top, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), 2, dim=-1)
        return top / top.sum(dim=-1, keepdim=True), ids, top * 3

    logits = torch.randn(4, 8)
    gm = _graph(fn, logits)
    [c] = router_topk.find(gm.graph)
    assert (c.renorm, c.out_dtype) == (False, torch.float32)
    router_topk.rewrite(gm.graph, c)
    gm.recompile()
    for a, b in zip(gm(logits), fn(logits)):
        assert torch.equal(a, b)


def test_logits_that_need_gradients_are_left_to_aten():
    w = torch.randn(8, 16, requires_grad=True)
    gm = _graph(lambda x: _qwen_router(F.linear(x, w)), torch.randn(4, 16))
    assert [c.needs_grad for c in router_topk.find(gm.graph)] == [True]
    report = fx_pass.fuse_mlps(gm)
    assert report.routers == [] and len(report.routers_with_grad) == 1
    targets = {n.target for n in gm.graph.nodes}
    assert torch.topk in targets and torch.ops.mlp_fuser.moe_router_topk.default not in targets


# ---- end to end ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["qwen3_moe", "qwen2_moe", "mixtral", "olmoe"])
def test_backend_fuses_every_router_and_keeps_the_output(model_type):
    """Inductor compiles one family's graph; the others' through the same pass, run op by op (the router op's
    treatment by Inductor does not depend on the family)."""
    model = _hf.tiny_model(model_type)
    inputs = _hf.example_inputs(model, seq_len=6, batch=2)
    layers = model.config.num_hidden_layers
    backend = mlp_fuser.backend if model_type == "qwen3_moe" else mlp_fuser.make_backend(inductor=False)
    with torch.no_grad():
        ref = model(*inputs).logits
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        compiled(*inputs)
        out = {}
        assert count_ops(lambda: out.setdefault("y", compiled(*inputs).logits), ROUTER_OP) == layers
        report = mlp_fuser.explain(model, *inputs)
    torch.testing.assert_close(out["y"], ref, rtol=1e-4, atol=2e-5)
    assert len(report.routers) == layers and "Router top-k fused" in str(report)
    assert "router_topk" in mlp_fuser.patterns.NAMES


def test_backend_without_the_pattern_leaves_routers_alone():
    model = _hf.tiny_model("qwen3_moe")
    inputs = _hf.example_inputs(model, seq_len=4, batch=1)
    backend = mlp_fuser.make_backend(patterns=("routed_experts",), inductor=False)  # the pass decides, not Inductor
    with torch.no_grad():
        torch._dynamo.reset()
        compiled = torch.compile(model, backend=backend)
        compiled(*inputs)
        assert count_ops(lambda: compiled(*inputs), ROUTER_OP) == 0


# ---- patch ---------------------------------------------------------------------------------------------------------


def _routers(model):
    return [n for n, m in model.named_modules() if is_fused_router(m)]


@pytest.mark.parametrize("model_type", ["qwen3_moe", "mixtral", "olmoe", "qwen2_moe"])
def test_patch_fuses_every_router_and_unpatch_restores_it(model_type):
    model = _hf.tiny_model(model_type)
    inputs = _hf.example_inputs(model, seq_len=6, batch=2)
    layers = model.config.num_hidden_layers
    with torch.no_grad():
        ref = model(*inputs).logits
    mlp_fuser.patch(model)
    assert _routers(model) == [f"model.layers.{i}.mlp.gate" for i in range(layers)]
    out = {}
    with torch.no_grad():
        assert count_ops(lambda: out.setdefault("y", model(*inputs).logits), ROUTER_OP) == layers
    torch.testing.assert_close(out["y"], ref, rtol=1e-4, atol=2e-5)
    assert mlp_fuser.is_patched(copy.deepcopy(model))
    mlp_fuser.unpatch(model)
    assert _routers(model) == [] and not any("forward" in m.__dict__ or is_swapped(m) for m in model.modules())


def test_patched_routers_leave_gradients_and_training_to_their_own_forward():
    model = _hf.tiny_model("qwen3_moe")
    inputs = _hf.example_inputs(model, seq_len=5, batch=1)
    mlp_fuser.patch(model)
    assert count_ops(lambda: model(*inputs).logits.sum().backward(), ROUTER_OP) == 0
    assert model.model.layers[0].mlp.gate.weight.grad is not None
    model.train()
    with torch.no_grad():
        assert count_ops(lambda: model(*inputs), ROUTER_OP) == 0


def test_patch_without_the_pattern_and_routers_that_are_not_top_k_softmax():
    model = _hf.tiny_model("qwen3_moe")
    mlp_fuser.patch(model, patterns=("routed_experts", "gated"))
    assert _routers(model) == []
    for model_type in ("deepseek_v3", "gpt_oss"):  # sigmoid with groups; top-k before the softmax
        model = _hf.tiny_model(model_type)
        mlp_fuser.patch(model)
        assert _routers(model) == [], model_type


class _BakedRouter(torch.nn.Module):
    """A top-k router whose forward bakes the token count into a view: its captured graph holds for 3 tokens only."""

    def __init__(self):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.randn(8, 16))

    def forward(self, x):
        logits = F.linear(x.view(3, 16), self.weight) if x.shape[0] == 3 else F.linear(x, self.weight)
        top, ids = torch.topk(F.softmax(logits, dtype=torch.float, dim=-1), 2, dim=-1)
        return logits, top, ids


def test_a_router_whose_graph_holds_for_its_sample_only_is_left_alone():
    assert fuse_router(_BakedRouter(), {}) is None


def test_explain_names_the_routers_left_to_aten_for_their_gradients():
    model = _hf.tiny_model("olmoe")
    inputs = _hf.example_inputs(model, seq_len=4, batch=1)
    report = mlp_fuser.explain(model, *inputs)  # gradients on: the training path
    layers = model.config.num_hidden_layers
    assert report.routers == [] and len(report.routers_with_grad) == layers
    assert "left to aten, its logits needing gradients" in str(report)
    with torch.no_grad():
        report = mlp_fuser.explain(model, *inputs)
    assert len(report.routers) == layers and report.routers_with_grad == []
