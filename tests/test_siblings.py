"""q, k and v as one FP8 GEMM: ``patch`` packs a module's lone FP8 linears side by side in one buffer
(``packed.pack_together``) and the backend merges those that read one input into one ``quant_linear``
(``graph/siblings.py``), whose columns are the three outputs."""

from __future__ import annotations

import pytest
import torch
from conftest import requires_cuda
from test_fp8 import _fp8_llama, rel_err

import mlp_fuser
from mlp_fuser import config
from mlp_fuser.patch import packed

pytest.importorskip("transformers")

QUANT_LINEAR = torch.ops.mlp_fuser.quant_linear.default


def _model(layers=2, bias=False):
    """A tiny FP8 LLaMA whose q, k, v and o fit side by side (head_dim 128: k's scales one 16-byte row)."""
    return _fp8_llama(layers=layers, hidden=512, kv_heads=1, attention_bias=bias)


def _compiled(model, graphs):
    backend = mlp_fuser.make_backend(inductor=False)

    def spy(gm, example_inputs):
        out = backend(gm, example_inputs)
        graphs.append(gm)
        return out
    torch._dynamo.reset()
    return torch.compile(model, backend=spy)


def _count(graphs, target=QUANT_LINEAR) -> int:
    return sum(n.target is target for g in graphs for n in g.graph.nodes)


def _logits(fn, ids):
    with torch.no_grad():
        return fn(ids).logits


def test_patch_packs_q_k_v_o_side_by_side_with_the_same_values():
    model, _ = _model()
    attn = model.model.layers[0].self_attn
    projs = [attn.q_proj, attn.k_proj, attn.v_proj, attn.o_proj]
    before = [(p.weight, p.weight.detach().clone(), p.weight_scale_inv.detach().clone()) for p in projs]
    state = model.state_dict()
    mlp_fuser.patch(model)
    bufs = {id(p._buffers[packed.BUFFER]) for p in projs}
    assert len(bufs) == 1  # one buffer, registered on each
    for p, (w, w0, s0) in zip(projs, before):
        assert p.weight is w and torch.equal(p.weight.view(torch.uint8), w0.view(torch.uint8))
        assert torch.equal(p.weight_scale_inv, s0)
    for a, b in zip(projs, projs[1:]):  # weights then scales, each run without a gap
        assert b.weight.data_ptr() == a.weight.data_ptr() + a.weight.numel()
        assert b.weight_scale_inv.data_ptr() == a.weight_scale_inv.data_ptr() + a.weight_scale_inv.numel() * 4
    base = attn.q_proj._buffers[packed.BUFFER].data_ptr()  # (CUDA's allocator aligns the base to 512 bytes)
    assert all((p.weight.data_ptr() - base) % 256 == 0 for p in projs)
    after = model.state_dict()
    assert after.keys() == state.keys()
    assert all(torch.equal(after[k].view(torch.uint8) if after[k].element_size() == 1 else after[k],
                           state[k].view(torch.uint8) if state[k].element_size() == 1 else state[k]) for k in state)
    mlp_fuser.unpatch(model)
    ptrs = {p.weight.untyped_storage().data_ptr() for p in projs}
    assert len(ptrs) == 4 and packed.BUFFER not in attn.q_proj._buffers


@pytest.mark.parametrize("merge,bias", [(True, False), (False, False), (True, True)])
def test_backend_computes_q_k_v_as_one_gemm(monkeypatch, merge, bias):
    """Merged: per layer one quant_linear for q, k and v and one for o (the MLP is one quant_gated_mlp), the logits
    eager's and the dequantized twin's, with attention biases too (Qwen2's; concatenated); off
    (``config.fp8_merge``): four a layer."""
    monkeypatch.setattr(config, "fp8_merge", merge)
    model, twin = _model(bias=bias)
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 7), generator=torch.Generator().manual_seed(1))
    graphs: list = []
    try:
        got = _logits(_compiled(model, graphs), ids)
    finally:
        torch._dynamo.reset()
    assert _count(graphs) == (2 if merge else 4) * 2
    eager = _logits(model, ids)
    assert rel_err(got, eager) < 1e-6
    assert rel_err(got, _logits(twin.double(), ids).float()) < 5e-2  # x quantized per token and block, as FP8Linear


class _Pair(torch.nn.Module):
    """Two FP8 linears that ``patch`` packs side by side; ``forward`` says how they are called."""

    def __init__(self, forward):
        from transformers.integrations.finegrained_fp8 import FP8Linear

        from mlp_fuser.kernels.fp8 import quantize_blocks

        super().__init__()
        self.q_proj = FP8Linear(512, 128, block_size=(128, 128))
        self.k_proj = FP8Linear(512, 128, block_size=(128, 128))
        g = torch.Generator().manual_seed(2)
        for p in (self.q_proj, self.k_proj):
            w, s = quantize_blocks(torch.randn(128, 512, generator=g), (128, 128))
            p.weight.data, p.weight_scale_inv.data = w, s
        self.fn = forward

    def forward(self, x, y):
        return self.fn(self, x, y)


