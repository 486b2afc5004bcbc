"""The one dispatcher: every op family's implementations are rows of ``Impl`` in a ``Registry`` (``dense.py``,
``experts.py``), and the choice among them is made here, in the same way for all.

A row declares what it runs on (devices, dtypes, ``why`` constraints that say why it cannot run a problem) and where
it runs but is not worth timing (``worth``); ``config.force_impl`` forces a row by name, in any family. Where several
rows are eligible on CUDA, ``time_candidates`` times each once per choice key (a family's shape bucket): warm-up
calls, GPU time with the calls queued behind a sleep kernel (so the host's cost does not decide), the host's time,
then the family's ``Rules`` (tie, large-M baseline) pick one implementation for CUDA graphs and one for plain calls.
The choices are kept in one cache (``_choices``). Under a caller's CUDA-graph capture nothing is timed: what the
family's ``first_capture`` names runs until a warm-up call outside the capture has chosen (``pick``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch import Tensor

from .. import compat, config

log = logging.getLogger("mlp_fuser")
ImplFn = Callable[..., Tensor]
Check = Callable[[Any], "str | None"]  # a problem -> None where the row takes it, else the reason
FLOAT = frozenset({torch.float32, torch.float16, torch.bfloat16})


@dataclass(frozen=True)
class Impl:
    """One implementation of an op family: ``fn`` called on the family's arguments; ``why_not`` on the family's
    ``Problem`` says why it cannot run it (None: it can)."""

    name: str
    fn: ImplFn
    devices: frozenset[str] | None  # None: every device aten runs on
    dtypes: frozenset[torch.dtype] | None = FLOAT  # None: any (the family's checks read the dtype)
    triton: bool = False  # a Triton kernel: on CPU only under the interpreter (config.triton_on_cpu)
    why: tuple[Check, ...] = field(default=(), compare=False)  # further constraints, in the order they are reported
    worth: tuple[Check, ...] = field(default=(), compare=False)  # where it runs but is not timed (forcing runs it)
    # args -> a function computing fn(*args) for any call with args' signature (the experts' launch plans)
    plan: Callable[[tuple], ImplFn] | None = field(default=None, compare=False)
    notes: str = field(default="", compare=False)

    def why_not(self, p) -> str | None:
        """None when this implementation supports the problem, else the constraint that fails."""
        if self.devices is not None:
            devices = set(self.devices)
            if self.triton and config.triton_on_cpu:
                devices.add("cpu")
            if p.device not in devices:
                return f"device {p.device} not in {sorted(devices)}"
        if self.dtypes is not None and p.dtype not in self.dtypes:
            return f"dtype {p.dtype} not supported"
        return _first_reason(self.why, p)

    def not_worth(self, p) -> str | None:
        """None when the dispatcher should time this implementation for the problem it supports, else why not."""
        return _first_reason(self.worth, p)

    def candidate(self, p) -> bool:
        """Whether the dispatcher times this implementation for ``p``: it runs it and it is worth timing there."""
        return self.why_not(p) is None and self.not_worth(p) is None


def _first_reason(checks: tuple[Check, ...], p) -> str | None:
    for check in checks:  # a loop, not a generator: the untimed families (FP8) ask on every call
        reason = check(p)
        if reason is not None:
            return reason
    return None


@dataclass(frozen=True)
class Rules:
    """How a family's candidates are timed and weighed (``time_candidates``)."""

    sleep_cycles: int  # the spin kernel the timed calls queue behind: longer than the host takes to queue them
    ramp_s: float = 0.0  # back-to-back calls before timing, so the clocks are up
    wall: bool = False  # host time as wall time between syncs (the GPU's inside); else the time to queue the calls
    tie: float = 0.0  # GPU times this close to the best count as a tie, broken by the call's cost (0: table order)
    gpu_bound_m: int | None = None  # rows from which the GPU's time hides the host's (a prefill)
    large_m_margin: float = 0.0  # from there, how much faster than ``baseline`` a plain call's pick must time
    baseline: str | None = None  # the unfused path a plain call keeps at large M unless clearly beaten
    calls: int = 3  # calls per timed sample
    rounds: int = 7  # samples per candidate, interleaved; the median counts


