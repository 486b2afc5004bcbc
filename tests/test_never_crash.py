"""Models whose MLP weights the op cannot read (transformers' FineGrainedFP8 ``FP8Linear``, a torchao-like quantized
tensor subclass): ``explain`` names each block as a near miss in the users' own names and raises nothing, ``patch``
leaves the model exactly as it was. Also: the one ``filter_fn(module, fqn)`` signature, and the folded report."""

from __future__ import annotations

import re

import pytest
import torch
import torch.nn.functional as F
from _hf_models import count_ops
from torch import nn
from torch.utils._pytree import tree_map

import mlp_fuser
from mlp_fuser import cli
from mlp_fuser.explain import fold
from mlp_fuser.patch.modules import fused_mlp

DYNAMO_NAMES = re.compile(r"\bl_|_modules_|_parameters_|\blinear_\d|\bmul_\d")


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _llama(layers: int = 2):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.AutoModelForCausalLM.from_config(cfg).eval()


def _ids():
    return torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(3))


def _snapshot(model):
    """What must not change: every module's class and instance forward, the state_dict's tensors (by storage and
    value)."""
    forwards = {p: (type(m), m.__dict__.get("forward")) for p, m in model.named_modules()}
    state = {k: (v.data_ptr(), v.dtype, v.detach().float().clone(), v.untyped_storage().nbytes())
             for k, v in model.state_dict().items()}
    return forwards, state


def _packed_fp8(k: str, dtype) -> bool:
    """A tensor ``patch`` packs (``patch.packed``): an FP8 layer's float8 weight or its scales. Unpatch gives each
    its own storage again (the same values), not the storage it had before patch."""
    return dtype == torch.float8_e4m3fn or k.endswith("weight_scale_inv")


def _assert_unchanged(model, before, ref):
    forwards, state = _snapshot(model)
    assert forwards == before[0] and "forward" not in model.__dict__ and not mlp_fuser.is_patched(model)
    assert state.keys() == before[1].keys()
    for k, (ptr, dtype, v, nbytes) in state.items():
        assert dtype == before[1][k][1] and torch.equal(v, before[1][k][2]) and nbytes == before[1][k][3], k
        assert ptr == before[1][k][0] or _packed_fp8(k, dtype), k
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, ref, rtol=0, atol=0)


def _assert_user_names(report):
    for m in report.near_misses:
        assert not DYNAMO_NAMES.search(m.reason), m.reason
    assert not DYNAMO_NAMES.search(str(report)) and not DYNAMO_NAMES.search(report.details()), report.details()


# ---- transformers' FineGrainedFP8 FP8Linear ---------------------------------------------------------------------


