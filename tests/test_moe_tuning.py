"""The experts' configs per device (kernels/moe_tuning): the H200's measured table where the device is one, the rule
for any other, and the SM count read from the device; on the CPU, with the device's properties faked."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from mlp_fuser.kernels import common, moe, moe_tuning
from mlp_fuser.kernels.common import k_loop_fits

H200 = dict(name="NVIDIA H200", major=9, minor=0, multi_processor_count=132,
            shared_memory_per_multiprocessor=228 * 1024)
A100 = dict(name="NVIDIA A100-SXM4-80GB", major=8, minor=0, multi_processor_count=108,
            shared_memory_per_multiprocessor=164 * 1024)
RTX4090 = dict(name="NVIDIA GeForce RTX 4090", major=8, minor=9, multi_processor_count=128,
               shared_memory_per_multiprocessor=100 * 1024)
CUDA0 = torch.device("cuda", 0)


def _clear():
    for f in (common.num_sms, common.smem_per_sm, moe_tuning._capability, moe_tuning.table, moe_tuning.rule_table,
              moe._default_config):
        f.cache_clear()


@pytest.fixture
def gpu(monkeypatch):
    """gpu(props): cuda:0 is a GPU with these properties from here on (the kernels compiled, not interpreted)."""
    monkeypatch.setattr(moe, "INTERPRET", False)

    def fake(props):
        monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: SimpleNamespace(**props))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        _clear()

    yield fake
    monkeypatch.undo()
    _clear()


def _h200_rule(kind, T, k, E, H, I, dtype):
    """default_config as it was before tables per device: the H200's candidates, its 132 SMs, 200 KiB."""
    buckets = moe.CONFIGS[kind]

    def filling(cands, S, N):
        touched = max(1, min(E, S))
        programs = [(touched if c["BLOCK_M"] <= 16 else -(-S // c["BLOCK_M"]) + touched // 2) * -(-N // c["BLOCK_N"])
                    for c in cands]
        return next((c for c, n in zip(cands, programs) if n >= 132), cands[programs.index(max(programs))])

    if kind in ("gate_up_tma", "down_tma"):
        cfg = dict(filling(buckets[128], T * k, I if kind == "gate_up_tma" else H))
    elif kind in ("gate_up", "down"):
        cfg = dict(filling(buckets[moe.rows_bucket(T, k, E)], T * k, I if kind == "gate_up" else H))
    else:
        rows, width = (T * k, I) if kind == "gate_up_pairs" else (T, H)
        programs = [rows * -(-width // c["BLOCK_N"]) for c in buckets[1]]
        enough = [c for c, n in zip(buckets[1], programs) if n >= 264]
        cfg = dict(enough[0] if enough else buckets[1][programs.index(max(programs))])
    n = moe_tuning.n_weights(kind)
    size = torch.empty((), dtype=dtype).element_size()
    while cfg["num_stages"] > 2 and not k_loop_fits(cfg["num_stages"], cfg["BLOCK_M"], cfg["BLOCK_K"],
                                                    cfg["BLOCK_N"], n, size):
        cfg["num_stages"] -= 1
    return cfg


def test_the_h200_gets_its_table_and_the_same_configs_as_before(gpu):
    gpu(H200)
    assert moe_tuning.device_key(CUDA0) == ((9, 0), 132) and moe_tuning.table(CUDA0) is moe_tuning.H200
    assert moe_tuning.smem_budget(CUDA0) == 200 * 1024
    for kind in moe.CONFIGS:
        for T, k, E, H, I in [(1, 8, 128, 2048, 768), (32, 8, 128, 2048, 768), (2048, 2, 8, 4096, 14336),
                              (1, 8, 64, 2880, 2880), (512, 4, 32, 1024, 480), (4096, 8, 128, 4096, 1536)]:
            for dtype in (torch.bfloat16, torch.float32):
                assert moe.default_config(kind, T, k, E, H, I, dtype, CUDA0) == _h200_rule(kind, T, k, E, H, I, dtype)
    # the GEMVs keep every SM streaming: at T = 1 the widest BLOCK_N that still gives two programs per SM
    assert moe.default_config("down_tokens", 1, 8, 128, 2048, 768, torch.bfloat16, CUDA0)["BLOCK_N"] == 8
    assert moe.default_config("down_tokens", 32, 8, 128, 2048, 768, torch.bfloat16, CUDA0)["BLOCK_N"] == 32
    assert moe.default_config("gate_up_pairs", 1, 8, 128, 2048, 768, torch.bfloat16, CUDA0)["BLOCK_N"] == 16
    assert moe.default_config("gate_up", 2048, 2, 8, 4096, 14336, torch.bfloat16, CUDA0)["BLOCK_M"] == 128
    assert moe.default_config("gate_up", 2048, 2, 8, 4096, 14336, torch.float32, CUDA0)["num_stages"] == 2


def test_an_unknown_device_gets_the_rule_with_its_own_sms_and_shared_memory(gpu):
    gpu(A100)
    assert moe_tuning.table(CUDA0) is not moe_tuning.H200
    # 8 pairs x 30 column tiles = 240 programs: two per SM of 108, not of the H200's 132
    assert moe.default_config("gate_up_pairs", 1, 8, 128, 2048, 480, torch.bfloat16, CUDA0)["BLOCK_N"] == 16
    gpu(H200)
    assert moe.default_config("gate_up_pairs", 1, 8, 128, 2048, 480, torch.bfloat16, CUDA0)["BLOCK_N"] == 8
    gpu(RTX4090)  # 100 KiB of shared memory per SM: every candidate cut to fit 72 KiB
    table, budget = moe_tuning.table(CUDA0), moe_tuning.smem_budget(CUDA0)
    assert budget == 72 * 1024 and table is not moe_tuning.H200
    for kind, buckets in table.items():
        for cands in buckets.values():  # each fits, or none did and the smallest stands alone
            assert cands and all(c["num_stages"] >= 2 for c in cands)
            assert all(moe_tuning._fits(c, kind, budget) for c in cands) or len(cands) == 1
    cfg = moe.default_config("gate_up", 2048, 2, 8, 4096, 14336, torch.bfloat16, CUDA0)
    assert k_loop_fits(cfg["num_stages"], cfg["BLOCK_M"], cfg["BLOCK_K"], cfg["BLOCK_N"], 2, 2, budget)
    assert cfg != _h200_rule("gate_up", 2048, 2, 8, 4096, 14336, torch.bfloat16)


def test_a_measured_device_is_a_row_of_data(gpu, monkeypatch):
    gpu(A100)
    mine = {kind: {b: [dict(c, num_warps=8) for c in cands] for b, cands in buckets.items()}
            for kind, buckets in moe_tuning.H200.items()}
    monkeypatch.setitem(moe_tuning.TUNED, ((8, 0), 108), mine)
    moe_tuning.table.cache_clear()
    assert moe_tuning.table(CUDA0) is mine
    assert moe.default_config("down", 64, 8, 64, 2048, 768, torch.bfloat16, CUDA0)["num_warps"] == 8
