"""Scale-out: tensor-parallel decode and an FSDP2 fine-tuning step, fused against unfused, on every rank at once.

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 NVSHMEM_DISABLE_NVLS=1 \\
        torchrun --nproc-per-node 2 benchmarks/bench_tp.py --out OUT              # the real run: TP = 2, NCCL, bf16
    torchrun --nproc-per-node 1 benchmarks/bench_tp.py --layers 4 --out OUT      # one GPU: a smoke test
    torchrun --nproc-per-node 2 benchmarks/bench_tp.py --tiny                    # CPU, gloo: checks the script
    ... --parts decode,module,fsdp,check   (default: all four)

(The script sets the three NVLink-multicast variables itself before any process group starts; they are spelled out
above for the launcher's own processes.)

Parts:
- ``decode``: a LLaMA-3-8B-dimension model (hidden 4096, intermediate 14336, 32 layers, 32 / 8 heads, vocabulary
  128256; ``--layers`` keeps fewer) loaded with transformers' tensor parallelism (``DistributedConfig(tp_plan=
  "auto")``) from a random-weight checkpoint that rank 0 writes once (``--ckpt``). Paths, each pair timed in turns:
  ``static`` / ``static_backend`` (``generate(cache_implementation="static", compile_config=CompileConfig(
  fullgraph=True[, backend=mlp_fuser.backend]))``) and ``eager`` / ``patch``, at B = 1 and 8.
- ``module``: the same checkpoint loaded whole, then ``parallelize_module`` (ColwiseParallel on q/k/v and gate/up,
  RowwiseParallel on o and down, as torchtitan plans a LLaMA layer), ``static`` / ``static_backend`` as above.
- ``fsdp``: LLaMA 2048/5632, 8 layers, vocabulary 32000, ``fully_shard`` per layer and on the model,
  ``MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)``, AdamW; one step (forward, backward, optimizer) on
  ``--seq`` tokens per rank: ``eager`` / ``patch`` and ``compile`` / ``backend`` (``torch.compile`` of the model),
  step ms (median) and peak memory per rank.
- ``check``: last-token logits of the prompt, sharded and fused (``patch`` on the tp_plan model, the backend on the
  parallelize_module model) and sharded unfused, each against a float64 unsharded reference: the fused error must
  stay within twice the unfused error plus 1e-3 of the logits' scale.

Decode ms/token = (t(N new tokens) - t(1)) / (N - 1), the best of ``--rounds``, after two warm-up generations,
32-token prompt, greedy, EOS disabled. Rank 0 prints the table and writes OUT/tp.md and OUT/tp.json; every rank's
peak memory is gathered into the table.
"""

from __future__ import annotations

import os

for _k, _v in (("NCCL_NVLS_ENABLE", "0"), ("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1"), ("NVSHMEM_DISABLE_NVLS", "1")):
    os.environ.setdefault(_k, _v)  # NVLink multicast off: the device's rule, before NCCL reads its environment

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))
import mlp_fuser  # noqa: E402

DIMS = {"8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
        "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=8, num_attention_heads=32,
                   num_key_value_heads=4, vocab_size=32000),
        "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=128)}
PARTS = ("decode", "module", "fsdp", "check")


def log(*a):
    if dist.get_rank() == 0:
        print(*a, flush=True)


def config(name: str, layers: int | None = None):
    import transformers

    dims = dict(DIMS[name])
    if layers:
        dims["num_hidden_layers"] = layers
    return transformers.LlamaConfig(**dims, max_position_embeddings=4096)


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def checkpoint(args, device, dtype) -> str:
    """A random-weight LLaMA checkpoint (written by rank 0 once; the others wait)."""
    import transformers

    path = os.path.join(args.ckpt, f"{'tiny' if args.tiny else '8b'}-{args.layers or 'all'}")
    if dist.get_rank() == 0 and not os.path.exists(os.path.join(path, "config.json")):
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(config("tiny" if args.tiny else "8b", args.layers)).to(dtype)
        model.save_pretrained(path)
        del model
    dist.barrier()
    return path


def load_tp(path, dtype):
    import transformers

    try:
        kw = dict(distributed_config=transformers.DistributedConfig(tp_plan="auto"))
    except (AttributeError, TypeError):
        kw = dict(tp_plan="auto")
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    return model.eval()


def load_parallelized(path, dtype, device, mesh):
    import transformers
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    plan = {f"{p}_proj": ColwiseParallel() for p in ("self_attn.q", "self_attn.k", "self_attn.v", "mlp.gate", "mlp.up")}
    plan.update({"self_attn.o_proj": RowwiseParallel(), "mlp.down_proj": RowwiseParallel()})
    for layer in model.model.layers:
        parallelize_module(layer, mesh, plan)
    return model


