"""Linear → act → Linear (BERT, GPT-2, OPT, GPT-NeoX, Falcon, StarCoder2, T5 …), biases optional.

The two Linears may sit in different modules (BERT's ``BertIntermediate.dense`` and ``BertOutput.dense``); an
eval-mode dropout may sit between the activation and the second Linear (T5).
"""

from __future__ import annotations

from . import act_match
from .common import Candidate, strip
from .projections import Proj, is_projection, match_projection


def match(down: Proj) -> Candidate | None:
    base, passed = strip(down.x)
    act = act_match.match(base, is_projection)
    if act is None:
        return None
    return Candidate("plain", down, gate=match_projection(act.leaf), up=None, act=act, extra=passed)
