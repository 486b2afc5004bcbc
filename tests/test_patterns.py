"""The pattern registry and the safety checks, on small hand-written modules.

Each module is run unfused and through ``mlp_fuser.patch``: the outputs must agree, the number of
``mlp_fuser::`` op calls (torch.profiler) must be what was expected, and ``explain`` must say what it fused or
name the check that failed.
"""

import copy
import io
import logging
import math

import pytest
import torch
import torch.nn.functional as F
from _hf_models import count_ops
from torch import nn
from torch.testing._internal.two_tensor import TwoTensor

import mlp_fuser
from mlp_fuser.patch.modules import fused_mlp

K, I, O = 16, 32, 24


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def assert_fused(module, *inputs, n=1, pattern=None, activation=None):
    """patch(module) gives the unfused outputs with ``n`` op calls; explain reports ``n`` sites."""
    with torch.no_grad():
        ref = module(*inputs)
        report = mlp_fuser.explain(module, *inputs)
        mlp_fuser.patch(module)
        out = module(*inputs)
        ops = count_ops(lambda: module(*inputs))
    mlp_fuser.unpatch(module)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert ops == n, str(report)
    assert len(report.fused) == n and not report.near_misses, str(report)
    for site in report.fused:
        assert pattern is None or site.pattern == pattern, str(report)
        assert activation is None or site.activation == activation, str(report)
    return report


def assert_not_fused(module, *inputs, check, train=False):
    """Nothing is fused, outputs stay the same, and explain names ``check``."""
    module.train(train)
    report = mlp_fuser.explain(module, *inputs)
    torch.manual_seed(1)
    ref = module(*inputs)
    mlp_fuser.patch(module)
    torch.manual_seed(1)
    out = module(*inputs)
    ops = count_ops(lambda: module(*inputs))
    mlp_fuser.unpatch(module)
    torch.testing.assert_close(out, ref)
    assert ops == 0
    assert not report.fused and check in report.checks_failed(), str(report)
    assert check in str(report) and "Nothing fused" in str(report)
    return report