@torch.library.custom_op("mlp_fuser_test::fp8_matmul", mutates_args=())
def _fp8_matmul(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return x @ (w.to(x.dtype) * scale.to(x.dtype)).T


@_fp8_matmul.register_fake
def _(x, w, scale):
    return x.new_empty(*x.shape[:-1], w.shape[0])


def _fp8_llama(layers: int = 2):
    """A tiny LLaMA whose MLP projections are FP8Linear with per-tensor scales, as the FineGrainedFP8 quantizer
    builds them."""
    from transformers.integrations.finegrained_fp8 import FP8Linear

    model = _llama(layers)
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            lin = getattr(layer.mlp, name)
            fp8 = FP8Linear(lin.in_features, lin.out_features)
            with torch.no_grad():
                scale = lin.weight.abs().amax() / 448
                fp8.weight.copy_((lin.weight / scale).to(torch.float8_e4m3fn))
                fp8.weight_scale_inv.fill_(scale)
            setattr(layer.mlp, name, fp8)
    return model


@pytest.fixture
def fp8_kernel(monkeypatch):
    """The finegrained-fp8 hub kernel as an opaque op on the CPU (the real one is a CUDA Triton kernel)."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")

    def matmul(x, w, scale, block_size, dtype, activation_scale=None):
        return _fp8_matmul(x, w, scale)

    monkeypatch.setattr(fp8, "_FINEGRAINED_FP8", fp8.FineGrainedFP8(matmul, None, None))
    monkeypatch.setattr(fp8, "is_deepgemm_loadable", lambda: False)


def test_fp8linear_mlp_is_fused_and_unpatch_restores_it(fp8_kernel):
    """FP8Linear MLPs (per-tensor scales): explain reports them fused with their format, patch runs them through the
    FP8 op with the model's numbers, unpatch gives the model back untouched."""
    model = _fp8_llama()
    with torch.no_grad():
        ref = model(_ids()).logits
    before = _snapshot(model)
    report = mlp_fuser.explain(model, _ids())
    assert report.error is None and not report.near_misses, report.details()
    assert [s.path for s in report.fused] == ["model.layers.0.mlp", "model.layers.1.mlp"], report.details()
    assert {s.pattern for s in report.fused} == {"gated (fp8_e4m3 per tensor)"}
    _assert_user_names(report)
    assert mlp_fuser.patch(model) is model and mlp_fuser.is_patched(model)
    with torch.no_grad():
        torch.testing.assert_close(model(_ids()).logits, ref)
    mlp_fuser.unpatch(model)
    _assert_unchanged(model, before, ref)


def test_fp8linear_without_its_kernel_explain_traces_it_and_patch_runs_it(monkeypatch):
    """On a machine without the hub kernel the forward itself raises; explain still captures the model's graph
    (transformers' FP8 layers traced on the aten stand-in for that kernel) and reports the blocks patch fuses, with
    no error and never Dynamo's TorchRuntimeError; after patch the model runs."""
    fp8 = pytest.importorskip("transformers.integrations.finegrained_fp8")
    monkeypatch.setattr(fp8, "_FINEGRAINED_FP8", None)
    monkeypatch.setattr(fp8, "is_kernels_available", lambda: False)
    model = _fp8_llama()
    report = mlp_fuser.explain(model, _ids())
    assert report.error is None and report.graphs >= 1, report.error
    assert fp8._FINEGRAINED_FP8 is None  # the stand-in was the capture's alone
    assert "TorchRuntimeError" not in str(report)
    assert len(report.fused) == 2 and not report.near_misses, report.details()
    _assert_user_names(report)
    with pytest.raises(ImportError):
        model(_ids())
    mlp_fuser.patch(model)
    with torch.no_grad():
        assert mlp_fuser.is_patched(model) and torch.isfinite(model(_ids()).logits).all()


# ---- a torchao-like quantized weight ----------------------------------------------------------------------------


class Int8Tensor(torch.Tensor):
    """Weight-only int8 as torchao stores it: a wrapper subclass that reports the float dtype, holds int8 data and a
    per-row scale, and dequantizes for every op (``__torch_dispatch__``)."""

    @staticmethod
    def __new__(cls, qdata, scale, dtype=torch.float32):
        return torch.Tensor._make_wrapper_subclass(cls, qdata.shape, dtype=dtype, device=qdata.device)

    def __init__(self, qdata, scale, dtype=torch.float32):
        self.qdata, self.scale = qdata, scale

    @classmethod
    def quantize(cls, w):
        scale = w.detach().abs().amax(1, keepdim=True) / 127
        return cls((w.detach() / scale).round().to(torch.int8), scale, w.dtype)

    def dequantize(self):
        return self.qdata.to(self.dtype) * self.scale

    def __tensor_flatten__(self):
        return ["qdata", "scale"], self.dtype

    @staticmethod
    def __tensor_unflatten__(inner, dtype, outer_size, outer_stride):
        return Int8Tensor(inner["qdata"], inner["scale"], dtype)

    def __repr__(self):
        return f"Int8Tensor({self.dequantize()})"

    @classmethod
    def __torch_dispatch__(cls, func, types, args, kwargs=None):
        if func is torch.ops.aten.detach.default:
            return Int8Tensor(args[0].qdata, args[0].scale, args[0].dtype)
        unwrap = lambda t: t.dequantize() if isinstance(t, Int8Tensor) else t  # noqa: E731
        return func(*tree_map(unwrap, args), **tree_map(unwrap, kwargs or {}))


def test_tensor_subclass_weights_are_a_named_near_miss_and_patch_leaves_them():
    model = _llama()
    for layer in model.model.layers:
        for name in ("gate_proj", "up_proj", "down_proj"):
            proj = getattr(layer.mlp, name)
            proj.weight = nn.Parameter(Int8Tensor.quantize(proj.weight), requires_grad=False)
    with torch.no_grad():
        ref = model(_ids()).logits
    before = _snapshot(model)
    report = mlp_fuser.explain(model, _ids())
    assert not report.fused and report.checks_failed() == {"plain_tensors"}, report.details()
    assert [m.path for m in report.near_misses] == ["model.layers.0.mlp", "model.layers.1.mlp"], report.details()
    assert "model.layers.0.mlp.gate_proj.weight is a Int8Tensor, a tensor subclass" in report.details()
    _assert_user_names(report)
    mlp_fuser.patch(model)
    _assert_unchanged(model, before, ref)


# ---- user-facing names in every reason --------------------------------------------------------------------------


class Gated(nn.Module):
    def __init__(self, K=16, I=32):  # noqa: E741
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(K, I), nn.Linear(K, I), nn.Linear(I, K)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.mlp = Gated()

    def forward(self, x):
        return x + self.mlp(x)


class Stack(nn.Module):
    def __init__(self, n=3):
        super().__init__()
        self.layers = nn.ModuleList(Block() for _ in range(n))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def _x():
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def test_near_miss_reasons_name_modules_and_parameters():
    m = Stack(1)
    m.layers[0].mlp.down.double()
    report = mlp_fuser.explain(m, _x())
    assert [x.check for x in report.near_misses] == ["dtype_device"], report.details()
    assert report.near_misses[0].reason == "layers.0.mlp.down.weight is torch.float64 but x is torch.float32"
    m = Stack(1)
    m.layers[0].mlp.gate.register_forward_hook(lambda mod, inp, out: out)  # Dynamo inlines it: still one MLP
    kept = []
    m.layers[0].mlp.up.register_forward_hook(lambda mod, inp, out: kept.append(out))
    report = mlp_fuser.explain(m, _x())
    assert [x.check for x in report.near_misses] == ["single_use"], report.details()
    assert report.near_misses[0].reason.startswith("the output of layers.0.mlp.up escapes"), report.near_misses
    _assert_user_names(report)


# ---- filter_fn(module, fqn) -------------------------------------------------------------------------------------


def test_filter_fn_takes_module_and_fqn_in_patch_and_backend():
    m, x = Stack(3), _x()
    with torch.no_grad():
        ref = m(x)
    seen = []

    def only_1(module, fqn):
        seen.append((module, fqn))
        return fqn == "layers.1.mlp"

    mlp_fuser.patch(m, filter_fn=only_1)
    assert seen == [(m.layers[i].mlp, f"layers.{i}.mlp") for i in range(3)]
    assert [fused_mlp(b.mlp) for b in m.layers] == [False, True, False]
    with torch.no_grad():
        assert count_ops(lambda: m(x)) == 1
        torch.testing.assert_close(m(x), ref)
    mlp_fuser.unpatch(m)
    seen.clear()
    mlp_fuser.patch(m, filter_fn=only_1, per_module=False)  # the whole forward: the module looked up by its path
    with torch.no_grad():
        assert count_ops(lambda: m(x)) == 1
    assert sorted(seen, key=lambda s: s[1]) == [(m.layers[i].mlp, f"layers.{i}.mlp") for i in range(3)]
    mlp_fuser.unpatch(m)
    torch._dynamo.reset()
    seen.clear()
    compiled = torch.compile(m, backend=mlp_fuser.make_backend(inductor=False, filter_fn=only_1))
    with torch.no_grad():
        assert count_ops(lambda: compiled(x)) == 1
        torch.testing.assert_close(compiled(x), ref)
    assert sorted(seen, key=lambda s: s[1]) == [(None, f"layers.{i}.mlp") for i in range(3)]  # no root: None
    torch._dynamo.reset()
    seen.clear()
    compiled = torch.compile(m, backend=mlp_fuser.make_backend(inductor=False, filter_fn=only_1, root=m))
    with torch.no_grad():
        assert count_ops(lambda: compiled(x)) == 1
    assert sorted(seen, key=lambda s: s[1]) == [(m.layers[i].mlp, f"layers.{i}.mlp") for i in range(3)]


@pytest.mark.parametrize("bad", [lambda fqn: True, lambda module, fqn, extra: True, lambda: True])
def test_filter_fn_of_the_wrong_arity_is_a_clear_type_error(bad):
    m = Stack(1)
    for call in (lambda: mlp_fuser.patch(m, filter_fn=bad), lambda: mlp_fuser.make_backend(filter_fn=bad),
                 lambda: mlp_fuser.merge_gate_up(m, filter_fn=bad)):
        with pytest.raises(TypeError, match=r"filter_fn.*\(module, fqn\)"):
            call()
    assert not mlp_fuser.is_patched(m)
    with pytest.raises(TypeError, match="callable"):
        mlp_fuser.patch(m, filter_fn="layers.0.mlp")


# ---- the folded report ------------------------------------------------------------------------------------------


def test_fold_ranges_and_sets():
    assert fold([f"model.layers.{i}.mlp" for i in range(30)]) == [("model.layers.{0..29}.mlp", 30)]
    assert fold(["model.layers.0.mlp", "model.layers.2.mlp", "model.layers.5.mlp"]) == [("model.layers.{0,2,5}.mlp", 3)]
    assert fold(["a.0.b", "a.1.b", "a.2.b", "a.3.b", "a.7.b"]) == [("a.{0..3,7}.b", 5)]
    assert fold(["enc.0.ff", "dec.0.ff", "lm"]) == [("enc.0.ff", 1), ("dec.0.ff", 1), ("lm", 1)]
    assert fold(["x.0.y.0", "x.0.y.1", "x.1.y.0"]) == [("x.0.y.{0,1}", 2), ("x.1.y.0", 1)]


def test_report_folds_identical_blocks_details_behind_a_flag():
    m = Stack(4)
    kept = []
    m.layers[2].mlp.up.register_forward_hook(lambda mod, inp, out: kept.append(out))  # one near miss among four
    report = mlp_fuser.explain(m, _x())
    text = str(report)
    fused = [ln for ln in text.splitlines() if ln.strip().startswith("layers.")]
    assert fused[0].split() == ["layers.{0,1,3}.mlp", "gated", "silu", "16", "→", "32", "→", "16", "×3"], text
    assert fused[1].split()[:3] == ["layers.2.mlp", "gated", "single_use"] and "the output of up" in fused[1], text
    assert len(fused) == 2 and "layers.0.mlp" not in text, text
    details = report.details()
    for i in range(4):
        assert f"layers.{i}.mlp" in details
    assert str(mlp_fuser.explain(m, _x(), verbose=True)) == details
    assert len(report.fused) == 3 and len(report.near_misses) == 1  # the lists stay one entry per block


def test_cli_explain_details_flag(capsys):
    assert cli.main(["explain", "llama"]) == 0
    short = capsys.readouterr().out
    assert cli.main(["explain", "llama", "--details"]) == 0
    details = capsys.readouterr().out
    assert "model.layers.{0,1}.mlp" in short and "×2" in short and "model.layers.0.mlp" not in short, short
    assert "model.layers.0.mlp" in details and "model.layers.1.mlp" in details and "×2" not in details, details


@torch._dynamo.allow_in_graph
def _load_kernel():
    raise ImportError("kernel unavailable")


def test_explain_names_the_error_dynamo_ran_into():
    """A function Dynamo runs on fake tensors (as transformers' kernel loaders) raises: the report names that error,
    not Dynamo's wrapping of it."""

    def forward(x):
        _load_kernel()
        return x + 1

    report = mlp_fuser.explain(forward, _x())
    assert report.error == "ImportError: kernel unavailable", report.error
