"""Routing metadata for the grouped expert GEMMs, built on the device with static shapes (no host sync).

``moe_align(ids, E, BLOCK_M)`` sorts the S = T·k token-expert pairs (pair p = t·k + j) by expert and pads each
expert's run to a multiple of BLOCK_M with the sentinel S, so that every BLOCK_M-row block of the sorted list belongs
to one expert. Pairs whose id is not in [0, E) (expert-parallel sentinels) are dropped. Within an expert the pairs
keep their order (ascending p), so the torch and Triton versions give identical results.

Shapes are static upper bounds: B_max = cdiv(S + (BLOCK_M - 1) · min(E, S), BLOCK_M) blocks; ``num_blocks`` (on the
device) says how many are used, and block_expert is E past it, so that programs for unused blocks exit at once.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl
from torch import Tensor

from .common import INTERPRET, Prepared, cdiv, launch, next_power_of_2

TRITON_MAX_PAIRS = 4096  # one program sorts every pair in registers: beyond this the torch version is used


class Routing(NamedTuple):
    sorted_pairs: Tensor  # int32 (B_max·BLOCK_M,): pair ids grouped by expert, runs padded with S
    block_expert: Tensor  # int32 (B_max,): the expert of each block, E past num_blocks
    num_blocks: Tensor  # int32 (1,): blocks in use
    block_m: int
    k: int  # experts per token: pair p is token p // k


def max_blocks(S: int, E: int, block_m: int) -> int:
    return cdiv(S + (block_m - 1) * min(E, S), block_m)


def moe_align_torch(ids: Tensor, E: int, block_m: int) -> Routing:
    """The reference: torch ops only, no host sync (fine for any S)."""
    T, k = ids.shape
    S, dev = T * k, ids.device
    n_blocks = max_blocks(S, E, block_m)
    flat = ids.reshape(-1).long()
    expert = torch.where((flat >= 0) & (flat < E), flat, E)  # dropped pairs go to bin E
    counts = torch.zeros(E + 1, dtype=torch.long, device=dev).scatter_add_(0, expert, torch.ones_like(expert))[:E]
    blocks = (counts + block_m - 1) // block_m
    block_end = blocks.cumsum(0)
    block_start = torch.cat([block_end.new_zeros(1), block_end])  # index E: the dump slot of dropped pairs
    count_start = torch.cat([counts.new_zeros(1), counts.cumsum(0)])
    order = torch.argsort(expert, stable=True)
    sorted_expert = expert[order]
    rank = torch.arange(S, device=dev) - count_start[sorted_expert]
    dest = torch.where(sorted_expert < E, block_start[sorted_expert] * block_m + rank, n_blocks * block_m)
    sorted_pairs = torch.full((n_blocks * block_m + 1,), S, dtype=torch.int32, device=dev)
    sorted_pairs.scatter_(0, dest, order.to(torch.int32))
    b = torch.arange(n_blocks, device=dev)
    block_expert = torch.searchsorted(block_end, b, right=True).to(torch.int32)  # E past the last used block
    num_blocks = block_end[-1:].to(torch.int32) if E > 0 else torch.zeros(1, dtype=torch.int32, device=dev)
    return Routing(sorted_pairs[:-1], block_expert, num_blocks, block_m, k)


@triton.jit
def _moe_align_kernel(
    ids_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr,
    S, E, n_sorted, n_blocks,
    BLOCK_M: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr,
):
    # -- experts of all S pairs (BLOCK_S >= S lanes), dropped and padding lanes in bin E -------------
    offs_s = tl.arange(0, BLOCK_S)
    ids = tl.load(ids_ptr + offs_s, mask=offs_s < S, other=E)
    expert = tl.where((ids >= 0) & (ids < E), ids, E).to(tl.int32)

    # -- per-expert counts, blocks and starts (BLOCK_E > E bins) -------------------------------------
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.where(offs_e < E, tl.histogram(expert, BLOCK_E), 0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_start = tl.cumsum(blocks, 0) - blocks
    count_start = tl.cumsum(counts, 0) - counts
    num_blocks = tl.sum(blocks, 0)

    # -- sort the keys expert·BLOCK_S + p: pairs by expert, ascending p inside; rank = place in the run ---
    keys = tl.sort(expert * BLOCK_S + offs_s)
    sorted_expert = keys // BLOCK_S
    pair = keys % BLOCK_S
    valid = sorted_expert < E
    rank = offs_s - tl.gather(count_start, sorted_expert, 0)
    dest = tl.gather(block_start, sorted_expert, 0) * BLOCK_M + rank

    # -- the padding everywhere first, then (after the barrier) the pairs over it ---------------------
    for start in range(0, n_sorted, FILL):
        offs_f = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs_f, S, mask=offs_f < n_sorted)
    for start in range(0, n_blocks, FILL):  # unused blocks only: the used ones are written below
        offs_f = start + tl.arange(0, FILL)
        tl.store(block_expert_ptr + offs_f, E, mask=(offs_f < n_blocks) & (offs_f >= num_blocks))
    tl.debug_barrier()
    tl.store(sorted_ptr + dest, pair, mask=valid)
    tl.store(block_expert_ptr + dest // BLOCK_M, sorted_expert, mask=valid & (rank % BLOCK_M == 0))
    tl.store(num_blocks_ptr, num_blocks)


def moe_align_triton(ids: Tensor, E: int, block_m: int) -> Routing:
    """One single-program Triton launch (S up to TRITON_MAX_PAIRS)."""
    T, k = ids.shape
    S, dev = T * k, ids.device
    if S > TRITON_MAX_PAIRS:
        raise ValueError(f"moe_align_triton: ids has {S} pairs, more than {TRITON_MAX_PAIRS}; use moe_align_torch")
    n_blocks = max_blocks(S, E, block_m)
    sorted_pairs = torch.empty(n_blocks * block_m, dtype=torch.int32, device=dev)
    block_expert = torch.empty(n_blocks, dtype=torch.int32, device=dev)
    num_blocks = torch.empty(1, dtype=torch.int32, device=dev)
    if S == 0:
        return Routing(sorted_pairs, block_expert, num_blocks.zero_(), block_m, k)
    flat = ids.reshape(-1)  # a copy only where ids is not contiguous
    launch(_moe_align_kernel, (1,), flat, sorted_pairs, block_expert, num_blocks, *_align_args(S, E, block_m),
           **_align_constexprs(S, E, block_m))
    return Routing(sorted_pairs, block_expert, num_blocks, block_m, k)


def _align_args(S: int, E: int, block_m: int) -> tuple:
    """The sorting program's integer arguments."""
    n_blocks = max_blocks(S, E, block_m)
    return S, E, n_blocks * block_m, n_blocks


