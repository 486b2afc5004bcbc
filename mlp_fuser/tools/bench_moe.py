"""The routed-experts benchmark: ``mlp_fuser::moe_mlp`` against transformers' own experts implementations.

    python -m mlp_fuser bench --moe [--budget-s 540] [--out DIR] [--sizes qwen3,mixtral] [--ms 1,8,32,128,512,2048,8192]
    python -m mlp_fuser bench --moe --sizes gptoss    # GPT-OSS-20B's experts: ours through the experts switch
    python -m mlp_fuser bench --moe --tiny --device cpu      # checks the script itself, times nothing real

For each experts size and token count M, on one transformers experts module (``Qwen3MoeExperts`` /
``MixtralExperts``) holding random bf16 weights, with random top-k routing (softmax of random logits, the top k
renormalised, as the routers make it), it times
  ours        ``mlp_fuser.moe_mlp`` on the module's weights (the dispatcher picks the implementation; its name is shown)
  grouped_mm  transformers' default (``config._experts_implementation = "grouped_mm"``)
  batched_mm  what ``generate`` swaps in while decoding (a weight copy gathered per token-expert pair: skipped where
              those copies would not fit)
  eager       the module's own loop over the experts it hits (plain calls only: its ``nonzero`` reads the routing on
              the host, which a CUDA graph cannot capture; skipped at large M, where it only repeats grouped_mm's GEMMs)
as CUDA-graph medians (``triton.testing.do_bench_cudagraph``) and plain-call medians (``do_bench``), each call
rotating over ``N_SETS`` input sets (x and routing). The floor is max(bytes of the distinct experts the routing
touches + x + y at ``TBPS``, FLOPs at ``TFLOPS``). Every output is checked against a float64 loop over the experts
(rel. error ‖y − ref‖/‖ref‖); ours must be within 1.25x grouped_mm's. ``--budget-s``: no row starts that would end
past it; what is skipped is listed. The markdown table goes to stdout and to OUT/moe.md, the rows to OUT/moe.json,
rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone

import torch

from ..dispatch import experts
from ..ops import moe

# (label, family, H, I, E, k)
SIZES = {
    "qwen3": ("Qwen3-30B-A3B", "qwen3_moe", 2048, 768, 128, 8),
    "mixtral": ("Mixtral-8x7B", "mixtral", 4096, 14336, 8, 2),
    # transposed, interleaved gate/up with biases and the clamped quick-GELU gate; not in the default sizes
    "gptoss": ("GPT-OSS-20B", "gpt_oss", 2880, 2880, 32, 4),
}
DEFAULT_SIZES = ("qwen3", "mixtral")
TINY_SIZES = {"tiny": ("tiny", "qwen3_moe", 64, 32, 8, 2)}
MS = [1, 8, 32, 128, 512, 2048, 8192]
TINY_MS = [1, 5, 17]
PEERS = ["grouped_mm", "batched_mm", "eager"]
TBPS, TFLOPS = 4.3, 790.0  # H200: HBM bandwidth and dense bf16 peak, the floor's ceilings
N_SETS = 3
CHECK_FACTOR = 1.25
BATCHED_MAX_BYTES = 40e9  # batched_mm gathers (T·k) copies of the experts' weights: past this it would not fit
EAGER_MAX_M = 2048


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build_experts(family: str, H: int, I: int, E: int, k: int, dtype, device):
    """A transformers experts module of ``family`` with random weights (built on meta, filled in place)."""
    if family == "mixtral":
        from transformers import MixtralConfig
        from transformers.models.mixtral.modeling_mixtral import MixtralExperts as cls

        cfg = MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    elif family == "gpt_oss":
        from transformers import GptOssConfig
        from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts as cls

        cfg = GptOssConfig(hidden_size=H, intermediate_size=I, num_local_experts=E, num_experts_per_tok=k)
    else:
        from transformers import Qwen3MoeConfig
        from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts as cls

        cfg = Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=E, num_experts_per_tok=k)
    with torch.device("meta"):
        mod = cls(cfg).to(dtype)
    mod = mod.to_empty(device=device).requires_grad_(False)
    g = torch.Generator(device=device).manual_seed(0)
    mod.gate_up_proj.normal_(0.0, H**-0.5, generator=g)
    mod.down_proj.normal_(0.0, I**-0.5, generator=g)
    for name in ("gate_up_proj_bias", "down_proj_bias"):
        if getattr(mod, name, None) is not None:
            getattr(mod, name).normal_(0.0, 0.1, generator=g)
    return mod


def is_generic(mod) -> bool:
    """Whether the module is one of the families the silu-only pieces below do not describe (GPT-OSS): then ours runs
    through transformers' experts switch and the reference is the module's own loop in float64."""
    return getattr(mod, "gate_up_proj_bias", None) is not None


def module_reference64(mod, x, ids, wts):
    """The module's own loop over its experts ("eager"), on a float64 copy of it."""
    import copy

    m64 = copy.deepcopy(mod).double()
    m64.config._experts_implementation = "eager"
    with torch.no_grad():
        return m64(x.double(), ids, wts.double())