class Lambda(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Plain(nn.Module):
    def __init__(self, act, bias=True, drop=None):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(K, I, bias=bias), nn.Linear(I, O, bias=bias)
        self.act = act if isinstance(act, nn.Module) else Lambda(act)
        self.drop = drop if drop is not None else nn.Identity()

    def forward(self, x):
        return self.fc2(self.drop(self.act(self.fc1(x))))


class Gated(nn.Module):
    def __init__(self, act=F.silu, bias=False, up_first=False):
        super().__init__()
        self.gate, self.up = nn.Linear(K, I, bias=bias), nn.Linear(K, I, bias=bias)
        self.down = nn.Linear(I, O, bias=bias)
        self.act, self.up_first = act, up_first

    def forward(self, x):
        g, u = self.act(self.gate(x)), self.up(x)
        return self.down(u * g if self.up_first else g * u)


class Merged(nn.Module):
    def __init__(self, how="chunk", bias=False):
        super().__init__()
        self.gate_up, self.down = nn.Linear(K, 2 * I, bias=bias), nn.Linear(I, O, bias=bias)
        self.how = how

    def forward(self, x):
        h = self.gate_up(x)
        gate, up = h.chunk(2, dim=-1) if self.how == "chunk" else h.split(I, dim=-1)
        return self.down(up * F.silu(gate))


def x3(*lead):
    return torch.randn(*(lead or (2, 5)), K)


# ---- activations as models write them -------------------------------------------------------------


def _gelu_new(x):
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


def _bloom_gelu(x):
    return x * 0.5 * (1.0 + torch.tanh(0.79788456 * x * (1 + 0.044715 * x * x)))


ACTS = {
    "F.gelu": (F.gelu, "gelu"),
    "F.gelu-tanh": (lambda x: F.gelu(x, approximate="tanh"), "gelu_tanh"),
    "nn.GELU": (nn.GELU(), "gelu"),
    "nn.GELU-tanh": (nn.GELU(approximate="tanh"), "gelu_tanh"),
    "F.silu": (F.silu, "silu"),
    "nn.SiLU": (nn.SiLU(), "silu"),
    "F.relu": (F.relu, "relu"),
    "torch.relu": (torch.relu, "relu"),
    "nn.ReLU": (nn.ReLU(), "relu"),
    "gelu_new-formula": (_gelu_new, "gelu_tanh"),
    "bloom-formula": (_bloom_gelu, "gelu_tanh"),
    "gelu-erf-formula": (lambda x: x * 0.5 * (1.0 + torch.erf(x / math.sqrt(2.0))), "gelu"),
    "quick_gelu-formula": (lambda x: x * torch.sigmoid(1.702 * x), "quick_gelu"),
    "silu-formula": (lambda x: x * torch.sigmoid(x), "silu"),
    "relu2-square": (lambda x: torch.square(F.relu(x)), "relu2"),
    "relu2-pow": (lambda x: F.relu(x) ** 2, "relu2"),
}


@pytest.mark.parametrize("name", list(ACTS))
def test_activation_spellings(name):
    act, expected = ACTS[name]
    assert_fused(Plain(act), x3(), pattern="plain", activation=expected)


ACT2FN_NAMES = {
    "gelu": "gelu", "gelu_new": "gelu_tanh", "gelu_fast": "gelu_tanh", "gelu_pytorch_tanh": "gelu_tanh",
    "gelu_python": "gelu", "gelu_accurate": "gelu_tanh", "quick_gelu": "quick_gelu", "silu": "silu",
    "swish": "silu", "relu": "relu", "relu2": "relu2",
}  # fmt: skip


@pytest.mark.parametrize("key", list(ACT2FN_NAMES))
def test_hf_act2fn(key):
    act2fn = pytest.importorskip("transformers.activations").ACT2FN
    assert_fused(Gated(act=act2fn[key]), x3(), pattern="gated", activation=ACT2FN_NAMES[key])


# ---- projections and patterns -------------------------------------------------------------------------


@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("lead", [(7,), (2, 5), (2, 3, 4)])
def test_plain_bias_and_leading_dims(bias, lead):
    assert_fused(Plain(F.gelu, bias=bias), x3(*lead), pattern="plain", activation="gelu")


def test_conv1d_gpt2():
    conv1d = pytest.importorskip("transformers.pytorch_utils").Conv1D

    class GPT2MLP(nn.Module):
        def __init__(self):
            super().__init__()
            self.c_fc, self.c_proj = conv1d(I, K), conv1d(O, I)

        def forward(self, x):
            return self.c_proj(_gelu_new(self.c_fc(x)))

    assert_fused(GPT2MLP(), x3(), pattern="plain", activation="gelu_tanh")


class MatmulMLP(nn.Module):
    """Falcon's ``x @ w.T (+ b)`` and an ``(in, out)`` weight used as ``x @ w``."""

    def __init__(self, bias):
        super().__init__()
        self.w1 = nn.Parameter(torch.randn(I, K) / 4)
        self.w2 = nn.Parameter(torch.randn(I, O) / 4)  # (in, out)
        self.b1 = nn.Parameter(torch.randn(I)) if bias else None

    def forward(self, x):
        h = x @ self.w1.T
        if self.b1 is not None:
            h = h + self.b1
        return F.gelu(h) @ self.w2


@pytest.mark.parametrize("bias", [True, False])
def test_matmul_projections(bias):
    assert_fused(MatmulMLP(bias), x3(), pattern="plain", activation="gelu")


@pytest.mark.parametrize("up_first", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_gated_either_order(up_first, bias):
    assert_fused(Gated(bias=bias, up_first=up_first), x3(), pattern="gated", activation="silu")


@pytest.mark.parametrize("how", ["chunk", "split"])
@pytest.mark.parametrize("bias", [False, True])
def test_merged_gate_up(how, bias):
    assert_fused(Merged(how, bias), x3(), pattern="merged_gate_up", activation="silu")


@pytest.mark.parametrize("drop", [nn.Dropout(0.3), Lambda(lambda h: F.dropout(h, 0.5, training=False))])
def test_eval_dropout_between(drop):
    assert_fused(Plain(F.relu, drop=drop).eval(), x3(), activation="relu")


def test_zero_dropout_in_training_is_fused():
    m = Plain(F.gelu, drop=nn.Dropout(0.0)).train()
    x = x3().requires_grad_()
    ref = m(x)
    (gx_ref,) = torch.autograd.grad(ref.sum(), x)
    mlp_fuser.patch(m)
    out = m(x)
    assert count_ops(lambda: m(x)) == 1
    (gx,) = torch.autograd.grad(out.sum(), x)
    torch.testing.assert_close(out, ref)
    torch.testing.assert_close(gx, gx_ref)


def test_two_sites_in_one_module():
    m = nn.Sequential(Plain(F.gelu), nn.LayerNorm(O), nn.Linear(O, K), Gated())
    assert_fused(m, x3(), n=2)


# ---- near misses: each safety check -------------------------------------------------------------------


class ReturnsIntermediate(Plain):
    def forward(self, x):
        h = self.act(self.fc1(x))
        return self.fc2(h), h


class StoresIntermediate(Plain):
    def forward(self, x):
        h = self.act(self.fc1(x))
        self.last_hidden = h
        return self.fc2(h)


class TwoInputs(Gated):
    def forward(self, x, y):
        return self.down(self.act(self.gate(x)) * self.up(y))


class CastsToDouble(Plain):
    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)).double())


