"""A user's mistake through ``mlp_fuser.patch`` reads as it would without mlp_fuser.

The patched model is called once correctly, then by mistake (a wrong feature size, float ``input_ids``, integer
features): the exception has the unpatched model's class and message, nothing is printed or logged, and the next
correct call is still right and still fused.
"""

import importlib
import io
import logging

import pytest
import torch
from _hf_models import count_ops
from torch import nn

import mlp_fuser


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def torch_logs(monkeypatch):
    """What torch's loggers print (to stderr, through handlers made when torch was imported), collected here."""
    out = io.StringIO()
    for name, logger in list(logging.Logger.manager.loggerDict.items()):
        if name.split(".")[0] == "torch" and isinstance(logger, logging.Logger):
            for h in logger.handlers:
                if type(h) is logging.StreamHandler:  # the stderr handlers (not the trace file)
                    monkeypatch.setattr(h, "stream", out)
    return out


def _tiny_llama():
    transformers = pytest.importorskip("transformers")
    cfg = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    return transformers.LlamaModel(cfg).eval(), 2


def _sequential():
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).eval(), 1


MISTAKES = {  # name: (build, good call kwargs, the mistake's kwargs)
    "seq-wrong-features": (_sequential, lambda: dict(input=torch.randn(2, 16)), lambda: dict(input=torch.randn(2, 12))),
    "seq-int-features": (_sequential, lambda: dict(input=torch.randn(2, 16)),
                         lambda: dict(input=torch.randint(0, 5, (2, 16)))),
    "llama-wrong-hidden-size": (_tiny_llama, lambda: dict(input_ids=torch.randint(1, 128, (1, 5))),
                                lambda: dict(inputs_embeds=torch.randn(1, 5, 24))),
    "llama-float-input-ids": (_tiny_llama, lambda: dict(input_ids=torch.randint(1, 128, (1, 5))),
                              lambda: dict(input_ids=torch.rand(1, 5))),
}


def _call(model, kwargs):
    if "input" in kwargs:  # nn.Sequential takes its input by position
        return model(kwargs["input"])
    return model(**kwargs)


def _main(out):
    return out if isinstance(out, torch.Tensor) else out.last_hidden_state


@pytest.mark.parametrize("name", list(MISTAKES))
def test_mistake_through_patch_reads_as_eager(name, capfd, torch_logs):
    build, good, bad = MISTAKES[name]
    torch.manual_seed(0)
    model, n_mlp = build()
    good_kw, bad_kw = good(), bad()
    with torch.no_grad():
        ref = _main(_call(model, good_kw))
        with pytest.raises(Exception) as eager:
            _call(model, bad_kw)
        mlp_fuser.patch(model)
        _call(model, good_kw)
        capfd.readouterr()
        with pytest.raises(Exception) as patched:
            _call(model, bad_kw)
        assert type(patched.value) is type(eager.value)
        assert str(patched.value) == str(eager.value)
        assert capfd.readouterr() == ("", "")
        assert torch_logs.getvalue() == ""
        torch.testing.assert_close(_main(_call(model, good_kw)), ref)
        assert count_ops(lambda: _call(model, good_kw)) == n_mlp


class _Instance(nn.Module):
    """A model whose forward was replaced on the instance (a wrapper's), patched through that forward."""

    def __init__(self):
        super().__init__()
        self.mlp, _ = _sequential()
        self.forward = lambda x: self.mlp(x) * 2


def test_mistake_through_patch_of_an_instance_forward(capfd, torch_logs):
    model = _Instance()
    x, bad = torch.randn(2, 16), torch.randn(2, 12)
    with torch.no_grad():
        with pytest.raises(RuntimeError) as eager:
            model(bad)
        mlp_fuser.patch(model)
        ref = model(x)
        capfd.readouterr()
        with pytest.raises(RuntimeError) as patched:
            model(bad)
        assert str(patched.value) == str(eager.value)
        assert capfd.readouterr() == ("", "") and torch_logs.getvalue() == ""
        torch.testing.assert_close(model(x), ref)
        assert count_ops(lambda: model(x)) == 1


class _BrokenUnderDynamo(nn.Module):
    """Fails only when compiled: a stand-in for a bug of Dynamo or of the graph pass."""

    def __init__(self):
        super().__init__()
        self.mlp, _ = _sequential()

    def forward(self, x):
        if torch.compiler.is_compiling():
            x = x @ torch.ones(3, 3)
        return self.mlp(x)


def _break_the_pass(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("a bug in the graph pass")

    monkeypatch.setattr(importlib.import_module("mlp_fuser.graph.fx_pass"), "fuse_mlps", broken)
    for where in ("mlp_fuser.patch.modules", "mlp_fuser.patch.router"):  # proven afresh, as at a first patch
        monkeypatch.setattr(importlib.import_module(where), "_PROOFS", {})
    return _sequential()[0], torch._dynamo.exc.BackendCompilerFailed, "a bug in the graph pass", "", {}


def _break_the_op(monkeypatch):
    def broken(*args):
        return ValueError, "broken validation"

    monkeypatch.setattr(importlib.import_module("mlp_fuser.ops.dense"), "_problem", broken)
    return _sequential()[0], ValueError, "broken validation", "", {}


def _break_dynamo(monkeypatch):
    # Dynamo runs the whole forward only when patching it whole: per module, the MLP alone is captured
    return (_BrokenUnderDynamo(), torch._dynamo.exc.TorchRuntimeError, "fake tensor", "failed while attempting",
            dict(per_module=False))


@pytest.mark.parametrize("broken", [_break_the_pass, _break_the_op, _break_dynamo], ids=["pass", "op", "dynamo"])
def test_a_failure_of_mlp_fuser_or_dynamo_is_not_hidden(broken, monkeypatch, torch_logs):
    """Where the eager forward succeeds after the patched one failed, the failure is not the user's: it is raised
    as it was (by patch itself where it proves a module's MLP, else by the call), and what torch logged for it is
    logged."""
    model, exc, match, logged, kwargs = broken(monkeypatch)
    with torch.no_grad(), pytest.raises(exc, match=match):
        mlp_fuser.patch(model, **kwargs)
        model(torch.randn(2, 16))
    assert logged in torch_logs.getvalue()


def test_mistake_through_the_backend_is_torch_compiles_own():
    """Through the backend a mistake raises what torch.compile raises with any backend (Dynamo wraps an error met
    while tracing, before any backend runs): the README's Known limits say so."""
    errors = []
    for backend in ("eager", mlp_fuser.backend):
        torch._dynamo.reset()
        compiled = torch.compile(_sequential()[0], backend=backend)
        with torch.no_grad():
            compiled(torch.randn(2, 16))
            with pytest.raises(Exception) as info:
                compiled(torch.randn(2, 12))
        errors.append((type(info.value), str(info.value).splitlines()[0]))
    assert errors[0] == errors[1]
