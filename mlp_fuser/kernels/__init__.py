"""Triton kernels of the fused MLP (design, byte counts and predictions: benchmarks/NOTES.md).

- ``act_mul(g, u, activation)``: h = act(g) * u elementwise, one launch (the cuBLAS path's glue).
- ``gate_up_act(x2, w_gate, b_gate, w_up, b_up, activation)``: gate and up in one autotuned GEMM, act·mul in
  its epilogue; h (M, I) in x's dtype.
- ``fused_mlp_small_m(x2, w_gate, b_gate, w_up, b_up, w_down, b_down, activation)``: the whole MLP for small M,
  split over I, each weight byte read once, fp32 atomic reduction of the partial outputs; y (M, O).

Weights are (out, in) tensors with any strides; ``w_up=None`` means a plain (ungated) MLP; biases are optional.
"""

from .act_mul import act_mul
from .gemm import gate_up_act
from .small_m import fused_mlp_small_m

__all__ = ["act_mul", "gate_up_act", "fused_mlp_small_m"]
