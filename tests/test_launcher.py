"""kernels.common.Launcher: the first call of a key goes through Triton, later ones straight to the compiled launcher.

The real direct launch needs a GPU (tests/test_gpu.py checks its results there); here a stand-in kernel records
what it is asked to do, so the bookkeeping (which calls go where, with which arguments) is checked on the CPU.
"""

from types import SimpleNamespace

import pytest
import torch

from mlp_fuser import compat
from mlp_fuser.kernels import common


class FakeCompiled:
    function, packed_metadata = "fn-handle", ("warps", "ctas", "smem")

    def __init__(self):
        self.runs = []

    def run(self, *launch):
        self.runs.append(launch)


class FakeKernel:
    """A triton.jit function of three runtime parameters and two constexprs (BLOCK, ACT)."""

    params = [SimpleNamespace(is_constexpr=c) for c in (False, False, False, True, True)]

    def __init__(self):
        self.compiled = FakeCompiled()
        self.slow = []

    def __getitem__(self, grid):
        def launch(*args, **constexprs):
            self.slow.append((grid, args, constexprs))
            return self.compiled
        return launch


class FakeAutotuner(FakeKernel):
    best_config = SimpleNamespace(all_kwargs=lambda: {"BLOCK": 64, "num_warps": 4})

    def __init__(self):
        super().__init__()
        self.fn = SimpleNamespace(params=FakeKernel.params)

    params = property(lambda self: (_ for _ in ()).throw(AttributeError("params")))


@pytest.fixture
def gpu_free(monkeypatch):
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setattr(compat, "current_stream", lambda device: 1000 + device)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)


def test_first_call_through_triton_then_direct(gpu_free):
    k = FakeKernel()
    launch = common.Launcher(k)
    slow_before = common.Launcher.slow_calls
    launch(("a",), (5,), "x", "y", 7, BLOCK=32, ACT="silu")
    assert len(k.slow) == 1 and k.compiled.runs == []
    launch(("a",), (5,), "x2", "y2", 8, BLOCK=32, ACT="silu")
    assert len(k.slow) == 1
    assert k.compiled.runs == [(5, 1, 1, 1003, "fn-handle", FakeCompiled.packed_metadata, None, None, None,
                                "x2", "y2", 8, None, None)]
    launch(("b",), (2, 3), "x", "y", 7, BLOCK=32, ACT="silu")  # a new key: through Triton again
    assert len(k.slow) == 2 and len(k.compiled.runs) == 1
    assert common.Launcher.slow_calls - slow_before == 2  # the count benchmarks report


