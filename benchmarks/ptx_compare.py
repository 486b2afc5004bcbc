"""Compile mlp_fuser's Triton kernels for sm_90 from two source trees, without a GPU, and compare the PTX.

    python benchmarks/ptx_compare.py BASE_DIR NEW_DIR

BASE_DIR and NEW_DIR are checkouts of this repository (e.g. ``git worktree add --detach /tmp/base HEAD`` made
before a change, and the working tree). For a change meant to alter no kernel (renames, comments), every line
should say "identical". Each tree is loaded in a child process (``PYTHONPATH=DIR``, TRITON_INTERPRET unset).

How: each variant below calls a public kernel function on small CPU tensors, with ``Launcher.__call__``
replaced by a recorder, so the call site's own positional arguments and constexprs are captured instead of
launched. Each recorded launch is compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90,
32))`` under the specialization Triton derives from those arguments (dtypes, 16-byte alignment, integers equal
to 1 or divisible by 16), once per autotuner config that the kernel's own prune keeps for them.

Compared: the PTX without debug info (``.loc``/``.file`` lines, ``.debug_*`` sections and inlining-scope labels:
line numbers move when only comments do). PTX names kernel parameters ``<kernel>_param_<index>``, so renamed Python
parameters need no further normalisation; a kernel renamed in Python would show as DIFFERENT. Prints one line per
(variant, kernel, config); exits 1 if any is DIFFERENT or missing.

    python benchmarks/ptx_compare.py --wgmma

The routed experts' launches at model sizes (the configs the GPU gets: Qwen3-30B-A3B at 2048 and 8192 tokens,
GPT-OSS-20B at 8192, forward and backward; float8 experts' W8A8 forward at 2048, pointer and TMA kernels), each
compiled as above and assembled by Triton's ptxas for sm_90a: a kernel whose wgmma instructions ptxas serializes
(C7515: an accumulator or register operand written by other instructions inside the pipeline) loses its overlap of
loads and tensor-core work.
Prints registers, spills and that warning per launch; exits 1 if any launch is serialized.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile

# variant -> a call of the public functions (k: mlp_fuser.kernels; randn: a bf16 CPU tensor; splitk config given;
# fp8_backward: the experts' backward on random float8 weights)
VARIANTS = {
    "act_mul flat silu*u": "k.act_mul(randn(16, 1024), randn(16, 1024), 'silu')",
    "act_mul tiled silu*u (strided)": "k.act_mul(randn(1024, 16).t(), randn(1024, 16).t(), 'silu')",
    "act_mul tiled gelu (strided)": "k.act_mul(randn(1024, 16).t(), None, 'gelu')",
    "gate_up_act SwiGLU no bias": "k.gate_up_act(randn(16, 512), randn(1024, 512), None, randn(1024, 512), None, "
                                  "'silu')",
    "gate_up_act GELU + bias": "k.gate_up_act(randn(16, 512), randn(1024, 512), randn(1024), None, None, 'gelu')",
    "small_m SwiGLU no bias": "k.fused_mlp_small_m(randn(4, 512), randn(1024, 512), None, randn(1024, 512), None, "
                              "randn(512, 1024), None, 'silu')",
    "small_m GELU + biases": "k.fused_mlp_small_m(randn(4, 512), randn(1024, 512), randn(1024), None, None, "
                             "randn(512, 1024), randn(512), 'gelu')",
    "swapab SwiGLU no bias, zeroing": "swapab.gate_up_act_swapab(randn(16, 512), randn(1024, 512), None, "
                                      "randn(1024, 512), None, 'silu', zero=torch.empty(40, dtype=torch.int32), "
                                      "config=(16, 64, 128, 4, 3))",
    "swapab GELU + bias": "swapab.gate_up_act_swapab(randn(16, 512), randn(1024, 512), randn(1024), None, None, "
                          "'gelu', config=(16, 64, 128, 4, 3))",
    "splitk SPLIT_K=1 no bias": "linear_splitk(randn(16, 2048), randn(512, 2048), None, (16, 64, 128, 1, 4, 4))",
    "splitk SPLIT_K=1 + bias": "linear_splitk(randn(16, 2048), randn(512, 2048), randn(512), (16, 64, 128, 1, 4, 4))",
    "splitk SPLIT_K=4 no bias": "linear_splitk(randn(16, 2048), randn(512, 2048), None, (16, 64, 128, 4, 4, 4))",
    "splitk SPLIT_K=4 + bias": "linear_splitk(randn(16, 2048), randn(512, 2048), randn(512), (16, 64, 128, 4, 4, 4))",
    "mlp_backward SwiGLU + h": "k.backward.mlp_backward(randn(256, 512), randn(512, 1024), randn(256, 1024), "
                               "randn(256, 1024), 'silu', True)",
    "mlp_backward gelu_tanh plain, no h": "k.backward.mlp_backward(randn(256, 512), randn(512, 1024), "
                                          "randn(256, 1024), None, 'gelu_tanh', False)",
    "act_mul_backward SwiGLU + h": "k.backward.act_mul_backward(randn(256, 512), randn(512, 1024), randn(256, 1024), "
                                   "randn(256, 1024), 'silu', True)",
    "act_mul_backward gelu plain, no h": "k.backward.act_mul_backward(randn(256, 512), randn(512, 1024), "
                                         "randn(256, 1024), None, 'gelu', False)",
    "moe sorted SwiGLU": "k.moe.moe_experts(randn(16, 512), ids(16, 2, 8), randn(16, 2), randn(8, 512, 512), None, "
                         "randn(8, 512, 256), None)",
    "moe sorted GPT-OSS biases interleaved": "k.moe.moe_experts(randn(16, 512), ids(16, 2, 8), randn(16, 2), "
                                             "randn(8, 512, 512), randn(8, 512), randn(8, 512, 256), randn(8, 512), "
                                             "k.moe.ExpertAct(alpha=1.702, limit=7.0, up_offset=1.0), True)",
    "moe pairs SwiGLU": "k.moe.moe_experts(randn(4, 512), ids(4, 2, 8), randn(4, 2), randn(8, 512, 512), None, "
                        "randn(8, 512, 256), None, path='pairs')",
    **{f"moe {path} SwiGLU": "k.moe.moe_experts(randn(1, 512), ids(1, 2, 8), randn(1, 2), randn(8, 512, 512), None, "
                              f"randn(8, 512, 256), None, path='{path}')"
       for path in ("unsorted", "unsorted_nomemset", "sorted_fused", "sorted_fused_nomemset")},
    "moe backward SwiGLU + biases": "k.moe_backward.moe_backward(randn(16, 512), ids(16, 2, 8), randn(16, 2), "
                                    "randn(8, 512, 512), randn(8, 512), randn(8, 512, 256), randn(8, 512), "
                                    "k.moe.ExpertAct(), False, randn(16, 512))",
    "moe sorted SwiGLU + biases, gate/up kept": "k.moe.moe_experts(randn(16, 512), ids(16, 2, 8), randn(16, 2), "
                                                "randn(8, 512, 512), randn(8, 512), randn(8, 512, 256), randn(8, 512), "
                                                "gu=randn(32, 512))",
    "moe backward SwiGLU + biases, gate/up read": "k.moe_backward.moe_backward(randn(16, 512), ids(16, 2, 8), "
                                                  "randn(16, 2), randn(8, 512, 512), randn(8, 512), "
                                                  "randn(8, 512, 256), randn(8, 512), k.moe.ExpertAct(), False, "
                                                  "randn(16, 512), gu=randn(32, 512))",
    "moe backward FP8 128-blocks, frozen": "fp8_backward(16, 2, 8, 512, 256, [128, 128])",
    "moe backward FP8 per channel, frozen": "fp8_backward(16, 2, 8, 512, 256, None)",
}
OPTIONS = ("num_warps", "num_stages", "num_ctas", "maxnreg")


def strip_debug(ptx: str) -> str:
    """The PTX less its debug info: the ``.debug_*`` sections, ``.loc``/``.file`` lines, and the ``$L__tmpN`` labels
    that mark inlined functions' scopes for the debugger (no branch targets them; a helper factored out of a kernel
    adds some and renumbers the rest)."""
    ptx = ptx.split("\t.section\t.debug_")[0]
    lines = [line for line in ptx.splitlines() if not re.match(r"\s*(\.(loc|file)\b|\$L__tmp\d+:$)", line)]
    return "\n".join(lines).strip()


def compile_launch(kernel, args, kwargs) -> dict[str, str]:
    """{config description: PTX} for one recorded launch."""
    import triton
    from triton._C.libtriton import native_specialize_impl
    from triton.backends.compiler import BaseBackend, GPUTarget

    target = GPUTarget("cuda", 90, 32)
    backend = triton.compiler.make_backend(target)
    jit = kernel if hasattr(kernel, "params") else kernel.fn
    if jit is kernel:
        configs = [None]
    else:  # an Autotuner: the configs it would try for these arguments
        kernel.nargs = dict(zip(kernel.arg_names, args))
        configs = kernel.prune_configs({k: v for k, v in kwargs.items() if k not in OPTIONS})
    out = {}
    for config in configs:
        values = {**kwargs, **(config.all_kwargs() if config is not None else {})}
        signature, constexprs, attrs = {}, {}, {}
        for i, p in enumerate(jit.params):
            if p.is_constexpr:
                signature[p.name], constexprs[p.name] = "constexpr", values[p.name]
                continue
            ty, attr = native_specialize_impl(BaseBackend, args[i], False, True, True)
            signature[p.name] = ty
            if ty == "constexpr":  # an integer equal to 1
                constexprs[p.name] = args[i]
            elif attr and "D" in attr:
                attrs[(i,)] = [["tt.divisibility", 16]]
        options = {k: values[k] for k in OPTIONS if k in values}
        src = triton.compiler.ASTSource(fn=jit, signature=signature, constexprs=constexprs, attrs=attrs)
        compiled = triton.compile(src, target=target, options=backend.parse_options(options).__dict__)
        desc = "" if config is None else " " + ",".join(f"{k}={v}" for k, v in config.all_kwargs().items())
        out[jit.__name__ + desc] = strip_debug(compiled.asm["ptx"])
    return out


def dump(tree: str) -> dict[str, str]:
    """{variant | kernel config: PTX} for the source tree on sys.path (run in a child process)."""
    import torch

    import mlp_fuser
    from mlp_fuser import kernels as k
    from mlp_fuser.kernels import common, swapab
    from mlp_fuser.kernels.splitk import linear_splitk

    if not os.path.realpath(mlp_fuser.__file__).startswith(os.path.realpath(tree) + os.sep):
        raise SystemExit(f"imported {mlp_fuser.__file__}, not the tree {tree}")
    launches = []
    common.Launcher.__call__ = lambda self, key, grid, *args, **kw: launches.append((self.kernel, args, kw))
    from mlp_fuser.kernels import moe, moe_backward  # noqa: F401  (reached as k.moe, k.moe_backward)

    def randn(*shape):
        return torch.randn(*shape, dtype=torch.bfloat16)

    def ids(T, topk, E):
        return torch.randint(0, E, (T, topk))

    def fp8_backward(T, topk, E, H, I, block):  # float8 experts (frozen): dx and d topk_weights
        def experts(N, K, gated):
            w = torch.randn(E, N, K).to(torch.float8_e4m3fn)
            s = torch.rand(E, -(-N // block[0]), -(-K // block[1])) if block else torch.rand(E, N)
            return k.fp8.fp8_experts(w, s, block, gated)
        gu, d = experts(2 * I, H, True), experts(H, I, False)
        k.moe_backward.moe_backward(randn(T, H), ids(T, topk, E), randn(T, topk), gu.w, None, d.w, None,
                                    k.moe.ExpertAct(), False, randn(T, H), need_weights=False, scales=(gu, d))

    env = {"k": k, "linear_splitk": linear_splitk, "swapab": swapab, "torch": torch, "randn": randn, "ids": ids,
           "fp8_backward": fp8_backward}
    out = {}
    for name, code in VARIANTS.items():
        launches.clear()
        try:
            eval(code, env)
        except TypeError as e:  # a call this tree's functions do not take (a newer variant): "only in" the other
            print(f"{tree}: {name}: {e}", file=sys.stderr)
            continue
        for kernel, args, kwargs in list(launches):
            for desc, ptx in compile_launch(kernel, args, kwargs).items():
                out[f"{name} | {desc}"] = ptx
    return out


WGMMA_CASES = {  # name -> (T, k, E, H, I, GPT-OSS's layout, biases and clamped activation, float8 weights W8A8: the
    # sorted path, or the one named)
    "Qwen3-30B-A3B T=2048": (2048, 8, 128, 2048, 768, False, False),
    "Qwen3-30B-A3B T=8192": (8192, 8, 128, 2048, 768, False, False),
    "GPT-OSS-20B T=8192": (8192, 4, 32, 2880, 2880, True, False),
    "Qwen3-30B-A3B FP8 T=2048": (2048, 8, 128, 2048, 768, False, True),
    "Qwen3-30B-A3B FP8 TMA T=2048": (2048, 8, 128, 2048, 768, False, "sorted_tma"),  # float8 weight boxes
}


def wgmma_check() -> int:
    """``--wgmma``: every launch of the experts' forward and backward at WGMMA_CASES' sizes, assembled for sm_90a."""
    import torch

    from mlp_fuser import kernels as k
    from mlp_fuser.kernels import common

    ptxas = os.path.join(os.path.dirname(__import__("triton").__file__), "backends", "nvidia", "bin", "ptxas")
    launches = []
    common.Launcher.__call__ = lambda self, key, grid, *args, **kw: launches.append((self.kernel, args, kw))
    bad, seen = 0, set()
    for case, (T, topk, E, H, I, oss, fp8) in WGMMA_CASES.items():
        def empty(*shape):  # nothing runs: the values are never read
            return torch.empty(*shape, dtype=torch.bfloat16)
        x, dy, wts = empty(T, H), empty(T, H), empty(T, topk)
        ids = torch.randint(0, E, (T, topk))
        if oss:  # (E, H, 2I) interleaved and (E, I, H), seen transposed as the op takes them
            gu, d = empty(E, H, 2 * I).transpose(1, 2), empty(E, I, H).transpose(1, 2)
            bgu, bd, act = empty(E, 2 * I), empty(E, H), k.moe.ExpertAct(alpha=1.702, limit=7.0, up_offset=1.0)
        else:
            gu, d, bgu, bd, act = empty(E, 2 * I, H), empty(E, H, I), None, None, k.moe.ExpertAct()
        launches.clear()
        if fp8:  # the forward only (frozen float8 experts train through the bf16-tile backward)
            scales = [k.fp8.fp8_experts(torch.empty(w.shape, dtype=torch.float8_e4m3fn),
                                        torch.ones(E, w.shape[1] // 128, w.shape[2] // 128), (128, 128), gated=i == 0)
                      for i, w in enumerate((gu, d))]
            path = fp8 if isinstance(fp8, str) else "sorted"
            real, k.moe.tma_why_not = k.moe.tma_why_not, lambda *a: None  # CPU tensors: as if on a Hopper GPU
            try:
                k.moe.moe_experts(x, ids, wts, scales[0].w, None, scales[1].w, None, act, False, path,
                                  scales=tuple(scales), a8=True)
            finally:
                k.moe.tma_why_not = real
        else:
            k.moe.moe_experts(x, ids, wts, gu, bgu, d, bd, act, oss)
            k.moe_backward.moe_backward(x, ids, wts, gu, bgu, d, bd, act, oss, dy)
        for kernel, args, kwargs in launches:
            for desc, ptx in compile_launch(kernel, args, kwargs).items():
                tile = ",".join(f"{n}={kwargs[n]}" for n in ("BLOCK_M", "BLOCK_N", "BLOCK_K", "num_warps", "num_stages")
                                if n in kwargs)
                with tempfile.TemporaryDirectory() as tmp:
                    path = os.path.join(tmp, "k.ptx")
                    with open(path, "w") as f:
                        f.write(ptx)
                    r = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", path, "-o", os.devnull],
                                       capture_output=True, text=True)
                if r.returncode:
                    raise SystemExit(f"ptxas failed on {desc}: {r.stderr[-500:]}")
                serialized = "wgmma.mma_async instructions are serialized" in r.stderr
                used = re.search(r"Used (\d+) registers", r.stderr)
                spill = re.search(r"(\d+) bytes spill stores", r.stderr)
                line = (f"{'SERIALIZED' if serialized else 'async':10s} {case}: {desc} {tile} | "
                        f"{used.group(1) if used else '?'} registers, {spill.group(1) if spill else '?'} bytes spilled")
                if line not in seen:
                    seen.add(line)
                    print(line)
                bad += serialized
    return 1 if bad else 0


def main() -> int:
    if sys.argv[1:] == ["--wgmma"]:
        os.environ.pop("TRITON_INTERPRET", None)
        if "triton" in sys.modules:
            raise SystemExit("--wgmma: run it in a process of its own (TRITON_INTERPRET unset before triton loads)")
        return wgmma_check()
    if len(sys.argv) == 4 and sys.argv[1] == "--dump":  # the child: python ptx_compare.py --dump TREE OUT
        with open(sys.argv[3], "w") as f:
            json.dump(dump(sys.argv[2]), f)
        return 0
    if len(sys.argv) != 3:
        print(__doc__)
        return 2
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n, tree in enumerate(sys.argv[1:]):
            env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
            env.update(PYTHONPATH=os.path.abspath(tree), TRITON_CACHE_DIR=os.path.join(tmp, f"cache{n}"))
            path = os.path.join(tmp, f"{n}.json")
            subprocess.run([sys.executable, os.path.abspath(__file__), "--dump", tree, path], env=env, check=True)
            with open(path) as f:
                results.append(json.load(f))
    base, new = results
    bad = 0
    for key in sorted(base.keys() | new.keys(), key=lambda k: (list(base) + list(new)).index(k)):
        if key not in base or key not in new:
            verdict = "only in " + ("NEW" if key not in base else "BASE")
        else:
            verdict = "identical" if base[key] == new[key] else "DIFFERENT"
        bad += verdict != "identical"
        print(f"{verdict:10s} {key}")
    print(f"{len(base.keys() | new.keys()) - bad} identical, {bad} not")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
