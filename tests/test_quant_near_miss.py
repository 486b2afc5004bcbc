"""MLPs whose projections are integer-quantized layers (compressed-tensors int schemes, GPTQ / AWQ ``QuantLinear``,
bitsandbytes ``Linear4bit`` / ``Linear8bitLt``, HQQ's ``HQQLinear``): ``explain`` names each as a near miss with the
layer's class and format, ``patch`` leaves the model exactly as it was, and a module of such layers that is not an
MLP is not reported. The libraries' layers are stood in for by modules holding their attributes (none is needed
here); compressed-tensors' are its own, where it is installed."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn

import mlp_fuser

K, I = 256, 384  # noqa: E741
READS = "the ops read bf16/fp16/fp32 or float8 weights"


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _unpack4(q: Tensor) -> Tensor:
    """int32 holding 8 nibbles each along dim 0 -> their values (0..15), 8 times as many rows."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=q.device)
    return ((q.unsqueeze(1) >> shifts.view(1, -1, 1)) & 15).reshape(-1, q.shape[-1])


@torch.library.custom_op("mlp_fuser_test::int4_matmul", mutates_args=())
def _int4_matmul(x: Tensor, qweight: Tensor, scales: Tensor, g_idx: Tensor) -> Tensor:
    """GPTQ's kernel stand-in (opaque to Dynamo, as the libraries' CUDA kernels are)."""
    return x @ ((_unpack4(qweight).to(x.dtype) - 8) * scales[g_idx].to(x.dtype))


@_int4_matmul.register_fake
def _(x, qweight, scales, g_idx):
    return x.new_empty(*x.shape[:-1], scales.shape[-1])


