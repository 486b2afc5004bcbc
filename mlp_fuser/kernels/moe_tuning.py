"""The experts kernels' tile configs, per device: data, looked up by the device's (capability, SM count).

``TUNED`` holds each measured device's table: per kind of launch and M bucket, the candidates in order of preference
(benchmarks/NOTES.md, "Mixtures of experts"). A device not in it (another GPU, or the same one cut down) gets
``rule_table``: the measured candidates that fit its shared memory, each with as many of its stages as fit; then,
for every device, ``moe.default_config`` takes the first candidate whose grid fills the device's own SMs.
"""

from __future__ import annotations

from functools import cache

import torch

from .common import k_loop_fits, num_sms, smem_per_sm


def _cfg(bm: int, bn: int, bk: int, warps: int, stages: int) -> dict:
    return {"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "num_warps": warps, "num_stages": stages}


# Candidates per kind and M bucket (rows per touched expert, rounded up to 16, 64 or 128), timed on an H200.
# Two weight tiles per K step in gate_up; every one fits k_loop_fits in bf16.
H200: dict[str, dict[int, list[dict]]] = {
    "gate_up": {
        16: [_cfg(16, 64, 128, 4, 4), _cfg(16, 32, 128, 4, 5), _cfg(16, 64, 64, 4, 6), _cfg(16, 32, 256, 4, 4)],
        64: [_cfg(64, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 3), _cfg(32, 64, 128, 4, 4), _cfg(64, 64, 128, 4, 3)],
        128: [_cfg(128, 128, 64, 8, 3), _cfg(128, 64, 64, 4, 4), _cfg(64, 128, 64, 4, 4), _cfg(128, 128, 32, 8, 4),
              _cfg(128, 128, 64, 8, 4), _cfg(64, 128, 64, 8, 4)],
    },
    "down": {
        16: [_cfg(16, 128, 128, 4, 4), _cfg(16, 64, 128, 4, 5), _cfg(16, 32, 256, 4, 4), _cfg(16, 64, 256, 4, 4)],
        64: [_cfg(64, 64, 64, 4, 4), _cfg(32, 128, 128, 4, 4), _cfg(64, 128, 64, 4, 4), _cfg(64, 128, 128, 8, 3)],
        128: [_cfg(128, 256, 64, 8, 4), _cfg(128, 256, 64, 8, 3), _cfg(128, 128, 64, 8, 4), _cfg(64, 256, 64, 8, 3),
              _cfg(64, 128, 64, 4, 4), _cfg(128, 64, 64, 4, 4)],
    },
    # weights by TMA (benchmarks/NOTES.md, "Large M"): measured at 128 rows per expert only
    "gate_up_tma": {
        128: [_cfg(128, 128, 64, 8, 4), _cfg(128, 128, 64, 8, 3), _cfg(128, 64, 128, 8, 3)],
    },
    "down_tma": {
        128: [_cfg(128, 256, 64, 8, 3), _cfg(128, 128, 64, 8, 4), _cfg(128, 128, 128, 8, 3)],
    },
    "gate_up_pairs": {
        1: [_cfg(1, 16, 256, 4, 3), _cfg(1, 32, 256, 4, 3), _cfg(1, 16, 512, 4, 3), _cfg(1, 8, 512, 4, 3),
            _cfg(1, 32, 128, 4, 4)],
    },
    "down_tokens": {
        1: [_cfg(1, 32, 256, 4, 3), _cfg(1, 16, 256, 4, 3), _cfg(1, 64, 128, 4, 3), _cfg(1, 16, 512, 4, 3),
            _cfg(1, 8, 512, 4, 3), _cfg(1, 32, 512, 8, 3)],
    },
}

# W8A8 grouped GEMMs (fp8 x and weights, scales per K step) from 64 rows per expert, 128-wide K steps (an H100 sweep,
# benchmarks/NOTES.md, "FP8 routed experts"); gate/up on 8 warps (on 4 it spills); fewer rows take the bf16 table's.
FP8_W8A8 = {"gate_up": _cfg(64, 64, 128, 8, 3), "down": _cfg(64, 128, 128, 4, 3)}
# The TMA kernels' (float8 weight boxes, sorted_tma; a K step scaled by one weight scale a tile, moe.ws_tile), by
# mean rows per touched expert (an H100 grid, NOTES "FP8 experts at prefill"): 128-row tiles on 8 warps from
# FP8_TMA_BIG_ROWS, 64-row tiles below.
FP8_TMA_BIG_ROWS = 256
FP8_TMA = {64: {"gate_up_tma": _cfg(64, 64, 128, 4, 3), "down_tma": _cfg(64, 128, 128, 4, 3)},
           FP8_TMA_BIG_ROWS: {"gate_up_tma": _cfg(128, 128, 128, 8, 4), "down_tma": _cfg(128, 128, 128, 8, 4)}}


def fp8_tma_config(kind: str, rows: float) -> dict:
    """A W8A8 TMA launch's config (``kind``: gate_up_tma or down_tma) for ``rows`` mean rows per touched expert."""
    return dict(FP8_TMA[FP8_TMA_BIG_ROWS if rows >= FP8_TMA_BIG_ROWS else 64][kind])

# (compute capability, SM count) -> its table. The H100 SXM shares the H200's key (GH100, 132 SMs): its table too.
TUNED: dict[tuple[tuple[int, int], int], dict[str, dict[int, list[dict]]]] = {
    ((9, 0), 132): H200,
}

SMEM_BUDGET = 200 * 1024  # of an sm90's 228 KiB per SM, the rest left to the epilogue (NOTES, shared memory rule)
_EPILOGUE = 28 * 1024


def n_weights(kind: str) -> int:
    """Weight tiles per K step of a kind's kernel (gate and up: two)."""
    return 2 if kind in ("gate_up", "gate_up_tma") else 1


def device_key(device: torch.device) -> tuple[tuple[int, int], int]:
    """(compute capability, SM count) of a CUDA device: ``TUNED``'s key."""
    return _capability(device), num_sms(device)


@cache
def _capability(device: torch.device) -> tuple[int, int]:
    if device.type != "cuda":
        return (0, 0)
    props = torch.cuda.get_device_properties(device)
    return props.major, props.minor


def smem_budget(device: torch.device) -> int:
    """Bytes of shared memory a config's K loop may take on ``device``: an sm90's 200 KiB at most."""
    return min(SMEM_BUDGET, smem_per_sm(device) - _EPILOGUE)


@cache
def table(device: torch.device) -> dict[str, dict[int, list[dict]]]:
    """The configs for ``device``: its measured table in ``TUNED``, else ``rule_table``'s."""
    return TUNED.get(device_key(device)) or rule_table(smem_budget(device))


@cache
def rule_table(budget: int) -> dict[str, dict[int, list[dict]]]:
    """For a device nobody measured: the H200's candidates in its order, each with its stages cut (to 2 at least)
    until its bf16 K loop fits ``budget`` bytes; those that do not fit even then are dropped, the smallest kept where
    none fits."""
    out: dict[str, dict[int, list[dict]]] = {}
    for kind, buckets in H200.items():
        out[kind] = {}
        for bucket, cands in buckets.items():
            fitted = []
            for c in cands:
                c = dict(c)
                while c["num_stages"] > 2 and not _fits(c, kind, budget):
                    c["num_stages"] -= 1
                if _fits(c, kind, budget):
                    fitted.append(c)
            smallest = min(cands, key=lambda c: c["BLOCK_M"] * c["BLOCK_N"] * c["BLOCK_K"])
            out[kind][bucket] = fitted or [{**smallest, "num_stages": 2}]
    return out


def _fits(c: dict, kind: str, budget: int) -> bool:
    return k_loop_fits(c["num_stages"], c["BLOCK_M"], c["BLOCK_K"], c["BLOCK_N"], n_weights(kind), 2, budget)
