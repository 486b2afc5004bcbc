"""The experts' kernels as Hopper gets them, checked without a GPU: each launch at model sizes (the configs the GPU
uses) compiled for sm_90a and assembled by Triton's ptxas (``benchmarks/ptx_compare.py --wgmma``). A kernel whose
wgmma instructions ptxas serializes keeps its tensor cores idle while it loads; no timing on the CPU would show it."""

import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_no_experts_kernel_serializes_its_wgmma(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(PYTHONPATH=ROOT, TRITON_CACHE_DIR=str(tmp_path))
    r = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "ptx_compare.py"), "--wgmma"], env=env,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout + r.stderr[-2000:]
    lines = r.stdout.splitlines()
    kernels = {line.split(": ")[1].split()[0] for line in lines}
    assert {"_moe_gate_up_kernel", "_moe_down_kernel", "_moe_bwd_act_kernel", "_moe_wgrad_kernel"} <= kernels, lines
