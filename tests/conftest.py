"""Shared test setup.

Without CUDA, the Triton kernels are tested through the Triton interpreter: TRITON_INTERPRET must be set
before any kernel is defined, so it is set here, before mlp_fuser is imported anywhere.
"""

import contextlib
import os

import torch

HAS_CUDA = torch.cuda.is_available()
if not HAS_CUDA:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

# Triton's interpreter runs kernels on CPU tensors; on a GPU machine the kernels run on CUDA.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter mishandles bf16 (tl.dot returns garbage); bf16 is tested on the GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])

requires_cuda = pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the GPU suite runs on the H200)")


@contextlib.contextmanager
def poisoned_empty():
    """torch.empty fills floating tensors with NaN inside this block (deterministic mode's fill), so a kernel that
    leaves part of its output unwritten fails the comparison."""
    old = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(old[0], warn_only=old[1])


@pytest.fixture(autouse=True)
def _seed_and_precision():
    torch.manual_seed(0)
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
