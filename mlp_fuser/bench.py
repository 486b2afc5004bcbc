"""The GPU benchmark's entry point: ``python -m mlp_fuser bench [args]`` calls ``main(argv)``.

Placeholder until the benchmark harness lands here (see benchmarks/bench_mlp.py). It needs a CUDA GPU:
the Triton kernels are what it measures.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence


def main(argv: Sequence[str] | None = None) -> int:
    import torch

    if not torch.cuda.is_available():
        print(
            "mlp_fuser bench: no CUDA GPU found. The benchmark times the Triton kernels, which run on CUDA;\n"
            "run it on a machine with an NVIDIA GPU. (On this machine, `python -m mlp_fuser demo` shows the\n"
            "fusion on a real model with the CPU reference path.)",
            file=sys.stderr,
        )
        return 2
    raise NotImplementedError("mlp_fuser bench: the GPU benchmark harness is not written yet")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main(sys.argv[1:]))
