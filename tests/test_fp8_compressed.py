"""compressed-tensors FP8 checkpoints ("FP8", "FP8_DYNAMIC", "FP8_BLOCK"), quantized and saved with the library's own
API and loaded back with transformers' ``from_pretrained`` as users get them: ``patch`` fuses their MLPs reading the
float8 weights and ``weight_scale`` as stored, ``explain`` names the format, other schemes are left as they were."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn.functional as F

import mlp_fuser
from mlp_fuser.dispatch import fp8
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.kernels.common import INTERPRET
from mlp_fuser.ops import quant
from mlp_fuser.patch import packed
from mlp_fuser.patch.modules import fused_mlp
from mlp_fuser.reference import rel_err

ct = pytest.importorskip("compressed_tensors")
transformers = pytest.importorskip("transformers")

FP8_SCHEMES = ("FP8_DYNAMIC", "FP8", "FP8_BLOCK")
H, I, V = 256, 384, 100
PATTERNS = {
    "FP8_DYNAMIC": "gated (fp8_e4m3 per channel, compressed-tensors; x per token and 128 columns, not per token)",
    "FP8": "gated (fp8_e4m3 per tensor, compressed-tensors; x per token and 128 columns, not by its static "
           "input_scale)",
    "FP8_BLOCK": "gated (fp8_e4m3 128x128 blocks, compressed-tensors)",
}


def _scheme(name: str):
    from compressed_tensors.quantization import QuantizationArgs, QuantizationScheme, preset_name_to_scheme

    if name == "FP8_GROUP64":  # FP8 weights, activations in groups of 64: finer than the op's 128 columns
        args = dict(num_bits=8, type="float", symmetric=True, dynamic=True, strategy="group", group_size=64)
        return QuantizationScheme(targets=["Linear"], weights=preset_name_to_scheme("FP8_DYNAMIC", ["Linear"]).weights,
                                  input_activations=QuantizationArgs(**args))
    return preset_name_to_scheme(name, ["Linear"])


def _save(scheme: str, path) -> None:
    """A tiny LLaMA quantized as llm-compressor does (weight scales from each weight's absmax per channel, tensor or
    block; static input scales from a calibration batch), compressed and saved with compressed-tensors' config."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import QuantizationConfig, apply_quantization_config
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V)
    model = transformers.LlamaForCausalLM(cfg).eval()
    amax: dict = {}
    hooks = [m.register_forward_pre_hook(lambda m, a: amax.__setitem__(m, a[0].abs().amax()))
             for m in model.modules() if isinstance(m, torch.nn.Linear)]
    with torch.no_grad():
        model(torch.randint(0, V, (2, 16)))
    for h in hooks:
        h.remove()
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": _scheme(scheme)}, ignore=["lm_head"]))
    for m in model.modules():
        if (args := getattr(getattr(m, "quantization_scheme", None), "weights", None)) is None:
            continue
        w = m.weight.detach()
        if args.strategy == "block":
            bn, bk = args.block_structure
            w = w.reshape(w.shape[0] // bn, bn, w.shape[1] // bk, bk).transpose(1, 2).flatten(2)
        if args.strategy in ("channel", "block", "group"):
            lo, hi = w.amin(-1, keepdim=args.strategy == "channel"), w.amax(-1, keepdim=args.strategy == "channel")
        else:
            lo, hi = w.amin().reshape(1), w.amax().reshape(1)
        m.weight_scale.data.copy_(calculate_qparams(lo, hi, args)[0].reshape(m.weight_scale.shape))
        if hasattr(m, "input_scale"):
            m.input_scale.data.fill_(amax[m] / 448)
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(path)
    compressor.update_config(path)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    saved: dict = {}

    def get(scheme: str):
        if scheme not in saved:
            saved[scheme] = tmp_path_factory.mktemp(scheme)
            _save(scheme, saved[scheme])
        return saved[scheme]
    return get


def _load(path, **kwargs):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs).eval()


def _plain_mlps(model) -> None:
    """The checkpoint's own model, decompressed, with its MLPs' activation quantization off: what the op computes on
    the CPU (the weights dequantized, x as it is); attention keeps compressed-tensors' forward."""
    with torch.no_grad():
        model(torch.zeros(1, 1, dtype=torch.long))  # compressed-tensors decompresses the model on its first forward
    for layer in model.model.layers:
        for proj in layer.mlp.children():
            proj.quantization_enabled = False


def _dtypes(model, part: str) -> set:
    return {m.weight.dtype for layer in model.model.layers for m in getattr(layer, part).children()
            if hasattr(m, "weight")}


