"""patch per module: where a model's MLPs are modules of their own, each gets a fused forward and the rest of the
model stays eager (mlp_fuser/patch/modules.py)."""

import copy
import gc
import weakref

import pytest
import torch
import torch.nn.functional as F
from _hf_models import count_ops
from torch import nn

import mlp_fuser
from mlp_fuser.graph import fx_pass
from mlp_fuser.patch import modules
from mlp_fuser.patch.api import _MODULES
from mlp_fuser.patch.modules import SWAPPED, fuse_module, fused_mlp


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield


def _llama(layers=3):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval()



def _own(m):
    """The module's own forward (its class's before ``patch`` gave it one of its own)."""
    return getattr(type(m), SWAPPED, type(m)).forward

def test_llama_mlps_are_patched_one_by_one_and_the_rest_stays_eager():
    model = _llama()
    ids = torch.randint(1, 128, (2, 7), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(ids).logits
        tokens = model.generate(ids, max_new_tokens=6, do_sample=False)
        mlp_fuser.patch(model)
        assert model.__dict__[_MODULES] == [f"model.layers.{i}.mlp" for i in range(3)]
        assert "forward" not in model.__dict__  # the model's own forward is untouched
        assert all(fused_mlp(layer.mlp) for layer in model.model.layers)
        assert mlp_fuser.is_patched(model)
        assert torch.equal(model(ids).logits, ref)  # on the CPU the op computes what the modules compute
        assert count_ops(lambda: model(ids)) == 3
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)
    with torch.inference_mode():  # how many serving stacks call a model
        assert torch.equal(model.generate(ids, max_new_tokens=6, do_sample=False), tokens)
    mlp_fuser.unpatch(model)
    assert not mlp_fuser.is_patched(model) and _MODULES not in model.__dict__
    assert all("forward" not in layer.mlp.__dict__ and not fused_mlp(layer.mlp) for layer in model.model.layers)
    assert count_ops(lambda: model(ids)) == 0


def test_training_mode_is_fused_too_with_gradients():
    model = _llama(2).train()
    ids = torch.randint(1, 128, (2, 5))
    ref = model(ids, labels=ids).loss
    ref.backward()
    ref_grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad()
    mlp_fuser.patch(model)
    assert count_ops(lambda: model(ids)) == 2
    loss = model(ids, labels=ids).loss
    loss.backward()
    torch.testing.assert_close(loss, ref)
    for n, p in model.named_parameters():
        torch.testing.assert_close(p.grad, ref_grads[n], rtol=1e-5, atol=1e-6, msg=n)


class DropoutMLP(nn.Module):
    """GPT-2's shape: a dropout after the down projection."""

    def __init__(self, p):
        super().__init__()
        self.fc1, self.fc2, self.drop = nn.Linear(8, 16), nn.Linear(16, 8), nn.Dropout(p)

    def forward(self, x):
        return self.drop(self.fc2(F.gelu(self.fc1(x))))


def test_an_active_dropout_is_left_to_the_original_forward():
    m = DropoutMLP(0.5)
    forward = fuse_module(m)
    assert set(forward.forward.graphs) == {False}  # eval: the dropout is the identity; train: it is not
    mlp_fuser.patch(m)
    x = torch.randn(3, 8)
    m.eval()
    assert count_ops(lambda: m(x)) == 1
    m.train()
    torch.manual_seed(3)
    out = m(x)
    torch.manual_seed(3)
    assert torch.equal(out, DropoutMLP.forward(m, x))
    assert count_ops(lambda: m(x)) == 0


def test_weights_are_read_on_every_call():
    m = DropoutMLP(0.0).eval()
    mlp_fuser.patch(m)
    x = torch.randn(3, 8)
    m.fc2.weight = nn.Parameter(torch.randn(8, 16))  # a new Parameter object
    with torch.no_grad():
        torch.testing.assert_close(m(x), DropoutMLP.forward(m, x))
        m.double()
        torch.testing.assert_close(m(x.double()), DropoutMLP.forward(m, x.double()))
        assert count_ops(lambda: m(x.double())) == 1