def test_autotuned_grid_comes_from_the_chosen_config(gpu_free):
    k = FakeAutotuner()
    launch = common.Launcher(k)
    launch(("a",), lambda meta: (100 // meta["BLOCK"], 2), "x", "y", 7, ACT="silu")
    launch(("a",), lambda meta: (100 // meta["BLOCK"], 2), "x", "y", 7, ACT="silu")
    assert k.compiled.runs[0][:3] == (1, 2, 1)


def test_a_launch_hook_sends_every_call_through_triton(gpu_free, monkeypatch):
    import triton

    k = FakeKernel()
    launch = common.Launcher(k)
    launch(("a",), (1,), "x", "y", 7, BLOCK=32, ACT="silu")
    hook = triton.knobs.runtime.launch_enter_hook

    def profiler_hook(metadata):
        return None

    hook.add(profiler_hook)
    try:
        launch(("a",), (1,), "x", "y", 7, BLOCK=32, ACT="silu")
    finally:
        hook.remove(profiler_hook)
    assert len(k.slow) == 2 and k.compiled.runs == []


def test_prepared_goes_direct_once_compiled_keyed_on_alignment(gpu_free, monkeypatch):
    """A plan's ``Prepared`` launch: the first call through ``launch`` (compiling), later calls with the same
    tensors' alignment straight to the compiled kernel, another alignment through ``launch`` again (its own
    specialization), and calls being recorded for a plan (``Launcher.recording``) always through ``launch``."""
    k = FakeKernel()
    monkeypatch.setitem(common._LAUNCHERS, k, common.Launcher(k))
    prepared = common.Prepared(k, (5,), BLOCK=32, ACT="silu")
    t = torch.empty(64)
    prepared(t, 7, t)
    assert len(k.slow) == 1 and k.compiled.runs == []
    prepared(t[4:], 7, t)  # both 16-byte aligned still: direct
    assert len(k.slow) == 1 and len(k.compiled.runs) == 1 and k.compiled.runs[0][9] is not t
    prepared(t[1:], 7, t)  # x misaligned: a key of its own, through Triton once
    assert len(k.slow) == 2
    prepared(t[2:], 7, t)
    assert len(k.slow) == 2 and len(k.compiled.runs) == 2
    common.Launcher.recording.launches = []
    try:
        prepared(t, 7, t)
        assert len(common.Launcher.recording.launches) == 1  # seen by the recording: through launch
    finally:
        del common.Launcher.recording.launches


@pytest.mark.parametrize("tensors", [0, 1, 3])
def test_prepared_picks_its_tensors_however_many(tensors, gpu_free, monkeypatch):
    """``Prepared`` reads the alignment of the tensors among its arguments, none, one or all of them: a later call
    with them aligned as before goes direct, one with its last tensor moved off alignment goes through Triton."""
    k = FakeKernel()
    monkeypatch.setitem(common._LAUNCHERS, k, common.Launcher(k))
    prepared = common.Prepared(k, (5,), BLOCK=32, ACT="silu")
    t = torch.empty(64)
    args = [t] * tensors + [7] * (3 - tensors)
    prepared(*args)
    prepared(*[t[4:] if a is t else a for a in args])
    assert len(k.slow) == 1 and len(k.compiled.runs) == 1
    moved = args[:tensors - 1] + [t[1:]] + args[tensors:] if tensors else args  # the last tensor alone moved
    prepared(*moved)
    assert len(k.slow) == (2 if tensors else 1)


def test_constexprs_must_come_last(gpu_free):
    k = FakeKernel()
    k.params = [SimpleNamespace(is_constexpr=c) for c in (False, True, False)]
    with pytest.raises(ValueError, match="constexpr parameters must come last"):
        common.Launcher(k)


def test_aligned_bits():
    t = torch.empty(64)
    assert common.aligned(t, t[1:], t[4:]) == 0b101


# ---- launch_source: a plan's call to Triton's C launch function, the one CudaLauncher.__call__ makes -------------


class CudaLauncher:  # triton 3.6's launcher, transcribed (this machine has 3.7): no scratch, so no allocator call
    def __init__(self):
        self.global_scratch_size = self.profile_scratch_size = 0

    def __call__(self, gridX, gridY, gridZ, stream, function, *args):
        self.launch(gridX, gridY, gridZ, stream, function, self.launch_cooperative_grid, self.launch_pdl,
                    None, None, *args)


def _launchers():
    """Triton's own CudaLauncher of this triton (its real __call__) and the 3.6 transcription, without a compiled
    kernel behind them: each one's C launch function is a recorder."""
    from triton.backends.nvidia.driver import CudaLauncher as Real

    real = Real.__new__(Real)
    real.global_scratch_size = real.profile_scratch_size = 0
    real.global_scratch_align = real.profile_scratch_align = 1
    real.arg_annotations, real.kernel_signature, real.num_ctas = ("ann",), b"sig", 1
    return {"this triton": real, "triton 3.6": CudaLauncher()}


@pytest.mark.parametrize("which", ["this triton", "triton 3.6"])
@pytest.mark.parametrize("coop_pdl", [(False, False), (True, True)])
def test_launch_source_passes_what_the_launchers_call_passes(which, coop_pdl):
    run = _launchers()[which]
    run.launch_cooperative_grid, run.launch_pdl = coop_pdl
    calls = []
    run.launch = lambda *a: calls.append(a)
    compiled = SimpleNamespace(run=run, function=object(), packed_metadata=("warps", 4))
    args = (123456, 7.5, 3, None, None)  # a pointer, a float, an int, two constexpr slots
    run(4, 2, 1, 99, compiled.function, compiled.packed_metadata, None, None, None, *args)  # as Launcher calls it

    consts = {}
    line = common.launch_source(compiled, (4, 2, 1), "s", ["p", "f", "n", "None", "None"], "_k0_", consts)
    exec(f"def go(s, p, f, n):\n    {line}\n", consts)
    consts["go"](99, *args[:3])
    assert len(calls) == 2 and calls[1] == calls[0]
    assert consts["_k0_launch"] is run.launch  # the C function, not the Python layer around it


@pytest.mark.parametrize("which", ["this triton", "triton 3.6"])
def test_launchers_direct_launch_passes_what_the_launchers_call_passes(which):
    """A Launcher's later calls of a key go through ``_direct``: the C launch function, with the very arguments the
    compiled kernel's launcher would pass it (its constexpr slots as None)."""
    run = _launchers()[which]
    run.launch_cooperative_grid, run.launch_pdl = False, True
    calls = []
    run.launch = lambda *a: calls.append(a)
    compiled = SimpleNamespace(run=run, function=object(), packed_metadata=("warps", 4))
    run(4, 2, 1, 99, compiled.function, compiled.packed_metadata, None, None, None, 123456, 7.5, 3, None, None)
    common._direct(compiled, (4, 2, 1), 2)(99, (123456, 7.5, 3))
    assert len(calls) == 2 and calls[1] == calls[0]


def test_launch_source_calls_the_launcher_where_it_must_allocate_or_is_unknown():
    for change in ("scratch", "form"):
        run = _launchers()["triton 3.6"]
        if change == "scratch":
            run.global_scratch_size = 64  # __call__ allocates it through Triton's allocator: keep __call__
        else:
            run = SimpleNamespace(**vars(run))  # not a CudaLauncher
        compiled = SimpleNamespace(run=run, function="fn", packed_metadata="meta")
        consts = {}
        line = common.launch_source(compiled, (1, 1, 1), "s", ["p"], "_k0_", consts)
        assert consts["_k0_launch"] is run and line.startswith("_k0_launch(1, 1, 1, s, _k0_fn, _k0_meta, None"), change


def test_a_kernel_without_a_known_signature_goes_through_triton(gpu_free):
    """Where Triton's JITFunction does not say which parameters are constexprs (compat.constexpr_flags None), every
    call takes Triton's own launch: correct, with no direct launch to get wrong."""

    class Unsigned(FakeKernel):
        params = property(lambda self: (_ for _ in ()).throw(AttributeError("params")))

    k = Unsigned()
    assert compat.constexpr_flags(k) is None
    launch = common.Launcher(k)
    for _ in range(3):
        launch(("a",), (5,), "x", "y", 7, BLOCK=32, ACT="silu")
    assert len(k.slow) == 3 and k.compiled.runs == []