def test_near_miss_intermediate_returned():
    report = assert_not_fused(ReturnsIntermediate(F.gelu), x3(), check="single_use")
    assert "escapes the graph" in str(report)


def test_near_miss_intermediate_stored():
    assert_not_fused(StoresIntermediate(F.gelu), x3(), check="single_use")


def test_near_miss_hooked_intermediate():
    m = Plain(nn.GELU())
    seen = []
    m.act.register_forward_hook(lambda mod, inp, out: seen.append(out))
    assert_not_fused(m, x3(), check="single_use")
    assert seen


def test_near_miss_gate_and_up_read_different_inputs():
    assert_not_fused(TwoInputs(), x3(), x3(), check="same_input")


def test_near_miss_dtypes():
    m = CastsToDouble(F.gelu)
    m.fc2.double()
    assert_not_fused(m, x3(), check="dtype_device")


class _OnlyAten(TwoTensor):
    """A weight wrapper that, as torchao's quantized tensors do, runs the aten ops it implements and no others."""

    @staticmethod
    def __tensor_unflatten__(inner, meta, outer_size, outer_stride):
        return _OnlyAten(inner["a"], inner["b"], outer_size, outer_stride)

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func.namespace != "aten":
            raise NotImplementedError(f"{cls.__name__} does not implement {func}")
        return super().__torch_dispatch__(func, types, args, kwargs)


def test_near_miss_tensor_subclass_weight():
    """A weight that is a tensor subclass (quantized, a DTensor, ...) would take the op to its __torch_dispatch__,
    which need not know it: patch and the backend leave the MLP alone, and explain names plain_tensors."""
    m = Gated(F.silu)
    w = m.gate.weight.detach()
    m.gate.weight = nn.Parameter(_OnlyAten(w.clone(), w.clone()), requires_grad=False)
    x = x3()
    with torch.no_grad():
        assert_not_fused(m, x, check="plain_tensors")
        ref = m(x)
        out = torch.compile(m, backend=mlp_fuser.backend)(x)
    torch.testing.assert_close(out, ref)


