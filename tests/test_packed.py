"""patch stores each fused FP8 layer's float8 weights and scales as one buffer (``mlp_fuser.patch.packed``): the
Parameters stay the same objects with the same values, no byte is held twice, a compiled step reads the buffer, and
anything that replaces a packed tensor ends the packing rather than leaving a compiled model on stale bytes."""

from __future__ import annotations

import copy

import pytest
import torch
from test_fp8 import _fp8_llama

import mlp_fuser
from mlp_fuser.patch import packed

pytest.importorskip("transformers")


def _fp8_layers(model):
    from transformers.integrations.finegrained_fp8 import FP8Linear

    return [m for m in model.modules() if isinstance(m, FP8Linear)]


def _storage_bytes(model) -> int:
    """Bytes of the distinct storages behind the model's parameters and buffers."""
    seen = {}
    for t in (*model.parameters(), *model.buffers()):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
    return sum(seen.values())


def _logits(fn, ids):
    with torch.no_grad():
        return fn(ids).logits


def _compiled_follows(model, ids, change) -> None:
    """``model`` compiled and run, then ``change()``d: the compiled model gives eager's new logits, not its old ones."""
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        old = _logits(compiled, ids)
        change()
        want = _logits(model, ids)
        assert not torch.allclose(want, old, rtol=1e-3, atol=1e-3)
        assert torch.allclose(_logits(compiled, ids), want, rtol=1e-5, atol=1e-5)
    finally:
        torch._dynamo.reset()


def test_patch_packs_each_fp8_layer_with_the_same_parameters_values_and_bytes():
    model, _ = _fp8_llama()
    layers = _fp8_layers(model)
    before = {n: (p, p.detach().clone()) for n, p in model.named_parameters()}
    state = model.state_dict()
    nbytes = _storage_bytes(model)
    mlp_fuser.patch(model)
    assert len(layers) == 14  # 2 layers x q, k, v, o, gate, up, down
    for m in layers:
        buf = m._buffers[packed.BUFFER]
        assert buf.dtype == torch.float8_e4m3fn and packed.is_packed(m, ("weight", "weight_scale_inv"))
        for t in (m.weight, m.weight_scale_inv):
            assert buf.data_ptr() <= t.data_ptr() < buf.data_ptr() + buf.numel()
    for n, p in model.named_parameters():
        assert p is before[n][0] and torch.equal(p.view(torch.uint8) if p.element_size() == 1 else p,
                                                 before[n][1].view(torch.uint8) if p.element_size() == 1
                                                 else before[n][1]), n
    assert list(model.state_dict()) == list(state)  # the buffer is not persistent: checkpoints are unchanged
    assert _storage_bytes(model) <= nbytes + 14 * 2 * 256  # the same bytes, each tensor 256-aligned
    mlp_fuser.unpatch(model)
    assert not any(packed.BUFFER in m._buffers or packed.LAYOUT in m.__dict__ for m in model.modules())
    assert all(p is before[n][0] for n, p in model.named_parameters())


def test_compiled_patched_model_reads_the_buffer_and_gives_eagers_logits():
    """Compiled, the FP8 layers take the buffer's views; poisoning the buffer's weight bytes (while the Parameters
    keep theirs: a copy) changes the compiled logits, so the compiled step did read it."""
    model, _ = _fp8_llama()
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(1))
    want = _logits(model, ids)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend="aot_eager")
        assert torch.allclose(_logits(compiled, ids), want, rtol=1e-5, atol=1e-5)
        q = model.model.layers[0].self_attn.q_proj
        w = q.weight.detach().clone()
        q.weight.data = w  # the Parameter now outside the buffer (``.data`` is not watched: documented)
        q._buffers[packed.BUFFER][: w.numel()].fill_(0)
        assert not torch.allclose(_logits(compiled, ids), want, rtol=1e-3, atol=1e-3)
        assert torch.allclose(_logits(model, ids), want, rtol=1e-5, atol=1e-5)  # eager reads the Parameters
    finally:
        torch._dynamo.reset()


@pytest.mark.parametrize("how", ["setattr", "load_state_dict_assign"])
def test_replacing_a_packed_weight_ends_its_packing(how):
    """A packed weight replaced on its module (new values): its packing is dropped, so the compiled model (which
    read the buffer before) recompiles onto the new Parameter and matches eager with the new weights."""
    model, _ = _fp8_llama()
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(2))
    gate = model.model.layers[1].mlp.gate_proj

    def replace():
        new = torch.nn.Parameter((-gate.weight.float()).to(gate.weight.dtype), requires_grad=False)
        if how == "setattr":
            gate.weight = new
        else:
            gate.load_state_dict({"weight": new, "weight_scale_inv": gate.weight_scale_inv.detach().clone()},
                                 strict=False, assign=True)
        assert packed.BUFFER not in gate._buffers and packed.LAYOUT not in gate.__dict__

    _compiled_follows(model, ids, replace)