@dataclass(eq=False)
class Registry:
    """One kind of op's implementations: its table of rows and how they are timed."""

    kind: str  # part of every cache key
    impls: list[Impl]
    rules: Rules | None  # None: never timed, the first row that runs a problem runs it (``first``)
    fallback: str = "reference"  # runs anywhere: taken where nothing else runs
    # what runs a key's first call inside a CUDA-graph capture (untimed, not kept): "fallback", or the "first" candidate
    first_capture: str = "fallback"
    what: str = ""  # how the logs name the op before the problem ("the backward of ")
    describe: Callable[[Any], str] = str  # one line for logs
    timed: Callable[[Impl, tuple], ImplFn] = field(default=lambda impl, args: impl.fn)  # what a sample calls

    def __post_init__(self):
        self.by_name = {i.name: i for i in self.impls}
        if self.first_capture not in ("fallback", "first"):
            raise ValueError(f"first_capture must be 'fallback' or 'first', not {self.first_capture!r}")
        _REGISTRIES.append(self)


_REGISTRIES: list[Registry] = []


class Choice(NamedTuple):
    """The implementation for calls captured in CUDA graphs (the least GPU time: replays cost no host time) and the
    one for plain calls (GPU and host time); indexed by ``eager``."""

    graph: Impl
    eager: Impl

    @property
    def name(self) -> str:
        return self.eager.name if self.eager is self.graph else f"{self.eager.name} (graphs: {self.graph.name})"


# ---- choosing ------------------------------------------------------------------------------------

_choices: dict[tuple, Choice] = {}  # the one choice cache: (family key, settings, kind) -> Choice


def _forced(reg: Registry, p) -> Impl | None:
    """The row ``config.force_impl`` names in this registry, checked against ``p``; None where the choice is free
    (nothing forced, or another registry's row: a backward implementation for the forward, a dense one for the
    experts; "reference" forces every family that has one)."""
    if not config.force_impl:
        return None
    impl = reg.by_name.get(config.force_impl)
    if impl is None:
        if any(config.force_impl in r.by_name for r in _REGISTRIES):
            return None
        known = list(dict.fromkeys(n for r in _REGISTRIES for n in r.by_name))
        raise ValueError(f"mlp_fuser: MLP_FUSER_IMPL={config.force_impl!r} is not one of {known}")
    reason = impl.why_not(p)
    if reason is not None:
        raise ValueError(f"mlp_fuser: forced implementation {impl.name!r} cannot run {p}: {reason}")
    return impl


def candidates(reg: Registry, p) -> list[Impl]:
    """The eligible implementations in table order, or the forced one."""
    forced = _forced(reg, p)
    return [forced] if forced is not None else [i for i in reg.impls if i.candidate(p)]


def first(reg: Registry, p) -> Impl:
    """The first row that runs ``p`` in table order, or the forced one: the choice of a family that is not timed."""
    forced = _forced(reg, p)
    return forced if forced is not None else next(i for i in reg.impls if i.candidate(p))


def describe_first(reg: Registry, p) -> str:
    """For a family that is not timed: which row runs ``p``, and why each one above it does not."""
    lines = []
    for impl in reg.impls:
        why = impl.why_not(p)
        if why is None:
            return "\n".join([*lines, f"{impl.name}: runs"])
        lines.append(f"{impl.name}: {why}")
    return "\n".join(lines)


def kept_plan(plans: dict, key: tuple, choose: Callable[[], Impl], args: tuple, limit: int = 1024):
    """(row, plan or None) kept in ``plans`` for a call signature ``key``: chosen (``choose()``) and its plan built
    from ``args`` at the signature's first call; ``plans`` emptied when it holds ``limit``."""
    hit = plans.get(key)
    if hit is None:
        impl = choose()
        if len(plans) >= limit:
            plans.clear()
        hit = plans[key] = (impl, impl.plan(args) if impl.plan is not None else None)
    return hit


def _key(reg: Registry, key: tuple) -> tuple:
    return (*key, config.force_impl, config.triton_on_cpu, config.autotune, reg.kind)


def cached(reg: Registry, key: tuple) -> Choice | None:
    """The choice kept for the family key ``key``, or None."""
    return _choices.get(_key(reg, key))


