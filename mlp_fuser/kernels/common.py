"""What the kernels share: the M bucket, the interpreter switch, tl.dot's precision, the shared-memory rule and
``Launcher``, which launches a compiled kernel directly once its specialization is known (where ``mlp_fuser.compat``
allows Triton's private launch).

Nothing here imports the rest of mlp_fuser but ``compat``: the kernels depend only downward.
"""

from __future__ import annotations

import operator
import os
import threading
import weakref
from collections.abc import Callable, Sequence
from functools import cache, partial

import torch

from .. import compat
from ..compat import launch_source  # noqa: F401 (its old home: plans and tests import it here)

try:  # host-side TMA descriptors (Triton >= 3.4): a launch's key reads them
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover (the tested Tritons have them)
    TensorDescriptor = None

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"  # the Triton interpreter runs kernels on CPU tensors


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for host-side integers (``triton.cdiv`` is a constexpr function: slow to call from Python)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    return 1 if n <= 1 else 1 << (n - 1).bit_length()


def m_bucket(M: int) -> int:
    """M rounded up to a power of two: the key of every per-shape choice (implementation, autotuned config)."""
    return next_power_of_2(M)


def dot_precision(dtype: torch.dtype) -> str:
    """tl.dot's input_precision: IEEE fp32 unless the user allowed TF32, as for torch's own matmuls."""
    if dtype == torch.float32 and not torch.backends.cuda.matmul.allow_tf32:
        return "ieee"
    return "tf32"  # the default; only fp32 operands are affected by it


def k_loop_bytes(stages: int, block_m: int, block_k: int, block_n: int, n_weights: int, itemsize: int) -> int:
    """Shared memory of ``stages`` pipelined K steps, each one x tile and ``n_weights`` weight tiles."""
    return stages * (block_m * block_k + n_weights * block_k * block_n) * itemsize


def k_loop_fits(stages: int, block_m: int, block_k: int, block_n: int, n_weights: int, itemsize: int,
                budget: int = 200 * 1024) -> bool:
    """Whether ``k_loop_bytes`` fit in the shared memory budget (by default 200 KiB of an sm90's 227, the rest left
    to the epilogue); an upper bound of what Triton allocates (benchmarks/NOTES.md, shared memory rule)."""
    return k_loop_bytes(stages, block_m, block_k, block_n, n_weights, itemsize) <= budget


@cache
def num_sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


@cache
def smem_per_sm(device: torch.device) -> int:
    """Shared memory of one SM in bytes (an sm90's 228 KiB where torch does not report it)."""
    if device.type != "cuda":
        return 228 * 1024
    props = torch.cuda.get_device_properties(device)
    return getattr(props, "shared_memory_per_multiprocessor", 228 * 1024)