def test_a_bias_added_after_patch_ends_the_packing_and_counts():
    """A lone FP8 linear's compiled call takes its block and whether it has a bias from the packing's constant (no
    guard on the parameters dict): a bias registered after patch drops the packing, and the compiled model adds it."""
    model, _ = _fp8_llama()
    mlp_fuser.patch(model)
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(4))
    q = model.model.layers[0].self_attn.q_proj
    assert q.__dict__[packed.LAYOUT][1] == ((128, 128), False)

    def add_bias():
        q.bias = torch.nn.Parameter(torch.randn(q.weight.shape[0], generator=torch.Generator().manual_seed(5)))
        assert packed.LAYOUT not in q.__dict__

    _compiled_follows(model, ids, add_bias)


def test_deepcopy_of_a_patched_model_reads_its_own_bytes():
    """torch's deepcopy clones each Parameter apart from the buffer (documented: the copy holds those bytes twice);
    the copy's compiled step reads its own buffer, with the same values."""
    model, _ = _fp8_llama()
    mlp_fuser.patch(model)
    twin = copy.deepcopy(model)
    a, b = _fp8_layers(model)[0], _fp8_layers(twin)[0]
    assert b._buffers[packed.BUFFER].data_ptr() != a._buffers[packed.BUFFER].data_ptr()
    assert torch.equal(b._buffers[packed.BUFFER].view(torch.uint8), a._buffers[packed.BUFFER].view(torch.uint8))
    ids = torch.randint(0, 100, (2, 9), generator=torch.Generator().manual_seed(3))
    torch._dynamo.reset()
    try:
        assert torch.equal(_logits(torch.compile(twin, backend="aot_eager"), ids), _logits(model, ids))
    finally:
        torch._dynamo.reset()


def test_save_pretrained_of_a_patched_fp8_model_writes_the_checkpoint_as_before(tmp_path):
    from safetensors.torch import load_file

    model, _ = _fp8_llama()
    want = {k: v.clone() for k, v in model.state_dict().items()}
    mlp_fuser.patch(model)
    model.save_pretrained(tmp_path)
    got = {}
    for f in tmp_path.glob("*.safetensors"):
        got.update(load_file(f))
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k


def _fp8_qwen3moe():
    from test_guards import _bench_model

    return _bench_model("qwen3moe", fp8=True)(2)


@pytest.mark.parametrize("make", [lambda: _fp8_llama()[0], _fp8_qwen3moe], ids=["llama", "qwen3moe"])
def test_torch_save_of_a_patched_fp8_model_loads_it_unpatched_with_the_same_bytes(make):
    """torch.save of a patched FP8 model (packed layers, the experts its config's switch runs too) writes each packed
    tensor on its own: the loaded model is unpatched, holds no buffer, the same state bytes, each tensor its own
    storage; patched again it gives the same logits. The saved model stays packed."""
    import io

    model = make()
    ids = torch.randint(3, 100, (1, 6), generator=torch.Generator().manual_seed(4))
    mlp_fuser.patch(model)
    out = _logits(model, ids)
    n_packed = sum(packed.BUFFER in m._buffers for m in model.modules())
    assert n_packed >= 8  # q, k, v, o and the MLP's or experts' tensors of 2 layers
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    assert not mlp_fuser.is_patched(loaded) and sum(packed.BUFFER in m._buffers for m in model.modules()) == n_packed
    assert not any(packed.BUFFER in m._buffers or packed.LAYOUT in m.__dict__ for m in loaded.modules())
    want, got = model.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    for k, v in want.items():
        assert got[k].dtype == v.dtype and torch.equal(got[k].view(torch.uint8), v.view(torch.uint8)), k
        assert got[k].untyped_storage().nbytes() == got[k].nbytes, k  # a storage of its own
    mlp_fuser.patch(loaded)
    assert torch.equal(_logits(loaded, ids), out)


def test_pack_leaves_what_it_cannot_hold():
    from transformers.integrations.finegrained_fp8 import FP8Linear

    f = FP8Linear(256, 128, block_size=(128, 128))
    f.weight.data = f.weight.data.t().contiguous().t()  # a transposed view: not contiguous
    assert not packed.pack(f, ("weight", "weight_scale_inv"))
    assert packed.BUFFER not in f._buffers
    assert not packed.pack(f, ("weight", "no_such_tensor"))
    meta = FP8Linear(256, 128, block_size=(128, 128)).to("meta")
    assert not packed.pack(meta, ("weight", "weight_scale_inv"))
    hooked = FP8Linear(256, 128, block_size=(128, 128))
    hooked._hf_hook = object()  # accelerate's offloading: the weights move in and out at each call
    assert not packed.pack(hooked, ("weight", "weight_scale_inv")) and packed.BUFFER not in hooked._buffers
    assert packed.pack(FP8Linear(256, 128, block_size=(128, 128)), ("weight", "weight_scale_inv"))
