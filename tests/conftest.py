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

with contextlib.suppress(ImportError):  # its first import warns on stderr once: here, not inside a test that reads it
    import torchao.prototype.mx_formats  # noqa: F401
    import torchao.quantization  # noqa: F401

# Triton's interpreter runs kernels on CPU tensors; on a GPU machine the kernels run on CUDA.
KERNEL_DEVICE = "cuda" if HAS_CUDA else "cpu"
# The interpreter mishandles bf16 (tl.dot returns garbage); bf16 is tested on the GPU only.
KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if HAS_CUDA else [])

# The GPU suite, `pytest -m gpu`: every test that needs CUDA (these marks), and the kernels' bf16 cases (below).
CUDA_ONLY = [pytest.mark.gpu, pytest.mark.skipif(not HAS_CUDA, reason="needs CUDA (the GPU suite runs on the H200)")]


def requires_cuda(test):
    """A test (or class) that needs CUDA: in the GPU suite, skipped elsewhere."""
    for mark in CUDA_ONLY:
        test = mark(test)
    return test


def pytest_collection_modifyitems(items):
    if HAS_CUDA:  # bf16 cases exist on CUDA only (KERNEL_DTYPES): the interpreter cannot test them
        for item in items:
            spec = getattr(item, "callspec", None)
            if spec is not None and any(v is torch.bfloat16 for v in spec.params.values()):
                item.add_marker(pytest.mark.gpu)


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


@pytest.fixture
def exact_fp8_casts(monkeypatch):
    """The interpreter rounds fp32/fp16 -> float8_e4m3fn without carrying into the exponent (7.9 -> 4): casts to it
    go through torch's (round to nearest even, as the GPU's cvt), so in-kernel quantization is testable."""
    if os.environ.get("TRITON_INTERPRET") != "1":
        return
    import numpy as np
    from triton import language as tl
    from triton.runtime import interpreter as I

    real = I.InterpreterBuilder.create_fp_to_fp

    def create_fp_to_fp(self, src, dst_type, rounding_mode):
        if dst_type.scalar == tl.float8e4nv and src.dtype.scalar in (tl.float32, tl.float16):
            q = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
            return I.TensorHandle(q, dst_type.scalar)
        return real(self, src, dst_type, rounding_mode)
    monkeypatch.setattr(I.InterpreterBuilder, "create_fp_to_fp", create_fp_to_fp)


@pytest.fixture(autouse=True)
def _seed_and_precision():
    torch.manual_seed(0)
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old
