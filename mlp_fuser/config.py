"""mlp_fuser's run-time settings: one object, read and set from Python, each also set by an environment variable.

    import mlp_fuser
    mlp_fuser.config.sites = False            # from here on
    with mlp_fuser.config.patch(autotune=False):
        ...                                   # for a block
    print(mlp_fuser.config.settings())        # every setting's value

Each setting takes its environment variable's value when mlp_fuser is imported (``reload()`` reads them again);
setting a name that is not a setting raises ``AttributeError``. The settings:

- ``force_impl`` (``MLP_FUSER_IMPL``, default None): force one implementation by name in any op family's table
  (``IMPLS`` in ``mlp_fuser.dispatch.dense``, ``.experts``, ``.router``, ``.fp8``), for tests and benchmarks; a name
  from another family's table leaves this family's choice free, an unknown name is an error.
  None: the dispatcher chooses.
- ``triton_on_cpu`` (``MLP_FUSER_TRITON_ON_CPU=1``, default False): let the Triton implementations take CPU tensors;
  only meaningful with ``TRITON_INTERPRET=1`` (the Triton interpreter), which is how the kernels are tested without a
  GPU.
- ``autotune`` (``MLP_FUSER_AUTOTUNE=0`` turns it off, default True): on CUDA, time the eligible implementations once
  per shape bucket; off: take the first eligible one in priority order.
- ``triton_backward`` (``MLP_FUSER_TRITON_BACKWARD=1``, default False): let the dispatcher also time the Triton
  backward GEMM (``triton_backward_gemm``: dh = dy @ w_down with the activation's derivative in its epilogue) against
  cuBLAS dh + one Triton elementwise pass (``cublas_backward_act``). Off: it lost, and its autotuning takes tens of
  seconds per dtype on first use (benchmarks/NOTES.md, Triton backward GEMM). ``force_impl`` can still force it.
- ``moe_tma`` (``MLP_FUSER_MOE_TMA=1``, default False): let the experts' dispatcher also time
  ``triton_moe_sorted_tma`` (the sorted path with the weights read through TMA descriptors) where experts get more
  than 96 rows each. Off, it is timed from 512 rows each only: faster on the GPU but heavier on the host, which
  bounds a prefill through ``patch`` at fewer rows (benchmarks/NOTES.md, Mixtures of experts, "Large M");
  ``force_impl`` can force it.
- ``moe_rows_lowp`` (``MLP_FUSER_MOE_ROWS_LOWP=0`` turns it off, default True): the routed experts' per-pair rows
  (down's output before the k-sum, T·k·H elements) in x's dtype (bf16, fp16) instead of fp32: half the bytes written
  and read back where T·k is large (prefill), one more rounding of each pair's weighted row; off: fp32 rows
  (benchmarks/NOTES.md, FP8 routed experts, "Rows in x's dtype").
- ``quack`` (``MLP_FUSER_QUACK=0`` turns it off, default True): let the dispatcher consider QuACK's gated GEMM
  (``quack_gated_*``, where quack-kernels is installed and the GPU is an sm90).
- ``plans`` (``MLP_FUSER_PLANS=0`` turns them off, default True): launch plans (``runtime/plans.py``); off: every CUDA
  call takes the full path (validation, dispatch, launch keys). For benchmarks and for ruling plans out when
  debugging.
- ``sites`` (``MLP_FUSER_SITES=0`` turns them off, default True): a patched module's call site
  (``patch.site.EagerSite``) runs a plan it matched itself; off: every call goes through the eager entry (its
  checks, the plan's signature).
- ``inductor_direct`` (``MLP_FUSER_INDUCTOR_DIRECT=0`` turns it off, default True): Inductor's generated code calls
  the op's Python entry (``runtime/inductor.py``); off: the registered op through the dispatcher, as for any custom
  op. Applies to graphs compiled after it is set (graphs already compiled, or loaded from Inductor's cache, keep the
  call they were generated with).
- ``private_apis`` (``MLP_FUSER_PRIVATE=0`` turns them off, default True): use torch's and Triton's private APIs
  (``mlp_fuser.compat``) in the tested versions; off: Triton's own launch, no launch plans, no Inductor renaming,
  every call through the registered op. Setting it applies at once (``compat.refresh()``).
- ``check_routing`` (``MLP_FUSER_CHECK_ROUTING=1``, default False): check the experts op's routing ids on CUDA too
  (a host sync per call; on the CPU they are always checked).
- ``fp8_w8a8`` (``MLP_FUSER_FP8_W8A8=0`` turns it off, default True): FP8 weights multiply activations quantized per
  token and 128 columns on the fp8 tensor cores, at every M (transformers' own FP8 scheme; faster than casting the
  weights, benchmarks/NOTES.md, FP8 weights); off: the activations keep their dtype and each weight tile is cast on
  chip (W8A16: about 20x less error, slower).
- ``moe_backward`` (``MLP_FUSER_MOE_BACKWARD=save``, default "recompute"): what routed experts keep for their
  backward where no ``backward=`` was given to ``patch`` / ``make_backend`` (the experts switch, ``patch(model)``):
  "recompute" keeps only the op's inputs and recomputes gate/up in the backward (least memory); "save" keeps gate/up's
  output, T·k·2I elements a layer, and the backward skips that grouped GEMM (``mlp_fuser::moe_mlp_save``). Read at
  each call of the switch; by the backend when it compiles a graph.
- ``fp8_one_launch`` (``MLP_FUSER_FP8_ONE_LAUNCH=0`` turns it off; default True): let the FP8 experts' dispatcher
  also time ``fp8_moe_one_launch`` at up to 32 token-expert pairs (gate/up, h and down in one kernel:
  ``kernels/moe_one.py``; checked and timed on an H100: benchmarks/NOTES.md, "One token in one launch").
- ``fp8_fused_h`` (``MLP_FUSER_FP8_FUSED_H=0`` turns it off; default True): the FP8 experts' TMA gate/up
  launch quantizes h itself where its tiles are 128 columns wide (no h in x's dtype in HBM, no quantize launch:
  ``kernels.moe.fused_h_quant``). Read when a launch plan is built.
- ``fp8_merge`` (``MLP_FUSER_FP8_MERGE=0`` turns it off; default True): the backend computes FP8 linears that read
  one input and that ``patch`` packed side by side (q, k and v) as one GEMM (``graph/siblings.py``). Read by the
  backend when it compiles a graph.
"""