def routing(M: int, E: int, k: int, dtype, device, g):
    """(topk_ids, topk_weights) as a router makes them: softmax of random logits, the top k renormalised."""
    probs = torch.softmax(torch.randn(M, E, device=device, generator=g), dim=-1)
    wts, ids = probs.topk(k, dim=-1)
    return ids, (wts / wts.sum(-1, keepdim=True)).to(dtype)


def reference64(x, ids, wts, wgu, wd):
    """The experts' output in float64: a loop over the experts the routing hits (silu · up, then down)."""
    x64, out = x.double(), torch.zeros(x.shape, dtype=torch.float64, device=x.device)
    for e in ids.unique().tolist():
        tok, slot = (ids == e).nonzero(as_tuple=True)
        g, u = (x64[tok] @ wgu[e].double().T).chunk(2, dim=-1)
        h = torch.nn.functional.silu(g) * u
        out.index_add_(0, tok, (h @ wd[e].double().T) * wts[tok, slot].double().unsqueeze(-1))
    return out


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def variants(mod):
    """{name: fn(x, ids, wts)}: ours, then transformers' implementations (``config._experts_implementation``)."""
    def ours(x, ids, wts):
        if is_generic(mod):  # the experts switch: the module's layout, biases and gate as patch reads them
            from ..patch import experts as patch_experts

            mod.config._experts_implementation = patch_experts.NAME
            return mod(x, ids, wts)
        return moe.moe_mlp(x, ids, wts, mod.gate_up_proj, None, mod.down_proj, None, "silu")

    def peer(name):
        def run(x, ids, wts):
            mod.config._experts_implementation = name
            return mod(x, ids, wts)
        return run

    return {"ours": ours, **{p: peer(p) for p in PEERS}}


def skip_reason(name: str, M: int, H: int, I: int, k: int, esize: int, device: str) -> str | None:
    if name == "batched_mm" and M * k * 3 * H * I * esize > BATCHED_MAX_BYTES:
        return f"skipped: {M * k * 3 * H * I * esize / 1e9:.0f} GB of gathered weights"
    if name == "eager" and M > EAGER_MAX_M and device == "cuda":
        return f"skipped: M > {EAGER_MAX_M}"
    return None


def time_us(fn, sets, device, graph: bool) -> float:
    """Median µs of one call, each timed call rotating over the input sets."""
    def work():
        for s in sets:
            fn(*s)

    if device != "cuda":  # checks the script: one warm-up, one timed pass
        work()
        t0 = time.perf_counter()
        work()
        return (time.perf_counter() - t0) / len(sets) * 1e6
    from triton.testing import do_bench, do_bench_cudagraph

    if graph:
        return do_bench_cudagraph(work, rep=100, return_mode="median") * 1e3 / len(sets)
    return do_bench(work, warmup=25, rep=100, return_mode="median") * 1e3 / len(sets)