def generate_fn(model, path: str, ids, new_tokens: int):
    import transformers

    kw = dict(do_sample=False, eos_token_id=None, pad_token_id=0, min_new_tokens=new_tokens,
              max_new_tokens=new_tokens)
    if path.startswith("static"):
        backend = mlp_fuser.backend if path == "static_backend" else "inductor"
        cc = transformers.CompileConfig(fullgraph=True, backend=backend)
        cc._compile_all_devices = True  # transformers compiles on CUDA only unless told (for --tiny on the CPU)
        kw.update(cache_implementation="static", compile_config=cc)
    return lambda n: model.generate(ids, **{**kw, "min_new_tokens": n, "max_new_tokens": n})


def time_decode(gens: dict, device, new_tokens: int, rounds: int) -> dict:
    """ms per decoded token for each path, the paths taking turns in each round."""
    for gen in gens.values():
        for _ in range(2):
            gen(new_tokens)
    best = {p: float("inf") for p in gens}
    for _ in range(rounds):
        for p, gen in gens.items():
            ts = []
            for n in (1, new_tokens):
                dist.barrier()
                sync(device)
                t0 = time.perf_counter()
                gen(n)
                sync(device)
                ts.append(time.perf_counter() - t0)
            best[p] = min(best[p], (ts[1] - ts[0]) / (new_tokens - 1) * 1e3)
    return best


def peak_gib(device) -> list[float]:
    """Every rank's peak allocated memory since the last reset, in GiB (0 on the CPU)."""
    mine = torch.tensor([torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else 0.0])
    every = [torch.zeros(1) for _ in range(dist.get_world_size())]
    dist.all_gather(every, mine.to(device) if dist.get_backend() == "nccl" else mine)
    return [round(float(t), 2) for t in every]


def part_decode(args, device, dtype, rows, mesh, parallelized: bool):
    path = checkpoint(args, device, dtype)
    load = (lambda: load_parallelized(path, dtype, device, mesh)) if parallelized else (lambda: load_tp(path, dtype))
    base, fused = load(), load()
    pairs = [("static", "static_backend")] + ([] if parallelized else [("eager", "patch")])
    for batch in args.batches:
        torch.manual_seed(batch)
        ids = torch.randint(1, base.config.vocab_size, (batch, 32), device=device)
        for a, b in pairs:
            if b == "patch":
                mlp_fuser.patch(fused)
            else:
                mlp_fuser.unpatch(fused)  # the backend alone
            gens = {a: generate_fn(base, a, ids, args.new_tokens), b: generate_fn(fused, b, ids, args.new_tokens)}
            ms = time_decode(gens, device, args.new_tokens, args.rounds)
            setup = "parallelize_module" if parallelized else "tp_plan=auto"
            rows.append(dict(part="module" if parallelized else "decode", setup=setup, B=batch, baseline=a, path=b,
                             base_ms=round(ms[a], 3), ms=round(ms[b], 3), speedup=round(ms[a] / ms[b], 3)))
            log(rows[-1])
    mlp_fuser.unpatch(fused)
    del base, fused


def part_fsdp(args, device, rows):
    import transformers
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16 if device.type == "cuda" else torch.float32,
                                  reduce_dtype=torch.float32)
    cfg = config("tiny" if args.tiny else "1b")
    torch.manual_seed(dist.get_rank())
    ids = torch.randint(0, cfg.vocab_size, (1, args.seq), device=device)
    results = {}
    for path in ("eager", "patch", "compile", "backend"):
        torch.manual_seed(0)
        with torch.device(device):
            model = transformers.LlamaForCausalLM(cfg)
        for layer in model.model.layers:
            fully_shard(layer, mp_policy=policy)
        fully_shard(model, mp_policy=policy)
        if path == "patch":
            mlp_fuser.patch(model)
        fwd = model
        if path in ("compile", "backend"):
            torch._dynamo.reset()
            fwd = torch.compile(model, backend=mlp_fuser.backend if path == "backend" else "inductor")
        opt = torch.optim.AdamW(model.parameters(), lr=1e-5)

        def step(fwd=fwd, opt=opt):
            fwd(input_ids=ids, labels=ids).loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)

        for _ in range(3):
            step()
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        times = []
        for _ in range(args.steps):
            dist.barrier()
            sync(device)
            t0 = time.perf_counter()
            step()
            sync(device)
            times.append((time.perf_counter() - t0) * 1e3)
        results[path] = (statistics.median(times), peak_gib(device))
        del model, fwd, opt
    for a, b in (("eager", "patch"), ("compile", "backend")):
        rows.append(dict(part="fsdp", setup="fully_shard + bf16 mixed precision", B=1, baseline=a, path=b,
                         base_ms=round(results[a][0], 2), ms=round(results[b][0], 2),
                         speedup=round(results[a][0] / results[b][0], 3), base_peak_gib=results[a][1],
                         peak_gib=results[b][1]))
        log(rows[-1])


