"""Run 22: the pooled GPU training-step test must be able to fail. Each mutant perturbs one gradient of the op's
backward (the weights' by 3%, scaled; the input's by 3% noise) and runs the test for patch-save; it must raise."""
import sys

import torch

sys.path.insert(0, "tests")
import test_gpu  # noqa: E402

from mlp_fuser import ops  # noqa: E402

real = ops._backward_core


def scaled_w_down(*a, **k):
    g = list(real(*a, **k))
    if g[5] is not None:
        g[5] = g[5] * 1.03
    return tuple(g)


def noisy_dx(*a, **k):
    g = list(real(*a, **k))
    if g[0] is not None:
        g[0] = g[0] + 0.03 * g[0].norm() / g[0].numel() ** 0.5 * torch.randn_like(g[0])
    return tuple(g)


for name, mutant in (("d(w_down) x 1.03", scaled_w_down), ("dx + 3% noise", noisy_dx)):
    ops._backward_core = mutant
    try:
        test_gpu.test_gpu_training_step_bf16_autocast_matches_unfused("patch-save")
        print(f"mutant {name}: SURVIVED (the test passed)")
    except AssertionError as e:
        print(f"mutant {name}: killed ({str(e)[:160]})")
    finally:
        ops._backward_core = real
