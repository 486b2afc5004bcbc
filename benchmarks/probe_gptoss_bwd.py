# ruff: noqa: B008, B023, E501, F821  (a probe: deleted once its finding is in NOTES)
"""GPU probe: the routed experts' backward at GPT-OSS-20B dims, stage by stage (triton.testing.do_bench).

    cd <mlp_fuser repo>; ln -sfn $PWD/patterns mlp_fuser/patterns; PYTHONPATH=$PWD python benchmarks/probe_gptoss_bwd.py

Dims: hidden 2880, 32 experts of I 2880, top 4, T = 8192 tokens (S = 32768 pairs), bf16. Configurations:
  gptoss        GPT-OSS as transformers stores it: gate_up (E, H, 2I) interleaved, down (E, I, H), both passed as
                .transpose(1, 2) views; biases; quick_gelu clamped at 7, up + 1
  gptoss_contig the same values with the weights copied to the op's logical layout ((E, 2I, H), (E, H, I))
  gptoss_nobias gptoss without the biases
  qwen          Qwen3's layout at the same dims (E, 2I, H) concatenated, no biases, silu
For each: the Triton forward (sorted), every row of the dispatcher's backward table (experts.BACKWARD_IMPLS), and
for the Triton backward its stages (routing; "act+dwts": the act kernel alone, storing no [dg du]; "+dx"/"+dW":
what dx or the weight gradients add to it, by the Triton kernels or grouped_mm). Then one call of each backward row
of ``gptoss`` under the CUDA profiler (its 12 most expensive kernels: the act kernel's time inside each row is the
one to watch), and the op end to end as a model calls it (parameters in transformers' storage, views passed, .grad
accumulated; recompute and backward "save"), with the dispatcher's own log line of its timed rows.
Options: --T 8192, --configs gptoss,qwen,..., --no-profile, --sweep-act (7 act-kernel tiles per configuration).
About 1.5 minutes on an H200 with the defaults (mostly Triton compiles).
"""

from __future__ import annotations

import argparse
import logging
import time

import torch
from triton.testing import do_bench

from mlp_fuser.dispatch import experts
from mlp_fuser.kernels import moe as kmoe
from mlp_fuser.kernels import moe_backward as kbwd
from mlp_fuser.kernels.moe_routing import moe_align
from mlp_fuser.reference import Gate

E, H, I, K_TOP = 32, 2880, 2880, 4
GPTOSS_GATE = Gate("quick_gelu", True, True, 7.0, False, 1.0)
QWEN_GATE = Gate("silu", True, False)


