"""Helpers for starting Dynamo on a function, shared by ``patch`` and ``explain``."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from typing import Any

_ids = itertools.count()


def fresh_code(fn: Callable[..., Any]) -> Callable[..., Any]:
    """A function calling ``fn`` through a code object of its own.

    Dynamo keeps its compile cache (and its recompile limit, 8) per code object, and every HF model's forward is
    the same decorated wrapper; starting Dynamo at a fresh code object gives each patched model, and each explain,
    a cache of its own instead of exhausting the shared one.
    """

    def call(*args, **kwargs):
        return fn(*args, **kwargs)

    call.__code__ = call.__code__.replace(co_name=f"mlp_fuser_{next(_ids)}")
    return call
