"""Random routed-experts problems shared by the kernel and backward tests: fresh values, weights as transformers
stores them (or transposed as GPT-OSS does)."""

from __future__ import annotations

import torch


def expert_tensors(gen: torch.Generator, T: int, E: int, H: int, I: int, gated: bool = True, bias: bool = False):
    """x (T, H), w_gu (E, 2I or I, H), b_gu, w_d (E, H, I), b_d in fp32, drawn from ``gen`` in this order: x, w_gu,
    w_d, b_gu, b_d (biases None without ``bias``); scaled so that activations stay O(1)."""
    rows = 2 * I if gated else I
    x = torch.randn((T, H), generator=gen)
    w_gu = torch.randn((E, rows, H), generator=gen) / H ** 0.5 * 2
    w_d = torch.randn((E, H, I), generator=gen) / I ** 0.5
    b_gu = torch.randn((E, rows), generator=gen) if bias else None
    b_d = torch.randn((E, H), generator=gen) if bias else None
    return x, w_gu, b_gu, w_d, b_d


def sentinels(gen: torch.Generator, shape, E: int) -> torch.Tensor:
    """Expert-parallel sentinel ids (>= E) of three kinds, drawn at random: just past E (the sorting program's spare
    histogram bins below next_pow2(E + 1)), past its histogram's bins, and near int32's largest."""
    bins = max(16, 1 << E.bit_length())  # the sorting program's BLOCK_E: next_pow2(E + 1), at least 16
    kinds = torch.stack([E + torch.randint(0, 3, shape, generator=gen),
                         bins + torch.randint(0, 2 * bins, shape, generator=gen),
                         2**31 - 1 - torch.randint(0, 1000, shape, generator=gen)])
    return kinds.gather(0, torch.randint(0, 3, (1, *shape), generator=gen))[0]


def stored_transposed(w_gu: torch.Tensor, w_d: torch.Tensor):
    """The same weights stored (E, H, 2I) and (E, I, H), as GPT-OSS keeps them: the kernels get transposed views."""
    return w_gu.transpose(1, 2).contiguous().transpose(1, 2), w_d.transpose(1, 2).contiguous().transpose(1, 2)