class _Int8Linear(nn.Linear):
    """Weight-only int8, as quantization libraries build a projection: int8 weight, a per-row scale, and a forward
    that dequantizes: the op then gets the plain dequantized weight, computed in the graph on every call."""

    def __init__(self, lin: nn.Linear):
        super().__init__(lin.in_features, lin.out_features, bias=lin.bias is not None)
        scale = lin.weight.detach().abs().amax(1, keepdim=True) / 127
        self.weight = nn.Parameter((lin.weight.detach() / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        if lin.bias is not None:
            self.bias = lin.bias

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.scale, self.bias)


@pytest.mark.parametrize("first", ["gate", "all"])
def test_fused_with_int8_weights_dequantized_in_forward(first):
    """An int8 weight in the module's first parameter does not stop patch from proving the MLP (its sample input
    takes the first floating-point dtype), and the fused output is the unfused one."""
    m = Gated(F.silu, bias=True)
    for name in ("gate",) if first == "gate" else ("gate", "up", "down"):
        setattr(m, name, _Int8Linear(getattr(m, name)))
    assert_fused(m, x3(), pattern="gated", activation="silu")


def test_fused_under_autocast():
    """Under autocast the projections compute in the autocast dtype; the op's autocast kernel casts the same way,
    so the site is fused and the output matches the unfused module under the same autocast."""
    m = Gated(F.silu, bias=True)
    x = x3()
    with torch.autocast("cpu", dtype=torch.bfloat16), torch.no_grad():
        ref = m(x)
        report = mlp_fuser.explain(m, x)
        mlp_fuser.patch(m)
        out = m(x)
        ops = count_ops(lambda: m(x))
        mlp_fuser.unpatch(m)
    assert len(report.fused) == 1 and ops == 1, str(report)
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out, ref)


def test_near_miss_cast_inside_mlp_under_autocast():
    """A value of another dtype than the autocast dtype inside the MLP is still a near miss."""
    m = CastsToDouble(F.gelu)
    m.fc2.double()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        report = mlp_fuser.explain(m, x3())
    assert not report.fused and "dtype_device" in report.checks_failed(), str(report)


def test_near_miss_active_dropout():
    assert_not_fused(Plain(F.gelu, drop=nn.Dropout(0.5)), x3(), check="dropout_inactive", train=True)


def test_near_miss_unknown_activation():
    report = assert_not_fused(Plain(torch.tanh), x3(), check="activation")
    assert "tanh" in str(report)


def test_near_miss_opaque_activation():
    report = assert_not_fused(Plain(F.mish), x3(), check="activation")
    assert "mish" in str(report)


class LearnedActivation(nn.Module):
    """xIELU's form (Apertus' MLP): an activation with scalars learned with the model."""

    def __init__(self):
        super().__init__()
        self.alpha_p, self.alpha_n = nn.Parameter(torch.tensor([0.8])), nn.Parameter(torch.tensor([0.3]))
        self.register_buffer("beta", torch.tensor(0.5))

    def forward(self, x):
        pos = F.softplus(self.alpha_p) * x * x + self.beta * x
        neg = (torch.expm1(torch.clamp(x, max=0.0)) - x) * (self.beta + F.softplus(self.alpha_n)) + self.beta * x
        return torch.where(x > 0, pos, neg)


def test_near_miss_activation_with_learned_parameters():
    report = assert_not_fused(Plain(LearnedActivation()), x3(), check="activation")
    assert "alpha_p" in str(report) and "alpha_n" in str(report) and "beta" in str(report), str(report)
    report = assert_not_fused(Gated(LearnedActivation()), x3(), check="activation")
    assert "alpha_p" in str(report), str(report)


class ClampedGated(Gated):
    """DeepSeek-V4's shared experts and GPT-OSS's experts: gate clamped above, up on both sides (swiglu_limit)."""

    def __init__(self, gate=True, up=True, how="kwargs"):
        super().__init__()
        self.clamp_gate, self.clamp_up, self.how = gate, up, how

    def forward(self, x):
        g, u = self.gate(x), self.up(x)
        if self.clamp_gate:
            g = g.clamp(max=0.5)
        if self.clamp_up:
            u = u.clamp(min=-0.5, max=0.5) if self.how == "kwargs" else torch.clamp(u, -0.5, 0.5)
        return self.down(F.silu(g) * u)


