"""The checks tests/test_distributed.py runs in each of two gloo processes (one launch for all of them).

Each check builds a tiny sharded model, runs it fused (``patch`` or ``torch.compile(backend=mlp_fuser.backend)``)
and compares outputs and gradients with the unsharded model in float64. ``run(rank, world, port, out_dir)`` writes
``{check: "ok" | error text}`` per rank to ``out_dir/rank{rank}.json``.
"""

from __future__ import annotations

import contextlib
import copy
import json
import os
import time
import traceback

import torch
import torch.distributed as dist
from torch import nn

H, I, VOCAB = 32, 64, 96  # hidden, intermediate (split over two ranks), vocabulary
TOL = dict(rtol=1e-4, atol=1e-5)  # float32 against float64: one rounding per op, a few hundred terms

CHECKS = {}


def check(fn):
    CHECKS[fn.__name__] = fn
    return fn


@contextlib.contextmanager
def counting():
    """What was fused meanwhile, in a list: one entry per fused op call run eagerly (``patch``) and per site the
    graph pass fused (the backend, whose compiled training graph runs the op's pieces)."""
    from mlp_fuser.graph import fx_pass
    from mlp_fuser.ops import dense as ops
    from mlp_fuser.patch.modules import OPS

    calls, inner = [], (ops._forward, ops._forward_training, fx_pass.fuse_mlps)

    def counted(*args, **kwargs):
        calls.append(("run", args[0]))
        return inner[0](*args, **kwargs)

    def counted_training(*args, **kwargs):
        calls.append(("run", args[0]))
        return inner[1](*args, **kwargs)

    def counted_pass(gm, *args, **kwargs):
        report = inner[2](gm, *args, **kwargs)
        if not kwargs.get("dry_run"):  # the op nodes in the graph, not the report's word for them
            calls.extend(("site", n.name) for n in gm.graph.nodes if n.op == "call_function" and n.target in OPS)
        return report

    ops._forward, ops._forward_training, fx_pass.fuse_mlps = counted, counted_training, counted_pass
    try:
        yield calls
    finally:
        ops._forward, ops._forward_training, fx_pass.fuse_mlps = inner


def fused_count(calls, how: str) -> int:
    """Fused op calls run (``patch``) or sites fused (the backend)."""
    return sum(kind == ("run" if how == "patch" else "site") for kind, _ in calls)


def close(a, b, what: str, **tol):
    b = b.to(a.dtype)
    if not torch.allclose(a, b, **(tol or TOL)):
        raise AssertionError(f"{what}: max |diff| {(a - b).abs().max().item():.3g}")


def full(t):
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def compare_grads(model, ref, what: str):
    grads = {n: p.grad for n, p in ref.named_parameters()}
    seen = 0
    for name, p in model.named_parameters():
        name = name.replace("_orig_mod.", "").replace("_checkpoint_wrapped_module.", "")
        if p.grad is None:
            raise AssertionError(f"{what}: no gradient for {name}")
        close(full(p.grad), grads[name], f"{what}: grad of {name}")
        seen += 1
    assert seen == len(grads), f"{what}: {seen} of {len(grads)} gradients"


# ---- models ------------------------------------------------------------------------------------------


def llama_config():
    import transformers

    return transformers.LlamaConfig(hidden_size=H, intermediate_size=I, num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=64)


class Blocks(nn.Module):
    """Two LLaMA MLPs with residuals: the MLPs are the model's only projections."""

    def __init__(self):
        super().__init__()
        from transformers.models.llama.modeling_llama import LlamaMLP

        self.layers = nn.ModuleList(LlamaMLP(llama_config()) for _ in range(2))

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return x


def mesh(*shape):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", shape or (dist.get_world_size(),))


def tp_plan(gathered=False):
    """Colwise gate/up, rowwise down; ``gathered``: gate/up outputs all-gathered (Replicate) and down slicing its
    input again, which computes the same but is not the plan the fused op runs on."""
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    col = dict(output_layouts=Replicate()) if gathered else {}
    row = dict(input_layouts=Replicate()) if gathered else {}
    plan = {}
    for i in range(2):
        plan[f"layers.{i}.gate_proj"] = ColwiseParallel(**col)
        plan[f"layers.{i}.up_proj"] = ColwiseParallel(**col)
        plan[f"layers.{i}.down_proj"] = RowwiseParallel(**row)
    return plan