def _align_constexprs(S: int, E: int, block_m: int) -> dict:
    """The sorting program's constexprs and launch options."""
    return dict(BLOCK_M=block_m, BLOCK_S=max(16, next_power_of_2(S)), BLOCK_E=max(16, next_power_of_2(E + 1)),
                FILL=1024, num_warps=4 if S <= 1024 else 8)


# ---- many pairs: counts and ranks by atomics over many programs, then starts, then placement -------------------


@triton.jit
def _count_kernel(ids_ptr, counts_ptr, rank_ptr, S, E, BLOCK: tl.constexpr):
    # -- each pair takes the next free rank in its expert's run (the order within a run changes no result) ---
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=E)
    valid = (ids >= 0) & (ids < E)
    rank = tl.atomic_add(counts_ptr + tl.where(valid, ids, 0), 1, mask=valid)
    tl.store(rank_ptr + offs, rank, mask=offs < S)


@triton.jit
def _starts_kernel(counts_ptr, start_ptr, sorted_ptr, block_expert_ptr, num_blocks_ptr, S, E, n_sorted, n_blocks,
                   BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr, FILL: tl.constexpr):
    # -- block starts per expert, the padding, each block's expert ------------------------------------
    offs_e = tl.arange(0, BLOCK_E)
    counts = tl.load(counts_ptr + offs_e, mask=offs_e < E, other=0)
    blocks = (counts + BLOCK_M - 1) // BLOCK_M
    block_end = tl.cumsum(blocks, 0)
    tl.store(start_ptr + offs_e, block_end - blocks, mask=offs_e < E)
    tl.store(num_blocks_ptr, tl.sum(blocks, 0))
    for start in range(0, n_sorted, FILL):
        offs_f = start + tl.arange(0, FILL)
        tl.store(sorted_ptr + offs_f, S, mask=offs_f < n_sorted)
    ends = tl.where(offs_e < E, block_end, 1 << 30)
    for start in range(0, n_blocks, FILL):  # block b belongs to the first expert whose run ends after it
        offs_b = start + tl.arange(0, FILL)
        e = tl.sum((ends[None, :] <= offs_b[:, None]).to(tl.int32), 1)
        tl.store(block_expert_ptr + offs_b, e, mask=offs_b < n_blocks)