def stand_ins(w_gate: torch.Tensor, b_gate, w_up, b_up, fill: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """(w_up, b_gate, b_up) as a kernel takes them: an operand the call does not have is replaced by a tensor that is
    there (w_gate for w_up, ``fill`` for a bias), a valid pointer with valid strides that the kernel, its HAS_* flag
    off, never reads."""
    return (w_up if w_up is not None else w_gate, b_gate if b_gate is not None else fill,
            b_up if b_up is not None else fill)


def stored_as_one(wg: torch.Tensor, wu: torch.Tensor, pg: int, pu: int) -> bool:
    """Whether up's rows follow gate's in one storage, with the same shape, strides and dtype (``pg``, ``pu``: their
    data pointers, which the caller has): [gate; up] is then a (2I, K) view of that storage, as where a model keeps
    one merged weight and splits it in two (Phi-3's ``gate_up_proj``), and one GEMM computes both. The pointers are
    compared first; the storages (a Python object each) only when the pointers line up."""
    return (pu - pg == wg.shape[0] * wg.stride(0) * wg.element_size() and wg.stride(0) > 0 and wg.shape == wu.shape
            and wg.stride() == wu.stride() and wg.dtype == wu.dtype
            and wg.untyped_storage().data_ptr() == wu.untyped_storage().data_ptr())


def is_gate_up_as_one(wg: torch.Tensor, bg, wu, bu) -> bool:
    """Whether ``stored_as_one`` holds for gate and up and neither has a bias: what ``gate_up_as_one`` views, and
    what the dispatcher's ``Problem.one_weight`` says."""
    return wu is not None and bg is None and bu is None and stored_as_one(wg, wu, wg.data_ptr(), wu.data_ptr())


def gate_up_as_one(wg: torch.Tensor, bg, wu, bu) -> torch.Tensor | None:
    """[w_gate; w_up] as one (2I, K) view where ``is_gate_up_as_one``; else None."""
    if not is_gate_up_as_one(wg, bg, wu, bu):
        return None
    return wg.as_strided((2 * wg.shape[0], wg.shape[1]), wg.stride())


def aligned(*tensors: torch.Tensor) -> int:
    """A bit per tensor: its data pointer is 16-byte aligned (Triton specializes kernels on that)."""
    bits = 0
    for t in tensors:
        bits = (bits << 1) | (t.data_ptr() % 16 == 0)
    return bits


class Launcher:
    """Launches one Triton kernel (a ``triton.jit`` function, or an autotuner over one) with little host work.

    ``launcher(key, grid, *args, **constexprs)``: the first call of a ``key`` goes through Triton (binding,
    specialization, compilation, autotuning) and keeps the compiled kernel and its grid; later calls of that key
    hand the arguments straight to Triton's C launch function (``_direct``). So ``key`` must determine everything Triton
    specializes on and the grid depends on: every integer argument, the dtypes, each pointer's 16-byte alignment
    (``aligned``) and the constexprs. ``args`` are the kernel's non-constexpr parameters in order; the constexpr
    parameters come after them in the kernel's signature. Under the interpreter, or with a Triton launch hook
    set (a profiler), every call goes through Triton.
    """

    MAX_KEYS = 4096  # a process that sees endless new shapes starts the cache afresh rather than growing it
    slow_calls = 0  # calls (of every Launcher) that went through Triton's own launch path: benchmarks report it
    recording = threading.local()  # its .launches, while a list: this thread's launches are appended there

    def __init__(self, kernel):
        self.kernel = kernel
        self.cache: dict[tuple, tuple] = {}  # key -> (compiled kernel, grid, device index, its direct launch)
        if INTERPRET:  # an InterpretedFunction: nothing compiled to launch directly
            return
        constexpr = compat.constexpr_flags(kernel)
        if constexpr is None:  # a Triton that does not say: every call goes through Triton
            self.pad = None
            return
        n_args = constexpr.index(True) if True in constexpr else len(constexpr)
        if any(constexpr[:n_args]) or not all(constexpr[n_args:]):
            name = getattr(kernel, "__name__", kernel)
            raise ValueError(f"Launcher({name}): the constexpr parameters must come last")
        self.pad = (None,) * (len(constexpr) - n_args)  # the compiled launcher skips the constexpr slots

    def __call__(self, key: tuple, grid: Sequence[int] | Callable[[dict], Sequence[int]], *args, **constexprs):
        launches = getattr(Launcher.recording, "launches", None)
        if launches is not None:  # mlp_fuser.plans records a call's launches
            launches.append((self, key, args))
        hit = self.cache.get(key)
        if hit is not None and not compat.launch_hooks():
            hit[3](compat.current_stream(hit[2]), args)
            return
        Launcher.slow_calls += 1
        compiled = self.kernel[grid](*args, **constexprs)
        if INTERPRET or self.pad is None or not compat.can_launch_directly(compiled):  # Triton launches every call
            return
        if callable(grid):
            grid = grid({**constexprs, **compat.autotuned_config(self.kernel)})
        grid = (*grid, 1, 1)[:3]
        if len(self.cache) >= self.MAX_KEYS:
            self.cache.clear()
        self.cache[key] = (compiled, grid, torch.cuda.current_device(), _direct(compiled, grid, len(self.pad)))


def _direct(compiled, grid: tuple[int, int, int], n_constexprs: int) -> Callable[[int, tuple], None]:
    """``go(stream, args)``: launches ``compiled`` on ``grid`` with ``args`` (its non-constexpr arguments) by the
    shortest path ``compat.launch_source`` knows: Triton's C launch function itself where it can, else the compiled
    kernel's launcher."""
    consts: dict = {}
    call = compat.launch_source(compiled, grid, "s", ["*a", *["None"] * n_constexprs], "_", consts)
    exec(f"def go(s, a):\n    {call}\n", consts)  # noqa: S102 (source built by launch_source)
    return consts["go"]


_LAUNCHERS: dict = {}


def _desc_key(d) -> tuple:
    """What Triton specializes on in a host tensor descriptor, and more: its dtype, shape, strides, box, padding."""
    return d.base.dtype, tuple(d.shape), tuple(d.strides), tuple(d.block_shape), getattr(d, "padding", None)


def launch(kernel, grid: Sequence[int], *args, **constexprs) -> tuple:
    """``kernel[grid](*args, **constexprs)`` through a ``Launcher`` of its own, keyed on everything Triton
    specializes on: each tensor's dtype and 16-byte alignment, every other argument's value, the constexprs and
    launch options, and the grid. For kernels launched with plain Python values (no autotuner). Returns the key."""
    launcher = _LAUNCHERS.get(kernel)
    if launcher is None:
        launcher = _LAUNCHERS[kernel] = Launcher(kernel)
    key = _key(grid, args, constexprs)
    launcher(key, grid, *args, **constexprs)
    return key


def _key(grid: Sequence[int], args: tuple, constexprs: dict) -> tuple:
    """``launch``'s key of a launch."""
    # ints first: most arguments are, and an isinstance check against torch.Tensor costs more than the class test
    return (*grid, *[a if a.__class__ is int else (a.dtype, a.data_ptr() & 15 == 0) if isinstance(a, torch.Tensor)
                     else _desc_key(a) if a.__class__ is TensorDescriptor else a for a in args], *constexprs.items())


_DESCS: dict[int, tuple] = {}  # id(weight) -> (a weak reference to it, {(pointer, shape, strides, box): descriptor})


def kept_desc(w: torch.Tensor, block_n: int, block_k: int):
    """The (rows, last dim) view of a weight (2-D, or stacked experts) as a descriptor of (block_n, block_k) boxes,
    built once per weight, memory and box (a weight's descriptors go with it)."""
    entry = _DESCS.get(id(w))
    if entry is None or entry[0]() is not w:
        entry = _DESCS[id(w)] = (weakref.ref(w, partial(_forget, id(w))), {})
    key = (w.data_ptr(), w.shape, w.stride(), block_n, block_k)
    desc = entry[1].get(key)
    if desc is None:  # a detached view: the descriptor must not hold the weight itself, or it would never go
        desc = entry[1][key] = TensorDescriptor.from_tensor(w.detach().view(-1, w.shape[-1]), [block_n, block_k])
    return desc


def _forget(i: int, ref) -> None:
    if _DESCS.get(i, (None,))[0] is ref:
        del _DESCS[i]


class Prepared:
    """``launch(kernel, grid, *args, **constexprs)`` with the grid and constexprs fixed, for a plan whose calls pass
    the same integers and dtypes every time (its signature says so): once a call's launch is compiled, a later call
    reads only its tensors' 16-byte alignment and goes straight to the compiled kernel (``launch`` builds and hashes
    a key of every argument: several µs a launch)."""

    def __init__(self, kernel, grid: Sequence[int], **constexprs):
        self.kernel, self.grid, self.constexprs = kernel, tuple(grid), constexprs
        self.tensors: tuple[int, ...] | None = None  # the positions of the tensor arguments
        self.pick: Callable[[tuple], tuple] | None = None  # the arguments -> their tensors (``_picker``)
        self.hits: dict[int, tuple] = {}  # their alignment bits -> the launcher's cache entry

    def __call__(self, *args) -> None:
        pick = self.pick
        if pick is not None and getattr(Launcher.recording, "launches", None) is None and not compat.launch_hooks():
            hit = self.hits.get(aligned(*pick(args)))
            if hit is not None:
                hit[3](compat.current_stream(hit[2]), args)
                return
        key = launch(self.kernel, self.grid, *args, **self.constexprs)
        launcher = _LAUNCHERS.get(self.kernel)
        hit = launcher.cache.get(key) if launcher is not None and key is not None else None
        if hit is None:  # not compiled for direct launches (the interpreter, the public path)
            return
        where = tuple(i for i, a in enumerate(args) if isinstance(a, torch.Tensor))
        if self.tensors is None:
            self.tensors, self.pick = where, _picker(where)
        if where == self.tensors:
            self.hits[aligned(*self.pick(args))] = hit


def _picker(at: tuple[int, ...]) -> Callable[[tuple], tuple]:
    """A function of a launch's arguments giving those at positions ``at`` as a tuple (an itemgetter where it
    gives one: half the Python of picking them one by one)."""
    if len(at) > 1:
        return operator.itemgetter(*at)
    return lambda args: tuple(args[i] for i in at)
