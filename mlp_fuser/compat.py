"""Every private torch and Triton API mlp_fuser uses, in one place, with the public path beside it.

The host-time shortcuts rely on internals: Triton's ``CompiledKernel.run`` launch forms (``Launcher`` and the launch
plans call a compiled kernel's launcher directly), Inductor's lowering table (``runtime/inductor.py`` renames the op's
call in generated code), attributes set on ``torch.ops.mlp_fuser`` (what that code calls), ``torch._C`` functions
on the op's hot path and Dynamo's C++ tensor guards (``patch.site.EagerSite``). They are used only where the installed
versions are within the tested ranges (``TORCH``, ``TRITON``) and ``MLP_FUSER_PRIVATE`` (``config.private_apis``) is
not ``0``. Otherwise every call takes the public path: Triton's ``kernel[grid](...)`` launch, no launch plans, no
Inductor renaming, the registered op through the dispatcher; correct, and slower on the host.

``PRIVATE`` says which path is taken; ``refresh()`` recomputes it (setting ``config.private_apis`` calls it).

The rest are not shortcuts but the only way to something, used on both paths, each with its public fallback where
one exists (named in its comment): the dispatcher's keys behind the ops' Autograd and Autocast kernels, Dynamo's
trace-time hooks, errors and counters, FakeTensor, Inductor's compiler object and settings, Triton's kernel
signature, the GPU sleep kernel the dispatchers time behind, Tensor and DTensor internals. ``tests/test_private_api``
fails when a module outside this one reaches a private torch or Triton name.
"""

from __future__ import annotations

import contextlib
import inspect
import re

import torch
import torch.nn.functional as F
import torch.utils.checkpoint
import triton
from torch._subclasses.fake_tensor import FakeTensor, is_fake  # noqa: F401 (no public module holds them)

from . import config

TORCH = ((2, 11), (2, 13))  # tested torch versions, first and last (major, minor)
TRITON = ((3, 6), (3, 7))  # tested Triton versions