def choose(reg: Registry, p, args: tuple | None, key: tuple) -> Choice | None:
    """The choice for ``p`` (``key``: the family's key of it, its shape bucket and the settings its rows read): the
    only eligible one, or on CUDA the timed one (``args``: the call's arguments; None: no call to time, the first
    eligible and nothing kept). None when the first call of a key is being captured in a CUDA graph, where nothing can
    be timed: the caller runs ``capture_row`` and nothing is kept."""
    full = _key(reg, key)
    choice = _choices.get(full)
    if choice is not None:
        return choice
    found = candidates(reg, p) if reg.rules is not None else [first(reg, p)]
    if len(found) == 1 or p.device != "cuda" or not config.autotune or args is None:
        choice = Choice(found[0], found[0])
        if args is None and len(found) > 1 and p.device == "cuda" and config.autotune:
            return choice
    elif torch.cuda.is_current_stream_capturing():
        _warn_capture(reg, p, capture_row(reg, p))
        return None
    else:
        graph, eager = time_candidates(reg, found, args, p)
        named = {i.name: i for i in (*found, reg.by_name[reg.fallback])}
        choice = Choice(named[graph], named[eager])
    _choices[full] = choice
    return choice


def capture_row(reg: Registry, p) -> Impl:
    """The row that runs a key's first call inside a CUDA-graph capture, where nothing can be timed."""
    return candidates(reg, p)[0] if reg.first_capture == "first" else reg.by_name[reg.fallback]


def pick(reg: Registry, p, args: tuple | None, key: tuple) -> Impl:
    """The row to run ``p`` now (``choose``): the choice's row for CUDA graphs while one is being captured, else its
    row for plain calls; ``capture_row`` where the capture came first."""
    return row_now(reg, p, choose(reg, p, args, key))


def row_now(reg: Registry, p, choice: Choice | None) -> Impl:
    """The row of ``choice`` for a call of ``p`` now: its graph row while a capture is under way, else its row for
    plain calls; ``capture_row`` where there is no choice yet (a capture came first)."""
    if choice is None:
        return capture_row(reg, p)
    return choice[not capturing(p.device)]


def capturing(device: str) -> bool:
    """Whether a call on ``device`` (its type) is being captured in a CUDA graph now: the choice's graph row runs."""
    return device == "cuda" and torch.cuda.is_current_stream_capturing()


def choices(reg: Registry) -> dict[tuple, Choice]:
    """The choices made so far for one registry, by key (the family's key first, as it built it)."""
    return {k: c for k, c in _choices.items() if k[-1] == reg.kind}


def reset(reg: Registry | None = None) -> None:
    """Forget the choices (of one registry, or all)."""
    for k in [k for k in _choices if reg is None or k[-1] == reg.kind]:
        del _choices[k]


_warned: set = set()


def _warn_capture(reg: Registry, p, row: Impl) -> None:
    if (reg.kind, p) not in _warned:  # the kind too: a forward's and a backward's problems can be equal tuples
        _warned.add((reg.kind, p))
        ran = "running the unfused aten path" if reg.first_capture == "fallback" else f"{row.name} runs it untimed"
        log.warning("mlp_fuser: first call for %s%s inside a CUDA-graph capture: %s; call the model once before "
                    "capturing so the fastest implementation can be chosen", reg.what, reg.describe(p), ran)


# ---- timing -------------------------------------------------------------------------------------


def _warm_up(fn: ImplFn, args: tuple) -> None:
    """Compile, autotune and run ``fn`` on the call's arguments: what a timed sample must not include."""
    for _ in range(2):
        fn(*args)


def time_candidates(reg: Registry, found: list[Impl], args: tuple, p) -> tuple[str, str]:
    """(the choice for CUDA graphs, the choice for plain calls), from each candidate's GPU and host time per call
    (``measure``) as ``decide`` weighs them under the family's rules; the fallback where none runs."""
    gpu, host = measure(reg, found, args, p)
    if not gpu:  # every fast path failed here (each said why): the aten path always runs
        return reg.fallback, reg.fallback
    best, best_eager = decide(gpu, host, p, reg.rules)
    n = reg.rules.calls
    log.info("mlp_fuser: chose %s (eager calls: %s) for %s%s (GPU / %s µs per call: %s)", best, best_eager, reg.what,
             reg.describe(p), "wall" if reg.rules.wall else "host",
             ", ".join(f"{k} {gpu[k] / n * 1e3:.1f} / {host[k] / n * 1e3:.1f}" for k in gpu))
    return best, best_eager


