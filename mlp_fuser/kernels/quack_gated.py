"""Gate and up as one warp-specialised Hopper GEMM with act·mul in its epilogue, from quack (CuTe DSL), where it is
installed: an optional dispatch candidate, not a dependency.

    h = act(x @ w_gateᵀ) * (x @ w_upᵀ)      one kernel over [w_gate; w_up], the weights stored as one (2I, K) buffer

Why: at prefill sizes on the 7-8B shapes quack's gated GEMM beat cuBLAS's two GEMMs plus our act·mul kernel, and lost
at M <= 64 (benchmarks/NOTES.md, quack gated GEMM). The best of its tile configs changes from shape to shape, so each of
``CONFIGS`` is its own dispatch candidate and the dispatcher's timing picks per shape bucket.

What it needs, each declared as the candidate's constraint (``dispatch``): ``quack-kernels`` and the CuTe DSL
importable (``pip install quack-kernels``), an sm90 GPU (the configs are Hopper's), bf16 or fp16, a gated MLP without
biases whose gate and up weights are stored as one (``common.stored_as_one``: Phi-3's ``gate_up_proj``, or any model
after ``mlp_fuser.merge_gate_up``), an activation quack's epilogue computes as ours does (``ACTIVATIONS``), and TMA's
16-byte alignment of rows (K and I multiples of 8). ``config.quack = False`` (``MLP_FUSER_QUACK=0``) turns it off.
"""

from __future__ import annotations

import functools

import torch

from .. import config
from ..activations import ALIASES

# our activation -> quack's gated activation with the same function: silu(g) * u, relu(g) * u, gelu_tanh(g) * u
ACTIVATIONS = {"silu": "swiglu", "relu": "reglu", "gelu_tanh": "geglu"}

# Tile M x N, cluster M x N, schedule: each the best of some swept row (benchmarks/NOTES.md, quack gated GEMM)
CONFIGS = {
    "128x128": (128, 128, 1, 2, True),   # M = 2048 on both 7-8B shapes, M = 512 at 4096x14336, 8192x3584 M = 256
    "128x96": (128, 96, 1, 2, True),     # 3584x18944 and 8192x3584 at M = 128, 4096x11008 at M = 512
    "128x192": (128, 192, 1, 1, True),   # 3584x18944 M = 256, close at 4096x11008 M = 128-256
    "128x224c": (128, 224, 1, 2, False),  # cooperative: 4096x11008 and 4096x14336 at M = 128, 4096x14336 at M = 256
}


@functools.cache
def _quack():
    """(gemm_act, GemmConfig) from quack, or the reason it cannot be used here."""
    try:
        from quack.gemm_config import GemmConfig
        from quack.gemm_interface import gemm_act
    except Exception as e:  # not installed, or the CuTe DSL's libraries missing or broken
        return f"quack is not importable ({type(e).__name__}: {e})"
    return gemm_act, GemmConfig


@functools.cache
def _config(name: str):
    tile_m, tile_n, cluster_m, cluster_n, pingpong = CONFIGS[name]
    return _quack()[1](tile_m=tile_m, tile_n=tile_n, cluster_m=cluster_m, cluster_n=cluster_n, pingpong=pingpong,
                       is_dynamic_persistent=False, device_capacity=9)


def why_not(activation: str | None, K: int, I: int) -> str | None:
    """None where quack's gated GEMM can run this MLP on the current CUDA device, else why not."""
    if not config.quack:
        return "MLP_FUSER_QUACK=0"
    if ALIASES.get(activation, activation) not in ACTIVATIONS:
        return f"activation {activation!r} has no quack epilogue"
    if K % 8 or I % 8:
        return f"K={K} and I={I} must be multiples of 8 (TMA's 16-byte rows)"
    quack = _quack()
    if isinstance(quack, str):
        return quack
    if torch.cuda.get_device_capability()[0] != 9:
        return "not an sm90 GPU (its configs are Hopper's)"
    return None


def gated_act(x2: torch.Tensor, w_gate_up: torch.Tensor, activation: str, config: str) -> torch.Tensor:
    """h = act(x2 @ w_gateᵀ) * (x2 @ w_upᵀ), (M, I) in x2's dtype; ``w_gate_up``: the (2I, K) view [w_gate; w_up]."""
    gemm_act = _quack()[0]
    if w_gate_up.stride(1) != 1 or w_gate_up.stride(0) % 8 or w_gate_up.data_ptr() % 16:
        raise ValueError(f"mlp_fuser: quack's gated GEMM needs row-major weights with 16-byte aligned rows, got "
                         f"strides {w_gate_up.stride()} at offset {w_gate_up.data_ptr() % 16} (mod 16)")
    if x2.stride(1) != 1 or x2.stride(0) % 8 or x2.data_ptr() % 16:  # TMA's alignment: a copy that has it
        x2 = x2.clone(memory_format=torch.contiguous_format)
    act = ACTIVATIONS[ALIASES.get(activation, activation)]
    return gemm_act(x2, w_gate_up.t(), activation=act, store_preact=False, tuned=False, concat_layout=("B",),
                    config=_config(config))[1]
