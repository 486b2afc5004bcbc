"""Gated MLP: ``down(act(gate(x)) * up(x))`` in either multiplication order (LLaMA, Mistral, Qwen, Gemma, mT5 …)."""

from __future__ import annotations

from collections.abc import Callable

from torch.fx import Node

from . import act_match
from .common import Candidate, clamp_text, is_clamp, is_mul, strip
from .projections import Proj, match_projection


def match_gated(down: Proj, proj: Callable[[Node], Proj | None], pattern: str) -> Candidate | None:
    """The gated site feeding ``down``, with gate and up recognized by ``proj``."""
    mul, passed = strip(down.x)
    if not is_mul(mul):
        return None
    for act_side, up_side in (mul.args, mul.args[::-1]):
        up_base, up_passed = strip(up_side)
        clamped = up_base if is_clamp(up_base) else None  # DeepSeek-V4, GPT-OSS: up clamped to ±swiglu_limit
        if clamped is not None:
            up_base, more = strip(clamped.args[0])
            up_passed = up_passed + [clamped] + more
        up = proj(up_base)
        if up is None:
            continue
        act = act_match.match(act_side, lambda n: proj(n) is not None)
        if act is None:
            continue
        gate = proj(act.leaf)
        if gate.out is up.out:
            continue
        unsupported = None if clamped is None else (
            f"up's output is clamped ({clamp_text(clamped)}) before the product, with act {act.desc}: a bounded "
            "gated activation (DeepSeek-V4's and GPT-OSS's swiglu_limit); the op's activations take the projections' "
            "outputs as they are")
        return Candidate(pattern, down, gate=gate, up=up, act=act, extra=passed + [mul] + up_passed,
                         unsupported=unsupported)
    return None


def match(down: Proj) -> Candidate | None:
    return match_gated(down, match_projection, "gated")