@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_patch_runs_compressed_tensors_fp8_mlps_on_the_weights_as_stored(scheme, checkpoint):
    """The fused MLPs read the float8 weights and weight_scale (multiplied to dequantize, as compressed-tensors'
    decompression does): the patched model equals the checkpoint's own with its MLPs computing on the decompressed
    weights; the MLPs stay float8 through the forward, the rest is decompressed as compressed-tensors would."""
    model, twin = _load(checkpoint(scheme)), _load(checkpoint(scheme))
    _plain_mlps(twin)
    assert _pattern(model.model.layers[0].mlp) == PATTERNS[scheme]
    mlp_fuser.patch(model)
    assert fused_mlp(model.model.layers[0].mlp)
    assert _dtypes(model, "self_attn") == {torch.float32} and not hasattr(model, "ct_decompress_hook")
    ids = torch.randint(0, V, (2, 9))
    with torch.no_grad():
        out, ref = model(ids).logits, twin(ids).logits
    assert rel_err(out, ref) < 1e-5
    assert _dtypes(model, "mlp") == {K8.FP8}


def test_explain_before_patch_and_patch_again_after_unpatch(checkpoint):
    """explain names the format before patch (and changes nothing); unpatch leaves the MLPs compressed until the next
    forward decompresses them as compressed-tensors would, so a second patch fuses them again; unpatched, the model
    computes what the checkpoint computes."""
    model, own = _load(checkpoint("FP8_DYNAMIC")), _load(checkpoint("FP8_DYNAMIC"))
    ids = torch.randint(0, V, (1, 7))
    report = mlp_fuser.explain(model, ids)
    assert [s.pattern for s in report.fused] == [PATTERNS["FP8_DYNAMIC"]] * 2
    assert "its hook decompresses them on the first forward" in str(report)  # why the captured forward raised
    assert _dtypes(model, "self_attn") == _dtypes(model, "mlp") == {K8.FP8} and hasattr(model, "ct_decompress_hook")
    mlp_fuser.patch(model, filter_fn=lambda m, fqn: fqn == "model.layers.1.mlp")
    assert [n for n, m in model.named_modules() if fused_mlp(m)] \
        == ["model.layers.1.mlp"]
    assert _dtypes(model, "mlp") == {K8.FP8, torch.float32}
    mlp_fuser.unpatch(model)
    assert _dtypes(model, "mlp") == {K8.FP8, torch.float32} and hasattr(model, "ct_decompress_hook")
    mlp_fuser.patch(model)
    assert fused_mlp(model.model.layers[1].mlp)
    mlp_fuser.unpatch(model)
    with torch.no_grad():
        out, ref = model(ids).logits, own(ids).logits
    assert torch.equal(out, ref) and _dtypes(model, "mlp") == {torch.float32}


def test_patch_on_a_submodule_leaves_compressed_mlps_with_the_reason(checkpoint, caplog):
    """compressed-tensors' hook on the model returned by from_pretrained decompresses every layer on its first
    forward: patch, given a submodule, cannot keep the MLPs compressed, so it leaves them as they were."""
    model = _load(checkpoint("FP8_DYNAMIC"))
    with caplog.at_level("INFO", logger="mlp_fuser"):
        mlp_fuser.patch(model.model)
    assert "patch the model from_pretrained returned" in caplog.text
    assert not any("forward" in m.__dict__ for m in model.model.layers.modules() if not hasattr(m, "weight"))
    assert _dtypes(model, "self_attn") == {K8.FP8}


@pytest.mark.parametrize("scheme,why", [("W8A8", "int8"), ("FP8_GROUP64", "group")])
def test_patch_leaves_other_compressed_tensors_schemes_exactly_as_they_were(scheme, why, checkpoint, caplog):
    """int8 weights, and FP8 weights whose activations are quantized in groups of 64 (finer than the op's 128
    columns): left alone, with the reason."""
    model = _load(checkpoint(scheme))
    def state():
        return {n: (type(m), m.__dict__.get("forward"), {k: t.dtype for k, t in m._parameters.items() if t is not None})
                for n, m in model.named_modules()}
    before = state()
    with caplog.at_level("INFO", logger="mlp_fuser"):
        mlp_fuser.patch(model)
    assert state() == before and hasattr(model, "ct_decompress_hook")
    assert "model.layers.0.mlp" in caplog.text and why in caplog.text


