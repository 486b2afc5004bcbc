"""The benchmark's plan, time budget, row arithmetic and tables: plain Python, checked without a GPU."""

import copy
import math
import os
import re
import sys
from pathlib import Path

import pytest
import torch

from mlp_fuser.patch.modules import fused_mlp
from mlp_fuser.tools import bench


def _bench_generate():
    """benchmarks/bench_generate.py, imported as a module."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        import bench_generate
    finally:
        sys.path.pop(0)
    return bench_generate


def test_plan_orders_bf16_then_fp16_then_max_autotune():
    sections, tuned = bench.plan([0, 3], ["bf16", "fp16"], [1, 32, 256, 2048], fp16_ms=(1, 2048),
                                 max_autotune_ms=(2048, 512))
    assert sections == [(0, "bf16", [1, 32, 256, 2048]), (3, "bf16", [1, 32, 256, 2048]),
                        (0, "fp16", [1, 2048]), (3, "fp16", [1, 2048])]
    assert tuned == [(0, 2048), (3, 2048)], "512 is not among the timed M"
    assert bench.plan([0], ["fp16"], [1, 2048], fp16_ms=(1,))[1] == [], "max-autotune is a bf16 column"


def test_default_run_covers_the_issue_shapes_and_ms():
    names = [s[0] for s in bench.SHAPES[:bench.DEFAULT_SHAPES]]
    assert names == ["SwiGLU 4096x11008", "SwiGLU 4096x14336", "GELU+bias 4096x11008", "SwiGLU 3584x18944",
                     "SwiGLU 8192x3584"]
    assert {32, 256} <= set(bench.MS) and set(bench.MAX_AUTOTUNE_MS) == {m for m in bench.MS if m >= 512}


def test_budget_skips_what_would_not_fit_and_lists_it():
    now = [100.0]
    b = bench.Budget(50, clock=lambda: now[0])
    assert b.fits(40, "a")
    now[0] = 120.0
    assert not b.fits(31, "b") and b.fits(30, "c")
    assert b.skipped == ["b"]
    assert bench.estimate([], 15.0) == 15.0 and bench.estimate([3, 9, 4, 5], 1) == 9


def _row(shape="SwiGLU 4096x11008", M=128, fused=76.0, eager=90.0, compile_=88.0, err_f=3e-3, err_e=3e-3):
    row = dict(shape=shape, dtype="bfloat16", M=M, bound="mem", floor_us=64.6, impl="x", n_weight_sets=1,
               errors={}, graph_us={}, plain_us={})
    times = {"fused": (fused, fused), "eager": (eager, eager), "compile": (compile_, compile_)}
    return bench.update_row(row, {"fused": err_f, "eager": err_e, "compile": err_e}, times)


def test_update_row_speedup_floor_and_check():
    r = _row()
    assert r["best_peer"] == "compile" and abs(r["speedup"] - 88 / 76) < 1e-12
    assert abs(r["pct_floor"] - 100 * 64.6 / 76) < 1e-12 and r["fused_ok"]
    assert not _row(err_f=1.26 * 3e-3)["fused_ok"], "the 1.25x rule has no slack"
    r = bench.update_row(r, {"max-autotune": 3e-3}, {"max-autotune": (70.0, 70.0)})
    assert r["best_peer"] == "max-autotune" and r["speedup"] < 1


def test_write_results_is_complete_after_every_row(tmp_path):
    meta = dict(date="d", gpu="g", torch=torch.__version__, triton="t", command="c", budget_s=480, seconds=12.0,
                ceilings=dict(matmul_tflops=700, copy_tbps=4.2), sections=[dict(what="s", seconds=3.0)],
                skipped=["max-autotune SwiGLU 8192x3584 M=8192"])
    md = "\n".join(bench.write_results(str(tmp_path), meta, [_row()]))
    assert "| SwiGLU 4096x11008     | bfloat16 |   128 |" in md and "target" not in md.lower() and "issue" not in md
    assert "Skipped for the time budget (480 s): max-autotune SwiGLU 8192x3584 M=8192" in md
    assert (tmp_path / "results.json").exists()


def test_merge_workers_orders_rows_and_takes_the_max_autotune_timing(tmp_path):
    # bench --gpus: worker 0 timed shape 0's max-autotune row (M=512, all four variants in turns) and shape 3 bf16,
    # worker 1 shape 0 (bf16 M=512 without max-autotune, fp16 M=16); worker 2 wrote nothing.
    import json

    def meta(k):
        return dict(date="d", gpu="g", torch="t", triton="t", command="c", budget_s=480, seconds=100.0 + k,
                    ceilings=dict(matmul_tflops=680 + 10 * k, copy_tbps=4.2), sections=[dict(what="s", seconds=1.0)],
                    skipped=[f"x{k}"])

    fp16 = dict(_row(M=16), dtype="float16")
    mat = bench.update_row(_row(M=512, fused=80.0), {"max-autotune": 3e-3}, {"max-autotune": (78.0, 78.0)})
    outs = [tmp_path / f"gpu{k}" for k in range(3)]
    for k, rows in enumerate([[mat, _row(shape="SwiGLU 3584x18944", M=1)], [_row(M=512, fused=90.0), fp16]]):
        outs[k].mkdir()
        (outs[k] / "results.json").write_text(json.dumps(dict(meta=meta(k), rows=rows)))
    m, rows = bench.merge_workers([str(o) for o in outs], "python -m mlp_fuser bench --gpus 3", 480)
    assert [(r["shape"], r["dtype"], r["M"]) for r in rows] == [
        ("SwiGLU 4096x11008", "bfloat16", 512), ("SwiGLU 3584x18944", "bfloat16", 1),
        ("SwiGLU 4096x11008", "float16", 16)]
    assert rows[0]["graph_us"]["fused"] == 80.0 and rows[0]["best_peer"] == "max-autotune"
    assert m["ceilings"]["matmul_tflops"] == 685 and m["seconds"] == 101.0 and m["skipped"] == ["x0", "x1"]
    assert bench.merge_workers([str(outs[2])], "c", 1) is None
    assert "max-autotune" in "\n".join(bench.write_results(str(tmp_path), m, rows))


def test_generate_benchmark_times_the_eager_group_in_turns_on_the_cpu(tmp_path):
    # benchmarks/bench_generate.py with a tiny config: the eager group's paths each get a row, patch_noplan turns
    # the launch plans off only while its generate runs.
    import json

    import mlp_fuser

    bench_generate = _bench_generate()
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,patch,patch_noplan,prefill", "--batches",
                                "1", "--prefill-paths", "eager,patch,patch_nosite", "--rounds", "4",
                                "--prefill-logits", "last", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["phase"], r["path"]) for r in rows] == [("decode b=1", "eager"), ("decode b=1", "patch"),
                                                       ("decode b=1", "patch_noplan"), ("prefill", "eager"),
                                                       ("prefill", "patch"), ("prefill", "patch_nosite")]
    assert all(timed(r) for r in rows)
    assert all(r["diverges_at"] is None for r in rows[:3])  # fp32 on the CPU: the same tokens
    assert all(r["logits_rel_err"] < 1e-5 and r["logits_positions"] == 1 for r in rows[3:])  # as generate's prefill
    assert mlp_fuser.config.plans and mlp_fuser.config.sites
    # the decode rows keep each round's figure (--rounds of them); the table gives the paired ratio of every round
    # and their median beside the best-of's
    import statistics

    assert all(len(r["round_ms"]) == 4 for r in rows[:3])  # (on this tiny model a 1-token generate can take longer)
    eager, patch = rows[0]["round_ms"], rows[1]["round_ms"]
    ratios = [e / p for p, e in zip(patch, eager)]
    paired = ", ".join(f"{q:.3f}" for q in ratios)
    median = statistics.median(ratios)
    assert f"x eager (rounds {paired}; paired median {median:.3f}x) |" in (tmp_path / "generate.md").read_text()
    # the prefill rows keep every call's figure (20, the paths' order reversed every other round); the table gives
    # the median of the paired ratios (eager's call over patch's call of the same round)
    eager, patch = rows[3]["call_ms"], rows[4]["call_ms"]
    assert len(eager) == len(patch) == 20
    paired = statistics.median(e / p for p, e in zip(patch, eager))
    assert f"x eager (paired median {paired:.3f}x) |" in (tmp_path / "generate.md").read_text()
    # a budget already spent: nothing starts, every row says so
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,patch,prefill", "--batches", "1",
                                "--prefill-paths", "eager,patch", "--budget-s", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["path"], r["error"]) for r in rows] == [(p, "not reached (budget)") for p in ["eager", "patch"] * 2]


def test_generate_benchmark_prefill_with_gate_and_up_stored_as_one(tmp_path, capsys):
    # patch_merged and backend_merged: the prefill of a model whose MLPs' gate and up weights were re-stored as the
    # halves of one buffer (mlp_fuser.merge_gate_up), then patched or compiled; the same logits as eager's (fp32 on
    # the CPU), each compared with its baseline's row.
    import json

    bench_generate = _bench_generate()
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "prefill", "--prefill-paths",
                                "eager,patch_merged,compile,backend_merged", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["phase"], r["path"]) for r in rows] == [("prefill", p) for p in
                                                        ("eager", "patch_merged", "compile", "backend_merged")]
    assert all(r["logits_rel_err"] < 1e-5 for r in rows[1:])
    md = (tmp_path / "generate.md").read_text()
    assert "x eager (paired median" in md and "x compile (paired median" in md
    assert "2 MLPs' gate and up stored as one" in capsys.readouterr().err


def test_generate_benchmark_fp8_paths_beside_their_bf16_paths(tmp_path):
    # --fp8: the FP8 twin patched, timed in turns with the bf16 model patched (decode and prefill); its tokens
    # compared with bf16's and the FP8 reference's (transformers' FP8 forward, here on the aten stand-in for its Hub
    # kernel: its rows say so); its weights as stored: float8 linears with their fp32 block scales, the rest as the
    # model holds it.
    import json

    bench_generate = _bench_generate()
    assert bench_generate.main(["--tiny", "--device", "cpu", "--fp8", "--paths", "patch,fp8_patch,fp8_eager,prefill",
                                "--prefill-paths", "patch,fp8_patch,fp8_eager", "--batches", "1", "--rounds", "2",
                                "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["phase"], r["path"]) for r in rows] == [(p, q) for p in ("decode b=1", "prefill")
                                                       for q in ("patch", "fp8_patch", "fp8_eager")]
    for r in rows[2], rows[5]:
        assert timed(r) and "aten stand-in" in r["fp8"]
    bf16, fp8 = rows[0], rows[1]
    assert timed(bf16) and timed(fp8) and fp8["fp8"] == "linears FP8"
    assert set(fp8["diverges_from"]) == {"patch", "fp8_eager"}
    assert all(d is None or isinstance(d, int) for d in fp8["diverges_from"].values())
    assert 1e-3 < rows[4]["logits_rel_err"] < 0.1  # FP8's own error against fp32, no more
    assert 0 < rows[4]["logits_rel_err_fp8_ref"] < 0.1  # against transformers' FP8 (x quantized; here not: CPU)
    from mlp_fuser.patch import packed

    model = bench_generate.build("1b", "cpu", torch.float32, True)
    stored = 0
    for name, mod in model.named_modules():
        for p in mod.parameters(recurse=False):
            if isinstance(mod, torch.nn.Linear) and name != "lm_head":  # patch packs weight and scales, each aligned
                N, K = p.shape
                stored += sum(-(-n // packed._ALIGN) * packed._ALIGN
                              for n in (N * K, math.ceil(N / 128) * math.ceil(K / 128) * 4))
            else:
                stored += p.numel() * 4
    stored += sum(b.numel() * 4 for b in model.buffers())  # the rotary embedding's
    assert fp8["weights_gib"] * 2**30 == pytest.approx(stored, abs=0.5)
    md = (tmp_path / "generate.md").read_text()
    assert "| fp8_patch (linears FP8) |" in md and "x patch (rounds" in md and "vs patch: " in md
    assert f"weights {fp8['weights_gib']:.3g} ({fp8['weights_gib'] / bf16['weights_gib']:.2f}x)" in md


def test_memory_gives_each_path_its_peak_as_if_alone(monkeypatch):
    # CUDA's allocator counters, simulated: a path's peak is its model's weights, what it keeps between calls (a static
    # cache) and a call's own peak above that; what another path allocates meanwhile is not its own
    bench_generate = _bench_generate()
    state = dict(alloc=10_000, peak=10_000)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda: state["alloc"])
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda: state["peak"])
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda: state.update(peak=state["alloc"]))

    def use(keep, transient):
        state["peak"] = max(state["peak"], state["alloc"] + keep + transient)
        state["alloc"] += keep

    mem = bench_generate.Memory("cuda")
    with mem.warm("a"):
        use(100, 50)
    with mem.warm("b"):
        use(1000, 0)
    with mem.call("a"):
        use(0, 70)
    with mem.call("b"):
        use(0, 5)
    assert mem.peak == {"a": 170, "b": 1005}
    model = bench_generate.build("1b", "cpu", torch.float32, True)
    row = mem.row("a", model)
    assert row["peak_gib"] == pytest.approx(row["weights_gib"] + 170 / 2**30, abs=1e-12)
    assert row["weights_gib"] * 2**30 == sum(t.numel() * 4 for t in [*model.parameters(), *model.buffers()])


def test_fp8_twin_holds_the_models_weights_in_128_blocks():
    # every Linear but lm_head an FP8Linear of the model's weight (the rest shared); patched, the twin computes what
    # the model with those weights dequantized computes
    from transformers.integrations.finegrained_fp8 import FP8Linear

    import mlp_fuser
    from mlp_fuser.kernels import fp8 as K8
    from mlp_fuser.reference import rel_err

    bench_generate = _bench_generate()
    model = bench_generate.build("1b", "cpu", torch.float32, True)
    model.model.layers[0].mlp.gate_proj.weight.data[:70, :30] *= 50  # one block far louder than the others
    twin = bench_generate.fp8_twin(model)
    fp8 = {n: m for n, m in twin.named_modules() if isinstance(m, FP8Linear)}
    assert len(fp8) == 7 * len(model.model.layers) and type(twin.lm_head) is torch.nn.Linear
    assert twin.lm_head.weight.data_ptr() == model.lm_head.weight.data_ptr()  # shared, not copied
    assert twin.model.embed_tokens.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    deq = copy.deepcopy(model)
    for name, f in fp8.items():
        N, K = f.weight.shape
        assert f.weight.dtype == K8.FP8 and f.weight_scale_inv.shape == (math.ceil(N / 128), math.ceil(K / 128))
        w = K8.dequantize(K8.fp8_weight(f.weight, f.weight_scale_inv, f.block_size), torch.float64)
        assert rel_err(w, model.get_submodule(name).weight) < 0.04
        deq.get_submodule(name).weight.data = w.float()
    mlp_fuser.patch(twin)
    assert all(fused_mlp(layer.mlp) for layer in twin.model.layers)
    ids = torch.randint(3, 256, (2, 9))
    with torch.no_grad():
        assert rel_err(twin(ids).logits, deq(ids).logits) < 1e-5


def test_generate_benchmark_times_the_modules_inside_a_prefill(tmp_path, capsys):
    # --time-modules on the prefill pair eager / patch: host µs per call inside every decoder layer and each of its
    # children (the patched MLP is the fused forward) and the model's other modules during one forward over the
    # prompt, the whole forward's host time, and a line of totals with the layers' own glue.
    import re

    bench_generate = _bench_generate()
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "prefill", "--prefill-paths", "eager,patch",
                                "--time-modules", "--out", str(tmp_path)]) == 0
    err = capsys.readouterr().err
    layers = len(bench_generate.build("1b", "cpu", torch.float32, True).model.layers)
    for path in ("eager", "patch"):
        line = next(x for x in err.splitlines() if f"host time inside modules, 1b (tiny) prefill {path}," in x)
        assert "one forward over 64 tokens" in line, line
        whole = float(re.search(r"\(([0-9.]+) ms on the host in all\)", line)[1])
        per_call = {n: (float(us), int(c)) for n, us, c in re.findall(r"(plan \w+|[\w.]+) ([0-9.]+) µs per call "
                                                                       r"\(slowest \d+, (\d+) calls\)", line)}
        per_layer = {"layer", "self_attn", "mlp", "input_layernorm", "post_attention_layernorm"}
        # the unfused MLP's own children too (the patched one has none left to call; its launch plans are CUDA's)
        parts = {"mlp.gate_proj", "mlp.up_proj", "mlp.down_proj", "mlp.act_fn"} if path == "eager" else set()
        assert set(per_call) == per_layer | parts | {"embed_tokens", "rotary_emb", "norm", "lm_head"}, line
        assert all(per_call[n][1] == layers for n in parts), line
        assert sum(per_call[n][0] for n in parts) < per_call["mlp"][0] or not parts, line
        assert all(per_call[n][1] == layers for n in per_layer) and per_call["lm_head"][1] == 1, line
        children = layers * sum(per_call[n][0] for n in per_layer - {"layer"}) / 1e3
        assert 0 < children < layers * per_call["layer"][0] / 1e3 < whole, line
        assert re.search(r"garbage collector: \d+ passes, \d+ µs$", line), line
        totals = next(x for x in err.splitlines() if f"host ms in all, 1b (tiny) prefill {path}:" in x)
        glue = float(re.search(r"layers' own glue ([0-9.]+)", totals)[1])
        assert abs(glue - (layers * per_call["layer"][0] / 1e3 - children)) < 0.01, totals


def timed(row) -> bool:
    """Whether a row holds a time: a tiny CPU decode's ms/token is a difference of two timings of a few ms, which a
    loaded machine can turn negative (speed is measured on the GPU, not here)."""
    return isinstance(row.get("ms"), (int, float)) and math.isfinite(row["ms"])


def test_generate_benchmark_spreads_its_units_over_workers_and_merges_them(tmp_path):
    # --gpus 2 on the CPU: two worker processes (one GPU each on a GPU machine), their rows merged in the single-process
    # order, the compile group's tokens compared with eager's from the other worker.
    import json

    from mlp_fuser.tools import bench

    bench_generate = _bench_generate()
    todo = ["d0:1", "d0:8", "d1:1", "d1:8", "d2:1", "d2:8", "p0", "p1"]
    parts = bench.assign(todo, lambda u: bench_generate.UNIT_COST[(u[0], int(u[1]))], 4)
    assert sorted(u for p in parts for u in p) == sorted(todo)
    assert ["d2:1"] in parts and ["d2:8"] in parts  # the two heaviest units get a worker each
    assert bench.without(["--model", "1b", "--gpus=2", "--out", "x", "--tiny"], {"--gpus", "--out"}) == [
        "--model", "1b", "--tiny"]

    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,patch,compile", "--batches", "1",
                                "--gpus", "2", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["unit"], r["path"]) for r in rows] == [("d0:1", "eager"), ("d0:1", "patch"), ("d2:1", "compile")]
    assert all(timed(r) for r in rows)
    assert [r["diverges_at"] for r in rows] == [None, None, None]  # fp32 on the CPU: the same tokens on both workers
    assert (tmp_path / "gpu0" / "generate.json").exists() and (tmp_path / "gpu1" / "generate.json").exists()
    assert "| 1b (tiny) | decode b=1 | compile |" in (tmp_path / "generate.md").read_text()
    # workers stopped at the deadline: their units are listed, not lost
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,compile", "--batches", "1",
                                "--gpus", "2", "--deadline-s", "0", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [(r["path"], r["error"].split(",")[0]) for r in rows] == [("eager", "not reached (worker ended"),
                                                                     ("compile", "not reached (worker ended")]


def test_generate_benchmark_gc_clock_counts_the_collections_inside_its_block():
    # GcClock (--time-modules, --host-split): the collector's passes while the block runs, the full ones among them,
    # and their time; nothing after the block.
    import gc

    bench_generate = _bench_generate()
    with bench_generate.GcClock() as clock:
        gc.collect()
        gc.collect()
        gc.collect(0)
    assert (clock.passes, clock.full) == (3, 2) and clock.seconds > 0
    gc.collect()
    assert clock.passes == 3 and clock not in gc.callbacks


def test_generate_benchmark_quiet_timing_keeps_one_workers_timing_apart(tmp_path, monkeypatch, capsys):
    # --quiet-timing: a worker's timed rounds hold the lock file exclusively, its warm-ups share it, so no worker
    # times while another compiles or times; both workers of --gpus 2 get the lock's path.
    import json
    import subprocess

    bench_generate = _bench_generate()
    lock = tmp_path / "timing.lock"
    probe = ("import fcntl, sys\nf = open(sys.argv[1], 'a')\ntry:\n    fcntl.flock(f, {} | fcntl.LOCK_NB)\n"
             "    print('free')\nexcept OSError:\n    print('busy')")

    def other_worker(kind):  # what another process gets, without waiting
        flag = "fcntl.LOCK_EX" if kind == "time" else "fcntl.LOCK_SH"
        return subprocess.run([sys.executable, "-c", probe.format(flag), str(lock)], capture_output=True,
                              text=True, check=True).stdout.strip()

    monkeypatch.setenv(bench_generate.TIMING_LOCK, str(lock))
    with bench_generate.host_phase("warm"):
        assert (other_worker("warm"), other_worker("time")) == ("free", "busy")
    with bench_generate.host_phase("time"):
        assert (other_worker("warm"), other_worker("time")) == ("busy", "busy")
    assert (other_worker("warm"), other_worker("time")) == ("free", "free")
    # the time spent waiting for the lock is counted (the budget's estimates leave it out): another worker holds it
    holder = subprocess.Popen([sys.executable, "-c", "import fcntl, sys, time\nf = open(sys.argv[1], 'a')\n"
                               "fcntl.flock(f, fcntl.LOCK_EX)\nprint('held', flush=True)\ntime.sleep(0.6)", str(lock)],
                              stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    waited = bench_generate.lock_waited_s
    with bench_generate.host_phase("warm"):
        assert bench_generate.lock_waited_s - waited >= 0.3
    holder.wait()
    waited = bench_generate.lock_waited_s
    with bench_generate.host_phase("time"):  # a free lock: next to nothing
        assert bench_generate.lock_waited_s - waited < 0.3
    monkeypatch.delenv(bench_generate.TIMING_LOCK)
    with bench_generate.host_phase("time"):  # no lock asked for: nothing held
        assert other_worker("time") == "free"

    out = tmp_path / "run"
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,patch,prefill", "--batches", "1",
                                "--prefill-paths", "eager,patch", "--gpus", "2", "--quiet-timing", "--out",
                                str(out)]) == 0
    err = capsys.readouterr().err
    for k in (0, 1):
        assert f"[gpu {k}] timed rounds hold {out / 'timing.lock'}" in err, err
    rows = json.loads((out / "generate.json").read_text())
    assert [(r["unit"], r["path"]) for r in rows] == [("d0:1", "eager"), ("d0:1", "patch"), ("p0", "eager"),
                                                      ("p0", "patch")]
    assert all(timed(r) for r in rows)
    assert bench_generate.TIMING_LOCK not in os.environ  # not left behind in the caller's process


@pytest.mark.slow
def test_generate_benchmark_times_the_static_step_alone_inside_a_generate(tmp_path, capsys):
    # --step: the compiled decode step run again with one step's arguments inside a generate, which it then ends;
    # the generates timed after it still decode (fp32 on the CPU: the static path's tokens equal eager's).
    import json

    bench_generate = _bench_generate()
    assert bench_generate.main(["--tiny", "--device", "cpu", "--paths", "eager,static", "--batches", "1", "--step",
                                "--step-profile", "--out", str(tmp_path)]) == 0
    rows = json.loads((tmp_path / "generate.json").read_text())
    assert [r["path"] for r in rows] == ["eager", "static"]
    assert "step_host_ms" not in rows[0] and rows[1]["step_host_ms"] > 0 and rows[1]["step_back_ms"] > 0
    assert rows[1]["diverges_at"] is None
    err = capsys.readouterr().err
    assert "step alone, 1b (tiny) b=1 static: GPU nan ms" in err
    # --step-profile: the title, then pstats rows (calls, times, function)
    assert re.search(r"step alone, 1b \(tiny\) b=1 static: Python by own time over \d+ calls \(cProfile\)\n\s+\d+", err)


def test_generate_benchmark_guard_filter_drops_the_modules_guards(monkeypatch):
    # --guard-filter nn_modules: every compiled path gets torch.compile's guard_filter_fn, a new dict per compile
    # (torch.compile pops it); a compiled module then keeps no guard on its parameters; --freezing adds Inductor's
    # freezing; the rows' model label says both.
    import argparse

    bench_generate = _bench_generate()
    assert bench_generate.compile_options() is None

    def weight_guards(options):
        torch._dynamo.reset()
        lin = torch.nn.Linear(4, 4)

        def step(x):
            return lin(x)
        torch.compile(step, backend="eager", options=options)(torch.randn(2, 4))
        entries = torch._C._dynamo.eval_frame._debug_get_cache_entry_list(step.__code__)
        return sum("TENSOR_MATCH" in line and "_parameters" in line
                   for line in str(entries[0].guard_manager).splitlines())

    assert weight_guards(None) == 2  # the weight and the bias
    monkeypatch.setattr(bench_generate, "guard_filter", "nn_modules")
    a, b = bench_generate.compile_options(), bench_generate.compile_options()
    assert a is not b and a["guard_filter_fn"] is torch.compiler.skip_guard_on_all_nn_modules_unsafe
    assert weight_guards(a) == 0
    args = argparse.Namespace(model="1b", tiny=True, layers=None, guard_filter="nn_modules", freezing=True)
    assert bench_generate.model_label(args) == "1b (tiny), guards: nn_modules skipped, frozen"
    monkeypatch.setattr(bench_generate, "freezing", True)
    assert bench_generate.compile_options()["freezing"] is True
    torch._dynamo.reset()


def test_generate_benchmark_backend_nodirect_calls_the_registered_op(monkeypatch):
    # bench_generate's backend_nodirect path: the dynamic-cache backend compiled with Inductor's direct call off (its
    # graphs call the registered op), while the backend path's graphs call the op's entry; same tokens as compile.

    import mlp_fuser

    bench_generate = _bench_generate()
    calls, real = [], torch.ops.mlp_fuser._inductor_gated_mlp
    monkeypatch.setattr(torch.ops.mlp_fuser, "_inductor_gated_mlp", lambda *a, **k: calls.append(1) or real(*a, **k))
    model = bench_generate.build("1b", "cpu", torch.float32, True)
    ids = torch.randint(3, 256, (1, 8), generator=torch.Generator().manual_seed(3))
    counts, tokens = {}, {}
    torch._dynamo.reset()
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):  # no graph from an earlier run
        for path in ("compile", "backend", "backend_nodirect"):
            gen, done = bench_generate.generate_fn(copy.deepcopy(model), path, ids)
            calls.clear()
            tokens[path] = [gen(3) for _ in range(2)][-1]
            counts[path] = len(calls)
            done()
    torch._dynamo.reset()
    assert counts["compile"] == 0 and counts["backend"] > 0 and counts["backend_nodirect"] == 0
    assert mlp_fuser.config.inductor_direct  # back on after the path's generate
    assert torch.equal(tokens["backend"], tokens["compile"])
    assert torch.equal(tokens["backend_nodirect"], tokens["compile"])


def test_gpu_gaps_splits_scheduling_gaps_from_host_waits(capsys):
    # bench_generate's timeline: busy time, gaps <= 50 µs by the kernel after them, longer gaps (host waits) apart.
    from types import SimpleNamespace as NS

    bench_generate = _bench_generate()

    def ev(a, b, name, dev="CUDA"):
        return NS(time_range=NS(start=a, end=b), name=name, device_type=NS(name=dev))

    bench_generate.gpu_gaps([ev(0, 10, "mm"), ev(12, 20, "ours"), ev(21, 30, "mm"), ev(200, 210, "ours"),
                             ev(205, 212, "ours"), ev(5, 6, "cpu op", "CPU")], tokens=2)
    err = capsys.readouterr().err
    assert "span 106 µs, busy 20, gaps <= 50 µs 2, longer gaps (waiting for the host) 85" in err
    lines = [ln.split() for ln in err.splitlines()[1:]]
    assert lines == [["1.0", "1.0", "ours"], ["0.5", "1.0", "mm"]]  # per token: µs of gaps before, count


def test_run_workers_gives_each_worker_its_gpu_and_its_own_cores(monkeypatch):
    # bench.run_workers on a host of 8 cores with GPUs 2,3 visible: worker k gets the k-th visible GPU, the k-th half
    # of the cores (its affinity, set in the child) and as many Inductor compile threads.
    import os
    import subprocess

    made, pinned = [], []

    class FakePopen:
        def __init__(self, cmd, env, preexec_fn, **kw):
            made.append((cmd, env["CUDA_VISIBLE_DEVICES"], env["TORCHINDUCTOR_COMPILE_THREADS"]))
            preexec_fn()
            self.stdout, self.returncode = iter(["| a table line\n", "a log line\n"]), 0

        def wait(self, timeout=None):
            return 0

    monkeypatch.setattr(subprocess, "Popen", FakePopen)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(8)))
    monkeypatch.setattr(os, "sched_setaffinity", lambda pid, cpus: pinned.append(sorted(cpus)))
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "2,3")
    assert bench.run_workers([["a"], ["b"]]) == [0, 0]
    assert made == [(["a"], "2", "4"), (["b"], "3", "4")]
    assert pinned == [[0, 1, 2, 3], [4, 5, 6, 7]]


def test_bench_weights_merged_store_gate_and_up_as_one_buffer():
    from mlp_fuser.kernels.common import stored_as_one

    g = torch.Generator().manual_seed(0)
    for merged in (False, True):
        (wg, bg, wu, bu, wd, bd), = bench.make_weights(True, False, 16, 24, torch.float32, 1, g, "cpu", merged)
        assert wg.shape == wu.shape == (24, 16) and wd.shape == (16, 24) and bg is bu is bd is None
        assert stored_as_one(wg, wu, wg.data_ptr(), wu.data_ptr()) == merged
        assert not torch.equal(wg, wu)


def test_compiled_paths_keep_caches_of_their_own():
    """benchmarks/own_code.py: two models of one class compiled side by side get a Dynamo cache each (the shared
    forward code made the second a recompile of the first, whose every call then checked the first's guards)."""
    sys.path.insert(0, str(Path(__file__).parents[1] / "benchmarks"))
    try:
        from own_code import own_forward
    finally:
        sys.path.pop(0)

    class Scaled(torch.nn.Module):
        def __init__(self, k):
            super().__init__()
            self.k = k

        def forward(self, x):
            return x * self.k

    def compiles(own):
        torch._dynamo.reset()
        graphs = []

        def backend(gm, example_inputs):
            graphs.append(gm)
            return gm.forward

        models = [Scaled(2), Scaled(3)]
        if own:
            for m in models:
                own_forward(m)
        x = torch.ones(2)
        assert [torch.compile(m, backend=backend)(x)[0].item() for m in models] == [2.0, 3.0]
        return len(graphs)

    # a second entry for one code: none compiled. config.patch, not monkeypatch: torch 2.13's config module loses the
    # setting when monkeypatch's undo sets it back (later tests then fail reading it)
    try:
        with torch._dynamo.config.patch(recompile_limit=1):
            assert compiles(own=False) == 1 and compiles(own=True) == 2
    finally:
        torch._dynamo.reset()
