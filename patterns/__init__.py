"""The pattern registry (shipped as ``mlp_fuser.patterns``): one small file per family of MLP pattern.

Each pattern is ``match(down: Proj) -> Candidate | None``: given a projection, the MLP whose last Linear it is.
The graph pass (``mlp_fuser.graph.fx_pass``) tries them in order on every projection, then checks and rewrites.
"""

from __future__ import annotations

from . import gated, merged_gate_up, plain
from .common import Candidate
from .projections import Proj, match_projection

PATTERNS = {
    "merged_gate_up": merged_gate_up.match,
    "gated": gated.match,
    "plain": plain.match,
}
# Routed experts are found per experts module and routers' top-k per softmax, not per projection (``experts.py``,
# ``router_topk.py``): names the options accept too.
NAMES = (*PATTERNS, "routed_experts", "router_topk")


def find(down: Proj) -> Candidate | None:
    """The first pattern that matches the MLP ending in ``down`` (which patterns are enabled is a check of the
    graph pass, so that a disabled one is reported as a near miss)."""
    for fn in PATTERNS.values():
        c = fn(down)
        if c is not None:
            return c
    return None


__all__ = ["NAMES", "PATTERNS", "Candidate", "Proj", "find", "match_projection"]