def _version(text: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", text)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def in_range() -> bool:
    """Whether the installed torch and Triton are versions the private paths were tested on."""
    lo, hi = TORCH
    tlo, thi = TRITON
    return lo <= _version(torch.__version__) <= hi and tlo <= _version(triton.__version__) <= thi


# ---- the op's hot path: torch._C where allowed, the public equivalents elsewhere ---------------------------


def _any_requires_grad_public(*tensors) -> bool:
    return any(t is not None and t.requires_grad for t in tensors)


def _current_stream_public(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


def launch_hooks() -> bool:
    """Whether something (a profiler such as proton) asked Triton to call it around every launch."""
    hook = triton.knobs.runtime.launch_enter_hook  # a HookChain in the tested versions
    return hook is not None and bool(getattr(hook, "calls", True))


# Bound by refresh(). Direct references on the private path: no Python frame between the op and these checks.
# any_autocast_enabled and profiler_enabled are read only on the private path (``direct_calls``).
PRIVATE = False
any_requires_grad = _any_requires_grad_public
current_stream = _current_stream_public
any_autocast_enabled = profiler_enabled = None


def refresh() -> bool:
    """Choose the private or the public path from the versions and ``config.private_apis``; returns ``PRIVATE``."""
    global PRIVATE, any_requires_grad, any_autocast_enabled, profiler_enabled, current_stream
    PRIVATE = config.private_apis and in_range()
    c = torch._C
    if PRIVATE:
        any_requires_grad = c._any_requires_grad
        any_autocast_enabled = c._is_any_autocast_enabled
        profiler_enabled = c._autograd._profiler_enabled
        current_stream = getattr(c, "_cuda_getCurrentRawStream", _current_stream_public)
    else:
        any_requires_grad, current_stream = _any_requires_grad_public, _current_stream_public
        any_autocast_enabled = profiler_enabled = None
    return PRIVATE


def direct_calls() -> bool:
    """Whether the op may be computed right in its Python entries (``ops.eager_*``, ``ops.inductor_*``), skipping
    torch's dispatcher: only on the private path, whose checks say exactly when nothing needs the dispatcher."""
    return PRIVATE


PLAIN_TYPES = frozenset({torch.Tensor, torch.nn.Parameter, type(None)})


def plain_call(x, tensors) -> bool:
    """Whether an op's eager entry may compute a call right there, as the dispatcher would: x and ``tensors`` (the
    op's other floating operands, None allowed) plain CPU/CUDA tensors, no gradient, no autocast (on any device), no
    torch function or dispatch mode (fake tensors, functionalization), no functorch transform, no tracing; and no
    profiler, which then sees the op's own event. Never on the public path."""
    return plain_operands(x, tensors) and not (torch.is_grad_enabled() and any_requires_grad(x, *tensors))


def plain_operands(x, tensors) -> bool:
    """``plain_call`` but for gradients: the call may need them (its entry then applies the op's autograd.Function
    itself, as the op's autograd kernel would)."""
    # cheapest first; x.is_cuda / x.is_cpu, not x.device.type (which builds a device object, then a string)
    return (type(x) is torch.Tensor and PRIVATE and (x.is_cuda or x.is_cpu) and not torch.compiler.is_compiling()
            and nothing_intercepts() and PLAIN_TYPES.issuperset(map(type, tensors)))


def functorch_active() -> bool:
    """A torch.func transform (grad, vmap, jvp, ...) is active."""
    return bool(torch._C._are_functorch_transforms_active())


def no_dispatch_mode_or_transform() -> bool:
    """No torch dispatch mode (fake tensors, tracing) and no functorch transform is active."""
    return not torch._C._len_torch_dispatch_stack() and not torch._C._are_functorch_transforms_active()


def nothing_intercepts() -> bool:
    """No profiler, no autocast (on any device), no torch function or dispatch mode, no functorch transform: the
    process-wide half of ``plain_operands`` (private path only: its functions are bound there)."""
    return (not profiler_enabled()
            and not any_autocast_enabled()  # any device: asking for x's builds its device's name
            and not torch._C._is_torch_function_mode_enabled() and not torch._C._len_torch_dispatch_stack()
            and not torch._C._are_functorch_transforms_active())


def tensor_guards(tensors):
    """A checker of ``tensors``' metadata, ``checker.check(*others) -> bool``: each other tensor of the same Python
    type, dtype, device, sizes, strides, dispatch keys and requires_grad (Dynamo's C++ ``TensorGuards``, ≈ 0.5 µs for
    four tensors); None on the public path."""
    if not PRIVATE:
        return None
    from torch._C._dynamo.guards import TensorGuards

    return TensorGuards(*tensors, dynamic_dims_sizes=[list(t.shape) for t in tensors],
                        dynamic_dims_strides=[list(t.stride()) for t in tensors])


# ---- torch.ops attributes: what Inductor's renamed call reaches -----------------------------------------------


def set_op_attribute(name: str, fn) -> bool:
    """``torch.ops.mlp_fuser.<name> = fn`` on the private path (generated code reaches it from ``torch``); else
    nothing. Returns whether it was set."""
    if not PRIVATE:
        return False
    setattr(torch.ops.mlp_fuser, name, fn)
    return True


# ---- Triton's compiled-kernel launch ---------------------------------------------------------------------------

# How CudaLauncher.__call__ (triton.backends.nvidia.driver) calls its C launch function, keyed by the parameters the
# __call__ takes after (self, gridX, gridY, gridZ, stream, function): the arguments of that call, where the kernel has
# no scratch memory (no allocator is called) and no launch hooks are set (they are None). {args} the kernel's.
LAUNCH_FORMS = {
    ("args",):  # triton 3.6: (grid, stream, function, coop, pdl, scratch x2, metadata, launch metadata, hooks, *args)
        "{gx}, {gy}, {gz}, {s}, {fn}, {coop}, {pdl}, None, None, {meta}, None, None, None, {args}",
    ("kernel_metadata", "launch_metadata", "launch_enter_hook", "launch_exit_hook", "args"):  # triton 3.7
        "{gx}, {gy}, {gz}, {s}, {fn}, {coop}, {pdl}, {meta}, None, None, None, None, None, {ann}, {ksig}, ({args},)",
}


def can_launch_directly(compiled) -> bool:
    """Whether ``Launcher`` may keep ``compiled`` (a Triton CompiledKernel) and call its ``run`` itself later."""
    return PRIVATE and hasattr(compiled, "packed_metadata") and hasattr(compiled, "run")


def launch_source(compiled, grid: tuple[int, int, int], stream: str, args: list[str], prefix: str,
                  consts: dict) -> str:
    """Source that launches ``compiled`` on ``grid`` with the stream and arguments the given expressions evaluate to
    (``args``: its non-constexpr ones, then None for each constexpr slot). Where its launcher is Triton's CudaLauncher
    in a form ``LAUNCH_FORMS`` knows and the kernel needs no scratch memory, the source calls the launcher's C
    function itself, with the arguments ``CudaLauncher.__call__`` would pass (skipping that Python layer's host time:
    benchmarks/NOTES.md, launch plans); otherwise it calls the launcher. The names it uses, ``{prefix}...``, go into
    ``consts``."""
    run = compiled.run
    form = None
    if type(run).__name__ == "CudaLauncher" and not run.global_scratch_size and not run.profile_scratch_size:
        params = tuple(inspect.signature(type(run).__call__).parameters)
        if params[:6] == ("self", "gridX", "gridY", "gridZ", "stream", "function"):
            form = LAUNCH_FORMS.get(params[6:])
    gx, gy, gz = grid
    names = {k: f"{prefix}{k}" for k in ("fn", "meta", "coop", "pdl", "ann", "ksig", "launch")}
    consts.update({names["fn"]: compiled.function, names["meta"]: compiled.packed_metadata})
    if form is None:
        consts[names["launch"]] = run
        return f"{names['launch']}({gx}, {gy}, {gz}, {stream}, {names['fn']}, {names['meta']}, None, None, None, " \
               f"{', '.join(args)})"
    consts.update({names["launch"]: run.launch, names["coop"]: run.launch_cooperative_grid,
                   names["pdl"]: run.launch_pdl, names["ann"]: getattr(run, "arg_annotations", None),
                   names["ksig"]: getattr(run, "kernel_signature", None)})
    return f"{names['launch']}(" + form.format(gx=gx, gy=gy, gz=gz, s=stream, args=", ".join(args), **names) + ")"


# ---- Dynamo: the object behind a traced variable ---------------------------------------------------------------


def traced_value(var):
    """The Python object behind a ``torch._dynamo.comptime`` variable, or None. Not a shortcut but the only way a
    function run at trace time (an experts module's spec, which probes its tensors) reaches a module that Dynamo does
    not treat as a constant; on both paths. Private: ComptimeVar's VariableTracker and its ``value``."""
    get = getattr(var, "_i_will_not_complain_if_bc_breaks_VariableTracker", None)
    return getattr(get(), "value", None) if get is not None else None


# ---- Inductor's lowering table ---------------------------------------------------------------------------------


def inductor_imported() -> bool:
    """Whether Inductor's lowerings are loaded (something will lower a graph): nothing here imports Inductor."""
    import sys

    return "torch._inductor.lowering" in sys.modules


def inductor_lowering(op):
    """The lowering Inductor uses for ``op`` (made as its implicit fallback would be, where it has none), or None on
    the public path (Inductor then calls the registered op, as for any custom op)."""
    if not PRIVATE:
        return None
    from torch._inductor import lowering
    from torch._library.utils import get_layout_constraint_tag

    if op not in lowering.lowerings:  # what Inductor's implicit fallback for this op would be
        constraint = lowering.tag_to_layout_constraint(get_layout_constraint_tag(op, with_default=True))
        lowering.make_fallback(op, layout_constraint=constraint, warn=False)
    return lowering.lowerings[op]


def set_inductor_lowering(op, lower, fallback: bool) -> None:
    """Make ``lower`` Inductor's lowering of ``op``; ``fallback``: marked as a fallback handler (as Inductor's own
    fallbacks are, which its checks look for)."""
    from torch._inductor import lowering

    if fallback:
        lower._is_fallback_handler = True
    lowering.lowerings[op] = lower


def fallback_kernel(out):
    """The FallbackKernel node behind a fallback lowering's result (a tensor output wrapped for lowering), or None."""
    from torch._inductor import ir

    node = out
    while node is not None and not isinstance(node, ir.MultiOutput):
        node = getattr(node, "data", None)
    inputs = getattr(node, "inputs", None) or [None]
    return inputs[0] if isinstance(inputs[0], ir.FallbackKernel) else None


def python_wrapper() -> bool:
    """Whether the graph Inductor is lowering gets Python wrapper code (not C++, not an FX wrapper)."""
    from torch._inductor.virtualized import V

    return not V.graph.cpp_wrapper and not getattr(V.graph, "fx_wrapper", False)


# ---- Inductor as torch.compile runs it -------------------------------------------------------------------------


def inductor_compiler(mode: str | None, options: dict | None):
    """What ``torch.compile(backend="inductor", mode=mode, options=options)`` compiles a graph with (no public
    constructor: torch.compile builds this object itself)."""
    return torch._TorchCompileInductorWrapper(mode, options, None)


def inductor_cudagraphs() -> bool:
    """Inductor's global ``triton.cudagraphs`` setting (no public accessor)."""
    import torch._inductor.config as inductor_config

    return inductor_config.triton.cudagraphs


# ---- the dispatcher's keys: the ops' own Autograd and Autocast kernels ------------------------------------------
# torch.library.register_autograd/register_autocast are the public path, but neither redispatches below autograd
# nor casts to the autocast dtype of the call (register_autocast fixes one dtype): these kernels need the keys.

AFTER_AUTOGRAD = torch._C._after_autograd_keyset
PLAIN_KEYS = frozenset({torch._C.DispatchKey.CPU, torch._C.DispatchKey.CUDA})


def below_autograd():
    """A context in which calls dispatch below the Autograd key (an Autograd kernel's redispatch)."""
    return torch._C._AutoDispatchBelowAutograd()


_AUTOGRAD_KEYS = (torch._C.DispatchKey.AutogradFunctionality, torch._C.DispatchKey.ADInplaceOrView,
                  torch._C.DispatchKey.AutogradOther)


def autograd_recording():
    """A context in which autograd records again inside an op's kernel (a dispatch mode's handler runs kernels with
    the autograd keys excluded): for a kernel whose aten path computes gradients by autograd."""
    exclude = torch._C._dispatch_tls_local_exclude_set()
    for key in _AUTOGRAD_KEYS:
        exclude = exclude.remove(key)
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), exclude)


