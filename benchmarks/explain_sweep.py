"""``explain`` over every causal-LM model type of the installed transformers (tiny random models, CPU, no download).

    python3 benchmarks/explain_sweep.py [--jobs 2] [--timeout-s 90] [--max-params 50e6] [--out sweep.json] [TYPE ...]

Each type runs in a process of its own (``mlp_fuser.tools.models.tiny_model``, then ``mlp_fuser.explain``), so that one
family's crash, hang or memory does not end the sweep; a toy above ``--max-params`` parameters is reported, not run
(multimodal families keep their full-size towers). Prints one line per type as it ends, then a summary: how many
types built and ran, how many had MLPs fused, which had none (and their near misses), which failed and why.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

ONE = """
import json, sys, time
import mlp_fuser
from mlp_fuser.tools.models import example_inputs, model_from_config, tiny_config, toy_parameters
t, limit = sys.argv[1], float(sys.argv[2])
t0 = time.time()
try:
    cfg = tiny_config(t)
    n = toy_parameters(cfg)  # counted on the meta device first: a multimodal toy can be billions
    if n is not None and n > limit:
        raise RuntimeError(f"not tiny: {n / 1e6:.0f}M parameters")
    m = model_from_config(cfg)
    r = mlp_fuser.explain(m, *example_inputs(m))
    out = dict(fused=len(r.fused), near=[(x.path, x.check, x.reason[:160]) for x in r.near_misses],
               breaks=r.graph_breaks, s=round(time.time() - t0, 1))
except Exception as e:
    out = dict(error=f"{type(e).__name__}: {str(e).splitlines()[0][:160] if str(e) else ''}")
print("RESULT " + json.dumps(out), flush=True)
"""


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def run_one(model_type: str, timeout_s: float, max_params: float) -> dict:
    try:
        p = subprocess.run([sys.executable, "-c", ONE, model_type, str(max_params)], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired:
        return dict(error=f"timeout after {timeout_s:.0f} s")
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if not lines:
        tail = (p.stderr.strip().splitlines() or ["no output"])[-1][:160]
        return dict(error=f"exit {p.returncode}: {tail}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("types", nargs="*", help="model types (default: every causal-LM type)")
    ap.add_argument("--jobs", type=int, default=2)
    ap.add_argument("--timeout-s", type=float, default=90)
    ap.add_argument("--max-params", type=float, default=50e6)
    ap.add_argument("--out", default="")
    args = ap.parse_args()
    types = args.types or causal_lm_types()
    results: dict[str, dict] = {}

    def work(t):
        results[t] = run_one(t, args.timeout_s, args.max_params)
        print(t, json.dumps(results[t])[:220], flush=True)

    with ThreadPoolExecutor(args.jobs) as pool:
        list(pool.map(work, types))
    ran = {t: r for t, r in results.items() if "error" not in r}
    fused = sorted(t for t, r in ran.items() if r["fused"])
    none = sorted(t for t, r in ran.items() if not r["fused"])
    failed = sorted(t for t in results if t not in ran)
    print(f"\n{len(types)} types: {len(ran)} built and ran explain, {len(fused)} with MLPs fused, "
          f"{len(none)} with none, {len(failed)} failed to build or run")
    print("none fused:", ", ".join(f"{t} ({len(ran[t]['near'])} near miss(es))" for t in none))
    print("failed:", "; ".join(f"{t}: {results[t]['error'][:80]}" for t in failed))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=1, sort_keys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