from __future__ import annotations

import contextlib
import os
import sys
import types
from collections.abc import Callable, Iterator, Mapping


def _on_if_1(v: str) -> bool:
    return v == "1"


def _on_unless_0(v: str) -> bool:
    return v != "0"


# setting -> (environment variable, its value when unset, how its text reads): the one map of the variables
ENV: dict[str, tuple[str, str, Callable[[str], object]]] = {
    "force_impl": ("MLP_FUSER_IMPL", "", lambda v: v or None),
    "triton_on_cpu": ("MLP_FUSER_TRITON_ON_CPU", "0", _on_if_1),
    "autotune": ("MLP_FUSER_AUTOTUNE", "1", _on_unless_0),
    "triton_backward": ("MLP_FUSER_TRITON_BACKWARD", "0", _on_if_1),
    "moe_tma": ("MLP_FUSER_MOE_TMA", "0", _on_if_1),
    "moe_rows_lowp": ("MLP_FUSER_MOE_ROWS_LOWP", "1", _on_unless_0),
    "quack": ("MLP_FUSER_QUACK", "1", _on_unless_0),
    "plans": ("MLP_FUSER_PLANS", "1", _on_unless_0),
    "sites": ("MLP_FUSER_SITES", "1", _on_unless_0),
    "inductor_direct": ("MLP_FUSER_INDUCTOR_DIRECT", "1", _on_unless_0),
    "private_apis": ("MLP_FUSER_PRIVATE", "1", _on_unless_0),
    "check_routing": ("MLP_FUSER_CHECK_ROUTING", "0", _on_if_1),
    "fp8_w8a8": ("MLP_FUSER_FP8_W8A8", "1", _on_unless_0),
    "moe_backward": ("MLP_FUSER_MOE_BACKWARD", "recompute", str),
    "fp8_one_launch": ("MLP_FUSER_FP8_ONE_LAUNCH", "1", _on_unless_0),
    "fp8_merge": ("MLP_FUSER_FP8_MERGE", "1", _on_unless_0),
    "fp8_fused_h": ("MLP_FUSER_FP8_FUSED_H", "1", _on_unless_0),
}


def from_env(environ: Mapping[str, str] = os.environ) -> dict[str, object]:
    """Every setting's value as the environment ``environ`` gives it."""
    return {name: parse(environ.get(var, unset)) for name, (var, unset, parse) in ENV.items()}


force_impl: str | None
triton_on_cpu: bool
autotune: bool
triton_backward: bool
moe_tma: bool
moe_rows_lowp: bool
quack: bool
plans: bool
sites: bool
inductor_direct: bool
private_apis: bool
check_routing: bool
fp8_w8a8: bool
moe_backward: str
fp8_one_launch: bool
fp8_merge: bool
fp8_fused_h: bool


def settings() -> dict[str, object]:
    """Every setting's current value."""
    return {name: getattr(_self, name) for name in ENV}


def reload(environ: Mapping[str, str] = os.environ) -> None:
    """Every setting from the environment again (as at import)."""
    for name, value in from_env(environ).items():
        setattr(_self, name, value)


@contextlib.contextmanager
def patch(**changes) -> Iterator[None]:
    """Within the block, the given settings changed; their values before restored after it."""
    before = {name: getattr(_self, name) for name in changes if name in ENV}
    try:
        for name, value in changes.items():
            setattr(_self, name, value)
        yield
    finally:
        for name, value in before.items():
            setattr(_self, name, value)


class _Config(types.ModuleType):
    """This module's type: a setting's name is checked when set (a typo raises instead of being ignored), and
    ``private_apis`` takes effect at once."""

    def __setattr__(self, name: str, value) -> None:
        if name not in ENV and name not in vars(self):
            raise AttributeError(f"mlp_fuser.config has no setting {name!r}; the settings: {', '.join(ENV)}")
        super().__setattr__(name, value)
        compat = sys.modules.get("mlp_fuser.compat")
        if name == "private_apis" and compat is not None:
            compat.refresh()


_self = sys.modules[__name__]
vars(_self).update(from_env())
_self.__class__ = _Config