def test_transformers_compressed_tensors_fp8_linear_mlps_are_fused():
    """``use_optimized_inference=True`` (sm89+) loads CompressedTensorsFP8Linear: weight_scale (1, N) float32, x
    quantized per token. Built here as its loader builds it (the CPU cannot load it)."""
    from transformers.integrations.compressed_tensors import replace_with_compressed_tensors_fp8_linear

    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=1, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=V)
    model = transformers.LlamaForCausalLM(cfg).eval()
    twin = copy.deepcopy(model.model.layers[0].mlp).double()
    replace_with_compressed_tensors_fp8_linear(model, targets=["re:.*mlp.*"], ignore=["lm_head"])
    for name in ("gate_proj", "up_proj", "down_proj"):
        proj = model.model.layers[0].mlp.get_submodule(name)
        w = getattr(twin, name).weight.data
        s = w.abs().amax(1) / 448
        proj.weight.data = (w / s[:, None]).to(K8.FP8)
        proj.weight_scale.data = s.float()[None]
        getattr(twin, name).weight.data = proj.weight.data.double() * s.float().double()[:, None]
    mlp = model.model.layers[0].mlp
    assert _pattern(mlp) == PATTERNS["FP8_DYNAMIC"]
    mlp_fuser.patch(model)
    assert fused_mlp(mlp)
    x = torch.randn(2, 5, H)
    with torch.no_grad():
        assert rel_err(mlp(x), twin(x.double())) < 1e-5


def _pattern(mlp) -> str | None:
    """What explain reports for an unpatched MLP module (without tracing the whole model)."""
    from mlp_fuser.patch.fp8 import fp8_site

    site = fp8_site(mlp, "mlp", {})
    return None if site is None else site.pattern


@pytest.mark.skipif(not torch.cuda.is_available() and not INTERPRET, reason="the FP8 kernels need CUDA or the "
                    "interpreter")
@pytest.mark.parametrize("scheme", FP8_SCHEMES)
def test_the_ops_activation_scaling_is_no_less_accurate_than_the_checkpoints(scheme, checkpoint, monkeypatch):
    """The op's kernels quantize x per token and 128 columns (W8A8), the checkpoint per token (FP8_DYNAMIC), by one
    static input_scale (FP8) or per 128 columns (FP8_BLOCK): against float64 on the dequantized weights, the fused
    MLP's error stays within 1.25x the checkpoint's own MLP's (issue 50's accuracy bound)."""
    cuda = torch.cuda.is_available()
    monkeypatch.setattr(fp8, "_PLANS", {})
    if not cuda:
        monkeypatch.setattr(mlp_fuser.config, "triton_on_cpu", True)
    own, model = _load(checkpoint(scheme)), _load(checkpoint(scheme))
    own_mlp, seen = own.model.layers[0].mlp, []
    hook = own_mlp.register_forward_pre_hook(lambda m, args: seen.append(args[0]))
    with torch.no_grad():  # decompressed: the checkpoint's own MLP; x: its input in the model, as calibrated
        own(torch.randint(0, V, (2, 7), generator=torch.Generator().manual_seed(1)))
    hook.remove()
    mlp_fuser.patch(model)
    dev, dt = ("cuda", torch.bfloat16) if cuda else ("cpu", torch.float16)
    mlp, x = model.model.layers[0].mlp.to(dev), seen[0].to(dt)
    assert quant.choose(x, x.shape[0] * x.shape[1]) == "fp8_w8a8"  # the kernels, x quantized
    with torch.no_grad():
        w = {n: own_mlp.get_submodule(n).weight.double() for n in ("gate_proj", "up_proj", "down_proj")}
        ref = (F.silu(x.double() @ w["gate_proj"].T) * (x.double() @ w["up_proj"].T)) @ w["down_proj"].T
        theirs = rel_err(own_mlp(x.float()), ref)
        ours = rel_err(mlp(x.to(dev)).cpu(), ref)
    assert 0 < ours <= 1.25 * theirs, (ours, theirs)


def test_patched_mlps_compile_with_the_backend(checkpoint):
    """Compiling after patch (as for every FP8 checkpoint): the backend's graph calls the FP8 op on the float8
    weights. (Attention's own fake quantization is left out: Inductor's fused arithmetic can move a value across an
    e4m3 rounding boundary there, with or without mlp_fuser.)"""
    model = _load(checkpoint("FP8_BLOCK"))
    mlp_fuser.patch(model)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 5, H)
    graphs = []

    def backend(gm, example_inputs):
        graphs.append(str(gm.graph))
        return mlp_fuser.backend(gm, example_inputs)
    with torch.no_grad():
        ref, out = mlp(x), torch.compile(mlp, backend=backend)(x)
    assert rel_err(out, ref) < 1e-6 and _dtypes(model, "mlp") == {K8.FP8}
    assert len(graphs) == 1 and "quant_gated_mlp" in graphs[0]
    # each projection's float8 weight and weight_scale packed into one buffer: one graph input each (patch.packed)
    assert all(packed.is_packed(c, ("weight", "weight_scale")) for c in (mlp.gate_proj, mlp.up_proj, mlp.down_proj))
    assert "weight_scale" not in graphs[0] and graphs[0].count(packed.BUFFER) >= 3