def floor_us(M, H, I, k, esize, sets) -> tuple[float, str]:
    touched = sum(s[1].unique().numel() for s in sets) / len(sets)  # distinct experts per call, over the sets
    t_bytes = (touched * 3 * H * I + 2 * M * H) * esize / (TBPS * 1e12)
    t_flops = 2 * M * k * 3 * H * I / (TFLOPS * 1e12)
    return max(t_bytes, t_flops) * 1e6, "compute" if t_flops > t_bytes else "mem"


def bench_row(label, mod, M, H, I, E, k, dtype, device) -> dict:
    g = torch.Generator(device=device).manual_seed(1000 + M)
    sets = [(torch.randn(M, H, device=device, generator=g).to(dtype), *routing(M, E, k, dtype, device, g))
            for _ in range(N_SETS)]
    esize = torch.finfo(dtype).bits // 8
    floor, bound = floor_us(M, H, I, k, esize, sets)
    ref = (module_reference64(mod, *sets[0]) if is_generic(mod)
           else reference64(sets[0][0], sets[0][1], sets[0][2], mod.gate_up_proj, mod.down_proj))
    row = dict(experts=label, M=M, floor_us=floor, bound=bound, errors={}, graph_us={}, plain_us={}, skipped={})
    for name, fn in variants(mod).items():
        why = skip_reason(name, M, H, I, k, esize, device)
        if why is not None:
            row["skipped"][name] = why
            continue
        try:
            row["errors"][name] = rel_err(fn(*sets[0]), ref)  # also the dispatcher's choice, before any capture
            row["plain_us"][name] = time_us(fn, sets, device, graph=False)
            if device == "cuda" and name != "eager":
                row["graph_us"][name] = time_us(fn, sets, device, graph=True)
        except Exception as e:  # out of memory, or a capture that failed: the row says so, the others still run
            row["skipped"][name] = f"failed: {type(e).__name__}"
            log(f"[bench --moe] {label} M={M} {name}: {type(e).__name__}: {str(e)[:300]}")
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    gate = (moe.Gate("quick_gelu", interleaved=True, limit=mod.limit, up_offset=1.0) if is_generic(mod)
            else moe.Gate("silu"))
    p = experts.Problem(device, dtype, M, k, E, H, I, gate, is_generic(mod))
    row["impl"] = experts.chosen(p) or "?"
    return finish(row)


def finish(row: dict) -> dict:
    """The row's speed-ups, % of floor and check, from its times and errors."""
    times = row["graph_us"] if "ours" in row["graph_us"] else row["plain_us"]
    ours = times.get("ours", float("nan"))
    peers = {n: t for n, t in times.items() if n != "ours"}
    row["best_peer"] = min(peers, key=peers.get) if peers else None
    row["speedup"] = peers[row["best_peer"]] / ours if peers else float("nan")
    row["vs_grouped_mm"] = times["grouped_mm"] / ours if "grouped_mm" in times else float("nan")
    row["pct_floor"] = 100 * row["floor_us"] / ours
    e = row["errors"]
    row["err_ratio"] = e.get("ours", float("nan")) / e["grouped_mm"] if e.get("grouped_mm") else float("nan")
    row["check_ok"] = "ours" in e and (not e.get("grouped_mm") or row["err_ratio"] <= CHECK_FACTOR)
    return row


def _us(d: dict, skipped: dict, name: str) -> str:
    if name in d:
        return f"{d[name]:.1f}"
    return skipped.get(name, "–")


HEADER = ("| experts | M | floor µs | ours µs | impl | grouped_mm µs | batched_mm µs | ours plain µs | "
          "grouped_mm plain µs | batched_mm plain µs | eager plain µs | speed-up vs best peer | % of floor | "
          "rel. err ours / grouped_mm |\n" + "|---" * 14 + "|")


