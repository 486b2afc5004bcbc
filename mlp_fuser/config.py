"""Run-time settings, read from the environment once and changeable from Python.

- ``MLP_FUSER_IMPL``: force one implementation by name (see ``mlp_fuser.dispatch.IMPLS``), for tests
  and benchmarks. Unset: the dispatcher chooses.
- ``MLP_FUSER_TRITON_ON_CPU=1``: let the Triton implementations take CPU tensors; only meaningful with
  ``TRITON_INTERPRET=1`` (the Triton interpreter), which is how the kernels are tested without a GPU.
- ``MLP_FUSER_AUTOTUNE=0``: on CUDA, take the first eligible implementation in priority order instead of
  timing the eligible ones once per shape bucket.
- ``MLP_FUSER_TRITON_BACKWARD=1``: let the dispatcher also time the Triton backward GEMM (``triton_backward_gemm``:
  dh = dy @ w_down with the activation's derivative in its epilogue) against cuBLAS dh + one Triton elementwise
  pass (``cublas_backward_act``, the default). Off by default: it lost, and its autotuning takes tens of seconds
  per dtype on first use (benchmarks/NOTES.md, Triton backward GEMM). ``MLP_FUSER_IMPL`` can still force it.
- ``MLP_FUSER_MOE_TMA=1``: let the experts' dispatcher also time ``triton_moe_sorted_tma`` (the sorted path with the
  weights read through TMA descriptors) where experts get more than 96 rows each. Off by default: faster on the GPU,
  but heavier on the host, which bounds a prefill through ``patch`` (benchmarks/NOTES.md, Mixtures of experts,
  "Large M"); ``MLP_FUSER_IMPL`` can force it.
- ``MLP_FUSER_PLANS=0``: no launch plans (``mlp_fuser.plans``): every CUDA call takes the full path (validation,
  dispatch, launch keys). For benchmarks and for ruling plans out when debugging.
- ``MLP_FUSER_SITES=0``: a patched module's call site (``ops.EagerSite``) never runs a plan it matched itself: every
  call goes through the eager entry (its checks, the plan's signature). For benchmarks and debugging.
- ``MLP_FUSER_INDUCTOR_DIRECT=0``: Inductor's generated code calls the registered op through the dispatcher, as
  for any custom op, instead of the op's Python entry (``mlp_fuser.inductor``). Applies to graphs compiled after
  it is set (graphs already compiled, or loaded from Inductor's cache, keep the call they were generated with).
- ``MLP_FUSER_PRIVATE=0``: never use torch's or Triton's private APIs (``mlp_fuser.compat``): Triton's own launch,
  no launch plans, no Inductor renaming, every call through the registered op. They are also off where the installed
  torch or Triton is outside the tested versions. Call ``mlp_fuser.compat.refresh()`` after changing
  ``private_apis`` from Python.
"""

from __future__ import annotations

import os

force_impl: str | None = os.environ.get("MLP_FUSER_IMPL") or None
triton_on_cpu: bool = os.environ.get("MLP_FUSER_TRITON_ON_CPU", "0") == "1"
autotune: bool = os.environ.get("MLP_FUSER_AUTOTUNE", "1") != "0"
triton_backward: bool = os.environ.get("MLP_FUSER_TRITON_BACKWARD", "0") == "1"
moe_tma: bool = os.environ.get("MLP_FUSER_MOE_TMA", "0") == "1"
plans: bool = os.environ.get("MLP_FUSER_PLANS", "1") != "0"
sites: bool = os.environ.get("MLP_FUSER_SITES", "1") != "0"
inductor_direct: bool = os.environ.get("MLP_FUSER_INDUCTOR_DIRECT", "1") != "0"
private_apis: bool = os.environ.get("MLP_FUSER_PRIVATE", "1") != "0"
