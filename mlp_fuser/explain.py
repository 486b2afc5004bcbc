"""``explain(model, *inputs)``: which MLPs would be fused, which were not and why, without compiling anything.

The report folds identical blocks into one line (``model.layers.{0..29}.mlp  gated  silu  576 → 1536 → 576  ×30``)
and near misses into one line per reason; ``report.details()`` (or ``explain(..., verbose=True)``) has one row per
block.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch

from . import compat
from .activations import get_activation
from .graph._dynamo_utils import fresh_code
from .graph.fx_pass import CHECKS, NearMiss, PassReport, fuse_mlps
from .patch import compressed, experts, packed, quantized
from .patch.api import fused_forwards_aside, original_forward
from .patch.fp8 import (
    FP8_LINEAR_NAMES,
    fp8_linear_block,
    fp8_site,
    fuse_fp8_linear,
    sibling_groups,
    transformers_fp8_kernel_loads,
    weight_near_miss,
)


@dataclass
class Report(PassReport):
    """What the graph pass reports over every captured graph, and what Dynamo met while capturing them."""

    graphs: int = 0
    graph_breaks: int = 0  # distinct graph-break reasons met while capturing
    break_reasons: list[str] = field(default_factory=list)
    error: str | None = None  # what the forward raised under Dynamo, where it did
    verbose: bool = False  # str() gives the details
    fp8_linears: list[str] = field(default_factory=list)  # lone FP8 layers patch runs through the FP8 GEMM
    fp8_side_by_side: list[str] = field(default_factory=list)  # of those, packed with siblings (patch/packed.py)

    def __bool__(self) -> bool:
        return bool(self.fused)

    def _head(self) -> list[str]:
        lines = [
            f"mlp_fuser.explain: {len(self.fused)} MLP(s) fused, {len(self.near_misses)} near miss(es) "
            f"in {self.graphs} graph(s), {self.graph_breaks} graph break(s)"
        ]
        if self.error:
            lines += ["", f"The forward raised while Dynamo captured it: {self.error}"]
        if self.fp8_linears:
            where = ", ".join(p for p, _ in fold(self.fp8_linears))
            lines += ["", f"{len(self.fp8_linears)} other FP8 linear layer(s) run through mlp_fuser's FP8 GEMM under "
                          f"patch (transformers' FP8 kernel does not load here): {where}"]
        if self.fp8_side_by_side:
            where = ", ".join(p for p, _ in fold(self.fp8_side_by_side))
            lines += [f"Packed side by side with their siblings (compiled with mlp_fuser.backend, those reading one "
                      f"input run as one GEMM): {where}"]
        return lines

    def _tail(self) -> list[str]:
        lines = []
        if self.break_reasons:
            lines += ["", "Graph breaks:", *(f"  - {r.splitlines()[0][:200]}" for r in self.break_reasons)]
        if not self.fused:
            lines.append("")
            if self.near_misses:
                failed = ", ".join(sorted(self.checks_failed()))
                lines.append(f"Nothing fused: every candidate failed a check ({failed}).")
            elif self.error:
                lines.append("Nothing fused: no graph of the whole forward was captured (see above).")
            elif self.graphs == 0:
                lines.append("Nothing fused: Dynamo captured no graph (the forward fell back to Python entirely).")
            else:
                lines.append(
                    f"Nothing fused: no Linear → activation → Linear chain (plain, gated or merged gate/up) among the "
                    f"{self.projections} projection(s) in the captured graph(s)."
                )
        return lines

    def __str__(self) -> str:
        if self.verbose:
            return self.details()
        lines = self._head()
        if self.fused:
            groups = _groups(self.fused, lambda s: (s.pattern, s.activation, f"{s.K} → {s.I} → {s.O}"))
            lines += ["", "Fused:", *_table(None, groups)]
        if self.near_misses:
            groups = _groups(self.near_misses, lambda m: (m.pattern, m.check, _relative(m.reason, m.path)))
            lines += ["", "Not fused:", *_table(None, groups)]
        lines += self._routers(verbose=False)
        return "\n".join(lines + self._tail())

    def _routers(self, verbose: bool) -> list[str]:
        """The MoE routers whose softmax → top-k → renorm runs as one op (``mlp_fuser::moe_router_topk``)."""
        def listed(paths):
            return [f"  {p}" for p in paths] if verbose else [f"  {p}" + (f"  ×{n}" if n > 1 else "")
                                                              for p, n in fold(paths)]
        lines = []
        if self.routers:
            lines += ["", "Router top-k fused (softmax → top-k → renorm as one op):", *listed(self.routers)]
        if self.routers_with_grad:
            lines += ["", "Router top-k left to aten, its logits needing gradients (under torch.no_grad() or "
                      "inference_mode it is fused):", *listed(self.routers_with_grad)]
        return lines

    def details(self) -> str:
        """The report with one row per block (``str(report)`` folds identical blocks into one line)."""
        lines = self._head()
        if self.fused:
            rows = [(s.path or "<root>", s.pattern, s.activation, str(s.K), str(s.I), str(s.O)) for s in self.fused]
            lines += ["", "Fused:", *_table(("module", "pattern", "activation", "K", "I", "O"), rows)]
        if self.near_misses:
            rows = [(m.path or "<root>", m.pattern, m.check, m.reason) for m in self.near_misses]
            lines += ["", "Not fused:", *_table(("module", "resembles", "failed check", "reason"), rows)]
        lines += self._routers(verbose=True)
        return "\n".join(lines + self._tail())

    __repr__ = __str__


def _relative(reason: str, path: str) -> str:
    """``reason`` with the block's own path left out (``gate_proj.weight is ...``), so that blocks alike read alike."""
    return reason.replace(f"{path}.", "").replace(path, "the block") if path else reason