def test_near_miss_clamped_gated_activation():
    """Clamped projections are a bounded activation: never fused, and named. The bound 0.5 sits inside the
    projections' range here, so a fusion that dropped either clamp would change the output (assert_not_fused)."""
    for gate, up, how in ((False, True, "args"), (True, True, "kwargs"), (True, False, "kwargs")):
        report = assert_not_fused(ClampedGated(gate, up, how), x3(), check="activation")
        assert "clamp" in str(report), (gate, up, str(report))
        if up:
            assert "up's output is clamped" in str(report) and "0.5" in str(report), str(report)
    x = x3()
    m = Gated()
    clamped_input = nn.Sequential(nn.Hardtanh(-0.5, 0.5), m)  # a clamp outside the MLP changes nothing
    assert len(mlp_fuser.explain(clamped_input, x).fused) == 1


def test_a_norm_between_projections_is_not_an_activation():
    """A LayerNorm reads tensors besides its input too (its weight and bias), but reduces over a row: nothing there
    resembles an MLP, even with a row as short as a learned activation's scalars."""
    for width in (I, 2):
        m = nn.Sequential(nn.Linear(K, width), nn.LayerNorm(width), nn.Linear(width, O))
        report = mlp_fuser.explain(m, x3())
        assert not report.fused and not report.near_misses, str(report)


def test_near_miss_shapes():
    m = Gated()
    m.up = nn.Linear(K, 1, bias=False)  # broadcasts against the gate: not a gated MLP
    assert_not_fused(m, x3(), check="shapes")


def test_nothing_found_says_why():
    report = mlp_fuser.explain(nn.Sequential(nn.Linear(K, I), nn.LayerNorm(I), nn.Linear(I, O)), x3())
    assert not report.fused and not report.near_misses
    assert "no Linear → activation → Linear chain" in str(report)


# ---- options ---------------------------------------------------------------------------------------------


def test_options_allowed_and_filter():
    x = x3()
    report = mlp_fuser.explain(Gated(), x, activations=["gelu"])
    assert report.checks_failed() == {"allowed"}
    report = mlp_fuser.explain(Gated(), x, patterns=["plain"])
    assert report.checks_failed() == {"allowed"}
    m = nn.Sequential(Plain(F.gelu), nn.Linear(O, K), Plain(F.relu))
    seen = []
    mlp_fuser.patch(m, filter_fn=lambda module, fqn: seen.append((fqn, type(module))) or fqn == "0")
    assert count_ops(lambda: m(x)) == 1
    assert sorted(seen) == [("0", Plain), ("2", Plain)]
    compiled = torch.compile(Gated(), backend=mlp_fuser.make_backend(enabled=False, inductor=False))
    assert count_ops(lambda: compiled(x)) == 0
    compiled = torch.compile(Gated(), backend=mlp_fuser.make_backend(patterns=["plain"], inductor=False))
    assert count_ops(lambda: compiled(x)) == 0
    with pytest.raises(ValueError, match="unknown pattern"):
        mlp_fuser.make_backend(patterns=["nope"])


# ---- patch semantics ---------------------------------------------------------------------------------------


def test_patch_idempotent_unpatch_state_dict():
    m = Gated(bias=True)
    keys = {k: v.data_ptr() for k, v in m.state_dict().items()}
    assert mlp_fuser.patch(m) is m
    cls = type(m)
    assert fused_mlp(m) and type(mlp_fuser.patch(m)) is cls
    assert {k: v.data_ptr() for k, v in m.state_dict().items()} == keys
    x = x3()
    with torch.no_grad():
        out = m(x)
        m.to(torch.float64)  # new dtype: Dynamo re-captures, still fused
        assert count_ops(lambda: m(x.double())) == 1
        m.float()
        fresh = Gated(bias=True)
        fresh.load_state_dict(m.state_dict())
        torch.testing.assert_close(fresh(x), out)
        twin = copy.deepcopy(m)  # the copy's forward runs the copy's weights
        twin.down.weight.mul_(2)
        assert count_ops(lambda: twin(x)) == 1
        torch.testing.assert_close(twin(x), F.linear(F.silu(m.gate(x)) * m.up(x), 2 * m.down.weight, m.down.bias))
    mlp_fuser.unpatch(m)
    assert "forward" not in m.__dict__ and type(m) is Gated and mlp_fuser.unpatch(m) is m
    assert count_ops(lambda: m(x)) == 0


