"""FP8 routed experts as transformers' FP8Experts holds them, end to end on the CPU (fp32, tiny random models):
``patch`` and the "mlp_fuser" experts implementation against the same model with the dequantized weights."""

from __future__ import annotations

import copy

import pytest
import torch

import mlp_fuser
from mlp_fuser import config
from mlp_fuser.dispatch import fp8_experts
from mlp_fuser.patch import experts
from mlp_fuser.reference import rel_err
from mlp_fuser.tools import models as _hf

transformers = pytest.importorskip("transformers")
fp8_mod = pytest.importorskip("transformers.integrations.finegrained_fp8")


def _quantize(w: torch.Tensor, bn: int, bk: int):
    """(E, N, K) weights as Fp8Quantize stores them: float8_e4m3fn, scale_inv = amax / 448 per bn x bk block."""
    E, N, K = w.shape
    wp = torch.nn.functional.pad(w, (0, (-K) % bk, 0, (-N) % bn))
    blocks = wp.view(E, wp.shape[1] // bn, bn, wp.shape[2] // bk, bk)
    s = blocks.abs().amax(dim=(2, 4)).clamp(min=1e-12) / 448
    q = (blocks / s[:, :, None, :, None]).clamp(-448, 448).to(torch.float8_e4m3fn).view_as(wp)[:, :N, :K]
    return q.contiguous(), s


def _dequantize(q: torch.Tensor, s: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    E, N, K = q.shape
    full = s.double().repeat_interleave(bn, 1)[:, :N].repeat_interleave(bk, 2)[:, :, :K]
    return (q.double() * full).float()


def fp8_moe(model_type="qwen3_moe", block=(16, 32), weight_dtype=torch.float8_e4m3fn, **overrides):
    """A tiny MoE whose experts are FP8Experts (gate_proj and up_proj quantized apart, as checkpoints hold them, then
    stacked), beside a twin holding the dequantized weights in its own experts."""
    model = _hf.tiny_model(model_type, **overrides)
    g = torch.Generator().manual_seed(1)
    cls = fp8_mod.FP8Experts
    if not hasattr(cls.forward, "__wrapped__"):  # as replace_with_fp8_linear makes it: the experts interface's switch
        transformers.integrations.moe.use_experts_implementation(
            cls, experts_interface=fp8_mod.ALL_FP8_EXPERTS_FUNCTIONS, has_bias=False, has_gate=True)
    twin = copy.deepcopy(model)
    bn, bk = block
    for (path, m), (_, t) in zip(experts_modules(model), experts_modules(twin)):
        E, N, H = m.gate_up_proj.shape
        I = N // 2
        wgu = torch.randn(E, N, H, generator=g) / H ** 0.5
        wd = torch.randn(E, H, I, generator=g) / I ** 0.5
        qg, sg = _quantize(wgu[:, :I], bn, bk)
        qu, su = _quantize(wgu[:, I:], bn, bk)
        qd, sd = _quantize(wd, bn, bk)
        f = cls(m.config, block_size=block)
        f.gate_up_proj.data = torch.cat([qg, qu], 1).to(weight_dtype)
        f.gate_up_proj_scale_inv.data = torch.cat([sg, su], 1)
        f.down_proj.data, f.down_proj_scale_inv.data = qd.to(weight_dtype), sd
        model.set_submodule(path, f)
        with torch.no_grad():
            t.gate_up_proj.copy_(torch.cat([_dequantize(qg, sg, bn, bk), _dequantize(qu, su, bn, bk)], 1))
            t.down_proj.copy_(_dequantize(qd, sd, bn, bk))
    return model, twin, _hf.example_inputs(model, seq_len=6, batch=2)


def experts_modules(model):
    return [(n, m) for n, m in model.named_modules() if experts.is_experts(m)]


def logits(model, inputs):
    with torch.no_grad():
        return model(*inputs).logits


def counting(monkeypatch):
    calls = []
    real = fp8_experts.run
    monkeypatch.setattr(fp8_experts, "run", lambda *a: calls.append(1) or real(*a))
    return calls


@pytest.mark.parametrize("model_type,block,overrides", [
    ("qwen3_moe", (16, 32), {}), ("qwen3_moe", (128, 128), {}), ("mixtral", (16, 32), {}),
    ("qwen3_moe", (16, 32), {"moe_intermediate_size": 40}),  # I no multiple of the block: gate and up scales apart
])
def test_patch_runs_fp8_experts_as_their_dequantized_twin(model_type, block, overrides, monkeypatch):
    model, twin, inputs = fp8_moe(model_type, block, **overrides)
    ref = logits(twin, inputs)
    before = model.get_experts_implementation()
    mlp_fuser.patch(model)
    fused = experts_modules(model)
    assert fused and model.get_experts_implementation() == {"": "mlp_fuser"}  # FP8ExpertsInterface's switch
    assert not any("forward" in m.__dict__ for _, m in fused)
    calls = counting(monkeypatch)
    out = logits(model, inputs)
    assert len(calls) == len(fused)  # one quant_moe_mlp per layer
    assert rel_err(out, ref) < 1e-5
    mlp_fuser.unpatch(model)
    assert all("forward" not in m.__dict__ for _, m in fused)
    assert model.get_experts_implementation() == before != {"": "mlp_fuser"}


def test_experts_implementation_switch_runs_fp8_experts(monkeypatch):
    """set_experts_implementation("mlp_fuser") on a model of FP8Experts: registered in FP8ExpertsInterface too."""
    model, twin, inputs = fp8_moe("qwen3_moe", (16, 32))
    assert "mlp_fuser" in fp8_mod.ALL_FP8_EXPERTS_FUNCTIONS
    model.set_experts_implementation("mlp_fuser")
    calls = counting(monkeypatch)
    assert rel_err(logits(model, inputs), logits(twin, inputs)) < 1e-5
    assert len(calls) == len(experts_modules(model))


def test_patch_leaves_unsupported_fp8_experts_exactly_as_they_were(caplog):
    model, _, _ = fp8_moe("qwen3_moe", (16, 32), weight_dtype=torch.float8_e5m2)
    before = {n: (type(m), dict(m.__dict__).get("forward")) for n, m in experts_modules(model)}
    with caplog.at_level("INFO", logger="mlp_fuser"):
        mlp_fuser.patch(model)
    assert {n: (type(m), dict(m.__dict__).get("forward")) for n, m in experts_modules(model)} == before
    assert "float8_e5m2" in caplog.text
    assert "float8_e5m2" in experts.spec(experts_modules(model)[0][1]).reason


def test_explain_reports_fp8_experts_with_their_format():
    model, twin, inputs = fp8_moe("qwen3_moe", (16, 32))
    report = mlp_fuser.explain(model, *inputs)
    assert report.error is None  # transformers' FP8 experts traced offline, on the aten stand-in
    assert report.graph_breaks == mlp_fuser.explain(twin, *inputs).graph_breaks  # and no break of the stand-in's
    sites = [s for s in report.fused if s.path.endswith("experts")]
    assert len(sites) == 2 and all(s.pattern == "routed_experts (fp8_e4m3 16x32 blocks)" for s in sites)
    model, _, inputs = fp8_moe("qwen3_moe", (16, 32), weight_dtype=torch.float8_e5m2)
    report = mlp_fuser.explain(model, *inputs)
    misses = [m for m in report.near_misses if m.path.endswith("experts")]
    assert len(misses) == 2 and all("float8_e5m2" in m.reason for m in misses)
    assert not [s for s in report.fused if s.path.endswith("experts")]


def test_backend_compiles_fp8_experts_through_the_op(monkeypatch):
    """torch.compile with mlp_fuser's backend and the experts switch: the op in the graph, no graph break."""
    model, twin, inputs = fp8_moe("qwen3_moe", (16, 32))
    model.set_experts_implementation("mlp_fuser")
    torch._dynamo.reset()
    breaks = sum(torch._dynamo.utils.counters["graph_break"].values())
    calls = counting(monkeypatch)
    out = logits(torch.compile(model, backend=mlp_fuser.backend), inputs)
    assert rel_err(out, logits(twin, inputs)) < 1e-5
    assert len(calls) == 2 and sum(torch._dynamo.utils.counters["graph_break"].values()) == breaks


@pytest.mark.parametrize("fp8", [True, False])
@pytest.mark.parametrize("direct", [True, False])
def test_inductor_code_calls_the_experts_ops_entry(fp8, direct, monkeypatch):
    """Patched, then compiled by the backend: Inductor's code calls torch.ops.mlp_fuser._inductor_quant_moe_mlp (FP8
    experts) or _inductor_moe_mlp (the bf16 twin), the op computed right there with no round trip through the
    dispatcher, unless config.inductor_direct is off; the values are the twin's unpatched either way."""
    from torch._inductor.utils import run_and_get_code

    model, twin, inputs = fp8_moe("qwen3_moe", (16, 32))
    ref = logits(twin, inputs)
    m = model if fp8 else twin
    n = len(experts_modules(m))
    mlp_fuser.patch(m)
    monkeypatch.setattr(config, "inductor_direct", direct)
    torch._dynamo.reset()
    try:
        with torch._inductor.config.patch(fx_graph_cache=False):
            out, (code,) = run_and_get_code(lambda: logits(torch.compile(m, backend=mlp_fuser.backend), inputs))
    finally:
        torch._dynamo.reset()
    op = "quant_moe_mlp" if fp8 else "moe_mlp"
    assert rel_err(out, ref) < 1e-5
    assert code.count(f"torch.ops.mlp_fuser._inductor_{op}(") == (n if direct else 0)
    assert code.count(f"torch.ops.mlp_fuser.{op}.default(") == (0 if direct else n)


@pytest.mark.parametrize("impl", ["grouped_mm", "batched_mm", "eager"])
def test_fused_fp8_experts_are_as_accurate_as_transformers_own_fp8_forward(impl, monkeypatch):
    """The FP8 issue's accuracy bar for experts: patched (the experts kernels, x and h quantized per token: the
    interpreter on the CPU), the logits err against float64 (the dequantized weights) by at most 1.25x what
    transformers' own FP8Experts forward errs (``impl``, its code on the aten stand-in for its Hub kernel)."""
    from conftest import KERNEL_DEVICE

    from mlp_fuser.patch.hf_fp8 import transformers_fp8_in_aten

    monkeypatch.setattr(config, "triton_on_cpu", True)
    model, twin, inputs = fp8_moe("qwen3_moe", (16, 32))
    model, twin = model.to(KERNEL_DEVICE), twin.to(KERNEL_DEVICE, torch.float64)
    inputs = tuple(t.to(KERNEL_DEVICE) for t in inputs)
    twin.set_experts_implementation("eager")  # grouped_mm takes no float64
    ref = logits(twin, inputs)
    model.set_experts_implementation(impl)
    with transformers_fp8_in_aten():
        theirs = logits(model, inputs)
    mlp_fuser.patch(model)
    calls = counting(monkeypatch)
    ours = logits(model, inputs)
    mlp_fuser.unpatch(model)
    assert len(calls) == len(experts_modules(model))
    e_ours, e_theirs = rel_err(ours, ref), rel_err(theirs, ref)
    assert 0 < e_ours <= 1.25 * e_theirs, f"fused {e_ours:.2e} against transformers' {e_theirs:.2e}"
