"""CPU smoke tests of the MoE benchmarks: each runs its tiny configuration and writes its table."""

import importlib
import json
import os
import sys

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
    assert out.count("| tiny |") == 2 and "% of floor" in out and "target" not in out
    assert (tmp_path / "moe.md").read_text().count("| tiny |") == 2


def _row(**kw):
    row = dict(experts="Qwen3-30B-A3B", M=2048, floor_us=100.0, bound="mem", errors={"ours": 1e-3, "grouped_mm": 1e-3},
               graph_us={"ours": 200.0, "grouped_mm": 600.0}, plain_us={}, skipped={})
    row.update(kw)
    return row


def test_moe_row_floor_speedups_and_check():
    from mlp_fuser.tools.bench_moe import finish

    row = finish(_row())
    assert row["vs_grouped_mm"] == pytest.approx(3.0) and row["best_peer"] == "grouped_mm" and row["check_ok"]
    small = finish(_row(M=8, graph_us={"ours": 130.0, "grouped_mm": 600.0}))
    assert small["pct_floor"] == pytest.approx(100 / 1.3)
    wrong = finish(_row(errors={"ours": 1.3e-3, "grouped_mm": 1e-3}))
    assert not wrong["check_ok"] and wrong["err_ratio"] == pytest.approx(1.3)
    assert "target" not in row


def test_moe_reference64_matches_transformers_eager():
    import torch

    from mlp_fuser.tools.bench_moe import build_experts, reference64, rel_err, routing

    mod = build_experts("qwen3_moe", 32, 16, 6, 2, torch.float32, "cpu")
    g = torch.Generator().manual_seed(3)
    x = torch.randn(9, 32, generator=g)
    ids, wts = routing(9, 6, 2, torch.float32, "cpu", g)
    assert torch.allclose(wts.sum(-1), torch.ones(9))
    mod.config._experts_implementation = "eager"
    with torch.no_grad():
        assert rel_err(mod(x, ids, wts), reference64(x, ids, wts, mod.gate_up_proj, mod.down_proj)) < 1e-6


def _benchmark(name):
    """benchmarks/<name>.py, imported as a module."""
    sys.path.insert(0, os.path.join(ROOT, "benchmarks"))
    try:
        return importlib.import_module(name)
    finally:
        sys.path.pop(0)


