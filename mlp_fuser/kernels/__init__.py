"""Triton kernels. Filled in by kernels/*.py."""
