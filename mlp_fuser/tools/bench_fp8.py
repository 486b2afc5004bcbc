"""The FP8 benchmark: the mlp_fuser ops on FP8 weights against our bf16 op and torch's unfused FP8 GEMMs.

    python -m mlp_fuser bench --fp8 [--cases llama8b,qwen3,mixtral] [--ms 1,16,...] [--budget-s 540] [--out DIR]
    python -m mlp_fuser bench --fp8 --tiny --device cpu      # checks the script itself, times nothing real

Random weights quantized to float8_e4m3fn in 128 x 128 blocks with fp32 scales (as Qwen3 / DeepSeek FP8 checkpoints
store them; gate and up of experts apart, as transformers' FP8Experts does); the bf16 variants run the same weights
dequantized. One ``CASES`` entry per shape, of a ``KINDS`` kind:
  dense (a gated MLP, silu), at each M:
    bf16_op       mlp_fuser::gated_mlp on the dequantized weights
    fp8_op        mlp_fuser::quant_gated_mlp (the implementation it picks for M is named)
    w8a16, w8a8   the FP8 kernels in each mode, whatever the op would pick
    scaled_mm     the unfused FP8 MLP on torch's scaled GEMM: x quantized, gate, up, silu · up, h quantized, down;
                  blockwise (x 1 x 128, weights 128 x 128) where this torch and GPU take it, else rowwise (weights
                  requantized per row): the header says which ran and why not the finer one
    transformers  three transformers FP8Linear layers, where transformers' FP8 kernel loads (never offline)
  experts (routed, silu, random top-k routing as a router makes it):
    bf16_op       mlp_fuser::moe_mlp on the dequantized weights
    fp8_op        mlp_fuser::quant_moe_mlp (the row its table chose is named: eager, and for CUDA graphs where
                  that differs)
    fp8_moe_*     where the table times several rows (one token: sorted and unsorted), each forced in turn
Each output's error against float64 on the dequantized weights (x as given); for dense also that of transformers' FP8
semantics computed in aten (x and h quantized per token and 128 columns, then the dequantized weights): ``aten_fp8``.
Times: CUDA-graph medians (``do_bench_cudagraph``). Floor: FP8 weight bytes (1 a weight, the experts the routing
touches) + scales + x + y, at the device copy bandwidth measured in the same run. Measurements only, no targets.
The table goes to stdout and OUT/fp8.md, the rows to OUT/fp8.json, rewritten after every row.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from datetime import datetime, timezone
from typing import NamedTuple

import torch
import torch.nn.functional as F

from .. import compat, config
from ..dispatch import fp8_experts
from ..kernels import fp8 as K8
from ..kernels import fp8_cublas
from ..ops import moe, quant, quant_moe
from ..reference import Gate
from .bench_moe import reference64, routing, time_us

BLOCK = (128, 128)
VARIANTS = ["bf16_op", "fp8_op", "w8a16", "w8a8", "scaled_mm", "transformers"]


class Case(NamedTuple):
    label: str
    kind: str  # a key of KINDS
    dims: tuple  # dense (H, I); experts (H, I, E, k)
    ms: tuple


CASES = {
    "llama8b": Case("LLaMA-3-8B MLP", "dense", (4096, 14336), (1, 16, 64, 128, 512, 2048, 8192)),
    "qwen3": Case("Qwen3-30B-A3B experts", "experts", (2048, 768, 128, 8), (1, 8, 32, 128, 512, 2048)),
    "mixtral": Case("Mixtral-8x7B experts", "experts", (4096, 14336, 8, 2), (1, 8, 32, 128, 512, 2048)),
}
TINY_CASES = {
    "tiny": Case("tiny MLP", "dense", (128, 320), (1, 5)),
    "tiny_experts": Case("tiny experts", "experts", (64, 32, 8, 2), (1, 5)),
}


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def rel_err(y, ref) -> float:
    return ((y.double() - ref).norm() / ref.norm()).item()


def randn(shape, device, g, fan_in):
    return torch.randn(shape, device=device, generator=g) * fan_in**-0.5


def q_tokens64(t):
    """``t`` as transformers' FP8 kernel feeds it to the GEMM, in float64: quantized per token and 128 columns."""
    q, s = K8.quantize_rows_reference(t.reshape(-1, t.shape[-1]))
    return q.double() * s.double().repeat_interleave(K8.A8_BLOCK, 1)[:, :t.shape[-1]]