def blocks_tp(gathered=False):
    from torch.distributed.tensor.parallel import parallelize_module

    torch.manual_seed(0)
    ref = Blocks()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh(), tp_plan(gathered))
    return model, ref.double()


def fuse(model, how: str, inductor: bool = True):
    """``patch``, or torch.compile with the backend (``inductor=False``: the rewritten graph run op by op, for a
    whole model whose Inductor compile would take minutes on the CPU)."""
    import mlp_fuser

    if how == "patch":
        return mlp_fuser.patch(model)
    torch._dynamo.reset()
    return torch.compile(model, backend=mlp_fuser.backend if inductor else mlp_fuser.make_backend(inductor=False))


def x_input(requires_grad=True):
    torch.manual_seed(1)
    return torch.randn(2, 5, H, dtype=torch.float64, requires_grad=requires_grad)


# ---- parallelize_module ----------------------------------------------------------------------------------


def _blocks_run(how: str, train: bool):
    model, ref = blocks_tp()
    model.train(train)
    fused = fuse(model, how)
    x64 = x_input()
    x = x64.detach().float().requires_grad_()
    with counting() as calls, torch.set_grad_enabled(train):
        y = fused(x)
        if train:
            (y * y).sum().backward()
    assert fused_count(calls, how) == 2, f"{calls}: expected 2 (one per MLP)"
    y64 = ref(x64)
    close(y.detach(), y64.detach(), "output")
    if train:
        (y64 * y64).sum().backward()
        close(x.grad, x64.grad, "input gradient")
        compare_grads(model, ref, "parallelize_module")


@check
def tp_module_patch_eval():
    _blocks_run("patch", False)


@check
def tp_module_patch_train():
    _blocks_run("patch", True)


@check
def tp_module_backend_eval():
    _blocks_run("backend", False)


@check
def tp_module_backend_train():
    _blocks_run("backend", True)


@check
def tp_module_near_miss():
    """gate/up all-gathered, down slicing again: not the plan, so nothing fused, the placements named, and the
    outputs and gradients are those of the model run without mlp_fuser."""
    import mlp_fuser

    model, _ = blocks_tp(gathered=True)
    text = str(mlp_fuser.explain(model, x_input(False).float()))
    assert "0 MLP(s) fused, 2 near miss" in text and "plain_tensors" in text and "Replicate()" in text, text
    x = x_input().detach().float()
    want = copy.deepcopy(model)
    for how in ("patch", "backend"):
        got, ref = copy.deepcopy(model), copy.deepcopy(want)
        with counting() as calls:
            ys = [(m(xi), xi) for m, xi in ((fuse(got, how), x.clone().requires_grad_()),
                                             (ref, x.clone().requires_grad_()))]
            for y, _ in ys:
                (y * y).sum().backward()
        assert fused_count(calls, how) == 0, calls
        tol = dict(rtol=0, atol=0) if how == "patch" else {}  # Inductor may round differently from eager
        close(ys[0][0].detach(), ys[1][0].detach(), f"{how}: output", **tol)
        close(ys[0][1].grad, ys[1][1].grad, f"{how}: input gradient", **tol)
        for (name, p), q in zip(got.named_parameters(), ref.parameters()):
            close(full(p.grad), full(q.grad), f"{how}: grad of {name}", **tol)


@check
def tp_module_explain():
    import mlp_fuser

    model, _ = blocks_tp()
    report = mlp_fuser.explain(model, x_input(False).float())
    text = str(report)
    assert "2 MLP(s) fused, 0 near miss" in text and f" {I // dist.get_world_size()} " in text, text


