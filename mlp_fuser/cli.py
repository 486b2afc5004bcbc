"""The command line: ``python -m mlp_fuser {demo,explain,bench}`` (also installed as ``mlp-fuser``).

- ``demo``: SmolLM2-135M-Instruct with its MLPs fused: explain report, identical tokens, timings.
- ``explain TARGET [--details]``: TARGET is a HF model type (``llama``, ``gpt2``, ``qwen3``...: a tiny random model
  of that family is built) or a local checkpoint folder or ``.gguf`` file; prints ``mlp_fuser.explain``'s report
  (``--details``: one row per block).
- ``bench [ARGS]``: the GPU benchmark, ``mlp_fuser.tools.bench.main(ARGS)`` (``--moe``: routed experts, ``--fp8``:
  FP8 weights).

Results go to stdout, progress to stderr.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

import mlp_fuser

from . import __version__
from .tools import bench, demo
from .tools import models as _hf


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="python -m mlp_fuser",
        description="Find the MLP blocks of transformer models and run each as one fused op.",
    )
    ap.add_argument("--version", action="version", version=f"mlp_fuser {__version__}")
    sub = ap.add_subparsers(dest="command", metavar="{demo,explain,bench}")
    sub.required = True

    d = sub.add_parser("demo", help="SmolLM2-135M-Instruct: explain report, identical tokens, fused vs unfused timings")
    demo.add_arguments(d)

    e = sub.add_parser("explain", help="print the explain report of a model family (tiny random) or a local checkpoint")
    e.add_argument("target", help="a HF model type (llama, gpt2, qwen3, ...) or a local checkpoint folder / .gguf file")
    e.add_argument("--seq-len", type=int, default=8, help="length of the random example input_ids (default 8)")
    e.add_argument("--dtype", choices=sorted(demo.DTYPES), default="float32")
    e.add_argument("--details", action="store_true", help="one row per block (else identical blocks fold into one)")

    bench_help = "the GPU benchmark (needs CUDA); its arguments are passed to mlp_fuser.tools.bench.main"
    sub.add_parser("bench", help=bench_help, add_help=False)
    return ap


def explain(target: str, seq_len: int = 8, dtype: str = "float32", details: bool = False) -> str:
    """The explain report of ``target`` (see ``python -m mlp_fuser explain --help``), as text."""
    model = _hf.load_model(target, dtype=demo.DTYPES[dtype])
    inputs = _hf.example_inputs(model, seq_len=seq_len)
    with _hf.step(f"explain: tracing {type(model).__name__}"):
        report = mlp_fuser.explain(model, *inputs)
    return report.details() if details else str(report)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":  # everything after `bench` belongs to the benchmark's own parser
        return int(bench.main(argv[1:]) or 0)
    args = _parser().parse_args(argv)
    if args.command == "demo":
        return demo.run_from_args(args)
    if args.command == "explain":
        try:
            print(explain(args.target, seq_len=args.seq_len, dtype=args.dtype, details=args.details))
        except (ValueError, KeyError, OSError, ImportError) as err:
            print(f"mlp_fuser explain: {err}", file=sys.stderr)
            return 2
        return 0
    raise AssertionError(args.command)  # pragma: no cover


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
