"""The torch.compile backend: fuse the MLPs of the graph Dynamo captured, then hand it to Inductor.

The rewrite runs before AOTAutograd, so training works through the op's own autograd, and Inductor
(``compile_fx``) still does everything else. ``torch.compile(model, backend=mlp_fuser.backend)``, or
``backend="mlp_fuser"`` once the package is imported.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Callable, Iterable

from .activations import get_activation
from .fx_pass import fuse_mlps

log = logging.getLogger("mlp_fuser")
_graph_ids = itertools.count()


def make_backend(
    activations: Iterable[str] | None = None,
    patterns: Iterable[str] | None = None,
    enabled: bool = True,
    inductor: bool = True,
    filter_fn: Callable[[str], bool] | None = None,
):
    """A backend that fuses MLP sites, then compiles with Inductor (or, with ``inductor=False``, runs the graph).

    ``activations``: registry names or aliases allowed (default: all); ``patterns``: names from
    ``mlp_fuser.patterns.PATTERNS`` allowed (default: all); ``enabled=False``: no fusion at all;
    ``filter_fn(path) -> bool``: which sites, by module path, may be fused.
    """
    from . import patterns as registry

    acts = None if activations is None else {get_activation(a).name for a in activations}
    pats = None if patterns is None else set(patterns)
    if pats is not None and pats - set(registry.PATTERNS):
        raise ValueError(f"mlp_fuser: unknown pattern(s) {sorted(pats - set(registry.PATTERNS))}; "
                         f"known: {', '.join(registry.PATTERNS)}")

    def mlp_fuser_backend(gm, example_inputs):
        gid = next(_graph_ids)
        if enabled:
            report = fuse_mlps(gm, activations=acts, patterns=pats, filter_fn=filter_fn)
            log.info("mlp_fuser: graph %d: %s", gid, report.summary())
            for m in report.near_misses:
                log.debug("mlp_fuser: graph %d: not fused %s (%s): %s: %s", gid, m.path, m.pattern, m.check, m.reason)
        else:
            log.info("mlp_fuser: graph %d: fusion disabled", gid)
        if not inductor:
            return gm.forward
        from torch._inductor.compile_fx import compile_fx

        return compile_fx(gm, example_inputs)

    return mlp_fuser_backend


backend = make_backend()