def sp_plan():
    """Sequence parallel: gate/up read the input sharded over the sequence (all-gathered first), down's output is
    reduce-scattered back to it."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {}
    for i in range(2):
        plan[f"layers.{i}.gate_proj"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"layers.{i}.up_proj"] = ColwiseParallel(input_layouts=Shard(1))
        plan[f"layers.{i}.down_proj"] = RowwiseParallel(output_layouts=Shard(1))
    return plan


@check
def tp_sequence_parallel():
    """Sequence parallel: a named near miss (its placements in the reason); the model runs as without mlp_fuser,
    its gathered outputs and gradients those of the unsharded model."""
    from torch.distributed.tensor.parallel import parallelize_module

    import mlp_fuser

    torch.manual_seed(0)
    ref = Blocks()
    model = copy.deepcopy(ref)
    parallelize_module(model, mesh(), sp_plan())
    ref.double()
    world, rank = dist.get_world_size(), dist.get_rank()
    torch.manual_seed(1)
    x64 = torch.randn(2, 6, H, dtype=torch.float64, requires_grad=True)
    x = x64.detach().float().chunk(world, 1)[rank]  # each rank's slice of the sequence
    text = str(mlp_fuser.explain(model, x))
    assert "0 MLP(s) fused, 2 near miss" in text and "(Shard(dim=1),) to (Replicate(),)" in text, text
    y64 = ref(x64)
    (y64 * y64).sum().backward()
    for how in ("patch", "backend"):
        got, plain = copy.deepcopy(model), copy.deepcopy(model)
        runs = []
        with counting() as calls:
            for m in (fuse(got, how, inductor=False), plain):
                xi = x.clone().requires_grad_()
                y = m(xi)
                (y * y).sum().backward()  # each rank's part of the loss; the collectives' backward sums them
                runs.append((y.detach(), xi.grad))
        assert fused_count(calls, how) == 0, calls
        tol = dict(rtol=0, atol=0)
        (y, gx), (y0, gx0) = runs
        close(y, y0, f"{how}: output against the model without mlp_fuser", **tol)
        close(gx, gx0, f"{how}: input gradient against the model without mlp_fuser", **tol)
        ys = [torch.empty_like(y) for _ in range(world)]
        dist.all_gather(ys, y.contiguous())
        close(torch.cat(ys, 1), y64.detach(), f"{how}: gathered output")
        close(gx, x64.grad.chunk(world, 1)[rank], f"{how}: input gradient")
        compare_grads(got, ref, f"{how}: sequence parallel")


# ---- FSDP2 + tensor parallel on a 2-D mesh, as torchtitan composes them ------------------------------------


def _two_d(order: str):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor.parallel import parallelize_module

    world = dist.get_world_size()
    m2 = _mesh_2d(world)
    torch.manual_seed(0)
    ref = Blocks()
    model = copy.deepcopy(ref)
    ref.double()
    parallelize_module(model, m2["tp"], tp_plan())
    if order == "patch_first":
        fuse(model, "patch")
    for layer in model.layers:
        fully_shard(layer, mesh=m2["dp"])
    fully_shard(model, mesh=m2["dp"])
    if order == "patch_after":
        fuse(model, "patch")
    fused = fuse(model, "backend") if order == "backend" else model
    x64 = x_input()  # one data-parallel group here (dp = 1): every rank reads the same batch
    x = x64.detach().float().requires_grad_()
    with counting() as calls:
        y = fused(x)
        (y * y).sum().backward()
    n = fused_count(calls, "backend" if order == "backend" else "patch")
    assert n == 2 or (order == "backend" and n == 1), f"{calls}: expected 2 (one per MLP)"
    y64 = ref(x64)
    (y64 * y64).sum().backward()
    close(y.detach(), y64.detach(), "output")
    close(x.grad, x64.grad, "input gradient")
    compare_grads(model, ref, "2-D")


def _mesh_2d(world):
    from torch.distributed.device_mesh import init_device_mesh

    return init_device_mesh("cpu", (world // 2, 2), mesh_dim_names=("dp", "tp"))


@check
def fsdp_tp_2d_patch_after():
    _two_d("patch_after")


@check
def fsdp_tp_2d_patch_first():
    _two_d("patch_first")


@check
def fsdp_tp_2d_backend():
    _two_d("backend")


# ---- transformers tp_plan="auto" ---------------------------------------------------------------------------


def hf_models(path: str):
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(path, tp_plan="auto", dtype=torch.float32)
    ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
    return model, ref


def _hf_run(path: str, how: str, train: bool):
    model, ref = hf_models(path)
    model.train(train)
    ref.train(train)
    fused = fuse(model, how, inductor=False)
    if how == "patch":  # each MLP module on its own (not Dynamo over the whole model)
        from mlp_fuser.patch.modules import fused_mlp

        assert all(fused_mlp(m.mlp) for m in model.model.layers)
    torch.manual_seed(2)
    ids = torch.randint(0, VOCAB, (2, 7))
    with counting() as calls, torch.set_grad_enabled(train):
        out = fused(input_ids=ids, labels=ids)
        if train:
            out.loss.backward()
    assert fused_count(calls, how) == 2, f"{calls}: expected one per layer"
    ref_out = ref(input_ids=ids, labels=ids)
    close(out.logits.detach(), ref_out.logits.detach(), "logits")
    if train:
        ref_out.loss.backward()
        compare_grads(model, ref, "tp_plan=auto")


@check
def tp_hf_patch_eval(path):
    _hf_run(path, "patch", False)


@check
def tp_hf_patch_train(path):
    _hf_run(path, "patch", True)


@check
def tp_hf_backend_eval(path):
    _hf_run(path, "backend", False)


@check
def tp_hf_backend_train(path):
    _hf_run(path, "backend", True)


# ---- FSDP2 -------------------------------------------------------------------------------------------------


def _fsdp_model(ref, order: str, mp_policy=None):
    from torch.distributed.fsdp import fully_shard

    model = copy.deepcopy(ref)
    kw = {"mp_policy": mp_policy} if mp_policy is not None else {}
    if order == "patch_first":
        fuse(model, "patch")
    for layer in model.layers:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    if order == "patch_after":
        fuse(model, "patch")
    return model, (fuse(model, "backend") if order == "backend" else model)


def _fsdp_step(model, fused, dtype=torch.float32):
    """Output, input gradient and full parameter gradients of one forward/backward."""
    x = x_input().detach().to(dtype).requires_grad_()
    y = fused(x)
    (y.float() * y.float()).sum().backward()
    return [("output", y.detach().float()), ("input gradient", x.grad)] + [
        (f"grad of {n}", full(p.grad).float()) for n, p in model.named_parameters()]


def _rel(a, b) -> float:
    return ((a.double() - b).norm() / b.norm()).item()


def _fsdp_run(order: str, mp_policy=None):
    torch.manual_seed(0)
    ref = Blocks()
    if mp_policy is not None:  # MLP outputs larger than the residual's: the op's error shows through bf16's rounding
        with torch.no_grad():
            for p in ref.parameters():
                p.mul_(3)
    model, fused = _fsdp_model(ref, order, mp_policy)
    with counting() as calls:
        got = _fsdp_step(model, fused)
    # the backend compiles a layer's forward once for both (FSDP's hooks break the graph between layers)
    n = fused_count(calls, "backend" if order == "backend" else "patch")
    assert n == 2 or (order == "backend" and n == 1), f"{calls}: expected 2 (one per MLP)"
    ref64 = copy.deepcopy(ref).double()
    want = [(w, t.double()) for w, t in _fsdp_step(ref64, ref64, torch.float64)]
    if mp_policy is None:
        for (what, a), (_, b) in zip(got, want):
            close(a, b, what)
        return
    # bf16 rounds each op: the fused model's error (relative, in norm) is held to the unfused FSDP model's
    plain, _ = _fsdp_model(ref, "none", mp_policy)
    for (what, a), (_, p), (_, b) in zip(got, _fsdp_step(plain, plain), want):
        e, e0 = _rel(a, b), _rel(p, b)
        assert e <= 1.5 * e0 + 1e-3, f"{what}: relative error {e:.3g}, unfused {e0:.3g}"


@check
def fsdp_patch_after():
    _fsdp_run("patch_after")


@check
def fsdp_patch_first():
    _fsdp_run("patch_first")


@check
def fsdp_backend():
    _fsdp_run("backend")


@check
def fsdp_mixed_precision():
    from torch.distributed.fsdp import MixedPrecisionPolicy

    _fsdp_run("patch_after", MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32))


# ---- the launch ---------------------------------------------------------------------------------------------


def run(rank: int, world: int, port: int, out_dir: str, names: list[str], hf_path: str):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    os.environ.setdefault("TRITON_INTERPRET", "1")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    results, times = {}, {}
    try:
        for name in names:
            fn = CHECKS[name]
            start = time.perf_counter()
            try:
                fn(hf_path) if name.startswith("tp_hf") else fn()
                results[name] = "ok"
                times[name] = time.perf_counter() - start
            except Exception:
                results[name] = traceback.format_exc(limit=8)
            dist.barrier()
    finally:
        with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
            json.dump(results, f)
        with open(os.path.join(out_dir, f"times{rank}.json"), "w") as f:
            json.dump(times, f)
        dist.destroy_process_group()