def test_patched_model_pickles_unpatched_and_patches_again():
    """torch.save keeps weights and structure; the fused forward is a compiled function, not state, so the loaded
    model is unpatched (and says so), and patch fuses it again."""
    m = mlp_fuser.patch(Gated(bias=True))
    x = x3()
    with torch.no_grad():
        out = m(x)
        buf = io.BytesIO()
        torch.save(m, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert mlp_fuser.is_patched(m) and not mlp_fuser.is_patched(loaded)
        assert count_ops(lambda: loaded(x)) == 0
        torch.testing.assert_close(loaded(x), out)
        assert mlp_fuser.patch(loaded) is loaded and mlp_fuser.is_patched(loaded)
        assert count_ops(lambda: loaded(x)) == 1
        torch.testing.assert_close(loaded(x), out)
        mlp_fuser.unpatch(loaded)
        assert "forward" not in loaded.__dict__ and not mlp_fuser.is_patched(loaded)
        assert count_ops(lambda: m(x)) == 1  # the original stays patched


# ---- backend -------------------------------------------------------------------------------------------------


def test_backend_by_name_inductor_and_log(caplog):
    m = Merged(bias=True)
    x = x3()
    with torch.no_grad():
        ref = m(x)
        with caplog.at_level(logging.INFO, logger="mlp_fuser"):
            compiled = torch.compile(m, backend="mlp_fuser")
            out = compiled(x)
        assert count_ops(lambda: compiled(x)) == 1
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)
    assert any("fused 1 MLP(s) (merged_gate_up/silu: 1)" in r.getMessage() for r in caplog.records)


def test_explain_counts_graph_breaks():
    class Broken(nn.Module):
        def __init__(self):
            super().__init__()
            self.a, self.b = Gated(), Plain(F.gelu)
            self.proj = nn.Linear(O, K)

        def forward(self, x):
            h = self.proj(self.a(x))
            torch._dynamo.graph_break()
            return self.b(h)

    report = mlp_fuser.explain(Broken(), x3())
    assert report.graphs == 2 and report.graph_breaks >= 1 and len(report.fused) == 2, str(report)
    assert "1 graph break" in str(report)


def test_fuse_mlps_on_an_fx_graph_with_get_attr():
    """The pass also takes a plain torch.fx graph, whose parameters are get_attr nodes."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.passes.fake_tensor_prop import FakeTensorProp

    from mlp_fuser.graph.fx_pass import fuse_mlps

    class Functional(nn.Module):
        def __init__(self):
            super().__init__()
            self.w1, self.b1 = nn.Parameter(torch.randn(I, K)), nn.Parameter(torch.randn(I))
            self.w2 = nn.Parameter(torch.randn(O, I))

        def forward(self, x):
            return F.linear(F.silu(F.linear(x, self.w1, self.b1)), self.w2)

    m, x = Functional(), x3()
    gm = torch.fx.symbolic_trace(m)
    FakeTensorProp(gm, FakeTensorMode(allow_non_fake_inputs=True)).propagate(x)
    report = fuse_mlps(gm)
    assert [(s.pattern, s.activation, s.K, s.I, s.O) for s in report.fused] == [("plain", "silu", K, I, O)]
    with torch.no_grad():
        torch.testing.assert_close(gm(x), m(x))
        assert count_ops(lambda: gm(x)) == 1
