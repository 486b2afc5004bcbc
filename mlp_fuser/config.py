"""Run-time settings, read from the environment once and changeable from Python.

- ``MLP_FUSER_IMPL``: force one implementation by name (see ``mlp_fuser.dispatch.IMPLS``), for tests
  and benchmarks. Unset: the dispatcher chooses.
- ``MLP_FUSER_TRITON_ON_CPU=1``: let the Triton implementations take CPU tensors; only meaningful with
  ``TRITON_INTERPRET=1`` (the Triton interpreter), which is how the kernels are tested without a GPU.
- ``MLP_FUSER_AUTOTUNE=0``: on CUDA, take the first eligible implementation in priority order instead of
  timing the eligible ones once per shape bucket.
- ``MLP_FUSER_TRITON_BACKWARD=1``: let the dispatcher choose the Triton backward implementations
  (``dispatch.BACKWARD_IMPLS``). Off by default until they are measured on a GPU: they are tested through the
  Triton interpreter only, and the backward runs the aten reference meanwhile. ``MLP_FUSER_IMPL`` can still
  force one.
"""

from __future__ import annotations

import os

force_impl: str | None = os.environ.get("MLP_FUSER_IMPL") or None
triton_on_cpu: bool = os.environ.get("MLP_FUSER_TRITON_ON_CPU", "0") == "1"
autotune: bool = os.environ.get("MLP_FUSER_AUTOTUNE", "1") != "0"
triton_backward: bool = os.environ.get("MLP_FUSER_TRITON_BACKWARD", "0") == "1"
