"""Compiled paths timed side by side, each with a Dynamo cache of its own.

Dynamo keeps compiled entries per code object, and transformers' forward decorators share one code object across
every model (and a benchmark's one function compiled with several backends shares its own): each call of a path
compiled later first fails the earlier paths' guards. On the H100 an FP8 Qwen3-MoE step took 0.69 ms of host alone
and 1.03 ms after a bf16 one in the same process (benchmarks/NOTES.md). A copy of the code object is a new cache.
"""

from __future__ import annotations

import types


def own_function(fn):
    """``fn`` on a copy of its code object: what Dynamo compiles from it is cached apart from ``fn``'s."""
    own = types.FunctionType(fn.__code__.replace(), fn.__globals__, fn.__name__, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__, own.__dict__ = fn.__kwdefaults__, dict(fn.__dict__)
    return own


def own_forward(model):
    """``model.forward`` on a code object of its own (an instance attribute; ``del model.forward`` undoes it where
    the class's was copied). A forward the instance already holds is copied if it is a method, else left as it is."""
    fn = model.__dict__.get("forward")
    if fn is None:
        fn = type(model).forward
    elif isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
        fn = fn.__func__
    else:
        return model
    model.forward = types.MethodType(own_function(fn), model)
    return model