@triton.jit
def _place_kernel(ids_ptr, rank_ptr, start_ptr, sorted_ptr, S, E, BLOCK_M: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ids = tl.load(ids_ptr + offs, mask=offs < S, other=E)
    valid = (ids >= 0) & (ids < E)
    e = tl.where(valid, ids, 0)
    dest = tl.load(start_ptr + e, mask=valid, other=0) * BLOCK_M + tl.load(rank_ptr + offs, mask=valid, other=0)
    tl.store(sorted_ptr + dest, offs, mask=valid)


def moe_align_atomic(ids: Tensor, E: int, block_m: int) -> Routing:
    """Many pairs: ranks by atomics over many programs, then starts (one program), then placement: four launches,
    each short, where one program sorting every pair would take long. Within an expert the order of the pairs is
    the atomics' (any order gives the same results)."""
    T, k = ids.shape
    return _atomic_plan(T * k, k, E, block_m, ids.device)(ids)


SORT_MAX_PAIRS = 1024  # up to here one program sorting every pair is quickest; beyond, the atomics' four launches


def _on_triton(ids: Tensor) -> bool:
    return (ids.is_cuda or INTERPRET) and ids.dtype in (torch.int32, torch.int64)


def _sorts_in_one_program(ids: Tensor) -> bool:
    return _on_triton(ids) and ids.numel() <= SORT_MAX_PAIRS


def moe_align(ids: Tensor, E: int, block_m: int) -> Routing:
    """Pairs sorted by expert and padded to BLOCK_M, on the device: one sorting program for few pairs, the atomic
    version for many (and torch ops where Triton does not run)."""
    if _sorts_in_one_program(ids):
        return moe_align_triton(ids, E, block_m)
    if _on_triton(ids) and ids.numel() > 0:
        return moe_align_atomic(ids, E, block_m)
    return moe_align_torch(ids, E, block_m)


def align_plan(ids: Tensor, E: int, block_m: int) -> Callable[[Tensor], Routing]:
    """``moe_align`` as a function of the ids, for ids of this one's shape, strides, dtype and device: the launches'
    arguments worked out here, once (where torch ops sort, ``moe_align``)."""
    T, k = ids.shape
    S, dev = T * k, ids.device
    if S == 0 or not _on_triton(ids):
        return lambda ids: moe_align(ids, E, block_m)
    if not _sorts_in_one_program(ids):
        return _atomic_plan(S, k, E, block_m, dev)
    n_blocks, int32 = max_blocks(S, E, block_m), torch.int32
    ints = _align_args(S, E, block_m)
    sort = Prepared(_moe_align_kernel, (1,), **_align_constexprs(S, E, block_m))

    def align(ids: Tensor) -> Routing:
        sorted_pairs = torch.empty(n_blocks * block_m, dtype=int32, device=dev)
        block_expert = torch.empty(n_blocks, dtype=int32, device=dev)
        num_blocks = torch.empty(1, dtype=int32, device=dev)
        sort(ids.reshape(-1), sorted_pairs, block_expert, num_blocks, *ints)
        return Routing(sorted_pairs, block_expert, num_blocks, block_m, k)
    return align


def _atomic_plan(S: int, k: int, E: int, block_m: int, dev: torch.device) -> Callable[[Tensor], Routing]:
    """``moe_align_atomic``'s launches with their arguments worked out once."""
    n_blocks, BLOCK, int32 = max_blocks(S, E, block_m), 1024, torch.int32
    count = Prepared(_count_kernel, (cdiv(S, BLOCK),), BLOCK=BLOCK)
    starts = Prepared(_starts_kernel, (1,), BLOCK_M=block_m, BLOCK_E=max(16, next_power_of_2(E)), FILL=64,
                      num_warps=8)
    place = Prepared(_place_kernel, (cdiv(S, BLOCK),), BLOCK_M=block_m, BLOCK=BLOCK)

    def align(ids: Tensor) -> Routing:
        sorted_pairs = torch.empty(n_blocks * block_m, dtype=int32, device=dev)
        block_expert = torch.empty(n_blocks, dtype=int32, device=dev)
        num_blocks = torch.empty(1, dtype=int32, device=dev)
        counts = torch.zeros(E, dtype=int32, device=dev)
        rank = torch.empty(S, dtype=int32, device=dev)
        start = torch.empty(E, dtype=int32, device=dev)
        flat = ids.reshape(-1)
        count(flat, counts, rank, S, E)
        starts(counts, start, sorted_pairs, block_expert, num_blocks, S, E, n_blocks * block_m, n_blocks)
        place(flat, rank, start, sorted_pairs, S, E)
        return Routing(sorted_pairs, block_expert, num_blocks, block_m, k)
    return align