def measure(reg: Registry, found: list[Impl], args: tuple, p) -> tuple[dict, dict]:
    """GPU and host ms of ``rules.calls`` calls of each candidate that runs (none: empty dicts), the median of
    ``rules.rounds`` interleaved rounds. Each GPU sample queues the calls behind a spin kernel, so the GPU runs them
    back to back whatever the host costs (a CUDA-graph capture here would allocate from whatever memory pool the caller
    has set up); the host's time is the time to queue them, or (``rules.wall``) a sample of its own between syncs. The
    GPU is kept busy for ``rules.ramp_s`` first and the rounds interleave the candidates: right after an idle stretch
    the clocks are still ramping up, and timing one candidate after another would favour the last."""
    rules = reg.rules
    runnable: dict[str, ImplFn] = {}
    for impl in found:
        if impl.name == reg.fallback:
            continue  # the fast paths compute the same thing faster, in fp32 where it matters
        try:
            _warm_up(impl.fn, args)
        except Exception as e:  # a kernel that cannot compile for this shape is not chosen; say so
            log.warning("mlp_fuser: %s skipped for %s: %s: %s", impl.name, reg.describe(p), type(e).__name__, e)
            continue
        runnable[impl.name] = reg.timed(impl, args)
    if not runnable:
        return {}, {}
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < rules.ramp_s:
        for fn in runnable.values():
            fn(*args)
        torch.cuda.synchronize()
    events: dict[str, list] = {name: [] for name in runnable}
    host: dict[str, list] = {name: [] for name in runnable}
    for _ in range(rules.rounds):
        for name, fn in runnable.items():
            if rules.wall:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                for _ in range(rules.calls):
                    fn(*args)
                torch.cuda.synchronize()
                host[name].append((time.perf_counter() - t0) * 1e3)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            compat.gpu_sleep(rules.sleep_cycles)
            start.record()
            t0 = time.perf_counter()
            for _ in range(rules.calls):
                fn(*args)
            if not rules.wall:
                host[name].append((time.perf_counter() - t0) * 1e3)
            end.record()
            events[name].append((start, end))
        torch.cuda.synchronize()
    gpu = {name: _median([s.elapsed_time(e) for s, e in pairs]) for name, pairs in events.items()}
    return gpu, {name: _median(times) for name, times in host.items()}


def decide(gpu: dict[str, float], host: dict[str, float], p, rules: Rules) -> tuple[str, str]:
    """(the choice for CUDA graphs, the choice for plain calls) from GPU and host times. A call's cost: its GPU plus
    host time (its wall time where ``rules.wall``). For graphs: the fastest by GPU time; among those within
    ``rules.tie`` of it (the timing's noise), the least cost, so a lighter host wins where it saves more than its GPU
    time loses. For plain calls: the least cost, as a model run without graphs waits on the host at small M (decode).
    From ``rules.gpu_bound_m`` rows (a prefill), where the fastest GPU time also exceeds every candidate's host time,
    the host's time hides behind the GPU's whatever is chosen, so the choice for graphs stands for plain calls too; and
    there a plain call takes ``rules.baseline`` (the unfused module's GEMMs) unless the other beats it by more than
    ``rules.large_m_margin``: a few percent in isolation did not survive in situ (benchmarks/NOTES.md, eager choice
    at prefill)."""
    def cost(n):
        return host[n] if rules.wall else gpu[n] + host[n]

    best_gpu = min(gpu.values())
    within = [n for n in gpu if gpu[n] <= best_gpu * (1 + rules.tie)]
    best = min(within, key=cost) if rules.tie else within[0]  # no tie rule: the least GPU time, table order
    large = rules.gpu_bound_m is not None and p.rows >= rules.gpu_bound_m
    eager = best if large and best_gpu > max(host.values()) else min(gpu, key=cost)
    if large and rules.baseline in gpu and gpu[rules.baseline] <= gpu[eager] * (1 + rules.large_m_margin):
        eager = rules.baseline
    return best, eager


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]