def autocast_key(device_type: str) -> str:
    """The Autocast dispatch key's name of a device type (``AutocastCUDA``), as ``Library.impl`` takes it."""
    return "Autocast" + torch._C._dispatch_key_for_device(device_type)


def excluding(key_name: str):
    """A context in which the dispatch key ``key_name`` is skipped (an Autocast kernel calling the op again)."""
    return torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(getattr(torch._C.DispatchKey, key_name)))


# ---- Dynamo ----------------------------------------------------------------------------------------------------

# comptime(fn): run fn(ctx) at trace time where Dynamo traces the caller (no public form). The function itself, not a
# wrapper: Dynamo recognises the call by the function's identity.
from torch._dynamo.comptime import comptime  # noqa: E402,F401


def register_backend(fn, name: str) -> None:
    """``torch.compile(backend=name)`` calls ``fn`` (public path: passing ``fn`` itself as the backend)."""
    import torch._dynamo

    torch._dynamo.register_backend(fn, name=name)


def dynamo_errors() -> tuple[type, type]:
    """(Dynamo's base exception, its ``BackendCompilerFailed``), the types that wrap a traced error."""
    import torch._dynamo.exc as exc

    return exc.TorchDynamoException, exc.BackendCompilerFailed


def graph_breaks() -> dict:
    """Dynamo's graph-break counter, ``{reason: count}`` over the process (no public accessor)."""
    from torch._dynamo.utils import counters

    return counters["graph_break"]