# ---- torch's scaled GEMM: the unfused FP8 peer --------------------------------------------------------------


def _quant_row(t):
    s = t.float().abs().amax(-1, keepdim=True).clamp(min=1e-12) / K8.FP8_MAX
    return (t.float() / s).clamp(-K8.FP8_MAX, K8.FP8_MAX).to(K8.FP8), s


def peer_linear(recipe: str, fw: K8.Fp8Weight):
    """x -> x @ Wᵀ through ``compat.scaled_mm``: ``blockwise``, x quantized per token and 128 columns against the
    stored blocks (rows and K blocks padded to multiples of 4, as cuBLAS wants them); ``rowwise``, x per token
    against the weight requantized per output row."""
    if recipe == "blockwise":
        return lambda x: fp8_cublas.linear(x, fw)
    wq, sw = _quant_row(K8.dequantize(fw))

    def lin(x):
        q, s = _quant_row(x)
        return compat.scaled_mm(q, wq.t(), s, sw.t().contiguous(), "rowwise", x.dtype)
    return lin


def scaled_mm_mlp(fws, x, ref):
    """(recipe that ran, the peer MLP, why not the finer recipes): blockwise first, else rowwise, each checked on
    ``x`` against ``ref`` (a recipe that runs but reads its scales otherwise is caught here)."""
    why = []
    for recipe in ("blockwise", "rowwise"):
        try:
            g, u, d = (peer_linear(recipe, fw) for fw in fws)

            def mlp(x, g=g, u=u, d=d):
                return d(F.silu(g(x)) * u(x))
            err = rel_err(mlp(x), ref)
            if not err < 0.1:
                raise ValueError(f"error {err:.2e} against float64")
            return recipe, mlp, "; ".join(why)
        except Exception as e:  # this torch, cuBLAS or GPU does not take it: the next recipe
            why.append(f"{recipe}: {type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
    return None, None, "; ".join(why)


def transformers_why_not(device) -> str | None:
    from ..patch.fp8 import transformers_fp8_kernel_loads

    if device == "cuda" and transformers_fp8_kernel_loads():
        return None
    return "transformers' FP8 kernel does not load here (fetched from the Hub; CUDA only)"


# ---- the kinds: weights, inputs, variants, floor ------------------------------------------------------------


class Dense:
    """A gated MLP (H -> I -> H) on FP8 weights."""

    def __init__(self, dims, device, dtype, g):
        H, I = dims
        self.H, self.device, self.dtype = H, device, dtype
        self.q = [K8.quantize_blocks(randn(s, device, g, s[1]), BLOCK) for s in ((I, H), (I, H), (H, I))]
        self.fw = [K8.fp8_weight(q, s, BLOCK) for q, s in self.q]
        self.deq = [K8.dequantize(f, dtype) for f in self.fw]
        self.deq64 = [K8.dequantize(f, torch.float64) for f in self.fw]
        self.weight_bytes = sum(q.numel() + s.numel() * 4 for q, s in self.q)
        self.peer, self.notes = None, {}
        if device == "cuda":
            x = torch.randn(16, H, device=device, generator=g).to(dtype)
            recipe, self.peer, why = scaled_mm_mlp(self.fw, x, self.reference(x))
            self.notes["scaled_mm"] = (f"{recipe} ran" if recipe else "none ran") + (f" ({why})" if why else "")
        self.transformers = None
        if (why := transformers_why_not(device)) is None:
            self.transformers = self._transformers()
        self.notes["transformers"] = why or "ran"

    def _transformers(self):
        from transformers.integrations.finegrained_fp8 import FP8Linear

        layers = []
        for (q, s) in self.q:
            with torch.device("meta"):
                f = FP8Linear(q.shape[1], q.shape[0], block_size=BLOCK)
            f.weight, f.weight_scale_inv = (torch.nn.Parameter(t, requires_grad=False) for t in (q, s))
            layers.append(f)
        g, u, d = layers
        return lambda x: d(F.silu(g(x)) * u(x))

    def inputs(self, M, g):
        return (torch.randn(M, self.H, device=self.device, generator=g).to(self.dtype),)

    def reference(self, x):
        wg, wu, wd = self.deq64
        return (F.silu(x.double() @ wg.T) * (x.double() @ wu.T)) @ wd.T

    def aten_fp8(self, x):
        """transformers' FP8 semantics in aten: x and h quantized per token and 128 columns, gate and up rounded
        to x's dtype as its kernel outputs them."""
        wg, wu, wd = self.deq64
        xq = q_tokens64(x)
        gt, up = ((xq @ w.T).to(x.dtype).double() for w in (wg, wu))
        return q_tokens64((F.silu(gt) * up).to(x.dtype)) @ wd.T

    def variants(self, *args):
        (qg, sg), (qu, su), (qd, sd) = self.q
        wg, wu, wd = self.deq
        out = {
            "bf16_op": lambda x: torch.ops.mlp_fuser.gated_mlp(x, wg, None, wu, None, wd, None, "silu"),
            "fp8_op": lambda x: quant.quant_gated_mlp(x, qg, sg, None, qu, su, None, qd, sd, None, "silu",
                                                      block=BLOCK),
        }
        kernels = quant.why_not_kernels(torch.empty(0, device=self.device))
        for name, a8 in (("w8a16", False), ("w8a8", True)):
            out[name] = kernels or (lambda x, a8=a8: K8.fp8_linear(
                K8.fp8_linear(x, self.fw[0], self.fw[1], activation="silu", a8=a8), self.fw[2], a8=a8))
        out["scaled_mm"] = self.peer or self.notes.get("scaled_mm", "CUDA only")
        out["transformers"] = self.transformers or self.notes["transformers"]
        return out

    def impl(self, x):
        return quant.choose(x, x.shape[0], [(n, fw, None) for n, fw in zip(("gate", "up", "down"), self.fw)])

    def floor_bytes(self, args):
        return self.weight_bytes + 2 * args[0].numel() * args[0].element_size()


class Experts:
    """Routed experts (E of H -> I -> H, top k) on FP8 weights, as transformers' FP8Experts stores them."""

    def __init__(self, dims, device, dtype, g):
        H, I, E, self.k = dims
        self.H, self.E, self.device, self.dtype = H, E, device, dtype
        gate, up = (randn((E, I, H), device, g, H) for _ in range(2))
        (gq, gs), (uq, us) = (K8.quantize_blocks(w, BLOCK) for w in (gate, up))
        del gate, up
        self.wgu, self.sgu = torch.cat([gq, uq], 1), torch.cat([gs, us], 1)
        self.wd, self.sd = K8.quantize_blocks(randn((E, H, I), device, g, I), BLOCK)
        fgu = K8.fp8_experts(self.wgu, self.sgu, BLOCK, gated=True)
        fd = K8.fp8_experts(self.wd, self.sd, BLOCK)
        self.deq = (K8.dequantize_experts(fgu, dtype), K8.dequantize_experts(fd, dtype))
        self.deq32 = (K8.dequantize_experts(fgu), K8.dequantize_experts(fd))  # reference64 casts per expert
        self.per_expert = (self.wgu[0].numel() + self.wd[0].numel() + 4 * (self.sgu[0].numel() + self.sd[0].numel()))
        self.notes = {}

    def inputs(self, M, g):
        x = torch.randn(M, self.H, device=self.device, generator=g).to(self.dtype)
        return (x, *routing(M, self.E, self.k, self.dtype, self.device, g))

    def reference(self, x, ids, wts):
        return reference64(x, ids, wts, *self.deq32)

    def fp8_op(self, x, ids, wts):
        return quant_moe.quant_moe_mlp(x, ids, wts, self.wgu, self.sgu, self.wd, self.sd, "silu", block=BLOCK)

    def forced(self, name):
        """The op with its table's row ``name`` forced (``config.force_impl``), the setting restored after."""
        def fn(x, ids, wts):
            old, config.force_impl = config.force_impl, name
            try:
                return self.fp8_op(x, ids, wts)
            finally:
                config.force_impl = old
        return fn

    def problem(self, x, ids):
        fgu = K8.fp8_experts(self.wgu, self.sgu, BLOCK, gated=True)
        return fp8_experts.problem(x, ids, fgu, K8.fp8_experts(self.wd, self.sd, BLOCK), Gate("silu"))

    def variants(self, x, ids, wts):
        wgu, wd = self.deq
        out = {
            "bf16_op": lambda x, ids, wts: moe.moe_mlp(x, ids, wts, wgu, None, wd, None, "silu"),
            "fp8_op": self.fp8_op,
        }
        rows = fp8_experts.eligible(self.problem(x, ids))
        if len(rows) > 1:  # the table times them (one token: sorted and unsorted): each row's own time too
            out.update({i.name: self.forced(i.name) for i in rows})
        return out

    def impl(self, x, ids, wts):
        p = self.problem(x, ids)
        return fp8_experts.chosen(p) or fp8_experts.choose(p).name

    def floor_bytes(self, args):
        x, ids, _ = args
        return ids.unique().numel() * self.per_expert + 2 * x.numel() * x.element_size()


KINDS = {"dense": Dense, "experts": Experts}


# ---- rows and the table --------------------------------------------------------------------------------------


def copy_bandwidth(device) -> float:
    """Bytes per second of a device copy of 1 GiB (read + write), measured now."""
    from triton.testing import do_bench

    src = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    return 2 * src.numel() / (do_bench(lambda: dst.copy_(src), warmup=20, rep=200, return_mode="median") * 1e-3)


def bench_row(case: Case, setup, M: int, bw: float | None, device) -> dict:
    g = torch.Generator(device=device).manual_seed(1000 + M)
    args = setup.inputs(M, g)
    ref = setup.reference(*args)
    row = dict(case=case.label, M=M, us={}, errors={}, skipped={})
    row["floor_us"] = setup.floor_bytes(args) / bw * 1e6 if bw else None
    if hasattr(setup, "aten_fp8"):
        row["errors"]["aten_fp8"] = rel_err(setup.aten_fp8(*args), ref)
    for name, fn in setup.variants(*args).items():
        if isinstance(fn, str):
            row["skipped"][name] = fn
            continue
        try:
            row["errors"][name] = rel_err(fn(*args), ref)
            row["us"][name] = time_us(fn, [args], device, graph=device == "cuda")
        except Exception as e:  # out of memory, a capture that failed: the row says so, the others still run
            row["skipped"][name] = f"failed: {type(e).__name__}"
            log(f"[bench --fp8] {case.label} M={M} {name}: {type(e).__name__}: {str(e)[:300]}")
            if device == "cuda":
                torch.cuda.synchronize()
                torch.cuda.empty_cache()
    row["impl"] = setup.impl(*args)  # after the op's first call: the choice it made (timed where several rows run)
    us = row["us"]
    if "fp8_op" in us:
        for other in ("bf16_op", "scaled_mm", "transformers"):
            if other in us:
                row[f"vs_{other}"] = us[other] / us["fp8_op"]
        if row["floor_us"]:
            row["pct_floor"] = 100 * row["floor_us"] / us["fp8_op"]
    return row


HEADER = ("| case | M | FP8 floor µs | bf16 op µs | FP8 op µs | FP8 op impl | FP8 rows µs | w8a16 µs | w8a8 µs | "
          "scaled_mm µs | transformers µs | FP8 op vs bf16 op | vs scaled_mm | % of FP8 floor | rel. err FP8 op / "
          "aten FP8 / bf16 op |\n" + "|---" * 15 + "|")
ROW_PREFIX = "fp8_moe_"  # the experts table's rows timed one by one (Experts.variants)


def format_row(r: dict) -> str:
    def us(name):
        return f"{r['us'][name]:.1f}" if name in r["us"] else ("–" if name in r["skipped"] else "")

    def x(key, fmt="{:.2f}x"):
        return fmt.format(r[key]) if key in r else "–"

    e = r["errors"]
    errs = " / ".join(f"{e[n]:.1e}" if n in e else "–" for n in ("fp8_op", "aten_fp8", "bf16_op"))
    floor = f"{r['floor_us']:.1f}" if r["floor_us"] else "–"
    rows = ", ".join(f"{n.removeprefix(ROW_PREFIX)} {us(n)}" for n in (*r["us"], *r["skipped"])
                     if n.startswith(ROW_PREFIX)) or "–"
    return (f"| {r['case']} | {r['M']} | {floor} | {us('bf16_op')} | {us('fp8_op')} | {r['impl']} | {rows} | "
            f"{us('w8a16')} | {us('w8a8')} | {us('scaled_mm')} | {us('transformers')} | {x('vs_bf16_op')} | "
            f"{x('vs_scaled_mm')} | {x('pct_floor', '{:.0f}%')} | {errs} |")


def write(out: str, meta: dict, rows: list[dict]) -> list[str]:
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "fp8.json"), "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    bw = f"{meta['copy_tbps']:.2f} TB/s copy bandwidth (measured)" if meta["copy_tbps"] else "no floor off CUDA"
    md = [f"{meta['date']} · {meta['device']} · torch {meta['torch']} · `{meta['command']}` · {meta['seconds']:.0f} s"
          f" · {bw} · µs: " + ("CUDA-graph medians" if meta["copy_tbps"] else "one pass (checks the script)"), ""]
    md += [f"- {label}: {note}" for label, note in meta["notes"].items()] + ["", HEADER]
    md += [format_row(r) for r in rows]
    skipped = {f"{n} ({why})" for r in rows for n, why in r["skipped"].items()}
    if skipped:
        md += ["", "Not timed: " + "; ".join(sorted(skipped))]
    if meta["skipped"]:
        md += ["", f"Not run (--budget-s {meta['budget_s']:.0f}): " + "; ".join(meta["skipped"])]
    with open(os.path.join(out, "fp8.md"), "w") as f:
        f.write("\n".join(md) + "\n")
    return md