def _indices(values: list[int]) -> str:
    """``{0..29}`` for a run, ``{0,2,5}`` for a set, ``{0..5,8}`` for both."""
    values, parts, i = sorted(set(values)), [], 0
    while i < len(values):
        j = i
        while j + 1 < len(values) and values[j + 1] == values[j] + 1:
            j += 1
        parts += [f"{values[i]}..{values[j]}"] if j - i >= 2 else [str(v) for v in values[i:j + 1]]
        i = j + 1
    return "{" + ",".join(parts) + "}"


def fold(paths: list[str]) -> list[tuple[str, int]]:
    """Module paths that differ in one index folded into one (``model.layers.{0..29}.mlp``), each with the number
    of paths it stands for; paths alike in nothing stay as they are."""
    by_shape: dict[tuple, list[list[str]]] = {}
    for p in dict.fromkeys(paths):
        parts = p.split(".")
        by_shape.setdefault(tuple("#" if q.isdigit() else q for q in parts), []).append(parts)
    out = []
    for members in by_shape.values():
        varying = [i for i in range(len(members[0])) if len({m[i] for m in members}) > 1]
        if not varying:
            out.append((".".join(members[0]), 1))
            continue
        last = varying[-1]  # fold the innermost index; blocks that differ elsewhere too get a line each
        rest: dict[tuple, list[list[str]]] = {}
        for m in members:
            rest.setdefault(tuple(m[i] for i in varying[:-1]), []).append(m)
        for group in rest.values():
            parts = list(group[0])
            if len(group) > 1:
                parts[last] = _indices([int(m[last]) for m in group])
            out.append((".".join(parts), len(group)))
    return out


def _groups(items, key) -> list[tuple[str, ...]]:
    """One row per folded path of the items alike under ``key``: (path, *key, ×count)."""
    alike: dict[tuple, list[str]] = {}
    for it in items:
        alike.setdefault(key(it), []).append(it.path or "<root>")
    return [(p, *k, f"×{n}" if n > 1 else "") for k, paths in alike.items() for p, n in fold(paths)]


def _table(header, rows) -> list[str]:
    body = [header, *rows] if header else rows
    widths = [max(len(str(r[i])) for r in body) for i in range(len(body[0]))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    head = ["  " + fmt.format(*header).rstrip(), "  " + fmt.format(*("-" * w for w in widths))] if header else []
    return head + ["  " + fmt.format(*r).rstrip() for r in rows]


def _error_text(error: BaseException) -> str:
    """The error a user's code raised, without Dynamo's wrapping around it (``TorchRuntimeError: RuntimeError when
    making fake tensor call``), on one line."""
    seen: set[int] = set()
    while isinstance(error, compat.dynamo_errors()[0]) and id(error) not in seen:
        seen.add(id(error))
        inner = error.__cause__ or error.__context__
        if inner is None:
            break
        error = inner
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:300] if lines else ''}"


def explain(model, *example_inputs, activations=None, patterns=None, verbose: bool = False,
            **example_kwargs) -> Report:
    """Capture ``model``'s graph(s) with Dynamo on the example inputs and report every MLP site and near miss.

    Nothing is rewritten or compiled; the model runs once (eagerly, graph by graph). ``model`` may be an
    ``nn.Module`` (patched or not, or what ``torch.compile`` returned for one) or a function. MLP modules whose
    weights the op cannot read (integer, a GPTQ / AWQ / bitsandbytes / HQQ layer, a tensor subclass, a float8 format
    the FP8 op does not take) are near misses, whatever their forward does with them; FP8 MLP modules and FP8
    experts ``patch`` fuses are reported fused, their pattern naming the weight format. On a patched model the report
    is of the modules as patch found them (what runs fused, what does not and why). Where the forward raises under
    Dynamo, the report says what it raised instead of raising it. ``verbose=True``: ``str(report)`` is
    ``report.details()``, one row per block.
    """
    model = compat.uncompiled(model)
    if not isinstance(model, torch.nn.Module):
        return _explain(model, example_inputs, example_kwargs, activations, patterns, verbose)
    with fused_forwards_aside(model):
        return _explain(model, example_inputs, example_kwargs, activations, patterns, verbose)


