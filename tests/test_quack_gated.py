"""The quack_gated_* dispatch candidates (mlp_fuser/kernels/quack_gated.py): their declared constraints, and their
wiring into quack's gemm_act, checked here against a stand-in quack written in torch (quack itself needs an sm90
GPU; tests/test_gpu.py runs the real one where it is installed)."""

import sys
import types
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from mlp_fuser import config
from mlp_fuser.dispatch import dense as dispatch
from mlp_fuser.kernels import quack_gated

QUACK = [i for i in dispatch.IMPLS if i.name.startswith("quack_gated_")]
_GATED = {"swiglu": F.silu, "reglu": F.relu, "geglu": lambda g: F.gelu(g, approximate="tanh")}


@dataclass
class _GemmConfig:
    tile_m: int = 128
    tile_n: int = 192
    cluster_m: int = 2
    cluster_n: int = 1
    pingpong: bool = True
    is_dynamic_persistent: bool = True
    device_capacity: int = 9


@pytest.fixture
def fake_quack(monkeypatch):
    """quack.gemm_interface.gemm_act and quack.gemm_config.GemmConfig in torch (float64 inside), recording calls; an
    sm90 device."""
    calls = []

    def gemm_act(A, B, activation=None, store_preact=True, tuned=True, concat_layout=None, config=None):
        calls.append(dict(B=B, activation=activation, store_preact=store_preact, tuned=tuned,
                          concat_layout=concat_layout, config=config, A_ptr=A.data_ptr(), A_stride=A.stride()))
        assert concat_layout == ("B",) and B.shape[0] == A.shape[1]  # B: (K, 2I), its columns [gate; up]
        acc = A.double() @ B.double()
        I = acc.shape[1] // 2
        return None, (_GATED[activation](acc[:, :I]) * acc[:, I:]).to(A.dtype)

    quack = types.ModuleType("quack")
    gi, gc = types.ModuleType("quack.gemm_interface"), types.ModuleType("quack.gemm_config")
    gi.gemm_act, gc.GemmConfig = gemm_act, _GemmConfig
    for name, mod in (("quack", quack), ("quack.gemm_interface", gi), ("quack.gemm_config", gc)):
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    quack_gated._quack.cache_clear()
    quack_gated._config.cache_clear()
    yield calls
    quack_gated._quack.cache_clear()
    quack_gated._config.cache_clear()


def _problem(**kw):
    base = dict(device="cuda", dtype=torch.bfloat16, M=128, K=64, I=96, O=64, gated=True, activation="silu",
                one_weight=True)
    return dispatch.Problem(**{**base, **kw})


def test_one_candidate_per_config_and_the_constraints_each_declares(fake_quack, monkeypatch):
    assert [i.name for i in QUACK] == [f"quack_gated_{c}" for c in quack_gated.CONFIGS]
    for impl in QUACK:
        assert impl.why_not(_problem()) is None and impl.candidate(_problem())
        assert impl.candidate(_problem(dtype=torch.float16, activation="swish"))  # an alias of silu
        assert "not stored as one" in impl.why_not(_problem(one_weight=False))
        assert "dtype" in impl.why_not(_problem(dtype=torch.float32))
        assert "device cpu" in impl.why_not(_problem(device="cpu"))
        assert "no quack epilogue" in impl.why_not(_problem(activation="gelu"))  # erf's GELU: quack has the tanh one
        assert "multiples of 8" in impl.why_not(_problem(K=60))
        assert "multiples of 8" in impl.why_not(_problem(I=100))
        assert impl.not_worth(_problem(M=64)) and impl.not_worth(_problem(M=65)) is None  # lost at M <= 64 (NOTES)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (10, 0))
    assert "sm90" in QUACK[0].why_not(_problem())
    monkeypatch.setattr(config, "quack", False)
    assert "MLP_FUSER_QUACK=0" in QUACK[0].why_not(_problem())


def test_without_quack_they_say_so(monkeypatch):
    monkeypatch.setitem(sys.modules, "quack", None)  # import quack raises ImportError
    quack_gated._quack.cache_clear()
    try:
        assert "quack is not importable" in QUACK[0].why_not(_problem())
        assert not any(i.name.startswith("quack") for i in dispatch.eligible(_problem()))
    finally:
        quack_gated._quack.cache_clear()


@pytest.mark.parametrize("activation", ["silu", "relu", "gelu_tanh"])
def test_the_call_hands_quack_the_merged_weight_and_its_config(fake_quack, activation):
    K, I, O, M = 64, 96, 48, 10
    w = torch.randn(2 * I, K, dtype=torch.float32) * K ** -0.5
    wd = torch.randn(O, I) * I ** -0.5
    x = torch.randn(M, K)
    for impl in QUACK:
        fake_quack.clear()
        y = impl.fn(x, w[:I], None, w[I:], None, wd, None, activation)
        call, = fake_quack
        config = quack_gated.CONFIGS[impl.name.removeprefix("quack_gated_")]
        assert (call["config"].tile_m, call["config"].tile_n, call["config"].cluster_m, call["config"].cluster_n,
                call["config"].pingpong) == config
        assert call["B"].data_ptr() == w.data_ptr() and call["B"].shape == (K, 2 * I)  # the buffer itself, no copy
        assert call["activation"] == quack_gated.ACTIVATIONS[activation] and not call["store_preact"]
        assert not call["tuned"]
        act = {"silu": F.silu, "relu": F.relu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh")}[activation]
        xd, wdd = x.double(), w.double()
        ref = (act(xd @ wdd[:I].T) * (xd @ wdd[I:].T)) @ wd.double().T
        torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)


def test_inputs_without_tma_alignment_are_copied_and_separate_weights_refused(fake_quack):
    K, I = 64, 96
    w, wd = torch.randn(2 * I, K) * K ** -0.5, torch.randn(32, I) * I ** -0.5
    wide = torch.randn(5, K + 1)
    x = wide[:, 1:]  # rows 65 elements apart, the first 4 bytes in: TMA cannot read it as it is
    impl = QUACK[0]
    y = impl.fn(x, w[:I], None, w[I:], None, wd, None, "silu")
    assert fake_quack[0]["A_ptr"] != x.data_ptr() and fake_quack[0]["A_stride"] == (K, 1)
    ref = (F.silu(x.double() @ w[:I].double().T) * (x.double() @ w[I:].double().T)) @ wd.double().T
    torch.testing.assert_close(y.double(), ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="stored as one"):
        impl.fn(x, w[:I].clone(), None, w[I:], None, wd, None, "silu")
    wt = torch.randn(K, 2 * I).t()  # [gate; up] as one, but column-major
    with pytest.raises(ValueError, match="row-major"):
        impl.fn(x, wt[:I], None, wt[I:], None, wd, None, "silu")
