"""CPU smoke tests of the MoE benchmarks: each runs its tiny configuration and writes its table."""

import json
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_bench_moe_tiny_through_the_cli(tmp_path, capsys):
    from mlp_fuser import cli

    code = cli.main(["bench", "--moe", "--tiny", "--device", "cpu", "--ms", "1,5", "--out", str(tmp_path)])
    assert code == 0
    out = capsys.readouterr().out
    rows = json.load(open(tmp_path / "moe.json"))["rows"]
    assert [r["M"] for r in rows] == [1, 5]
    for r in rows:
        assert set(r["errors"]) == {"ours", "grouped_mm", "batched_mm", "eager"}
        assert all(0 <= e < 1e-5 for e in r["errors"].values()), r["errors"]  # fp32 against float64
        assert r["check_ok"] and r["impl"] == "reference"
    assert out.count("| tiny |") == 2 and "target met" in out
    assert (tmp_path / "moe.md").read_text().count("| tiny |") == 2


def _row(**kw):
    row = dict(experts="Qwen3-30B-A3B", M=2048, floor_us=100.0, bound="mem", errors={"ours": 1e-3, "grouped_mm": 1e-3},
               graph_us={"ours": 200.0, "grouped_mm": 600.0}, plain_us={}, skipped={})
    row.update(kw)
    return row


def test_moe_targets_and_check():
    from mlp_fuser.bench_moe import finish

    assert finish(_row())["target"].startswith("yes (>= 2.5x grouped_mm: 3.00x")
    assert finish(_row(graph_us={"ours": 300.0, "grouped_mm": 600.0}))["target"].startswith("NO")
    assert finish(_row(experts="Mixtral-8x7B", graph_us={"ours": 450.0, "grouped_mm": 600.0}))["target"].startswith(
        "yes (>= 1.3x")
    small = finish(_row(M=8, graph_us={"ours": 130.0, "grouped_mm": 600.0}))
    assert small["pct_floor"] == pytest.approx(100 / 1.3) and small["target"].startswith("NO (>= 80% of floor")
    assert finish(_row(M=256, graph_us={"ours": 140.0, "grouped_mm": 600.0}))["target"].startswith("yes (>= 70%")
    assert finish(_row(M=8192))["target"] == "– (no target)"
    wrong = finish(_row(errors={"ours": 1.3e-3, "grouped_mm": 1e-3}))
    assert not wrong["check_ok"] and wrong["target"].startswith("NO (error 1.30x")


def test_moe_reference64_matches_transformers_eager():
    import torch

    from mlp_fuser.bench_moe import build_experts, reference64, rel_err, routing

    mod = build_experts("qwen3_moe", 32, 16, 6, 2, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=g)
    ids, wts = routing(9, 6, 2, torch.float32, "cpu", g)
    assert torch.allclose(wts.sum(-1), torch.ones(9))
    mod.config._experts_implementation = "eager"
    with torch.no_grad():
        assert rel_err(mod(x, ids, wts), reference64(x, ids, wts, mod.gate_up_proj, mod.down_proj)) < 1e-6
