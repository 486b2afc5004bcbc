"""Triton kernels of the fused MLP (design and byte counts of each: benchmarks/NOTES.md).

- ``act_mul`` (act_mul.py): ``act_mul(g, u, activation)``, h = act(g) * u elementwise in one launch (the cuBLAS
  path's glue): a flat kernel for contiguous g and u, a tiled one for any strides.
- ``gate_up_act`` (gemm.py): ``gate_up_act(x2, w_gate, b_gate, w_up, b_up, activation)``, gate and up in one
  autotuned GEMM with act·mul in its epilogue; h (M, I) in x's dtype. ``gate_up_tile``, the tile it computes, is
  shared with the small-M kernel.
- ``fused_mlp_small_m`` (small_m.py): ``fused_mlp_small_m(x2, w_gate, b_gate, w_up, b_up, w_down, b_down,
  activation)``, the whole MLP for small M, split over I, each weight byte read once, fp32 atomic reduction of
  the partial outputs, then a finish kernel (b_down, cast; none for fp32 without b_down); y (M, O).
- ``splitk.linear_splitk(h, w, b)``: y = h @ wᵀ + b, a split-K GEMM streaming w once (the down projection at
  small M), reduced in a fixed order by the last program of each tile; ``splitk_config`` picks its blocks.
- ``swapab.gate_up_act_swapab(x2, w_gate, b_gate, w_up, b_up, activation, zero=None)``: gate_up_act's contract for
  a few tokens, the weight rows in the dot's M side (wgmma at M = 16), all of K per program; with linear_splitk it
  is the dispatcher's ``triton_swapab``.
- ``quack_gated.gated_act(x2, w_gate_up, activation, config)``: not Triton: quack's sm90 gated GEMM (CuTe DSL) over
  gate and up stored as one (2I, K) weight, act·mul in its epilogue, where ``quack-kernels`` is installed (an optional
  dependency); ``quack_gated.why_not`` says where it cannot run. The dispatcher's ``quack_gated_*`` candidates.
- ``common``: what they share: ``Launcher`` (launches a compiled kernel directly once its specialization is
  known), ``m_bucket``, ``cdiv``, ``next_power_of_2``, ``dot_precision``, ``k_loop_fits``, ``aligned``,
  ``num_sms``, ``smem_per_sm``, ``stand_ins`` (the absent operands' pointer arguments) and ``INTERPRET``.

Weights are (out, in) tensors with any strides; ``w_up=None`` means a plain (ungated) MLP; biases are optional.
The package exports the first three; ``splitk``, ``swapab``, ``quack_gated`` and ``common`` are imported as
modules.
"""

from .act_mul import act_mul
from .gemm import gate_up_act
from .small_m import fused_mlp_small_m

__all__ = ["act_mul", "gate_up_act", "fused_mlp_small_m"]