def set_recompile_limit(n: int) -> None:
    """Let Dynamo keep ``n`` compiled versions of a frame (a benchmark's many shapes; no public setting)."""
    import torch._dynamo

    torch._dynamo.config.cache_size_limit = n
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = n


# ---- autograd and tensors ----------------------------------------------------------------------------------------

# Raised through a module's forward by non-reentrant torch.utils.checkpoint to stop recomputing once done: the
# fused forward must let it pass (empty where torch has no such error).
CHECKPOINT_STOP = tuple(e for e in (getattr(torch.utils.checkpoint, "_StopRecomputationError", None),)
                        if e is not None)


def view_base(t):
    """The tensor ``t`` is a view of, or None (``Tensor._base``; no public accessor)."""
    return t._base


def local_tensor(t):
    """A DTensor's local shard as its value holds it (public fallback: ``to_local()``, an autograd op)."""
    local = getattr(t, "_local_tensor", None)
    return local if local is not None else t.to_local()


def dtensor_from_local() -> tuple:
    """The functions a traced ``DTensor.from_local`` call appears as in a graph: the public method and the function
    behind it (torch.distributed.tensor._api.from_local); empty without torch.distributed."""
    try:
        from torch.distributed.tensor import DTensor
        from torch.distributed.tensor._api import from_local
    except ImportError:
        return ()
    return DTensor.from_local, from_local