def test_generate_qwen3moe_tiny_eager_and_experts_switch(tmp_path):
    bench_generate = _benchmark("bench_generate")
    assert bench_generate.main(["--model", "qwen3moe", "--tiny", "--device", "cpu", "--paths", "eager,experts,prefill",
                                "--prefill-paths", "eager,experts", "--batches", "1", "--rounds", "1",
                                "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["phase"], r["path"]) for r in rows] == [("decode b=1", "eager"), ("decode b=1", "experts"),
                                                       ("prefill", "eager"), ("prefill", "experts")]
    assert rows[1]["diverges_at"] is None  # fp32 on the CPU: the mlp_fuser experts give eager's tokens
    assert rows[3]["logits_rel_err"] < 1e-5 and all(r["warmup_s"] >= 0 for r in rows)
    md = (tmp_path / "generate.md").read_text()
    assert md.count("| qwen3moe (tiny) |") == 4 and "x eager" in md and "warm-up s" in md


def test_generate_qwen3moe_twin_shares_weights_not_config():
    import torch

    bench_generate = _benchmark("bench_generate")
    model = bench_generate.build("qwen3moe", "cpu", torch.float32, tiny=True, layers=1)
    assert model.config.num_hidden_layers == 1
    twin = bench_generate.twin(model)
    assert twin.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()
    experts = twin.model.layers[0].mlp.experts, model.model.layers[0].mlp.experts
    assert experts[0].gate_up_proj.data_ptr() == experts[1].gate_up_proj.data_ptr()
    twin.set_experts_implementation("mlp_fuser")
    assert model.config._experts_implementation != "mlp_fuser"
    ids = torch.randint(3, 256, (1, 7))
    with torch.no_grad():
        assert torch.allclose(twin(ids).logits, model(ids).logits, atol=1e-5)
    rot = model.model.rotary_emb.inv_freq
    assert torch.isfinite(rot).all() and rot.max() == 1.0  # computed, not left empty by to_empty


def test_generate_fp8_experts_where_mlp_fuser_runs_them():
    # the experts become transformers' FP8Experts (gate and up quantized apart, then stacked, 128 x 128 blocks)
    # where mlp_fuser runs FP8Experts, else stay as they were and the note says so
    import torch
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts

    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.patch.experts import NAME
    from mlp_fuser.reference import rel_err

    bench_generate = _benchmark("bench_generate")
    model = bench_generate.build("qwen3moe", "cpu", torch.float32, tiny=True, layers=1)
    before = model.model.layers[0].mlp.experts
    runs = NAME in ALL_FP8_EXPERTS_FUNCTIONS
    assert bench_generate.fp8_experts(model) == ("experts FP8" if runs else
                                                 "experts bf16: mlp_fuser does not run FP8Experts yet")
    assert (model.model.layers[0].mlp.experts is before) is not runs
    model = bench_generate.build("qwen3moe", "cpu", torch.float32, tiny=True, layers=1)
    gate_up, down = (p.detach().clone() for p in (before.gate_up_proj, before.down_proj))
    assert bench_generate.fp8_experts(model, force=True) == "experts FP8"
    e = model.model.layers[0].mlp.experts
    assert isinstance(e, FP8Experts) and e.gate_up_proj.dtype == e.down_proj.dtype == K8.FP8
    assert e.gate_up_proj_scale_inv.shape == (8, 2, 1) and e.down_proj_scale_inv.shape == (8, 1, 1)
    I = gate_up.shape[1] // 2
    for x in range(8):
        halves = [(e.gate_up_proj[x, h * I:(h + 1) * I], e.gate_up_proj_scale_inv[x, h:h + 1],
                   gate_up[x, h * I:(h + 1) * I]) for h in (0, 1)]
        for q, s, w in [*halves, (e.down_proj[x], e.down_proj_scale_inv[x], down[x])]:
            assert rel_err(K8.dequantize(K8.fp8_weight(q, s, (128, 128)), torch.float64), w) < 0.04


def test_generate_moe_paths_compare_with_transformers_best():
    bench_generate = _benchmark("bench_generate")
    m = "qwen3moe (2 of 48 layers)"
    rows = [dict(model=m, phase="decode b=8", path=p, ms=ms) for p, ms in
            (("static", 30.0), ("static_kept", 18.0), ("static_fuser", 9.0), ("static_backend", 10.0))]
    assert bench_generate.baseline(rows, rows[2])["path"] == "static_kept"
    rows[0]["ms"] = 15.0
    assert bench_generate.baseline(rows, rows[3])["path"] == "static"
    assert bench_generate.baseline(rows, rows[1])["path"] == "static"
    dense = [dict(model="1b", phase="decode b=1", path=p, ms=1.0) for p in ("static", "static_backend")]
    assert bench_generate.baseline(dense, dense[1]) is dense[0] and bench_generate.baseline(dense, dense[0]) is None
    assert "| 2.000x static_kept" in "\n".join(bench_generate.write(rows[1:], "/tmp/_bench_moe_unused"))


def test_generate_memory_of_a_truncated_model_at_its_full_depth():
    # A 4-of-48-layer model's memory is dominated by its embeddings: the table also gives it at 48 layers, the
    # weights exact (the first layer's bytes for each missing one), the peak between adding those weights and also
    # scaling the measured rest (static cache, graphs) by the depth; each against the baseline's alike.
    import torch

    bench_generate = _benchmark("bench_generate")
    model = bench_generate.build("qwen3moe", "cpu", torch.float32, tiny=True, layers=1)
    row = bench_generate.Memory("cpu").row("patch", model)
    layer = sum(p.numel() * 4 for p in model.model.layers[0].parameters())
    assert (row["layers"], row["full_layers"]) == (1, 2) and row["layer_gib"] * 2**30 == pytest.approx(layer)
    assert "full_layers" not in bench_generate.Memory("cpu").row("patch", bench_generate.build("1b", "cpu",
                                                                                                torch.float32, True))
    bf16 = dict(weights_gib=10.0, peak_gib=12.0, layers=4, full_layers=48, layer_gib=1.0)
    fp8 = dict(weights_gib=6.0, peak_gib=8.0, layers=4, full_layers=48, layer_gib=0.5)
    cell = bench_generate.memory(fp8, bf16)
    assert cell.startswith("weights 6 (0.60x), peak 8 (0.67x); at 48 layers: ")
    assert cell.endswith("weights 28 (0.52x), peak 30–52 (0.54–0.67x)")  # 28 of 54; 30 of 56; 28+2*12 of 54+2*12


@pytest.mark.parametrize("family", ["qwen3moe-small", "gptoss-small"])
def test_train_moe_tiny(tmp_path, family):
    bench_train = _benchmark("bench_train")
    from mlp_fuser import config

    assert bench_train.main(["--model", family, "--tiny", "--device", "cpu", "--variants",
                             "eager,experts,experts-aten,experts-gw,experts-gx,experts-save,experts-free", "--shapes",
                             "1x16",
                             "--steps", "1",
                             "--warmup",
                             "1", "--adamw", "--out", str(tmp_path)]) == 0
    data = json.loads((tmp_path / "train.json").read_text())
    eager, experts, aten, gw, gx, save, free = data["rows"]
    assert [r["variant"] for r in data["rows"]] == ["eager", "experts", "experts-aten", "experts-gw", "experts-gx",
                                                    "experts-save", "experts-free"]
    assert abs(eager["loss"] - free["loss"]) > 1e-4  # the free experts did replace the experts
    assert data["env"]["adamw"] and config.force_impl is None  # the forced rows undone
    assert config.moe_backward == "recompute"
    for r in (experts, aten, gw, gx, save):
        assert abs(eager["loss"] - r["loss"]) < 1e-5  # the same weights at each variant's start
    assert (tmp_path / "train.md").read_text().count("| 1×16 |") == 7


def test_moe_row_where_ours_failed_says_so():
    from mlp_fuser.tools.bench_moe import finish, format_row

    row = finish(_row(errors={"grouped_mm": 1e-3}, graph_us={"grouped_mm": 600.0},
                      skipped={"ours": "failed: OutOfMemoryError"}, impl="?"))
    assert not row["check_ok"]
    assert "| failed: OutOfMemoryError |" in format_row(row)


def test_moe_backward_fp8_tiny(tmp_path):
    """bench_moe_backward --fp8 (the FP8 op's training step against the dequantized path and bf16) on the CPU: every
    path's dx and dwts checked against float64, its JSON and table written."""
    import subprocess

    env = {**os.environ, "OUT": str(tmp_path), "PYTHONPATH": ROOT}
    out = subprocess.run([sys.executable, os.path.join(ROOT, "benchmarks", "bench_moe_backward.py"), "--tiny", "--fp8",
                          "--T", "5"], env=env, capture_output=True, text=True, check=True).stdout
    (row,) = json.loads((tmp_path / "moe_backward_fp8.json").read_text())
    for path in ("fp8", "dequantized", "bf16"):
        assert set(row[f"{path}_err"]) == {"dx", "dwts"} and max(row[f"{path}_err"].values()) < 1e-5
    assert "| 5 |" in out and "fp8 vs dequantized" in out


@pytest.mark.usefixtures("exact_fp8_casts")
def test_kernels_fp8_experts_one_rows_and_a_wrong_config_rejected(monkeypatch, capsys):
    """bench_kernels.py's fp8_experts_one under the interpreter: a row per (path, a8, launch) at one token, and a
    config whose output is wrong (unsorted W8A8 gate/up, its first grid point, times 1.5) reported as an error and
    never timed, though its time (0.5 against 1.0) would make it the best."""
    from mlp_fuser.kernels import moe

    bench_kernels = _benchmark("bench_kernels")
    bad, good = bench_kernels._one_token_grid("gate_up", True)[:2]
    real = moe.experts_plan

    def experts_plan(*args, **kw):
        plan, up = real(*args, **kw), args[10]["gate_up"]
        if not (kw["a8"] and args[9] == "unsorted"
                and tuple(up[c] for c in ("BLOCK_N", "BLOCK_K", "num_warps", "num_stages")) == bad):
            return plan

        def wrong(*a):
            return plan(*a) * 1.5
        wrong.wrong = True
        return wrong

    monkeypatch.setattr(moe, "experts_plan", experts_plan)
    monkeypatch.setattr(bench_kernels, "_us", lambda fn, rep=50: (fn(), 0.5 if hasattr(fn.func, "wrong") else 1.0)[1])
    rows = bench_kernels.fp8_experts_one("1", "cpu", (128, 64, 8, 2), limit=2)
    cells = [r.split(" | ") for r in rows if r.startswith("| 1 |")]
    assert [c[1:4] for c in cells] == [[p, a8, kind] for p in ("unsorted", "unsorted_pdl") for a8 in ("True", "False")
                                       for kind in ("gate_up", "down")]
    assert all(c[5].startswith("1.0 ") and c[6].startswith("1.0 ") for c in cells)  # default and grid timed, all
    assert str(bad) not in " | ".join(cells[0]) and cells[0][6] == f"1.0 {good}"  # unsorted W8A8 gate/up
    assert cells[4][6] == f"1.0 {bad}"  # the same config through unsorted_pdl: right, timed, first of the ties
    assert f"T=1 unsorted a8=True gate_up {bad}: error" in capsys.readouterr().err


@pytest.mark.usefixtures("exact_fp8_casts")
def test_kernels_fp8_experts_tma_row(monkeypatch):
    """bench_kernels.py's fp8_experts_tma under the interpreter (one config a launch and BLOCK_M): the defaults'
    sum, each BLOCK_M's best pair, and gate/up quantizing h beside gate/up then quantize_rows, whose bits agree."""
    bench_kernels = _benchmark("bench_kernels")
    timed = []
    monkeypatch.setattr(bench_kernels, "_us", lambda fn, rep=50: (fn(), timed.append(fn), 1.0)[2])
    rows = bench_kernels.fp8_experts_tma("40", "cpu", {"tiny": (256, 256, 4, 2)}, limit=1)
    assert rows[-1] == ("| tiny | 40 | 20 | 2.0 | 2.0 (1.0 (64, 64, 128, 4, 3) + 1.0 (64, 128, 128, 4, 3)) | "
                        "2.0 (1.0 (128, 128, 128, 8, 3) + 1.0 (128, 128, 128, 8, 3)) | 1.0 / 1.0 |")
    assert len(timed) == 2 + 4 + 2


def test_gptoss_row_runs_through_the_switch_and_checks():
    """The GPT-OSS size's row on the CPU: ours through transformers' experts switch on the module as stored
    (transposed, interleaved, biases, clamped gate), every output against the module's own loop in float64."""
    import torch

    from mlp_fuser.tools.bench_moe import bench_row, build_experts

    mod = build_experts("gpt_oss", 32, 16, 4, 2, torch.float32, "cpu")
    assert mod.gate_up_proj.shape == (4, 32, 32) and mod.gate_up_proj_bias.abs().sum() > 0
    row = bench_row("tiny GPT-OSS", mod, 5, 32, 16, 4, 2, torch.float32, "cpu")
    assert row["check_ok"] and row["errors"]["ours"] < 1e-5 and row["errors"]["grouped_mm"] < 1e-5, row["errors"]