@pytest.mark.parametrize("how", ["different_inputs", "flattened", "merged"])
def test_merged_only_on_one_input_and_where_the_outputs_views_hold(how):
    """Called on different tensors (cross-attention's q and k), or with an output flattened by ``view`` (which a
    column slice of the merged product cannot give): two calls. On one input, viewed by heads: one. Either way
    eager's values."""
    forward, calls = {"different_inputs": (lambda m, x, y: m.q_proj(x) - m.k_proj(y), 2),
                      "flattened": (lambda m, x, y: m.q_proj(x).view(-1) - m.k_proj(x).view(-1), 2),
                      "merged": (lambda m, x, y: m.q_proj(x).view(3, 2, 64) - m.k_proj(x).view(3, 2, 64), 1)}[how]
    m = _Pair(forward).eval()
    mlp_fuser.patch(m)
    assert m.q_proj._buffers[packed.BUFFER] is m.k_proj._buffers[packed.BUFFER]
    g = torch.Generator().manual_seed(3)
    x, y = torch.randn(3, 512, generator=g), torch.randn(3, 512, generator=g)
    graphs: list = []
    try:
        with torch.no_grad():
            got = _compiled(m, graphs)(x, y)
    finally:
        torch._dynamo.reset()
    assert _count(graphs) == calls
    with torch.no_grad():
        assert rel_err(got, m(x, y)) < 1e-6


def test_a_replaced_sibling_leaves_the_merge_and_the_compiled_model_follows():
    """k_proj's weight replaced after patch: its packing ends; the compiled model reads the new weight (q and v
    are no longer adjacent: each its own call) and gives eager's new logits."""
    model, _ = _model(layers=1)
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(4))
    graphs: list = []
    try:
        compiled = _compiled(model, graphs)
        old = _logits(compiled, ids)
        assert _count(graphs) == 2
        k = model.model.layers[0].self_attn.k_proj
        k.weight = torch.nn.Parameter(k.weight.detach().clone().flip(0), requires_grad=False)
        assert packed.BUFFER not in k._buffers
        want = _logits(model, ids)
        assert not torch.allclose(want, old, rtol=1e-3, atol=1e-3)
        got = _logits(compiled, ids)
        assert rel_err(got, want) < 1e-6
        assert _count(graphs[1:]) == 4  # recompiled: q, k, v and o apart
    finally:
        torch._dynamo.reset()


@requires_cuda
@pytest.mark.parametrize("tokens", [1, 600])
def test_merged_gemm_on_cuda_matches_the_unmerged_calls(monkeypatch, tokens):
    """bf16 on the GPU through Inductor, at a decode size (the Triton W8A8 rows) and a prefill size (cuBLAS'
    blockwise GEMM where it runs): merged and unmerged logits agree as closely as two FP8 runs can (x quantized the
    same per token and block), and both are near the dequantized twin."""
    model, twin = _model()
    model.cuda()
    for name, p in model.named_parameters():
        if p.dtype == torch.float32 and not name.endswith("scale_inv"):
            p.data = p.data.bfloat16()
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (1, tokens), generator=torch.Generator().manual_seed(5)).cuda()
    got = {}
    for merge in (False, True):
        monkeypatch.setattr(config, "fp8_merge", merge)
        torch._dynamo.reset()
        try:
            got[merge] = _logits(torch.compile(model, backend=mlp_fuser.backend), ids).float()
        finally:
            torch._dynamo.reset()
    assert torch.isfinite(got[True]).all()
    assert rel_err(got[True], got[False]) < 2e-2
    ref = _logits(twin.double(), ids.cpu()).float()
    assert rel_err(got[True].cpu(), ref) < 8e-2


def test_explain_names_the_layers_packed_side_by_side():
    """explain lists the lone FP8 layers that patch would pack with their siblings; none where their scales would
    leave the next unaligned (head_dim 64: k's scales 8 bytes)."""
    model, _ = _model(layers=1)
    report = mlp_fuser.explain(model)
    assert sorted(report.fp8_side_by_side) == sorted(f"model.layers.0.self_attn.{p}_proj" for p in "qkvo")
    assert "Packed side by side" in str(report)
    apart, _ = _fp8_llama(layers=1)
    report = mlp_fuser.explain(apart)
    assert len(report.fp8_linears) == 4 and report.fp8_side_by_side == []
    assert "Packed side by side" not in str(report)