# grouped GEMM over experts: torch.nn.functional.grouped_mm where torch has it, else torch._grouped_mm, else None
grouped_mm = getattr(F, "grouped_mm", None) or getattr(torch, "_grouped_mm", None)


def scaled_mm(a, b, scale_a, scale_b, recipe: str, out_dtype: torch.dtype):
    """a @ b on float8 operands with their decoding scales (the FP8 benchmark's unfused peer): ``recipe`` "rowwise"
    (scale_a (M, 1), scale_b (1, N)) or "blockwise" (scale_a (M, K/128) 1 x 128, scale_b (K/128, N/128) 128 x 128).
    torch.nn.functional.scaled_mm where torch has it, else torch._scaled_mm (the scales' shapes give the recipe)."""
    if hasattr(F, "scaled_mm"):
        st = F.ScalingType
        ra, rb = (st.RowWise, st.RowWise) if recipe == "rowwise" else (st.BlockWise1x128, st.BlockWise128x128)
        return F.scaled_mm(a, b, scale_a, ra, scale_b, rb, output_dtype=out_dtype)
    return torch._scaled_mm(a, b, scale_a=scale_a, scale_b=scale_b, out_dtype=out_dtype)


def gpu_sleep(cycles: int) -> None:
    """Keep the current CUDA stream busy for about ``cycles`` GPU clock cycles, so the calls queued behind are timed
    without the host's time (``torch.cuda._sleep``; where absent, nothing: the timing then includes the host's)."""
    sleep = getattr(torch.cuda, "_sleep", None)
    if sleep is not None:
        sleep(cycles)


# ---- Triton kernels' signature -----------------------------------------------------------------------------------


def constexpr_flags(kernel) -> list[bool] | None:
    """For a ``triton.jit`` function (or an autotuner over one): whether each parameter is a constexpr, in order;
    None where Triton's JITFunction does not say (its ``params``; an Autotuner's ``fn``)."""
    jit = kernel if hasattr(kernel, "params") else getattr(kernel, "fn", None)
    params = getattr(jit, "params", None)
    return None if params is None else [p.is_constexpr for p in params]


def autotuned_config(kernel) -> dict:
    """The keyword arguments of the config an autotuner chose for its last call ({} for a plain jit function)."""
    best = getattr(kernel, "best_config", None)
    return best.all_kwargs() if best is not None else {}


refresh()


def uncompiled(model):
    """The module ``torch.compile`` wrapped (``OptimizedModule._orig_mod``), else ``model`` itself."""
    if type(model).__name__ == "OptimizedModule":
        return getattr(model, "_orig_mod", model)
    return model


# transformers' FP8 layers call the kernel its finegrained_fp8 module loaded into a private global (from the Hub)
def hf_fp8_kernel(module):
    """The FP8 kernel transformers' FP8 layers run (``module``: transformers.integrations.finegrained_fp8), once
    loaded, else None."""
    return getattr(module, "_FINEGRAINED_FP8", None)


@contextlib.contextmanager
def hf_fp8_kernel_as(module, kernel):
    """transformers' FP8 layers run ``kernel`` (a ``module.FineGrainedFP8``) inside the block."""
    kept = module._FINEGRAINED_FP8
    module._FINEGRAINED_FP8 = kernel
    try:
        yield
    finally:
        module._FINEGRAINED_FP8 = kept


def has_forward_hooks(module) -> bool:
    """Whether ``module`` has forward hooks or pre-hooks of its own (nn.Module has no public accessor)."""
    return bool(module._forward_hooks or module._forward_pre_hooks)
