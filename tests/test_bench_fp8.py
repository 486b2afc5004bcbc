"""The FP8 benchmark (``python -m mlp_fuser bench --fp8``) on the CPU: its tiny run, and torch's scaled-GEMM peer
against an emulation of the GEMM's scale recipes."""

import json

import pytest
import torch
import torch.nn.functional as F

from mlp_fuser import compat, config
from mlp_fuser.dispatch import fp8_experts
from mlp_fuser.kernels import fp8 as K8
from mlp_fuser.tools import bench_fp8


def test_bench_fp8_tiny_through_the_cli(tmp_path, capsys):
    from mlp_fuser import cli

    assert cli.main(["bench", "--fp8", "--tiny", "--device", "cpu", "--out", str(tmp_path)]) == 0
    out = capsys.readouterr().out
    rows = json.load(open(tmp_path / "fp8.json"))["rows"]
    assert [(r["case"], r["M"]) for r in rows] == [(c, m) for c in ("tiny MLP", "tiny experts") for m in (1, 5)]
    for r in rows:
        assert set(r["us"]) == {"bf16_op", "fp8_op"}  # the kernels, the peer and transformers' layers: CUDA only
        assert r["errors"]["fp8_op"] < 1e-5 and r["errors"]["bf16_op"] < 1e-5  # fp32 on the dequantized weights
        assert r["vs_bf16_op"] == r["us"]["bf16_op"] / r["us"]["fp8_op"] and r["floor_us"] is None
    for r in rows[:2]:  # x and h quantized per token and 128 columns: e4m3's error, no more
        assert 5e-3 < r["errors"]["aten_fp8"] < 0.1
        assert r["impl"] == "aten_dequantize" and r["skipped"]["w8a8"].startswith("x is on cpu")
        assert r["skipped"]["transformers"].startswith("transformers' FP8 kernel does not load here")
    assert rows[2]["impl"] == "aten_dequantize" and "aten_fp8" not in rows[2]["errors"]
    assert out.count("| tiny MLP |") == 2 and out.count("| tiny experts |") == 2
    assert (tmp_path / "fp8.md").read_text().count("| tiny ") == 4
    assert all(line.count("|") == bench_fp8.HEADER.split("\n")[0].count("|") for line in out.splitlines()
               if line.startswith("| tiny"))  # every row fills the header's columns


@pytest.mark.usefixtures("exact_fp8_casts")
def test_bench_fp8_times_each_one_token_experts_row(monkeypatch):
    """At one token the experts rows the FP8 table times (sorted, unsorted, one launch) are each timed forced, beside
    the op, in a column of their own; at a few pairs the sorted row and the one launch; past them the one row runs
    alone; the op's row is named."""
    monkeypatch.setattr(config, "triton_on_cpu", True)  # the kernels under the interpreter
    monkeypatch.setattr(config, "fp8_one_launch", True)
    monkeypatch.setattr(fp8_experts, "_PLANS", {})
    case = bench_fp8.TINY_CASES["tiny_experts"]
    setup = bench_fp8.Experts(case.dims, "cpu", torch.float32, torch.Generator().manual_seed(0))
    rows = ["fp8_moe_sorted_w8a8", "fp8_moe_unsorted_w8a8", "fp8_moe_unsorted_pdl_w8a8", "fp8_moe_one_launch"]
    one = bench_fp8.bench_row(case, setup, 1, None, "cpu")
    assert set(one["us"]) == {"bf16_op", "fp8_op", *rows} and one["impl"] == rows[0]
    assert all(one["errors"][n] == one["errors"]["fp8_op"] < 0.05 for n in rows[:3])  # the same bits, W8A8's error
    assert one["errors"]["fp8_moe_one_launch"] < one["errors"]["fp8_op"]  # W8A16: x unquantized
    at = [c.strip() for c in bench_fp8.HEADER.split("\n")[0].split("|")].index("FP8 rows µs")
    assert bench_fp8.format_row(one).split("|")[at].strip() == ", ".join(
        f"{n.removeprefix('fp8_moe_')} {one['us'][n]:.1f}" for n in rows)
    assert config.force_impl is None  # each forced call restored it
    five = bench_fp8.bench_row(case, setup, 5, None, "cpu")  # 10 pairs of 8 experts: the one launch timed too
    assert set(five["us"]) == {"bf16_op", "fp8_op", rows[0], rows[3]} and five["impl"] == rows[0]
    many = bench_fp8.bench_row(case, setup, 16, None, "cpu")  # 32 pairs of 8 experts: the sorted row alone
    assert set(many["us"]) == {"bf16_op", "fp8_op"} and many["impl"] == rows[0]
    assert bench_fp8.format_row(many).split("|")[at].strip() == "–"


def _emulated_scaled_mm(a, b, scale_a, scale_b, recipe, out_dtype):
    """torch's scaled GEMM in float64, reading the scales as each recipe lays them out."""
    a64, b64 = a.double(), b.double()
    if recipe == "rowwise":
        assert scale_a.shape == (a.shape[0], 1) and scale_b.shape == (1, b.shape[1])
        return ((a64 * scale_a.double()) @ (b64 * scale_b.double())).to(out_dtype)
    K, N = b.shape
    kb = -(-K // 128)  # torch's layouts (ScaledBlas.cpp): x's scales (M, K/128) unpadded, the weight's K blocks to 4
    assert a.shape[0] % 4 == 0 and scale_a.shape == (a.shape[0], kb) and scale_b.shape[0] == -(-kb // 4) * 4
    assert scale_a.stride(0) == 1  # outer-dim-major
    sa = scale_a.double().repeat_interleave(128, 1)[:, :K]
    sb = scale_b.double().repeat_interleave(128, 0)[:K].repeat_interleave(128, 1)[:, :N]
    return ((a64 * sa) @ (b64 * sb)).to(out_dtype)


def test_scaled_mm_peer_blockwise_first_then_rowwise(monkeypatch):
    g = torch.Generator().manual_seed(4)
    H, I = 256, 384
    fws = [K8.fp8_weight(*K8.quantize_blocks(torch.randn(n, k, generator=g) * k**-0.5), (128, 128))
           for n, k in ((I, H), (I, H), (H, I))]
    x = torch.randn(7, H, generator=g)
    deq = [K8.dequantize(f, torch.float64) for f in fws]
    ref = (F.silu(x.double() @ deq[0].T) * (x.double() @ deq[1].T)) @ deq[2].T
    monkeypatch.setattr(compat, "scaled_mm", _emulated_scaled_mm)
    recipe, mlp, why = bench_fp8.scaled_mm_mlp(fws, x, ref)
    assert recipe == "blockwise" and why == ""
    # blockwise reads the weights as stored: only the activations' quantization separates it from the reference
    xq = bench_fp8.q_tokens64(x)
    hq = bench_fp8.q_tokens64((F.silu(xq @ deq[0].T) * (xq @ deq[1].T)).float())
    assert bench_fp8.rel_err(mlp(x), hq @ deq[2].T) < 1e-5

    def no_blocks(a, b, scale_a, scale_b, recipe, out_dtype):
        if recipe == "blockwise":
            raise RuntimeError("Invalid scaling configuration")
        return _emulated_scaled_mm(a, b, scale_a, scale_b, recipe, out_dtype)

    monkeypatch.setattr(compat, "scaled_mm", no_blocks)
    recipe, mlp, why = bench_fp8.scaled_mm_mlp(fws, x, ref)
    assert recipe == "rowwise" and why == "blockwise: RuntimeError: Invalid scaling configuration"
    assert 1e-3 < bench_fp8.rel_err(mlp(x), ref) < 0.1