def _float8(module) -> bool:
    return any("float8" in str(p.dtype) for p in module.parameters(recurse=False))


def _fp8_layers_run(model):
    """Where transformers' FP8 layers cannot load their Hub kernel, the capture runs them on the aten stand-in
    (``patch/hf_fp8.py``), so that the graph is the model's and not an ImportError."""
    if not isinstance(model, torch.nn.Module) or transformers_fp8_kernel_loads():
        return contextlib.nullcontext()
    try:
        from transformers.integrations import finegrained_fp8 as hf
    except ImportError:
        return contextlib.nullcontext()
    kinds = tuple(c for c in (getattr(hf, "FP8Linear", None), getattr(hf, "FP8Experts", None)) if c is not None)
    if not any(isinstance(m, kinds) for m in model.modules()):
        return contextlib.nullcontext()
    from .patch.hf_fp8 import transformers_fp8_in_aten

    return transformers_fp8_in_aten()


def _explain(model, example_inputs, example_kwargs, activations, patterns, verbose) -> Report:
    """``explain`` for a model whose fused forwards, if any, are set aside."""
    acts = None if activations is None else {get_activation(a).name for a in activations}
    pats = set(patterns) if patterns else None
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = original_forward(model) if isinstance(model, torch.nn.Module) else model
    before = dict(compat.graph_breaks())
    error = None
    try:
        with _fp8_layers_run(model):
            torch.compile(fresh_code(fn), backend=record)(*example_inputs, **example_kwargs)
    except Exception as e:  # the report says what the forward raised: explain is how a user finds out why
        error = _error_text(e)
        if isinstance(model, torch.nn.Module) and compressed.HOOK in model.__dict__:  # explain runs no module hooks
            error += (" (the model's compressed-tensors layers are still compressed: its hook decompresses them on the"
                      " first forward, which explain does not run)")
    reasons = [r for r, n in compat.graph_breaks().items() if n > before.get(r, 0)]
    report = Report(graphs=len(graphs), graph_breaks=len(reasons), break_reasons=reasons, error=error,
                    verbose=verbose)
    for gm in graphs:
        r = fuse_mlps(gm, activations=acts, patterns=pats, dry_run=True)
        report.fused += r.fused
        report.near_misses += r.near_misses
        report.projections += r.projections
        report.routers += r.routers
        report.routers_with_grad += r.routers_with_grad
    if isinstance(model, torch.nn.Module):
        seen = {s.path for s in report.fused} | {m.path for m in report.near_misses}
        memo: dict = {}
        options = dict(activations=acts, patterns=pats)
        lone: list = []  # the lone FP8 linears, (path, module, block)
        for path, module in model.named_modules():
            fused_here = any(s.path == path for s in report.fused)
            if not fused_here and (site := fp8_site(module, path, options) or experts.fp8_site(module, path)):
                report.fused.append(site)  # the pass's near miss for its float8 weights, if any, no longer applies
                report.near_misses = [m for m in report.near_misses if m.path != path]
                seen |= {path, *(f"{path}.{name}" for name, _ in module.named_children())}
            elif path not in seen and (lin := fuse_fp8_linear(module)) is not None:
                report.fp8_linears.append(path)
                lone.append((path, module, fp8_linear_block(lin)))
            elif ((path not in seen or fused_here and any(quantized.describe(c) for c in module.children()))
                  and (m := weight_near_miss(module, path, options, memo)) is not None):
                report.fused = [s for s in report.fused if s.path != path]  # dequantized in forward: patch leaves it
                report.near_misses.append(m)
            elif (path not in seen or _float8(module)) and (why := experts.unfused_reason(module)) is not None:
                report.near_misses = [m for m in report.near_misses if m.path != path]  # its weights' reason first
                report.near_misses.append(NearMiss(path, "routed_experts", "experts", why))
        for group in sibling_groups(lone):
            if packed.together_why_not([m for _, m, _ in group], FP8_LINEAR_NAMES) is None:
                report.fp8_side_by_side += [p for p, _, _ in group]
    return report


__all__ = ["CHECKS", "Report", "explain", "fold"]
