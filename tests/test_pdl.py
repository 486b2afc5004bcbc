"""Programmatic dependent launch (PDL) of the two-kernel implementations.

With ``config.pdl`` set to a mode and where the GPU has it, ``triton_gemm_splitk`` and ``triton_swapab`` launch both
their kernels, and ``triton_gemm`` its gate/up kernel, with ``launch_pdl``: a kernel may start while the one ahead of
it ends, and its first step (``common.pdl_prologue``) waits for that kernel. The interpreter cannot run the wait
(inline PTX), so here: the wiring (which launches ask for PDL in which mode, and that the mode reaches the launch
keys) and the compiled PTX for sm_90 (the wait in each kernel with PDL, the signal where its mode puts one, neither
without). tests/test_gpu.py runs them on the H200.
"""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from mlp_fuser import config, dispatch
from mlp_fuser.kernels import common

ROOT = Path(__file__).resolve().parents[1]
PAIRS = ["triton_gemm_splitk", "triton_swapab", "triton_gemm"]


def test_no_pdl_on_the_cpu_nor_in_the_interpreter():
    assert not common.pdl_supported(torch.device("cpu"))
    assert not dispatch._pdl(torch.empty(2, 2))


@pytest.fixture
def launches(monkeypatch):
    """Every Triton launch, recorded instead of run: (kernel name, key, constexprs and options)."""
    log = []

    def record(self, key, grid, *args, **kw):
        log.append((getattr(self.kernel, "__name__", None) or self.kernel.fn.__name__, key, kw))

    monkeypatch.setattr(common.Launcher, "__call__", record)
    monkeypatch.setattr(dispatch.F, "linear", lambda h, w, b=None: h.new_empty((*h.shape[:-1], w.shape[0])))
    return log


@pytest.mark.parametrize("impl", PAIRS)
@pytest.mark.parametrize("mode", sorted(common.PDL_MODES))
def test_the_pairs_launch_with_pdl_where_supported_and_asked(impl, mode, launches, monkeypatch):
    monkeypatch.setattr(dispatch, "pdl_supported", lambda device: True)  # as on an H200
    monkeypatch.setattr(config, "pdl", mode)
    x, w = torch.randn(4, 64), torch.randn(96, 64)
    dispatch.IMPLS_BY_NAME[impl].fn(x, w, None, w, None, torch.randn(64, 96), None, "silu")
    assert len(launches) == (1 if impl == "triton_gemm" else 2)
    gdc = common.PDL_MODES[mode]
    for name, key, kw in launches:
        assert kw["launch_pdl"] is (gdc > 0) and kw["GDC"] == gdc, (name, kw)
        assert key[-1] == gdc, name  # compiled apart: a kernel with the wait is not one without it
    monkeypatch.setattr(dispatch, "pdl_supported", lambda device: False)  # an older GPU: never, whatever the setting
    launches.clear()
    dispatch.IMPLS_BY_NAME[impl].fn(x, w, None, w, None, torch.randn(64, 96), None, "silu")
    assert all(kw["launch_pdl"] is False and kw["GDC"] == 0 for _, _, kw in launches)


def test_an_unknown_pdl_mode_is_named(monkeypatch):
    monkeypatch.setattr(config, "pdl", "on")
    with pytest.raises(ValueError, match="MLP_FUSER_PDL='on' is not one of"):
        dispatch._pdl(torch.empty(2, 2))


_PTX = textwrap.dedent("""
    import sys, torch
    sys.path.insert(0, "benchmarks")
    import ptx_compare
    from mlp_fuser.kernels import common, gate_up_act
    from mlp_fuser.kernels.splitk import linear_splitk
    from mlp_fuser.kernels.swapab import gate_up_act_swapab
    launches = []
    common.Launcher.__call__ = lambda self, key, grid, *args, **kw: launches.append((self.kernel, args, kw))
    r = lambda *s: torch.randn(*s, dtype=torch.bfloat16)
    for pdl in (0, 1, 2, 3):
        linear_splitk(r(16, 2048), r(512, 2048), None, (16, 64, 128, 4, 4, 3), pdl=pdl)
        gate_up_act_swapab(r(16, 512), r(1024, 512), None, r(1024, 512), None, "silu", config=(16, 64, 128, 4, 3),
                           pdl=pdl)
        gate_up_act(r(16, 512), r(1024, 512), None, r(1024, 512), None, "silu", pdl=pdl)
    for kernel, args, kw in launches:
        ptx = next(iter(ptx_compare.compile_launch(kernel, args, kw).values()))
        wait, signal = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        loop = min(i for i in (ptx.find("wgmma.mma_async"), ptx.find("mma.sync")) if i >= 0)  # the first MMA
        where = "none" if signal < 0 else "start" if signal < loop else "loop"
        print(kw["GDC"], kw["launch_pdl"], wait >= 0 and (wait < loop), where)
""")


def test_the_kernels_wait_and_signal_in_their_sm90_ptx_only_with_pdl():
    """Compiled for sm_90 without a GPU (ptxas ships with Triton), in a process without the interpreter: each mode's
    wait before the main loop's first MMA, and its signal (if any) before it (mode 3) or after it (mode 2)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT), env.get("PYTHONPATH", "")])
    out = subprocess.run([sys.executable, "-c", _PTX], cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    lines = out.stdout.split("\n")[:-1]
    expected = ["0 False False none"] * 3 + ["1 True True none"] * 3 + ["2 True True loop"] * 3 + \
        ["3 True True start"] * 3
    assert lines == expected, out.stdout