def inputs(name: str, T: int, dev="cuda", dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(T, H, device=dev, dtype=dtype, generator=g)
    logits = torch.randn(T, E, device=dev, generator=g)
    top, ids = logits.topk(K_TOP, dim=-1)
    wts = top.softmax(-1).to(dtype)
    if name == "qwen":
        wgu = (torch.randn(E, 2 * I, H, device=dev, generator=g) * 0.02).to(dtype)
        wd = (torch.randn(E, H, I, device=dev, generator=g) * 0.02).to(dtype)
        return (x, ids, wts, wgu, None, wd, None, QWEN_GATE)
    wgu_store = (torch.randn(E, H, 2 * I, device=dev, generator=g) * 0.02).to(dtype)  # transformers' storage
    wd_store = (torch.randn(E, I, H, device=dev, generator=g) * 0.02).to(dtype)
    bgu = (torch.randn(E, 2 * I, device=dev, generator=g) * 0.02).to(dtype)
    bd = (torch.randn(E, H, device=dev, generator=g) * 0.02).to(dtype)
    wgu, wd = wgu_store.transpose(1, 2), wd_store.transpose(1, 2)
    if name == "gptoss_contig":
        wgu, wd = wgu.contiguous(), wd.contiguous()
    if name == "gptoss_nobias":
        bgu = bd = None
    return (x, ids, wts, wgu, bgu, wd, bd, GPTOSS_GATE)


def bench(fn) -> float:
    fn()
    torch.cuda.synchronize()
    return do_bench(fn, warmup=10, rep=60)  # ms, median


def fmt(ms: float | None) -> str:
    return "      -" if ms is None else f"{ms:8.2f}"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--T", type=int, default=8192)
    ap.add_argument("--configs", default="gptoss,gptoss_contig,gptoss_nobias,qwen")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--sweep-act", action="store_true", help="the act kernel at 7 tile configs per configuration")
    a = ap.parse_args()
    T, S = a.T, a.T * K_TOP
    flop_fwd = 2 * S * H * 3 * I
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; T={T}, S={S}, E={E}, H={H}, I={I}, bf16; "
          f"forward {flop_fwd / 1e12:.2f} TFLOP, backward 2x; times in ms (do_bench median)")
    rows = [i.name for i in experts.BACKWARD_IMPLS if i.name != "reference"]
    table = {}
    for name in a.configs.split(","):
        t0 = time.time()
        args = inputs(name, T)
        x, ids, wts, wgu, bgu, wd, bd, gate = args
        dy = torch.randn(T, H, device="cuda", dtype=x.dtype)
        act = experts.expert_act(gate)
        r = {}
        r["fwd triton"] = bench(lambda: kmoe.moe_experts(x, ids, wts, wgu, bgu, wd, bd, act, gate.interleaved,
                                                         "sorted"))
        for row in rows:
            fn = experts.BACKWARD_BY_NAME[row].fn
            try:
                r[row] = bench(lambda: fn(*args, dy, (True, True, None)))
            except Exception as e:  # noqa: BLE001
                print(f"  {name} {row}: {type(e).__name__}: {str(e)[:200]}")
                r[row] = None
        bm = kmoe.default_config("gate_up", T, K_TOP, E, H, I, x.dtype, x.device)["BLOCK_M"]
        r["  routing"] = bench(lambda: moe_align(ids, E, bm))
        routing = moe_align(ids, E, bm)

        def bwd(**kw):
            return lambda: kbwd.moe_backward(x, ids, wts, wgu, bgu, wd, bd, act, gate.interleaved, dy, routing, **kw)
        r["  act+dwts"] = bench(bwd(need_dx=False, need_weights=False))
        r["  +dx triton"] = bench(bwd(need_dx=True, need_weights=False)) - r["  act+dwts"]
        r["  +dW triton"] = bench(bwd(need_dx=False, need_weights=True)) - r["  act+dwts"]
        r["  +dW grouped"] = bench(bwd(need_dx=False, need_weights=True, wgrad="grouped")) - r["  act+dwts"]
        r["  +dx grouped"] = bench(bwd(need_dx=True, need_weights=False, dgrad="grouped")) - r["  act+dwts"]
        if a.sweep_act:  # the act kernel alone (need neither dx nor weights) at other tiles: (BLOCK_N, BLOCK_K, warps, stages)
            for bn, bk, nw, ns in ((64, 64, 8, 3), (64, 64, 4, 3), (128, 64, 8, 2), (64, 128, 8, 2), (32, 64, 4, 4),
                                   (128, 32, 8, 3), (32, 128, 4, 3)):
                cfg = {"BLOCK_N": bn, "BLOCK_K": bk, "num_warps": nw, "num_stages": ns}
                try:
                    r[f"  act {bn}x{bk} w{nw} s{ns}"] = bench(bwd(need_dx=False, need_weights=False,
                                                                  configs={"act": cfg}))
                except Exception as e:  # noqa: BLE001  (out of shared memory or registers)
                    print(f"  {name} act {cfg}: {type(e).__name__}: {str(e)[:120]}")
                    r[f"  act {bn}x{bk} w{nw} s{ns}"] = None
        table[name] = r
        print(f"  {name}: {time.time() - t0:.0f} s", flush=True)
        del args, x, wgu, wd, bgu, bd, dy
        torch.cuda.empty_cache()
    names = list(table)
    keys = list(dict.fromkeys(k for r in table.values() for k in r))
    print(f"\n{'stage':34s}" + "".join(f"{n:>15s}" for n in names))
    for key in keys:
        print(f"{key:34s}" + "".join(f"{fmt(table[n].get(key)):>15s}" for n in names))
    ideal = 2 * flop_fwd / 650e12 * 1e3
    print(f"(backward at 650 TFLOP/s: {ideal:.2f} ms; act+dwts and dx: ~1/3 each of it, dW ~1/3 + "
          f"{(E * 3 * H * I * 2) / 3e12 * 1e3:.2f} ms of store)")

    if "gptoss" not in names:
        return
    args = inputs("gptoss", T)
    dy = torch.randn(T, H, device="cuda", dtype=args[0].dtype)
    if not a.no_profile:
        for row in rows:
            fn = experts.BACKWARD_BY_NAME[row].fn
            try:
                fn(*args, dy, (True, True, None))
            except Exception:  # noqa: BLE001
                continue
            profiled(f"gptoss {row}", lambda: fn(*args, dy, (True, True, None)))

    # the op end to end as a model calls it: parameters in transformers' storage, views passed, grads accumulated
    x, ids, wts, wgu, bgu, wd, bd, gate = args
    P = [torch.nn.Parameter(t) for t in (wgu.transpose(1, 2), bgu, wd.transpose(1, 2), bd)]
    xr = x.clone().requires_grad_()
    from mlp_fuser.ops.moe import moe_mlp
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    for save in (False, True):
        def step():
            y = moe_mlp(xr, ids, wts, P[0].transpose(1, 2), P[1], P[2].transpose(1, 2), P[3], gate.activation,
                        gate.interleaved, gate.limit, gate.clamp_after, gate.up_offset, save_preact=save)
            y.backward(dy)
        step()  # the dispatcher times its rows here (its log line above)
        for t in [xr, *P]:
            t.grad = None
        ms = do_bench(step, warmup=10, rep=100, grad_to_none=[xr, *P])
        print(f"\nop forward+backward ({'save' if save else 'recompute'}): {ms:.2f} ms; grads' strides "
              f"{[tuple(t.grad.stride()) for t in P[::2]]} params' {[tuple(t.stride()) for t in P[::2]]}")
        if not a.no_profile:
            for t in [xr, *P]:
                t.grad = None
            profiled(f"op fwd+bwd {'save' if save else 'recompute'}", step)


def profiled(title, fn):
    from torch.profiler import ProfilerActivity, profile
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    evs = [e for e in prof.key_averages() if e.device_time_total > 0]
    evs.sort(key=lambda e: -e.device_time_total)
    total = sum(e.device_time_total for e in evs) / 1e3
    print(f"\n{title}: kernels {total:.2f} ms")
    for e in evs[:12]:
        print(f"  {e.device_time_total / 1e3:8.3f} ms x{e.count:<3d} {e.key[:110]}")


if __name__ == "__main__":
    main()