class QuantLinear(nn.Module):
    """auto_gptq's QuantLinear: int4 packed 8 to an int32 along the input dim, fp16 scales per group of 128 rows."""

    def __init__(self, k: int, n: int, seed: int, group: int = 128):
        super().__init__()
        self.infeatures, self.outfeatures, self.bits, self.group_size = k, n, 4, group
        g = _gen(seed)
        self.register_buffer("qweight", torch.randint(-2**31, 2**31 - 1, (k // 8, n), dtype=torch.int32, generator=g))
        self.register_buffer("qzeros", torch.full((k // group, n // 8), 0x77777777, dtype=torch.int32))
        self.register_buffer("scales", (torch.rand(k // group, n, generator=g) / 50).half())
        self.register_buffer("g_idx", torch.arange(k, dtype=torch.int32) // group)
        self.bias = None

    def forward(self, x):
        return _int4_matmul(x, self.qweight, self.scales, self.g_idx)


class WQLinear_GEMM(QuantLinear):  # noqa: N801 (AWQ's name)
    """AWQ's layer: in_features / out_features and w_bit; dequantized in plain torch here (Dynamo sees a matmul)."""

    def __init__(self, k: int, n: int, seed: int):
        super().__init__(k, n, seed)
        self.in_features, self.out_features, self.w_bit = k, n, 4
        del self.infeatures, self.outfeatures, self.bits

    def forward(self, x):
        return x @ ((_unpack4(self.qweight).to(x.dtype) - 8) * self.scales[self.g_idx].to(x.dtype))


class Params4bit(nn.Parameter):
    """bitsandbytes' 4-bit weight: uint8 holding two nibbles, its quant_state (absmax per block of 64) beside it."""


class Linear4bit(nn.Linear):
    def __init__(self, k: int, n: int, seed: int):
        super().__init__(k, n, bias=False, device="meta")
        g = _gen(seed)
        w = Params4bit(torch.randint(0, 256, (k * n // 2, 1), dtype=torch.uint8, generator=g), requires_grad=False)
        w.quant_type, w.blocksize, w.quant_state = "nf4", 64, torch.rand(k * n // 64, generator=g) / 8
        self.weight = w

    def forward(self, x):
        q = self.weight.view(-1)
        nibbles = torch.stack([q >> 4, q & 15], -1).reshape(-1, 64).to(x.dtype) - 8
        return F.linear(x, (nibbles * self.weight.quant_state[:, None]).reshape(self.out_features, -1))


class Int8Params(nn.Parameter):
    """bitsandbytes' 8-bit weight: int8, its scales per row in SCB."""


class Linear8bitLt(nn.Linear):
    def __init__(self, k: int, n: int, seed: int):
        super().__init__(k, n, device="meta")
        g = _gen(seed)
        w = Int8Params(torch.randint(-127, 128, (n, k), dtype=torch.int8, generator=g), requires_grad=False)
        w.CB, w.SCB = None, torch.rand(n, generator=g) + 0.5
        self.weight, self.bias = w, nn.Parameter(torch.randn(n, generator=g))

    def forward(self, x):
        return F.linear(x, self.weight.to(x.dtype) * self.weight.SCB[:, None] / 127 / 16, self.bias)


class HQQLinear(nn.Module):
    """HQQ's layer: W_q uint8 (two 4-bit values), scale and zero per group of 64 in its meta dict."""

    def __init__(self, k: int, n: int, seed: int):
        super().__init__()
        g = _gen(seed)
        self.in_features, self.out_features, self.bias = k, n, None
        self.W_q = nn.Parameter(torch.randint(0, 256, (k * n // 2, 1), dtype=torch.uint8, generator=g),
                                requires_grad=False)
        self.meta = {"nbits": 4, "group_size": 64, "shape": (n, k), "scale": torch.rand(k * n // 64, 1, generator=g)
                     / 8, "zero": torch.full((k * n // 64, 1), 8.0)}

    def forward(self, x):
        q = self.W_q.view(-1)
        w = torch.stack([q >> 4, q & 15], -1).reshape(-1, 64).to(x.dtype)
        return F.linear(x, ((w - self.meta["zero"]) * self.meta["scale"]).reshape(self.meta["shape"]))


BNB = "bitsandbytes.nn.modules"
for cls, home in [(QuantLinear, "auto_gptq.nn_modules.qlinear.qlinear_cuda_old"),
                  (WQLinear_GEMM, "awq.modules.linear.gemm"), (HQQLinear, "hqq.core.quantize"), (Params4bit, BNB),
                  (Linear4bit, BNB), (Int8Params, BNB), (Linear8bitLt, BNB)]:
    cls.__module__ = home  # where the libraries define them: the reason names who made the layer by it


class Gated(nn.Module):
    def __init__(self, make, seed):
        super().__init__()
        self.gate_proj, self.up_proj, self.down_proj = make(K, I, seed), make(K, I, seed + 1), make(I, K, seed + 2)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Plain(nn.Module):
    def __init__(self, make, seed):
        super().__init__()
        self.fc1, self.fc2 = make(K, I, seed), make(I, K, seed + 1)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class Attention(nn.Module):
    """Three projections, no activation between them: not an MLP."""

    def __init__(self, make, seed):
        super().__init__()
        self.q_proj, self.k_proj, self.v_proj = make(K, K, seed), make(K, K, seed + 1), make(K, K, seed + 2)

    def forward(self, x):
        scores = self.q_proj(x) @ self.k_proj(x).transpose(-1, -2) / K**0.5
        return scores.softmax(-1) @ self.v_proj(x)


class Net(nn.Module):
    def __init__(self, make, block=Gated, layers=2, attention=False):
        super().__init__()
        self.layers = nn.ModuleList(nn.ModuleDict({"mlp": block(make, 10 * i)}) for i in range(layers))
        if attention:
            for i, layer in enumerate(self.layers):
                layer["self_attn"] = Attention(make, 10 * i + 5)

    def forward(self, x):
        for layer in self.layers:
            if "self_attn" in layer:
                x = x + layer["self_attn"](x)
            x = x + layer["mlp"](x)
        return x


def _x():
    return torch.randn(2, 5, K, generator=_gen(99))


def _state(model):
    return {k: (type(v), v.dtype, v.data_ptr(), v.clone()) for k, v in model.state_dict().items()}


def _assert_left_as_it_was(model, forward=None):
    """patch leaves the model as it was: the same state_dict (tensors by type, storage and value), no forward
    replaced, the same output (``forward``: the unpatched output, where the model's own forward changes it)."""
    x = _x()
    with torch.no_grad():
        ref = model(x) if forward is None else forward(x)
    before = _state(model)
    forwards = {p: (type(m), m.__dict__.get("forward")) for p, m in model.named_modules()}
    mlp_fuser.patch(model)
    assert not mlp_fuser.is_patched(model)
    assert forwards == {p: (type(m), m.__dict__.get("forward")) for p, m in model.named_modules()}
    after = _state(model)
    assert after.keys() == before.keys()
    for k, (kind, dtype, ptr, v) in after.items():
        assert (kind, dtype, ptr) == before[k][:3] and torch.equal(v, before[k][3]), k
    with torch.no_grad():
        torch.testing.assert_close(model(x), ref, rtol=0, atol=0)


KINDS = {
    "gptq": (QuantLinear, "gate_proj is GPTQ's QuantLinear (qweight packed int4, group 128)"),
    "awq": (WQLinear_GEMM, "gate_proj is AWQ's WQLinear_GEMM (qweight packed int4, group 128)"),
    "bnb4": (Linear4bit, "gate_proj is bitsandbytes' Linear4bit (Params4bit nf4 weight)"),
    "bnb8": (Linear8bitLt, "gate_proj is bitsandbytes' Linear8bitLt (Int8Params int8 weight)"),
    "hqq": (HQQLinear, "gate_proj is HQQ's HQQLinear (W_q 4-bit, group 64)"),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_quantized_mlps_are_named_near_misses_and_patch_leaves_them(kind):
    make, what = KINDS[kind]
    model = Net(make).eval()
    report = mlp_fuser.explain(model, _x())
    assert not report.fused and report.checks_failed() == {"plain_tensors"}, report.details()
    assert [(m.path, m.pattern) for m in report.near_misses] == [("layers.0.mlp", "gated"), ("layers.1.mlp", "gated")]
    assert report.near_misses[1].reason == f"layers.1.mlp.{what}: {READS}", report.details()
    assert f"{what}: {READS}" in str(report)  # folded: the block's own path left out
    _assert_left_as_it_was(model)


def test_a_plain_quantized_mlp_is_a_near_miss():
    report = mlp_fuser.explain(Net(HQQLinear, block=Plain).eval(), _x())
    assert [(m.path, m.pattern) for m in report.near_misses] == [("layers.0.mlp", "plain"), ("layers.1.mlp", "plain")]
    assert report.near_misses[0].reason == f"layers.0.mlp.fc1 is HQQ's HQQLinear (W_q 4-bit, group 64): {READS}"


@pytest.mark.parametrize("kind", ["gptq", "bnb4", "hqq"])
def test_quantized_layers_outside_mlps_are_not_reported(kind):
    """Attention of quantized layers is not an MLP (proven on its twin of plain Linears): only the MLPs are named."""
    model = Net(KINDS[kind][0], attention=True).eval()
    report = mlp_fuser.explain(model, _x())
    assert [m.path for m in report.near_misses] == ["layers.0.mlp", "layers.1.mlp"], report.details()
    _assert_left_as_it_was(model)


# ---- compressed-tensors' own layers -----------------------------------------------------------------------------


def _compressed(scheme: str):
    """A Net of plain Linears quantized with compressed-tensors' preset ``scheme`` and compressed (its
    decompression hook on the model, as from_pretrained leaves it); and an uncompressed copy's forward."""
    pytest.importorskip("compressed_tensors")
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config, preset_name_to_scheme

    torch.manual_seed(0)
    model = Net(lambda k, n, seed: nn.Linear(k, n, bias=False)).eval()
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": preset_name_to_scheme(scheme, ["Linear"])}))
    for m in model.modules():
        if isinstance(m, nn.Linear):
            m.weight_scale.data.copy_(m.weight.detach().abs().amax(-1, keepdim=True).expand_as(m.weight_scale) / 7)
    ModelCompressor.from_pretrained_model(model).compress_model(model)
    twin = copy.deepcopy(model)  # the forward decompresses the model it runs: the reference runs a copy
    return model, twin


@pytest.mark.parametrize("scheme,what", [("W4A16", "a compressed-tensors int4 (group 128) layer"),
                                         ("W8A16", "a compressed-tensors int8 (group 128) layer"),
                                         ("W4A16_ASYM", "a compressed-tensors int4 asymmetric (group 128) layer"),
                                         ("W8A8", "a compressed-tensors int8 (per channel) layer")])
def test_compressed_tensors_int_mlps_are_named_near_misses_and_patch_leaves_them(scheme, what):
    model, twin = _compressed(scheme)
    held = {k for k in model.layers[0]["mlp"].gate_proj.state_dict()}
    assert ("weight_packed" in held) == (scheme != "W8A8")  # packed int4/int8: no weight at all
    report = mlp_fuser.explain(model, _x())
    assert not report.fused and report.checks_failed() == {"plain_tensors"}, report.details()
    assert [m.reason for m in report.near_misses] == [f"layers.{i}.mlp.gate_proj is {what}: {READS}" for i in (0, 1)]
    _assert_left_as_it_was(model, forward=twin)