def part_check(args, device, dtype, rows, mesh):
    import transformers

    path = checkpoint(args, device, dtype)
    torch.manual_seed(1)
    ids = torch.randint(1, 100, (2, 32), device=device)
    with torch.no_grad():
        ref = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).to(device)
        want = ref(ids).logits[:, -1]
        del ref
        scale = want.abs().max().item()
        for setup, load, fuse in (
                ("tp_plan=auto patch", lambda: load_tp(path, dtype), mlp_fuser.patch),
                ("parallelize_module backend", lambda: load_parallelized(path, dtype, device, mesh),
                 lambda m: torch.compile(m, backend=mlp_fuser.backend))):
            model = load()
            plain = model(ids).logits[:, -1].double()
            fused = fuse(model)(ids).logits[:, -1].double()
            err, base_err = ((t - want).abs().max().item() for t in (fused, plain))
            ok = err <= 2 * base_err + 1e-3 * scale
            rows.append(dict(part="check", setup=setup, B=2, path="logits vs float64", err=err, base_err=base_err,
                             ok=ok))
            log(rows[-1])
            del model


def write(rows, out, meta):
    if dist.get_rank() != 0:
        return
    lines = [f"# bench_tp: {meta}", "", "| part | setup | B | baseline | path | base ms | ms | speedup | peak GiB/rank "
             "(base → path) |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if r["part"] == "check":
            lines.append(f"| check | {r['setup']} | {r['B']} | unfused err {r['base_err']:.3g} | fused err "
                         f"{r['err']:.3g} | | | {'ok' if r['ok'] else 'FAIL'} | |")
            continue
        peak = f"{r.get('base_peak_gib', '')} → {r.get('peak_gib', '')}" if "peak_gib" in r else ""
        lines.append(f"| {r['part']} | {r['setup']} | {r['B']} | {r['baseline']} | {r['path']} | {r['base_ms']} | "
                     f"{r['ms']} | {r['speedup']}× | {peak} |")
    text = "\n".join(lines)
    print(text, flush=True)
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "tp.md"), "w") as f:
            f.write(text + "\n")
        with open(os.path.join(out, "tp.json"), "w") as f:
            json.dump(dict(meta=meta, rows=rows), f, indent=1)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tiny", action="store_true", help="tiny LLaMA on the CPU with gloo (checks the script)")
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--layers", type=int, default=None, help="decode model layers (default: 32)")
    ap.add_argument("--batches", default="1,8")
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seq", type=int, default=2048, help="FSDP step: tokens per rank")
    ap.add_argument("--steps", type=int, default=10, help="FSDP step: timed steps")
    ap.add_argument("--ckpt", default="/tmp/bench_tp_ckpt")
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    args.batches = [int(b) for b in args.batches.split(",")]
    parts = args.parts.split(",")
    if args.tiny:
        args.new_tokens, args.rounds, args.seq, args.steps = min(args.new_tokens, 4), 1, min(args.seq, 16), 2
        os.environ.setdefault("TRITON_INTERPRET", "1")
    cuda = torch.cuda.is_available() and not args.tiny
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dtype = torch.bfloat16 if cuda else torch.float32
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(device.type, (dist.get_world_size(),))
    import transformers

    meta = (f"{time.strftime('%Y-%m-%d')}, world {dist.get_world_size()}, {device.type}"
            f"{' ' + torch.cuda.get_device_name(device) if cuda else ''}, torch {torch.__version__}, "
            f"transformers {transformers.__version__}, {dtype}")
    log(meta)
    rows: list = []
    try:
        if "decode" in parts:
            part_decode(args, device, dtype, rows, mesh, parallelized=False)
        if "module" in parts:
            part_decode(args, device, dtype, rows, mesh, parallelized=True)
        if "fsdp" in parts:
            part_fsdp(args, device, rows)
        if "check" in parts:
            part_check(args, device, dtype, rows, mesh)
    finally:
        write(rows, args.out, meta)
        dist.destroy_process_group()
    return 0 if all(r.get("ok", True) for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