def main(argv=None) -> int:
    t0 = time.time()
    ap = argparse.ArgumentParser(prog="python -m mlp_fuser bench --fp8", description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"), help="folder for fp8.md / fp8.json")
    ap.add_argument("--budget-s", type=float, default=540.0, help="start no row that would end past this many seconds")
    ap.add_argument("--cases", default=",".join(CASES), help=f"of {sorted(CASES)}")
    ap.add_argument("--ms", default="", help="token counts (default: each case's own)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes in fp32 (runs on the CPU): checks the script")
    argv = sys.argv[1:] if argv is None else list(argv)
    args = ap.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        print("mlp_fuser bench --fp8: no CUDA GPU found (--tiny --device cpu checks the script)", file=sys.stderr)
        return 2
    if args.device != "cuda" and not args.tiny:
        print("mlp_fuser bench --fp8: off CUDA only --tiny runs", file=sys.stderr)
        return 2
    cases = TINY_CASES if args.tiny else {n: CASES[n] for n in args.cases.split(",") if n}
    ms = [int(m) for m in args.ms.split(",") if m]
    dtype = torch.float32 if args.tiny else torch.bfloat16
    cuda = args.device == "cuda"
    if cuda:
        torch.backends.cuda.matmul.allow_tf32 = False
    bw = copy_bandwidth(args.device) if cuda else None
    meta = dict(date=datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC"), torch=torch.__version__,
                device=torch.cuda.get_device_name() if cuda else "cpu", copy_tbps=bw / 1e12 if bw else None,
                command=("python -m mlp_fuser bench --fp8 " + " ".join(argv)).strip(), budget_s=args.budget_s,
                notes={}, skipped=[])
    rows: list[dict] = []
    last = 0.0  # seconds of the last row: the next one's estimate
    log(HEADER)
    for case in cases.values():
        setup = None
        for M in ms or case.ms:
            if time.time() - t0 + max(last, 5.0) > args.budget_s:
                meta["skipped"].append(f"{case.label} M={M}")
                log(f"[bench --fp8] {case.label} M={M}: not started (budget)")
                continue
            t_row = time.time()
            if setup is None:
                setup = KINDS[case.kind](case.dims, args.device, dtype, torch.Generator(args.device).manual_seed(0))
                meta["notes"].update({f"{case.label}, {k}": v for k, v in setup.notes.items()})
            rows.append(bench_row(case, setup, M, bw, args.device))
            last = time.time() - t_row
            log(format_row(rows[-1]) + f"  ({last:.0f} s)")
            write(args.out, dict(meta, seconds=time.time() - t0), rows)
        del setup
        if cuda:
            torch.cuda.empty_cache()
    print("\n".join(write(args.out, dict(meta, seconds=time.time() - t0), rows)))
    return 0 if rows and all("fp8_op" in r["errors"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