def format_row(r: dict) -> str:
    g, p, s, e = r["graph_us"], r["plain_us"], r["skipped"], r["errors"]
    gm = f"{e['grouped_mm']:.1e}" if "grouped_mm" in e else "–"
    mine = f"{e['ours']:.1e}" if "ours" in e else "–"
    check = f"{'ok' if r['check_ok'] else 'WRONG'} {mine} / {gm} ({r['err_ratio']:.2f})"
    return (f"| {r['experts']} | {r['M']} | {r['floor_us']:.1f} {r['bound']} | {_us(g, s, 'ours')} | {r['impl']} | "
            f"{_us(g, s, 'grouped_mm')} | {_us(g, s, 'batched_mm')} | {_us(p, s, 'ours')} | "
            f"{_us(p, s, 'grouped_mm')} | {_us(p, s, 'batched_mm')} | {_us(p, s, 'eager')} | "
            f"{r['speedup']:.2f}x {r['best_peer']} | {r['pct_floor']:.1f}% | {check} |")


def write(out: str, meta: dict, rows: list[dict]) -> list[str]:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "moe.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    md = [f"{meta['date']} · {meta['device']} · torch {meta['torch']} · `{meta['command']}` · {meta['seconds']:.0f} s"
          f" · floor at {TBPS} TB/s and {TFLOPS:.0f} TFLOP/s · µs: CUDA-graph medians unless 'plain'", "", HEADER]
    md += [format_row(r) for r in rows]
    if meta["skipped"]:
        md += ["", f"Not run (--budget-s {meta['budget_s']:.0f}): " + "; ".join(meta["skipped"])]
    with open(os.path.join(out, "moe.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def main(argv=None) -> int:
    t0 = time.time()
    ap = argparse.ArgumentParser(prog="python -m mlp_fuser bench --moe", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for moe.md / moe.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no row that would end past this many seconds")
    ap.add_argument("--sizes", default=",".join(DEFAULT_SIZES), help=f"experts sizes, of {sorted(SIZES)}")
    ap.add_argument("--ms", default="", help=f"token counts (default {MS})")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny experts in fp32 (runs on the CPU): checks the script")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mlp_fuser bench --moe: no CUDA GPU found (--tiny --device cpu checks the script)", file=sys.stderr)
        return 2
    if args.device != "cuda" and not args.tiny:
        print("mlp_fuser bench --moe: off CUDA only --tiny runs", file=sys.stderr)
        return 2
    sizes = TINY_SIZES if args.tiny else {n: SIZES[n] for n in args.sizes.split(",") if n}
    ms = [int(m) for m in args.ms.split(",") if m] or (TINY_MS if args.tiny else MS)
    dtype = torch.float32 if args.tiny else torch.bfloat16
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
                device=torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
                command=("python -m mlp_fuser bench --moe " + " ".join(argv)).strip(), budget_s=args.budget_s,
                skipped=[])
    rows: list[dict] = []
    last = 0.0  # seconds of the last row: the next one's estimate
    log(HEADER)
    for label, family, H, I, E, k in sizes.values():
        mod = None
        for M in ms:
            if time.time() - t0 + max(last, 5.0) > args.budget_s:
                meta["skipped"].append(f"{label} M={M}")
                log(f"[bench --moe] {label} M={M}: not started (budget)")
                continue
            t_row = time.time()
            if mod is None:
                mod = build_experts(family, H, I, E, k, dtype, args.device)
            rows.append(bench_row(label, mod, M, H, I, E, k, dtype, args.device))
            last = time.time() - t_row
            log(format_row(rows[-1]) + f"  ({last:.0f} s)")
            write(args.out, dict(meta, seconds=time.time() - t0), rows)
        del mod
        if args.device == "cuda":
            torch.cuda.empty_cache()
    print("\n".join(write(args.out, dict(meta, seconds=time.time() - t0), rows)))
    return 0 if rows and all(r["check_ok"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