def test_calls_unlike_the_proven_one_run_the_original_forward():
    m = DropoutMLP(0.0).eval()
    mlp_fuser.patch(m)
    x = torch.randn(3, 8)
    assert count_ops(lambda: m(x=x)) == 1  # the input by name
    for args, kwargs in (((x, x), {}), ((), {"input": x})):  # the original forward's own errors
        with pytest.raises(TypeError, match="DropoutMLP.forward"):
            m(*args, **kwargs)


def test_not_an_mlp_module():
    class NormInside(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.norm, self.fc2 = nn.Linear(8, 16), nn.LayerNorm(16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.norm(self.fc1(x))))

    class TwoOutputs(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            h = F.gelu(self.fc1(x))
            return self.fc2(h), h

    class AddsInput(nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return self.fc2(F.gelu(self.fc1(x))) + x

    for cls in (NormInside, TwoOutputs, AddsInput):
        assert fuse_module(cls()) is None, cls.__name__
    assert fuse_module(AddsInput().fc1) is None  # one projection


def test_per_module_false_runs_the_whole_forward_through_dynamo(monkeypatch):
    # The captured graph runs op by op, each op through its eager entry: computed right there (no dispatcher hop)
    # where nothing needs the dispatcher, through it under the profiler.
    from mlp_fuser import compat

    plain, real = [], compat.plain_operands
    monkeypatch.setattr(compat, "plain_operands", lambda *a: plain.append(real(*a)) or plain[-1])
    model = _llama(2)
    ids = torch.randint(1, 128, (1, 5))
    with torch.no_grad():
        ref = model(ids).logits
        mlp_fuser.patch(model, per_module=False)
        assert _MODULES not in model.__dict__ and "forward" in model.__dict__
        torch.testing.assert_close(model(ids).logits, ref)
        plain.clear()
        model(ids)
        assert plain == [True, True]
        assert count_ops(lambda: model(ids)) == 2
    mlp_fuser.unpatch(model)


def test_deepcopy_and_pickle_of_a_model_patched_per_module():
    import io

    model = _llama(2)
    ids = torch.randint(1, 128, (1, 5))
    mlp_fuser.patch(model)
    with torch.no_grad():
        twin = copy.deepcopy(model)
        assert mlp_fuser.is_patched(twin) and count_ops(lambda: twin(ids)) == 2
        twin.model.layers[0].mlp.down_proj.weight.mul_(2)  # the copy's forward reads the copy's weights
        assert not torch.equal(twin(ids).logits, model(ids).logits)
        buf = io.BytesIO()
        torch.save(model, buf)
        buf.seek(0)
        loaded = torch.load(buf, weights_only=False)
        assert not mlp_fuser.is_patched(loaded) and count_ops(lambda: loaded(ids)) == 0
        torch.testing.assert_close(loaded(ids).logits, model(ids).logits)
        mlp_fuser.patch(loaded)
        assert mlp_fuser.is_patched(loaded) and count_ops(lambda: loaded(ids)) == 2
        mlp_fuser.unpatch(loaded)
        assert all("forward" not in layer.mlp.__dict__ for layer in loaded.model.layers)


def test_patched_calls_skip_the_dispatcher_only_where_nothing_needs_it(monkeypatch):
    """A patched MLP computes the op right in its forward (no dispatcher hop, the implementation chosen for eager
    calls) for plain tensors, with gradients through the op's autograd.Function applied right there; autocast, a
    dispatch mode and torch.compile all get the registered op, and every route gives the module's own result."""
    from mlp_fuser.ops import dense as ops

    model = _llama(1)
    mlp = model.model.layers[0].mlp
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        ref = mlp(x)
    mlp_fuser.patch(model, backward="recompute")  # whose autograd forward is ops._forward, below the dispatcher
    routes = []
    forward = ops._forward
    def recorded(op, a, eager=False, key=None):
        routes.append(eager)
        return forward(op, a, eager, key)

    monkeypatch.setattr(ops, "_forward", recorded)
    training = ops._forward_training

    def recorded_training(op, a, save, planned):  # planned: the eager entry's call, no dispatcher hop before it
        routes.append(planned)
        return training(op, a, save, planned)

    monkeypatch.setattr(ops, "_forward_training", recorded_training)
    with torch.no_grad():
        torch.testing.assert_close(mlp(x), ref)
    assert routes == [True]
    y = mlp(x)  # the weights require grad: the op's autograd.Function, its forward the training path's entry
    y.sum().backward()
    assert routes == [True, True] and mlp.down_proj.weight.grad is not None
    torch.testing.assert_close(y, ref)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        assert mlp(x).dtype == torch.bfloat16
    assert routes[-1] is False
    with torch.no_grad():
        assert count_ops(lambda: mlp(x)) == 1  # a dispatch mode sees the op
        assert routes[-1] is False
        graphs = []

        def capture(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        torch.testing.assert_close(torch.compile(mlp, backend=capture)(x), ref)
    ops_in_graph = [n.target for n in graphs[0].graph.nodes if n.op == "call_function"]
    assert torch.ops.mlp_fuser.gated_mlp.default in ops_in_graph, ops_in_graph
    routes.clear()
    with torch.inference_mode():  # as no_grad: computed right there, an inference tensor out
        y = mlp(x)
        assert y.is_inference()
        torch.testing.assert_close(y, ref)
        torch.testing.assert_close(torch.ops.mlp_fuser.gated_mlp.default(
            x, mlp.gate_proj.weight, None, mlp.up_proj.weight, None, mlp.down_proj.weight, None, "silu"), ref)
    assert routes == [True, False]


class _Adapter(nn.Module):
    """A LoRA-like wrapper: the base projection plus a low-rank update."""

    def __init__(self, base):
        super().__init__()
        self.base, self.a, self.b = base, nn.Linear(base.in_features, 2, bias=False), nn.Linear(2, base.out_features,
                                                                                                   bias=False)

    def forward(self, x):
        return self.base(x) + self.b(self.a(x))


def test_a_projection_replaced_after_patching_runs_the_original_forward():
    """The proof covers the children it saw: an adapter wrapped around a projection later is not fused away."""
    model = _llama(1)
    mlp = model.model.layers[0].mlp
    mlp_fuser.patch(model)
    mlp.up_proj = _Adapter(mlp.up_proj)
    x = torch.randn(2, 3, 32)
    with torch.no_grad():
        got = mlp(x)
        want = _own(mlp)(mlp, x)
        assert count_ops(lambda: mlp(x)) == 0
    torch.testing.assert_close(got, want)
    assert (want - mlp.down_proj(F.silu(mlp.gate_proj(x)) * mlp.up_proj.base(x))).abs().max() > 1e-4


class MergedMLP(nn.Module):
    """Phi-3's shape: one gate_up projection whose output is split."""

    def __init__(self):
        super().__init__()
        self.gate_up_proj, self.down_proj = nn.Linear(8, 32, bias=False), nn.Linear(16, 8, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


def test_weights_read_as_they_are_take_one_generated_call_and_views_take_the_graph():
    """Where the op reads the module's weights unchanged (LLaMA), the patched forward is one generated function
    reading them from the modules' dicts; a merged weight's halves are views, so that forward runs the graph. Both
    compute what the module computes, with the weights of the moment."""
    model = _llama(1)
    mlp = model.model.layers[0].mlp
    merged = MergedMLP()
    x, x8 = torch.randn(2, 3, 32), torch.randn(2, 3, 8)
    mlp_fuser.patch(model)
    mlp_fuser.patch(merged)
    assert all(proof[2] is not None for proof in mlp.forward.graphs.values())
    assert all(proof[2] is None for proof in merged.forward.graphs.values())
    with torch.no_grad():
        for m, inp in ((mlp, x), (merged, x8)):
            torch.testing.assert_close(m(inp), _own(m)(m, inp))
            for p in m.parameters():
                p.mul_(0.5)  # updated in place: the next call sees it
            torch.testing.assert_close(m(inp), _own(m)(m, inp))
        mlp.down_proj.weight = nn.Parameter(torch.randn(32, 64))  # replaced: read from the dict on every call
        torch.testing.assert_close(mlp(x), _own(mlp)(mlp, x))


def _captures(monkeypatch) -> list:
    """Each capture patch makes of a module appends to the list returned (the pass runs once per capture)."""
    calls, real = [], fx_pass.fuse_mlps
    monkeypatch.setattr(fx_pass, "fuse_mlps", lambda *a, **k: calls.append(1) or real(*a, **k))
    monkeypatch.setattr(modules, "_PROOFS", {})
    return calls


def test_one_proof_per_signature_for_every_module_and_model(monkeypatch):
    """A model's identical MLPs and a second model of the same config share one capture per train/eval mode; each
    runs with its own weights, and the proof keeps no model's tensors alive."""
    captures = _captures(monkeypatch)
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(2))
    first = _llama(3)
    mlp_fuser.patch(first)
    assert len(captures) == 2  # eval and train, for all three layers
    kept = [weakref.ref(p) for p in first.parameters()]
    torch.manual_seed(5)
    second = _llama(3)
    for p in second.parameters():
        p.data.normal_()  # other weights than the first's: the proof must read the module it is given
    with torch.no_grad():
        ref = second(ids).logits
        mlp_fuser.patch(second)
        assert len(captures) == 2 and mlp_fuser.is_patched(second)
        out = {}
        assert count_ops(lambda: out.setdefault("y", second(ids).logits)) == 3
        torch.testing.assert_close(out["y"], ref, rtol=1e-5, atol=1e-5)
        del first
        gc.collect()
        assert all(r() is None for r in kept)
        assert modules._PROOFS
        second.train()
        torch.testing.assert_close(second(ids).logits, ref, rtol=1e-5, atol=1e-5)  # the train-mode proof too


class ActMLP(nn.Module):
    def __init__(self, act, inner=16):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(8, inner), nn.Linear(inner, 8), act

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


def test_modules_of_other_signatures_get_their_own_proofs(monkeypatch):
    """Another width, another activation setting of the same class, another dtype: each its own capture, each
    computing what it computes (float64 reference)."""
    captures = _captures(monkeypatch)
    mods = [ActMLP(nn.GELU()), ActMLP(nn.GELU(approximate="tanh")), ActMLP(nn.GELU(), 24), ActMLP(nn.GELU()).double(),
            ActMLP(nn.GELU())]
    for m in mods:
        mlp_fuser.patch(m.eval())
    assert len(captures) == 2 * 4  # the last module is the first's kind
    x = torch.randn(3, 8, dtype=torch.float64)
    with torch.no_grad():
        for m in mods:
            ref = _own(m)(copy.deepcopy(m).double(), x)
            xm = x.to(m.fc1.weight.dtype)
            assert count_ops(lambda m=m, xm=xm: m(xm)) == 1
            torch.testing.assert_close(m(xm).double(), ref, rtol=1e-5, atol=1e-6)


def test_per_module_patch_leaves_attention_as_eager_calls_it(monkeypatch):
    """The per-module patch changes only the MLPs: attention gets HF's eager call, SDPA with is_causal and no mask,
    in training too. The whole-model patch (per_module=False) runs the forward through Dynamo, where HF builds a
    (B, 1, T, T) mask instead: a different (slower on the GPU) attention, which is why patch is per module."""
    model = _llama(2).train()
    model.config._attn_implementation = "sdpa"
    ids = torch.randint(1, 128, (2, 16), generator=torch.Generator().manual_seed(2))
    seen = []
    sdpa = F.scaled_dot_product_attention

    def probe(*args, **kwargs):
        seen.append((kwargs.get("attn_mask") is None, kwargs.get("is_causal")))
        return sdpa(*args, **kwargs)

    monkeypatch.setattr(F, "scaled_dot_product_attention", probe)
    model(input_ids=ids, labels=ids).loss.backward()
    eager = set(seen)
    seen.clear()
    mlp_fuser.patch(model)
    assert mlp_fuser.is_patched(model) and model.__dict__.get(_MODULES)
    model(input_ids=ids, labels=ids).loss.backward()
    assert set(seen) == eager == {(True, True)}, (set(seen), eager)


def test_explain_reports_a_patched_or_compiled_model_as_patch_found_it():
    """A patched model's MLPs run the fused op, not a Linear chain: explain still reports them, as does the module
    torch.compile returns."""
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                                   num_key_value_heads=2, vocab_size=50)
    model = transformers.LlamaForCausalLM(cfg).eval()
    ids = torch.randint(0, 50, (1, 4))
    before = mlp_fuser.explain(model, ids)
    mlp_fuser.patch(model)
    patched = mlp_fuser.explain(model, ids)
    assert len(before.fused) == len(patched.fused) == 2
    assert fused_mlp(model.model.layers[0].mlp)  # put back after
    assert len(mlp_fuser.explain(torch.compile(model), ids).fused) == 2
