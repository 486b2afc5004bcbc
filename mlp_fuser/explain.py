"""``explain(model, *inputs)``: which MLPs would be fused, which were not and why, without compiling anything."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch._dynamo.utils import counters

from ._dynamo_utils import fresh_code
from .activations import get_activation
from .fx_pass import CHECKS, PassReport, fuse_mlps
from .patch import original_forward


@dataclass
class Report(PassReport):
    """What the graph pass reports over every captured graph, and what Dynamo met while capturing them."""

    graphs: int = 0
    graph_breaks: int = 0  # distinct graph-break reasons met while capturing
    break_reasons: list[str] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.fused)

    def __str__(self) -> str:
        lines = [
            f"mlp_fuser.explain: {len(self.fused)} MLP(s) fused, {len(self.near_misses)} near miss(es) "
            f"in {self.graphs} graph(s), {self.graph_breaks} graph break(s)"
        ]
        if self.fused:
            rows = [(s.path or "<root>", s.pattern, s.activation, str(s.K), str(s.I), str(s.O)) for s in self.fused]
            lines += ["", "Fused:", *_table(("module", "pattern", "activation", "K", "I", "O"), rows)]
        if self.near_misses:
            rows = [(m.path or "<root>", m.pattern, m.check, m.reason) for m in self.near_misses]
            lines += ["", "Not fused:", *_table(("module", "resembles", "failed check", "reason"), rows)]
        if self.break_reasons:
            lines += ["", "Graph breaks:", *(f"  - {r.splitlines()[0][:200]}" for r in self.break_reasons)]
        if not self.fused:
            lines.append("")
            if self.near_misses:
                failed = ", ".join(sorted(self.checks_failed()))
                lines.append(f"Nothing fused: every candidate failed a check ({failed}).")
            elif self.graphs == 0:
                lines.append("Nothing fused: Dynamo captured no graph (the forward fell back to Python entirely).")
            else:
                lines.append(
                    f"Nothing fused: no Linear → activation → Linear chain (plain, gated or merged gate/up) among the "
                    f"{self.projections} projection(s) in the captured graph(s)."
                )
        return "\n".join(lines)

    __repr__ = __str__


def _table(header, rows) -> list[str]:
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return ["  " + fmt.format(*header).rstrip(), "  " + fmt.format(*("-" * w for w in widths))] + [
        "  " + fmt.format(*r).rstrip() for r in rows
    ]


def explain(model, *example_inputs, activations=None, patterns=None, **example_kwargs) -> Report:
    """Capture ``model``'s graph(s) with Dynamo on the example inputs and report every MLP site and near miss.

    Nothing is rewritten or compiled; the model runs once (eagerly, graph by graph). ``model`` may be an
    ``nn.Module`` (patched or not) or a function.
    """
    acts = None if activations is None else {get_activation(a).name for a in activations}
    graphs = []

    def record(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    fn = original_forward(model) if isinstance(model, torch.nn.Module) else model
    before = dict(counters["graph_break"])
    torch.compile(fresh_code(fn), backend=record)(*example_inputs, **example_kwargs)
    reasons = [r for r, n in counters["graph_break"].items() if n > before.get(r, 0)]
    report = Report(graphs=len(graphs), graph_breaks=len(reasons), break_reasons=reasons)
    for gm in graphs:
        r = fuse_mlps(gm, activations=acts, patterns=set(patterns) if patterns else None, dry_run=True)
        report.fused += r.fused
        report.near_misses += r.near_misses
        report.projections += r.projections
    return report


__all__ = ["CHECKS", "Report", "explain"]
