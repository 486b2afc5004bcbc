"""mlp_fuser.compat: the private torch/Triton APIs only within the tested versions and with the switch on; elsewhere
the public path, which computes the same outputs."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch
import triton
from _mlp_cases import make_case
from conftest import KERNEL_DEVICE
from test_launcher import FakeKernel

import mlp_fuser  # noqa: F401 (registers the ops)
from mlp_fuser import compat, config
from mlp_fuser.kernels import common
from mlp_fuser.ops import dense as ops
from mlp_fuser.reference import rel_err


@pytest.fixture
def restore(monkeypatch):
    yield monkeypatch
    monkeypatch.undo()
    compat.refresh()
    assert compat.PRIVATE  # this machine's versions are in range: the rest of the suite runs the fast path


@pytest.mark.parametrize("torch_v,triton_v,ok", [
    ("2.11.0+cu128", "3.6.0", True), ("2.13.0+cpu", "3.7.1", True), ("2.10.1", "3.6.0", False),
    ("2.14.0.dev20270101", "3.7.0", False), ("2.12.0", "3.5.1", False), ("2.12.0", "3.8.0", False),
    ("3.0.0", "4.0.0", False),
])
def test_version_ranges(restore, torch_v, triton_v, ok):
    restore.setattr(torch, "__version__", torch_v)
    restore.setattr(triton, "__version__", triton_v)
    assert compat.in_range() is ok
    assert compat.refresh() is ok


def _outputs(c):
    with torch.no_grad():
        return ops.eager_gated_mlp(*c.args()), ops.inductor_gated_mlp(*c.args()), ops.gated_mlp(*c.args())


@pytest.mark.parametrize("how", ["unknown torch", "unknown triton", "switch off"])
def test_public_path_outside_the_tested_versions_gives_the_fast_paths_outputs(restore, how):
    """With an unknown torch or Triton (faked) or MLP_FUSER_PRIVATE=0, no private API is used: the op's entries go
    through the registered op, Triton launches every call itself, Inductor's lowering is left alone, and the outputs
    are the fast path's, bit for bit (Triton kernels under the interpreter here, compiled on a GPU machine)."""
    restore.setattr(config, "triton_on_cpu", True)
    restore.setattr(config, "force_impl", "triton_swapab")  # deterministic (small_m's atomic sum is not), planned
    c = make_case(5, 32, 48, 16, dtype=torch.float32, device=KERNEL_DEVICE)
    fast = _outputs(c)
    assert compat.PRIVATE and compat.plain_call(c.x, c.record()[1:7])
    if how == "unknown torch":
        restore.setattr(torch, "__version__", "2.99.0")
    elif how == "unknown triton":
        restore.setattr(triton, "__version__", "3.99.0")
    else:
        restore.setattr(config, "private_apis", False)
    assert compat.refresh() is False
    assert not compat.plain_call(c.x, c.record()[1:7])  # the registered op, through the dispatcher
    assert compat.inductor_lowering(torch.ops.mlp_fuser.mlp.default) is None
    assert not compat.set_op_attribute("_never_set", len) and "_never_set" not in vars(torch.ops.mlp_fuser)
    public = _outputs(c)
    for f, p in zip(fast, public):
        assert torch.equal(f, p)
    assert rel_err(public[0], c.reference64()) < 1e-5


def test_public_path_launches_through_triton_every_call(restore):
    restore.setattr(common, "INTERPRET", False)
    restore.setattr(torch.cuda, "current_device", lambda: 0)
    restore.setattr(config, "private_apis", False)
    compat.refresh()
    k = FakeKernel()
    launch = common.Launcher(k)
    for _ in range(3):
        launch(("a",), (5,), "x", "y", 7, BLOCK=32, ACT="silu")
    assert len(k.slow) == 3 and k.compiled.runs == [] and launch.cache == {}


def test_public_path_autograd_matches(restore):
    """Under autograd the public path's gradients are the fast path's."""
    c = make_case(4, 16, 24, 8, dtype=torch.float64)

    def grads():
        leaves = [t.detach().requires_grad_() for t in (c.x, c.wg, c.wu, c.wd)]
        x, wg, wu, wd = leaves
        ops.eager_gated_mlp(x, wg, c.bg, wu, c.bu, wd, c.bd, c.act).square().sum().backward()
        return [t.grad for t in leaves]

    fast = grads()
    restore.setattr(config, "private_apis", False)
    compat.refresh()
    for f, p in zip(fast, grads()):
        assert torch.equal(f, p)


def test_environment_switch():
    env = dict(os.environ, MLP_FUSER_PRIVATE="0")
    out = subprocess.run([sys.executable, "-c", "import mlp_fuser, torch; from mlp_fuser import compat; "
                          "print(compat.PRIVATE, '_inductor_gated_mlp' in vars(torch.ops.mlp_fuser))"],
                         env=env, capture_output=True, text=True, check=True).stdout.split()
    assert out == ["False", "False"]


def test_constexpr_flags_of_a_real_jit_function():
    import triton.language as tl

    def kernel(x_ptr, n, BLOCK: tl.constexpr, ACT: tl.constexpr):
        pass

    jit = triton.JITFunction(kernel)  # compiled Triton's, not the interpreter's (which triton.jit gives here)
    assert compat.constexpr_flags(jit) == [False, False, True, True]
    assert compat.constexpr_flags(triton.autotune([triton.Config({})], key=[])(jit)) == [False, False, True, True]


def test_gpu_sleep_without_torch_sleep_does_nothing(monkeypatch):
    calls = []
    monkeypatch.setattr(torch.cuda, "_sleep", lambda n: calls.append(n), raising=False)
    compat.gpu_sleep(7)
    assert calls == [7]
    monkeypatch.delattr(torch.cuda, "_sleep")
    compat.gpu_sleep(7)  # the public fallback: no sleep, no error
    assert calls == [7]


def test_local_tensor_falls_back_to_to_local():
    class Local:
        def to_local(self):
            return "public"

    class Private(Local):
        _local_tensor = "private"

    assert compat.local_tensor(Private()) == "private" and compat.local_tensor(Local()) == "public"


def test_grouped_mm_is_the_public_function_where_torch_has_it():
    import torch.nn.functional as F

    assert compat.grouped_mm is getattr(F, "grouped_mm", None) or compat.grouped_mm is torch._grouped_mm


def test_view_base():
    a = torch.randn(4, 6)
    assert compat.view_base(a) is None and compat.view_base(a[:, :3]) is a
