"""End to end, as people run models: HF ``generate`` on a LLaMA-architecture model with random weights, bf16.

    python benchmarks/bench_generate.py --model 1b|8b [--paths ...] [--batches 1,8] [--out DIR]
    python benchmarks/bench_generate.py --model 1b --tiny --device cpu      # checks the script itself
    python benchmarks/bench_generate.py --model 1b --paths eager,patch --batches 1 --time-modules   # in-situ host cost
    python benchmarks/bench_generate.py --model qwen3moe --layers 8 --batches 1,8,32 --budget-s 540   # routed experts
    python benchmarks/bench_generate.py --model qwen3moe --tiny --device cpu                            # checks it
    python benchmarks/bench_generate.py --model 8b|qwen3moe --fp8 [--batches 1,8,32]   # FP8 weights against bf16
    python benchmarks/bench_generate.py --model 1b --tiny --device cpu --fp8                            # checks it

Models: "1b" (hidden 2048, intermediate 5632, 16 layers, 32 query / 4 KV heads, vocabulary 32000) and "8b"
(LLaMA-3-8B dimensions: 4096, 14336, 32 layers, 32 / 8 heads, vocabulary 128256).
"qwen3moe": Qwen3-30B-A3B dimensions (48 layers, hidden 2048, 32 query / 4 KV heads, head_dim 128, 128 experts of
intermediate 768, top 8, vocabulary 151936), built on the meta device and filled in place on the GPU (seconds, not
minutes); ``--layers N`` keeps the first N layers (the model column says so), as compiling 48 layers takes long. Its
paths (``MOE_GROUPS``): ``eager`` (transformers' default experts, grouped_mm), ``patch``, ``experts``
(``set_experts_implementation("mlp_fuser")``); static cache + CUDA graphs with transformers' default (``static``:
generate swaps grouped_mm for batched_mm while decoding), ``static_kept`` (grouped_mm registered under another name,
so generate keeps it), ``static_fuser`` (the "mlp_fuser" experts implementation) and ``static_backend``; the
prefill's eager / patch / experts and compile / backend. Its paths share one copy of the weights (``twin``), and
static_fuser and static_backend are compared with the faster of static and static_kept. The warm-up column is the
two warm-up generates' seconds (the compile, for compiled paths).

Paths (``--paths``), run group by group in this order (each group for every batch size), each with and without
mlp_fuser where it applies:
- ``eager`` / ``patch``: the model as is, and ``mlp_fuser.patch(model)``; on request ``patch_noplan`` (decode) and
  ``patch_nosite`` (decode, prefill): patch with ``mlp_fuser.config.plans`` / ``config.sites`` off while they run;
- ``static`` / ``static_backend``: ``generate(cache_implementation="static", compile_config=CompileConfig(
  fullgraph=True[, backend=mlp_fuser.backend]))``: transformers compiles the decode step itself, mode
  reduce-overhead (Inductor's CUDA-graph trees);
- ``compile`` / ``backend``: ``model.forward = torch.compile(model.forward[, backend=mlp_fuser.backend])``, the
  default dynamic cache (the slowest to compile: about 60 s per batch size and path at 1b, 110 s at 8b);
  on request ``backend_nodirect``, the backend with Inductor's code calling the registered op through the dispatcher
  (``MLP_FUSER_INDUCTOR_DIRECT=0``), timed in turns with the other two;
- ``prefill``: one forward over 2048 tokens (no cache), eager / patch / compile / backend, median of 20, the paths
  of a pair (eager and patch; compile and backend) taking turns call by call (``time_prefill``); on request
  ``eager_copy`` (``--prefill-paths eager,patch,eager_copy``), an untouched copy of the model timed with them.

``--fp8``: an FP8 twin of the model (``fp8_twin``): every ``nn.Linear`` but lm_head becomes transformers' ``FP8Linear``
with float8_e4m3fn weights in 128 x 128 blocks and fp32 scales (the released FP8 checkpoints' format), quantized from
the bf16 weights on the GPU one layer at a time, everything else shared with the bf16 model, so an 8B model's twin fits
beside it; routed experts become ``FP8Experts`` only where mlp_fuser runs them (``fp8_experts``: else they stay bf16 and
the path column says so). Its paths (``FP8_GROUPS``), each timed in turns with the bf16 model's mlp_fuser path it is
compared with: ``fp8_patch`` (``mlp_fuser.patch`` on the twin) with ``patch``; ``fp8_static`` (the twin patched, then
``generate(cache_implementation="static", compile_config=CompileConfig(fullgraph=True))``: Dynamo traces the patched
modules' quant ops, Inductor compiles) with ``static_backend``; on request ``fp8_static_backend``, the same compiled
with ``mlp_fuser.backend`` (as ``static_backend`` is: the two FP8 rows then differ only in the compiler); the prefill's
``fp8_patch`` with ``patch`` and ``fp8_backend`` (the twin patched, then its forward compiled with
``mlp_fuser.backend``) with ``backend``; ``fp8_eager``, the twin as transformers runs it (the FP8 reference): on
transformers' FP8 kernel where it loads (it is fetched from the Hub: never offline), else on
``mlp_fuser.patch.hf_fp8``'s aten stand-in for it (its row says so: then its tokens and logits are the reference, its
time is not transformers'). Tokens: each FP8 row's first divergence from its bf16 path's and from the FP8
reference's. Memory (CUDA): each path's weights and its peak as if alone (``Memory``); a model cut to ``--layers`` also
at its released depth (``full_depth``: the embeddings weigh less there).

Decode ms/token = (t(64 new tokens) - t(1 new token)) / 63, each t the best of 3 after two warm-up generations,
32-token prompt, greedy, EOS disabled. The paths compared with each other (eager and patch; compile and backend;
static and static_backend) run on copies of one model and take turns in each of the 3 rounds, so a slow stretch of
a shared host weighs on both sides of a ratio alike. Each path's tokens are compared with eager's (bf16 greedy
decoding may diverge after some tokens; the first divergence is reported). The table is printed last and written to
OUT/generate.md and OUT/generate.json after every measurement. ``--budget-s`` starts no group past that many
seconds (nor one that took longer at the previous batch size than what is left) and lists what it skipped.

``--gpus N`` spreads the units of work (a decode group at one batch size, a prefill pair) over N GPUs, one worker
process each (its own GPU and share of the CPU cores), heaviest units first (``UNIT_COST``). The 8b table takes about
900 s on one GPU; its longest unit, the compile group at one batch size, took about 280 s alone on 16 cores,
so four GPUs should fit it in one 600-s call (not yet run whole: once that unit missed its 330-s deadline while
unpinned workers shared the cores). The paths compared with each other still share one GPU and take turns; only the
tokens are compared across workers. The workers still share the host's memory, caches and clocks: a host-bound path
(eager, patch, prefill) timed while another worker compiles can slow by half, so ``--quiet-timing`` makes
each worker's timed rounds wait until no other worker is warming up or timing (``host_phase``), at some cost in wall
time.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import gc
import json
import os
import statistics
import sys
import time

import torch
from own_code import own_forward

MODELS = {
    "1b": dict(hidden_size=2048, intermediate_size=5632, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=4, vocab_size=32000),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
}
MOE_MODELS = {
    "qwen3moe": dict(hidden_size=2048, num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4,
                     head_dim=128, moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8,
                     norm_topk_prob=True, vocab_size=151936),
}
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256)
TINY_MOE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, vocab_size=256)
DECODE_PATHS = ["eager", "patch", "compile", "backend", "static", "static_backend"]
# On request: patch with mlp_fuser.config.plans off (the op's full path every call), patch with config.sites off (every
# call through the eager entry's checks and the plan's signature); the dynamic-cache backend with Inductor's code
# calling the registered op through the dispatcher (mlp_fuser.config.inductor_direct off).
EXTRA_PATHS = ["patch_noplan", "patch_nosite", "backend_nodirect"]
# Paths timed together, taking turns (each on its own copy of the model): each with the path it is compared to.
# In this order (a --budget-s cuts from the end): eager's group first, as every path's tokens are compared with eager's.
GROUPS = [["eager", "patch", "patch_noplan", "patch_nosite"], ["static", "static_backend"],
          ["compile", "backend", "backend_nodirect"]]
# The prefill's pairs, timed the same way. On request: patch_merged and backend_merged, patch and the backend after
# each MLP's gate and up weights are re-stored as the halves of one buffer (mlp_fuser.merge_gate_up), so the op runs
# one GEMM for both (cuBLAS), or quack's gated GEMM where quack is installed.
# ``eager_copy``: an untouched copy of the model, what a copy alone reads against eager (the other paths run on copies).
PREFILL_GROUPS = [["eager", "patch", "patch_nosite", "patch_merged", "eager_copy"],
                  ["compile", "backend", "backend_merged"]]
BASELINE = {"eager": None, "patch": "eager", "compile": None, "backend": "compile", "static": None,
            "static_backend": "static", "patch_noplan": "eager", "patch_nosite": "eager", "backend_nodirect": "compile",
            "patch_merged": "eager", "eager_copy": "eager",
            "backend_merged": "compile"}
# The routed-experts model's groups (same positions as GROUPS': eager's, the static cache's, the dynamic cache's) and
# baselines: a tuple compares with the faster of its paths in the same run (transformers' best).
MOE_GROUPS = [["eager", "patch", "experts"], ["static", "static_kept", "static_fuser", "static_backend"],
              ["compile", "backend"]]
MOE_PREFILL_GROUPS = [["eager", "patch", "experts"], ["compile", "backend"]]
MOE_PATHS = "eager,patch,experts,static,static_kept,static_fuser,static_backend,prefill"
MOE_BASELINE = dict(BASELINE, experts="eager", static_kept="static", static_fuser=("static", "static_kept"),
                    static_backend=("static", "static_kept"))
# --fp8: the FP8 twin's paths, each in a group with the bf16 path it is compared with (same positions as GROUPS').
FP8_GROUPS = [["patch", "fp8_patch", "fp8_eager"], ["static_backend", "fp8_static", "fp8_static_backend"]]
FP8_PREFILL_GROUPS = [["patch", "fp8_patch", "fp8_eager"], ["backend", "fp8_backend"]]
FP8_PATHS = "patch,fp8_patch,fp8_eager,static_backend,fp8_static,prefill"
FP8_BASELINE = {"fp8_patch": "patch", "fp8_static": "static_backend", "fp8_static_backend": "static_backend",
                "fp8_eager": "patch", "fp8_backend": "backend"}
BASELINE.update(FP8_BASELINE)
MOE_BASELINE.update(FP8_BASELINE)
# Whose tokens each FP8 row is compared with, beside eager's: its bf16 path's, and the FP8 reference's.
TOKEN_REFS = {"fp8_patch": ("patch", "fp8_eager"), "fp8_static": ("static_backend", "fp8_eager"),
              "fp8_static_backend": ("static_backend", "fp8_eager"),
              "fp8_eager": ("patch",)}
FP8_BLOCK = (128, 128)
KEPT = "grouped_mm_kept"  # transformers' grouped_mm under a name generate does not swap for batched_mm


def is_moe(args) -> bool:
    return args.model in MOE_MODELS


def groups(args):
    return FP8_GROUPS if args.fp8 else MOE_GROUPS if is_moe(args) else GROUPS


def prefill_groups(args):
    return FP8_PREFILL_GROUPS if args.fp8 else MOE_PREFILL_GROUPS if is_moe(args) else PREFILL_GROUPS


def log(*a):
    print(*a, file=sys.stderr, flush=True)


def build(name, device, dtype, tiny, layers=None):
    if name in MOE_MODELS:
        return build_moe(name, device, dtype, tiny, layers)
    from transformers import LlamaConfig, LlamaForCausalLM

    dims = dict(TINY if tiny else MODELS[name])
    if layers:
        dims["num_hidden_layers"] = layers
    cfg = LlamaConfig(max_position_embeddings=4096, **dims)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(cfg).to(dtype).eval()
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    return model


def build_moe(name, device, dtype, tiny, layers=None):
    """The routed-experts model with random weights: built on the meta device, then ``to_empty`` on ``device`` and
    filled in place (normal 0.02; norms 1), so that 30B parameters take seconds; ``layers`` keeps the first N."""
    from transformers import Qwen3MoeConfig

    dims = dict(TINY_MOE if tiny else MOE_MODELS[name])
    full = dims["num_hidden_layers"]
    if layers:
        dims["num_hidden_layers"] = layers
    cfg = Qwen3MoeConfig(max_position_embeddings=4096, **dims)
    t0 = time.perf_counter()
    model = _materialize(cfg, device, dtype)
    g = torch.Generator(device=device).manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() == 1:  # the RMSNorms' scales
                p.fill_(1.0)
            else:
                p.normal_(0.0, 0.02, generator=g)
    model.generation_config.eos_token_id = None  # random weights: never stop early
    model.generation_config.pad_token_id = 0
    model._bench_shared = True  # its paths share these weights (twin)
    model._bench_full_layers = full  # the released model's depth: memory is also given as if it had them all
    sync(device)
    log(f"built {name} ({dims['num_hidden_layers']} layers, "
        f"{sum(p.numel() for p in model.parameters()) / 1e9:.2f} B parameters) in {time.perf_counter() - t0:.1f} s")
    return model


def _materialize(cfg, device, dtype):
    """A model of ``cfg`` in ``dtype`` on ``device`` with uninitialised weights, its rotary buffers computed."""
    from transformers import Qwen3MoeForCausalLM

    with torch.device("meta"):
        model = Qwen3MoeForCausalLM(cfg).to(dtype)
    model = model.to_empty(device=device).eval()
    rotary = model.model.rotary_emb  # non-persistent buffers: to_empty left them uninitialised
    with torch.device(device):
        model.model.rotary_emb = type(rotary)(cfg)
    return model


def twin(model):
    """A copy of ``model`` for another path: a deep copy, or for a routed-experts model one sharing its weights (its
    own config, so its own experts implementation; its own modules, so patch and compile stay apart)."""
    if not getattr(model, "_bench_shared", False):
        return copy.deepcopy(model)
    return shared_copy(model)


def shared_copy(model):
    """A copy of ``model`` whose modules are its own but whose tensors are ``model``'s."""
    cfg = copy.deepcopy(model.config)
    with torch.device("meta"):
        m = type(model)(cfg).to(model.dtype)
    m.load_state_dict(model.state_dict(), assign=True)  # the same tensors: no second copy of the weights
    with torch.device(model.device):
        m.model.rotary_emb = type(model.model.rotary_emb)(cfg)
    m.generation_config = copy.deepcopy(model.generation_config)
    m._bench_shared = getattr(model, "_bench_shared", False)
    m._bench_full_layers = getattr(model, "_bench_full_layers", None)
    return m.eval()


def fp8_twin(model):
    """The FP8 twin of ``model``: a ``shared_copy`` whose every ``nn.Linear`` but lm_head is transformers'
    ``FP8Linear`` holding the bf16 weight quantized in 128 x 128 blocks (fp32 scales), on its device, one layer at a
    time (the twin adds the FP8 bytes only); routed experts through ``fp8_experts``. ``m._bench_fp8`` says what
    became FP8."""
    from torch import nn
    from transformers.integrations.finegrained_fp8 import FP8Linear

    from mlp_fuser.kernels.fp8 import quantize_blocks

    m = shared_copy(model)
    with torch.no_grad():
        for parent in list(m.modules()):
            for name, c in list(parent.named_children()):
                if type(c) is not nn.Linear or name == "lm_head":
                    continue
                with torch.device("meta"):  # no host-side weight of its own to fill and drop
                    f = FP8Linear(c.in_features, c.out_features, block_size=FP8_BLOCK, has_bias=c.bias is not None)
                q, scale = quantize_blocks(c.weight, FP8_BLOCK)
                f.weight, f.weight_scale_inv = (nn.Parameter(t, requires_grad=False) for t in (q, scale))
                if c.bias is not None:
                    f.bias = c.bias
                setattr(parent, name, f)
        experts = fp8_experts(m)
    m._bench_fp8 = "linears FP8" + (f", {experts}" if experts else "")
    return m


def fp8_experts(model, force: bool = False) -> str:
    """Each routed-experts module of ``model`` as transformers' ``FP8Experts`` (gate and up quantized apart, then
    stacked, as transformers' FP8 quantizer stores them; 128 x 128 blocks), in place, where mlp_fuser runs FP8
    experts (it registered its experts forward in transformers' FP8ExpertsInterface; ``force``: regardless), else
    left as they are. Says which, for the table; "" for a model without experts."""
    from torch import nn
    from transformers.integrations.finegrained_fp8 import ALL_FP8_EXPERTS_FUNCTIONS, FP8Experts
    from transformers.integrations.moe import use_experts_implementation

    from mlp_fuser.kernels.fp8 import quantize_blocks
    from mlp_fuser.patch.experts import NAME

    experts = [(n, e) for n, e in model.named_modules() if n.endswith(".experts") and hasattr(e, "gate_up_proj")]
    if not experts:
        return ""
    if not (force or NAME in ALL_FP8_EXPERTS_FUNCTIONS):
        return "experts bf16: mlp_fuser does not run FP8Experts yet"

    cls = use_experts_implementation(experts_class=FP8Experts, experts_interface=ALL_FP8_EXPERTS_FUNCTIONS)
    cfg = model.config.get_text_config()
    for name, e in experts:
        with torch.device("meta"):
            f = cls(config=cfg, block_size=FP8_BLOCK)
        gate, up = e.gate_up_proj.chunk(2, dim=1)
        (gq, gs), (uq, us), (dq, ds) = (quantize_blocks(w, FP8_BLOCK) for w in (gate, up, e.down_proj))
        for attr, t in (("gate_up_proj", torch.cat([gq, uq], 1)), ("gate_up_proj_scale_inv", torch.cat([gs, us], 1)),
                        ("down_proj", dq), ("down_proj_scale_inv", ds)):
            setattr(f, attr, nn.Parameter(t, requires_grad=False))
        model.set_submodule(name, f)
    return "experts FP8"


def weight_bytes(model) -> int:
    """Bytes of ``model``'s parameters and buffers, each storage once."""
    seen = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
            for t in [*model.parameters(), *model.buffers()]}
    return sum(seen.values())


class Memory:
    """Each path's peak CUDA memory as if it ran alone, as torch.cuda.max_memory_allocated measures it (reset
    before each of its calls): its model's weights, plus the most it held above what was allocated before its
    warm-ups (its static cache and CUDA graphs kept between calls, and a call's own peak). The other paths' models
    and caches, resident meanwhile, count for none of it. Nothing off CUDA."""

    def __init__(self, device):
        self.cuda = device == "cuda"
        self.peak: dict[str, int] = {}
        self.kept: dict[str, int] = {}

    @contextlib.contextmanager
    def warm(self, path):
        """Around a path's warm-up calls (it alone runs meanwhile)."""
        if not self.cuda:
            yield
            return
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.peak[path] = torch.cuda.max_memory_allocated() - base
        self.kept[path] = torch.cuda.memory_allocated() - base

    @contextlib.contextmanager
    def call(self, path):
        """Around one timed call of a warmed-up path."""
        if not self.cuda or path not in self.kept:
            yield
            return
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        self.peak[path] = max(self.peak[path], self.kept[path] + torch.cuda.max_memory_allocated() - before)

    def row(self, path, model) -> dict:
        """The row's memory fields: weights GiB always, peak GiB on CUDA."""
        out = dict(weights_gib=weight_bytes(model) / 2**30)
        layers, full = len(model.model.layers), getattr(model, "_bench_full_layers", None)
        if full and full > layers:  # a truncated model: one layer's bytes, to give memory at the full depth too
            out.update(layers=layers, full_layers=full, layer_gib=weight_bytes(model.model.layers[0]) / 2**30)
        if path in self.peak:
            out["peak_gib"] = out["weights_gib"] + self.peak[path] / 2**30
        if getattr(model, "_bench_fp8", None):
            out["fp8"] = model._bench_fp8
        return out


def sync(device):
    if device == "cuda":
        torch.cuda.synchronize()


TIMING_LOCK = "BENCH_GENERATE_TIMING_LOCK"  # set by --gpus N --quiet-timing for its workers: a file they all lock
lock_waited_s = 0.0  # seconds this process has waited for that lock: the budget's estimates leave them out


@contextlib.contextmanager
def host_phase(kind: str):
    """With ``--quiet-timing``, the workers of ``--gpus N`` share one host without disturbing each other's timings: a
    worker's timed rounds ("time": an exclusive lock) wait until no other worker is warming up (compiling: "warm", a
    shared lock) or timing. Run 32 showed why: eager's 8b decode rounds took 24.7, 43.4 and 44.4 ms/token while the
    other worker compiled. Without the lock (one process, or the flag off) this does nothing."""
    path = os.environ.get(TIMING_LOCK)
    if not path:
        yield
        return
    import fcntl

    global lock_waited_s
    with open(path, "a") as f:
        t0 = time.perf_counter()
        fcntl.flock(f, fcntl.LOCK_EX if kind == "time" else fcntl.LOCK_SH)
        lock_waited_s += time.perf_counter() - t0
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _without_sites(model, ids, keep):
    """A prefill forward with mlp_fuser.config.sites off while it runs (the paths take turns)."""
    import mlp_fuser

    mlp_fuser.config.sites = False
    try:
        return model(ids, use_cache=False, **keep).logits
    finally:
        mlp_fuser.config.sites = True


GUARD_FILTERS = {"none": None, "nn_modules": "skip_guard_on_all_nn_modules_unsafe"}
guard_filter = "none"  # --guard-filter and --freezing: every compiled path's torch.compile options
freezing = False


def compile_options() -> dict | None:
    """torch.compile's options for every compiled path: a new dict each time (torch.compile pops the filter)."""
    name = GUARD_FILTERS[guard_filter]
    options = {"guard_filter_fn": getattr(torch.compiler, name)} if name else {}
    if freezing:  # Inductor folds the weights in as constants (inference graphs): fewer inputs per call
        options["freezing"] = True
    return options or None


def is_static(path: str) -> bool:
    """A path decoding with the static cache and CUDA graphs (``fp8_static`` and ``fp8_static_backend`` too)."""
    return path.startswith(("static", "fp8_static"))


def generate_fn(model, path, ids):
    """``n -> tokens`` for one path, and a cleanup to run after it."""
    import mlp_fuser
    from mlp_fuser.patch import experts

    kwargs = dict(do_sample=False, attention_mask=torch.ones_like(ids))
    cleanup = []
    if path in ("patch", "patch_noplan", "patch_nosite", "fp8_patch", "fp8_static", "fp8_static_backend"):
        mlp_fuser.patch(model)  # patch_noplan / patch_nosite: without launch plans / the sites' matching (gen)
        cleanup.append(lambda: mlp_fuser.unpatch(model))
    elif path in ("compile", "backend", "backend_nodirect"):
        # backend_nodirect: a backend of its own, so that Dynamo keeps its graphs apart from the backend path's
        backend = {"compile": "inductor", "backend": mlp_fuser.backend}.get(path) or mlp_fuser.make_backend()
        own_forward(model)
        model.forward = torch.compile(model.forward, backend=backend, options=compile_options())
        cleanup.append(lambda: model.__dict__.pop("forward", None))
    elif path == "experts":
        model.set_experts_implementation(experts.NAME)
        cleanup.append(lambda: model.set_experts_implementation("grouped_mm"))
    if is_static(path):
        from transformers import CompileConfig

        if path in ("static_kept", "static_fuser"):
            if path == "static_kept":
                from transformers.integrations.moe import ExpertsInterface, grouped_mm_experts_forward

                ExpertsInterface.register(KEPT, grouped_mm_experts_forward)
            model.set_experts_implementation(KEPT if path == "static_kept" else experts.NAME)
            cleanup.append(lambda: model.set_experts_implementation("grouped_mm"))
        own_forward(model)
        cleanup.append(lambda: model.__dict__.pop("forward", None))
        backend = mlp_fuser.backend if path in ("static_backend", "fp8_static_backend") else "inductor"
        options = compile_options()  # torch.compile takes a mode or options: reduce-overhead's CUDA graphs as an option
        cc = (CompileConfig(fullgraph=True, backend=backend, mode=None, options={**options, "triton.cudagraphs": True})
              if options else CompileConfig(fullgraph=True, backend=backend))
        cc._compile_all_devices = True  # transformers compiles on CUDA only unless told (for --tiny on the CPU)
        kwargs.update(cache_implementation="static", compile_config=cc)
        cleanup.append(lambda: [model.__dict__.pop(k, None) for k in ("_compiled_call", "_last_compile_config")])

    def gen(n):
        if path in ("patch_noplan", "patch_nosite"):
            setting = "plans" if path == "patch_noplan" else "sites"
            setattr(mlp_fuser.config, setting, False)  # while this path's generate runs: the paths take turns
            try:
                return model.generate(ids, max_new_tokens=n, **kwargs)
            finally:
                setattr(mlp_fuser.config, setting, True)
        if path == "backend_nodirect":  # compiled in its first generate; Inductor's cache off, which would answer
            mlp_fuser.config.inductor_direct = False  # with the backend path's code (the same graph)
            try:
                with torch._inductor.config.patch(fx_graph_cache=False):
                    return model.generate(ids, max_new_tokens=n, **kwargs)
            finally:
                mlp_fuser.config.inductor_direct = True
        return model.generate(ids, max_new_tokens=n, **kwargs)

    def done():
        for f in cleanup:
            f()

    return gen, done


def time_decode(gens, device, new_tokens, rounds=3, mem=None):
    """({path: ms per decode token}, {path: the same per round}) for warmed-up generate functions: each path's best
    of ``rounds`` generations of ``new_tokens`` and of 1 token, the paths taking turns within each round, so that a
    slow stretch of the host (a shared machine's) falls on every path alike rather than on whichever ran then. The
    per-round figures give paired ratios (a path against its baseline timed next to it in the same round), which a
    stretch that favoured one path in one round cannot move as much as it moves a best-of."""
    best = {path: {} for path in gens}
    per_round = {path: [] for path in gens}
    mem = mem or Memory("cpu")
    for _ in range(rounds):
        for path, gen in gens.items():
            took = {}
            for n in (new_tokens, 1):
                with mem.call(path):
                    t0 = time.perf_counter()
                    gen(n)
                    sync(device)
                    took[n] = time.perf_counter() - t0
                best[path][n] = min(best[path].get(n, float("inf")), took[n])
            per_round[path].append((took[new_tokens] - took[1]) / (new_tokens - 1) * 1e3)
    return {path: (b[new_tokens] - b[1]) / (new_tokens - 1) * 1e3 for path, b in best.items()}, per_round


def mark_divergence(results):
    """Set each decode row's ``diverges_at`` (the first new token where some sequence differs from eager's at the
    same batch size, None when all agree) from the rows' tokens; rows without an eager row to compare get none.
    An FP8 row also gets ``diverges_from``: the same against each path of ``TOKEN_REFS`` with a row at its batch size
    ("not run" where that row has no tokens)."""
    rows = {(r["model"], r["phase"], r["path"]): r for r in results}

    def first(a, b):
        diff = (torch.tensor(a) != torch.tensor(b)).any(0).nonzero()
        return None if diff.numel() == 0 else int(diff[0])

    for r in results:
        if "tokens" not in r:
            continue
        ref = rows.get((r["model"], r["phase"], "eager"), {}).get("tokens")
        if ref is not None:
            r["diverges_at"] = first(r["tokens"], ref)
        for other in TOKEN_REFS.get(r["path"], ()):
            o = rows.get((r["model"], r["phase"], other))
            if o is not None:
                r.setdefault("diverges_from", {})[other] = first(r["tokens"], o["tokens"]) if "tokens" in o else \
                    "not run"
    return results


def tokens_vs(r) -> str:
    """An FP8 row's token comparisons, in words."""
    return "; ".join(f"vs {other}: " + ("not run" if d == "not run" else "same" if d is None else f"diverge at {d}")
                     for other, d in r["diverges_from"].items())


def path_model(model, path, first: bool):
    """The model a path runs on: the group's first path on ``model``, an FP8 path on an FP8 twin, others on a twin."""
    if path.startswith("fp8"):
        return fp8_twin(model)
    return model if first else twin(model)


def fp8_reference_kernel(device) -> str:
    """The kernel the FP8 reference (the twin as transformers runs it) runs on: "hub", transformers' own (fetched
    from the Hub, CUDA only), else "aten", ``mlp_fuser.patch.hf_fp8``'s stand-in for it (transformers' FP8 code on
    aten: its tokens and logits are the reference, its time is not transformers')."""
    from mlp_fuser.patch import fp8 as patch_fp8

    return "hub" if device == "cuda" and patch_fp8.transformers_fp8_kernel_loads() else "aten"


def on_reference_kernel(fn, model, device):
    """``fn`` run on the FP8 reference's kernel; the model's table label says which kernel that is."""
    if fp8_reference_kernel(device) == "hub":
        return fn
    from mlp_fuser.patch.hf_fp8 import transformers_fp8_in_aten

    if "stand-in" not in model._bench_fp8:
        model._bench_fp8 += ", transformers' FP8 forward on an aten stand-in for its Hub kernel: time not its own"

    def call(*args):
        with transformers_fp8_in_aten():
            return fn(*args)
    return call


def time_prefill(fwds, ids, device, iters=20, mem=None):
    """({path: median ms of one forward}, {path: the ms of every call}) for ``fwds`` ({path: ids -> logits}), after
    two warm-up calls each. The paths take turns call by call (see ``time_decode``), in an order reversed every other
    round (A B, B A, ...), so that neither path always runs first after the other's synchronisation; the lists give
    paired ratios, call against the baseline's call of the same round. A prefill without CUDA graphs is mostly bound
    by the host here (the host's time to queue a 1b forward was 98% of its wall time), so single figures
    move by several percent between identical models: the paired median is the figure to compare."""
    mem = mem or Memory("cpu")
    for path, fwd in fwds.items():
        for _ in range(2):
            with mem.call(path):
                fwd(ids)
    sync(device)
    times = {path: [] for path in fwds}
    for i in range(iters):
        for path, fwd in (fwds.items() if i % 2 == 0 else reversed(fwds.items())):
            if device == "cuda":
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                with mem.call(path):
                    a.record()
                    fwd(ids)
                    b.record()
                    b.synchronize()
                times[path].append(a.elapsed_time(b))
            else:
                t0 = time.perf_counter()
                fwd(ids)
                times[path].append((time.perf_counter() - t0) * 1e3)
    return {path: statistics.median(t) for path, t in times.items()}, times


# Relative cost of one unit of work (a decode group at one batch size, or a prefill pair), from runs 14-15: the
# compile group's warm-ups compile the whole model three times per path and batch size. ``--gpus`` splits by these.
UNIT_COST = {("d", 0): 1.0, ("d", 1): 1.3, ("d", 2): 3.0, ("p", 0): 0.5, ("p", 1): 1.5}


def units(args) -> list[str]:
    """The units of work the arguments ask for, in the order a single process runs them: "d<group>:<batch>" (a
    decode group at one batch size), then "p<group>" (a prefill pair); ``--units`` keeps a subset."""
    paths, wanted = args.paths.split(","), args.prefill_paths.split(",")
    out = [f"d{gi}:{b}" for gi, group in enumerate(groups(args)) if any(p in paths for p in group)
           for b in args.batches.split(",")]
    if "prefill" in paths:
        out += [f"p{gi}" for gi, group in enumerate(prefill_groups(args)) if any(p in wanted for p in group)]
    if args.units:
        keep = set(args.units.split(","))
        out = [u for u in out if u in keep]
    return out


def unit_rows(args, unit: str) -> list[tuple[str, str]]:
    """(phase, path) of each row a unit produces."""
    if unit.startswith("d"):
        gi, batch = unit[1:].split(":")
        return [(f"decode b={batch}", p) for p in groups(args)[int(gi)] if p in args.paths.split(",")]
    return [("prefill", p) for p in prefill_groups(args)[int(unit[1:])] if p in args.prefill_paths.split(",")]


def run(args, results):
    import mlp_fuser
    from mlp_fuser.patch import experts

    device, dtype = args.device, (torch.bfloat16 if args.device == "cuda" else torch.float32)
    model = build(args.model, device, dtype, args.tiny, args.layers)
    vocab = model.config.vocab_size
    label = model_label(args)
    g = torch.Generator(device=device).manual_seed(0)
    prompt, new_tokens = (32, args.new_tokens) if not args.tiny else (8, 6)
    paths = args.paths.split(",")
    batches = [int(b) for b in args.batches.split(",")]
    inputs = {b: torch.randint(3, vocab, (b, prompt), device=device, generator=g) for b in batches}
    todo = units(args)
    took, start = {}, time.perf_counter()  # seconds of each group's last batch
    mem = Memory(device)
    if os.environ.get(TIMING_LOCK):
        log(f"timed rounds hold {os.environ[TIMING_LOCK]} (warm-ups share it)")

    def skip(what: str, estimate: float | None) -> bool:
        """Whether ``what`` would start past the budget (or, with the time its group took for the previous batch
        as the estimate, end past it). The estimate leaves out that group's waits for the timing lock: with
        ``--quiet-timing`` they are the other workers' compile time (a 4-GPU 8b table ended at 347 s of its
        550, the static B=8 unit never started)."""
        if args.budget_s is None or time.perf_counter() - start + (estimate or 0) <= args.budget_s:
            return False
        log(f"{label} {what}: not started, it would not fit in --budget-s {args.budget_s:.0f}")
        return True

    with torch.no_grad():
        for gi, group in enumerate(groups(args)):  # group by group: a budget cuts the least important (the last)
            members = [p for p in group if p in paths]
            for batch in batches if members else []:
                ids, unit = inputs[batch], f"d{gi}:{batch}"
                if unit not in todo:
                    continue
                if skip(f"b={batch} {', '.join(members)}", took.get(group[0])):
                    results.extend(dict(model=label, phase=f"decode b={batch}", path=p, unit=unit,
                                        error="not reached (budget)") for p in members)
                    write(results, args.out)
                    continue
                t_group, waited_before = time.perf_counter(), lock_waited_s
                live = {}  # path -> (gen, cleanup, its model, tokens of a warm-up, warm-up seconds)
                try:
                    for i, path in enumerate(members):  # the group's first path runs on the model, the others on copies
                        m = path_model(model, path, i == 0)
                        gen, done = generate_fn(m, path, ids)
                        if path == "fp8_eager":
                            gen = on_reference_kernel(gen, m, device)
                        try:
                            t0 = time.perf_counter()
                            with host_phase("warm"), mem.warm(path):
                                for _ in range(2):
                                    out = gen(new_tokens)
                                sync(device)
                            live[path] = (gen, done, m, out, time.perf_counter() - t0)
                        except Exception as e:  # report, keep the other paths' numbers
                            done()
                            log(f"{label} b={batch} {path}: FAILED: {type(e).__name__}: {str(e)[:1500]}")
                            results.append(dict(model=label, phase=f"decode b={batch}", path=path, unit=unit,
                                                error=type(e).__name__))
                    with host_phase("time"):
                        times, per_round = time_decode({p: v[0] for p, v in live.items()}, device, new_tokens,
                                                       args.rounds, mem)
                    for path, (gen, _, m, out, warm_s) in live.items():
                        if (batch, path) in args.profiled:
                            profile_decode(f"{label} b={batch} {path}", gen, device, not is_static(path))
                        if args.host_split and not is_static(path):
                            host_split(f"{label} b={batch} {path}", m, gen, device)
                        if args.time_modules and path in ("eager", "patch", "patch_noplan", "fp8_patch"):
                            time_modules(f"{label} b={batch} {path}", m, gen, device)
                        step = (time_step(f"{label} b={batch} {path}", m, gen, device, new_tokens,
                                  profile=args.step_profile and os.path.join(args.out, f"step_{path}_b{batch}.pstats"))
                                if args.step and is_static(path) else {})
                        results.append(dict(model=label, phase=f"decode b={batch}", path=path, unit=unit,
                                            ms=times[path], round_ms=per_round[path], warmup_s=warm_s,
                                            tokens=out[:, prompt:].tolist(), **step, **mem.row(path, m)))
                        row = mark_divergence(results)[-1]
                        div = row.get("diverges_at")
                        tokens = ("not compared (eager ran elsewhere)" if "diverges_at" not in row else "same as eager"
                                  if div is None else f"diverge from eager at new token {div}")
                        if row.get("diverges_from"):
                            tokens = tokens_vs(row)
                        log(f"{label} b={batch} {path}: {times[path]:.3f} ms/token (warm-ups {warm_s:.0f} s), tokens "
                            f"{tokens}")
                        write(results, args.out)
                finally:
                    for _, done, *_ in live.values():
                        done()
                    live.clear()
                    torch._dynamo.reset()
                    if device == "cuda":
                        torch.cuda.empty_cache()
                    took[group[0]] = time.perf_counter() - t_group - (lock_waited_s - waited_before)
        if any(u.startswith("p") for u in todo):
            ids = torch.randint(3, vocab, (1, 2048 if not args.tiny else 64), device=device, generator=g)
            keep = dict(logits_to_keep=1) if args.prefill_logits == "last" else {}  # generate's prefill asks for one
            ref_logits = model(ids, use_cache=False, **keep).logits.float()
            wanted = args.prefill_paths.split(",")
            for gi, group in enumerate(prefill_groups(args)):  # timed in turns, each on its own model copy
                members, fwds, unit = [p for p in group if p in wanted], {}, f"p{gi}"
                if unit not in todo:
                    continue
                if skip(f"prefill {', '.join(members)}", None):
                    results.extend(dict(model=label, phase="prefill", path=p, unit=unit, error="not reached (budget)")
                                   for p in members)
                    write(results, args.out)
                    continue
                models, fp8_logits = {}, {}
                try:
                    for i, path in enumerate(members):
                        m = models[path] = path_model(model, path, i == 0)
                        fwd = lambda ids, m=m: m(ids, use_cache=False, **keep).logits  # noqa: E731
                        if path == "fp8_eager":
                            fwd = on_reference_kernel(fwd, m, device)
                        if path == "experts":
                            m.set_experts_implementation(experts.NAME)
                        elif path in ("patch", "patch_merged", "patch_nosite", "fp8_patch", "fp8_backend"):
                            mlp_fuser.patch(m, merge_gate_up=path == "patch_merged")
                            if path == "patch_nosite":
                                fwd = lambda ids, m=m: _without_sites(m, ids, keep)  # noqa: E731
                        if path in ("compile", "backend", "backend_merged", "fp8_backend"):
                            if path == "backend_merged":
                                log(f"{label} prefill backend_merged: {len(mlp_fuser.merge_gate_up(m))} MLPs' gate "
                                    "and up stored as one")
                            compiled = torch.compile(own_forward(m).forward, backend="inductor" if path == "compile"
                                                     else mlp_fuser.backend, options=compile_options())
                            fwd = lambda ids, c=compiled: c(ids, use_cache=False, **keep).logits  # noqa: E731
                        try:
                            t0 = time.perf_counter()
                            with host_phase("warm"), mem.warm(path):
                                logits = fwd(ids)
                                err, positions = rel(logits, ref_logits), logits.shape[-2]
                            if path.startswith("fp8") and "fp8_eager" in members:  # for the FP8 reference's row
                                fp8_logits[path] = logits
                            del logits
                            fwds[path] = (fwd, err, time.perf_counter() - t0, positions)
                        except Exception as e:
                            log(f"{label} prefill {path}: FAILED: {type(e).__name__}: {str(e)[:1500]}")
                            results.append(dict(model=label, phase="prefill", path=path, unit=unit,
                                                error=type(e).__name__))
                    ref8 = fp8_logits.pop("fp8_eager", None)  # FP8 rows against the FP8 reference, where it ran
                    fp8_errs = {p: rel(v, ref8) for p, v in fp8_logits.items()} if ref8 is not None else {}
                    del ref8
                    fp8_logits.clear()
                    with host_phase("time"):
                        times, calls = time_prefill({p: v[0] for p, v in fwds.items()}, ids, device, mem=mem)
                    for path, (fwd, err, first_s, positions) in fwds.items():
                        extra = dict(logits_rel_err_fp8_ref=fp8_errs[path]) if path in fp8_errs else {}
                        results.append(dict(model=label, phase="prefill", path=path, unit=unit, ms=times[path],
                                            call_ms=calls[path], logits_rel_err=err, warmup_s=first_s,
                                            logits=args.prefill_logits, logits_positions=positions,
                                            **mem.row(path, models[path]), **extra))
                        log(f"{label} prefill {path}: {times[path]:.2f} ms (first call {first_s:.0f} s), logits rel "
                            f"err {err:.1e}" + (" against bf16's" if path.startswith("fp8") else "")
                            + (f", {fp8_errs[path]:.1e} against the FP8 reference's" if path in fp8_errs else ""))
                        if args.profile_cpu and device == "cuda":
                            profile_cpu(f"prefill {path}", lambda fwd=fwd: fwd(ids))
                        if args.time_modules and path in ("eager", "patch", "fp8_patch"):
                            time_modules(f"{label} prefill {path}", models[path], lambda _n, fwd=fwd: fwd(ids), device,
                                         what=f"one forward over {ids.shape[1]} tokens")
                    write(results, args.out)
                finally:
                    mlp_fuser.unpatch(model)
                    torch._dynamo.reset()
                    if device == "cuda":
                        torch.cuda.empty_cache()


def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def profile_cpu(label, fn, iters=3):
    """``fn`` under the profiler: ops and CUDA runtime calls by self CPU time, kernels by GPU time, and the GPU's
    timeline (its idle gaps), per call."""
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
    log(f"  CPU side of {label}, per call: self CPU µs, calls")
    events = [e for e in prof.key_averages() if e.self_cpu_time_total > 0]
    for e in sorted(events, key=lambda e: -e.self_cpu_time_total)[:15]:
        log(f"    {e.self_cpu_time_total / iters:9.1f} {e.count / iters:7.1f}x  {e.key[:80]}")
    kernels = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    log(f"  GPU side of {label}, per call: {sum(e.self_device_time_total for e in kernels) / iters:.0f} µs of "
        f"kernels, {sum(e.count for e in kernels) / iters:.0f} kernels; µs, count, kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:12]:
        log(f"    {e.self_device_time_total / iters:9.1f} {e.count / iters:7.1f}x  {e.key[:90]}")
    gpu_gaps(prof.events(), iters, per="call")  # whether the GPU waited for the host, and before which kernels


class GcClock:
    """Python's garbage collector while the block runs (a ``gc.callbacks`` entry): its passes, the full ones among
    them, and their seconds."""

    def __init__(self):
        self.seconds, self.passes, self.full, self._t0 = 0.0, 0, 0, 0.0

    def __call__(self, phase, info):
        if phase == "start":
            self._t0 = time.perf_counter()
        else:
            self.seconds += time.perf_counter() - self._t0
            self.passes += 1
            self.full += info["generation"] == 2

    def __enter__(self):
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc):
        gc.callbacks.remove(self)


def time_modules(label, model, gen, device, tokens=16, what=""):
    """Host time spent inside the model's modules during one generate of ``tokens`` new tokens (wall clock around each
    call, no synchronisation: where the host is the bottleneck this is what a call costs in the model): each decoder
    layer (``layer``, its whole call) and each of its children (``mlp``, ``self_attn``, the norms, by attribute name),
    the model's ``embed_tokens``, ``rotary_emb``, ``norm`` and ``lm_head``; the host's time for the whole call, and how
    many kernel launches went through Triton's own slow path meanwhile. ``what``: what ``gen`` runs, when not a
    generate (a prefill's forward). A second line gives each name's total in ms and the layers' own glue (a layer's
    time less its children's: the residual adds)."""
    from mlp_fuser.kernels.common import Launcher

    targets = []
    for layer in model.model.layers:
        targets.append(("layer", layer))
        targets += list(layer.named_children())
    targets += [(n, getattr(model.model, n)) for n in ("embed_tokens", "rotary_emb", "norm") if hasattr(model.model, n)]
    targets += [("lm_head", model.lm_head)] if hasattr(model, "lm_head") else []
    mlps = [layer.mlp for layer in model.model.layers if hasattr(layer, "mlp")]
    targets += [(f"mlp.{n}", c) for m in mlps if "forward" not in m.__dict__ for n, c in m.named_children()]
    stats: dict[str, list] = {}
    wrapped = []

    def clock(name, fn):
        def timed(*a, **k):
            t0 = time.perf_counter()
            out = fn(*a, **k)
            dt = time.perf_counter() - t0
            s = stats.setdefault(name, [0.0, 0, 0.0])
            s[0] += dt
            s[1] += 1
            s[2] = max(s[2], dt)
            return out
        return timed

    # a patched MLP's launch plans: the host time of each callee (cuBLAS's F.linear, torch.empty, a Triton launch)
    from mlp_fuser.dispatch import dense as dispatch
    plan_globals = [plan.__globals__ for plan in dispatch.PLANS.values()]
    saved = [dict(g) for g in plan_globals]
    for g in plan_globals:
        for n in [n for n in g if n in ("_linear", "_empty", "_zeros") or n.endswith("_launch")]:
            g[n] = clock(f"plan {n}", g[n])
    for name, module in targets:
        own = module.__dict__.get("forward")  # patch's fused forward, or None for the class's
        module.forward = clock(name, own or module.forward)
        wrapped.append((module, own))
    slow = Launcher.slow_calls
    try:
        with GcClock() as collected:
            t0 = time.perf_counter()
            gen(tokens)
            issued = time.perf_counter() - t0  # the host's time to queue the whole call: nothing waits for the GPU
            sync(device)
    finally:
        for module, own in wrapped:
            if own is None:
                del module.__dict__["forward"]
            else:
                module.forward = own
        for g, before in zip(plan_globals, saved):
            g.update(before)
    log(f"  host time inside modules, {label}, {what or f'one generate of {tokens} tokens'} ({issued * 1e3:.2f} ms "
        "on the host in all): " + ", ".join(f"{n} {t / c * 1e6:.1f} µs per call (slowest {m * 1e6:.0f}, {c} calls)"
                                           for n, (t, c, m) in stats.items())
        + f"; Triton slow-path launches meanwhile: {Launcher.slow_calls - slow}; garbage collector: "
        f"{collected.passes} passes, {collected.seconds * 1e6:.0f} µs")
    children = {n for n, _ in model.model.layers[0].named_children()}  # timed inside "layer": not added to it again
    inside = children | {n for n in stats if n.startswith(("mlp.", "plan "))}  # and those timed inside an MLP
    glue = stats["layer"][0] - sum(stats[n][0] for n in children if n in stats) if "layer" in stats else 0.0
    log(f"  host ms in all, {label}: " + ", ".join(f"{n} {t * 1e3:.3f}" for n, (t, _, _) in stats.items())
        + f", layers' own glue {glue * 1e3:.3f}, outside every timed module "
        f"{(issued - sum(stats[n][0] for n in stats if n not in inside)) * 1e3:.3f}")


def host_split(label, model, gen, device, tokens=16):
    """Where the host's time goes in one generate of ``tokens`` new tokens, without a profiler: wall time per
    token, host time inside ``model.forward`` (no synchronisation), inside the op (``ops._forward``, plans
    included), in Python's garbage collector (``gc.callbacks``), and the synchronisations torch reports
    (``torch.cuda.set_sync_debug_mode``)."""
    import warnings

    from mlp_fuser.ops import dense as ops

    acc = dict(fwd=0.0, fwd_n=0, op=0.0, op_n=0)
    real_op, t_fwd = ops._forward, [0.0]

    def pre(module, args):  # forward hooks, not a replaced forward: Dynamo's guards on the model stay as they were
        t_fwd[0] = time.perf_counter()

    def post(module, args, out):
        acc["fwd"] += time.perf_counter() - t_fwd[0]
        acc["fwd_n"] += 1

    def op(*a, **k):
        t0 = time.perf_counter()
        out = real_op(*a, **k)
        acc["op"] += time.perf_counter() - t0
        acc["op_n"] += 1
        return out

    hooks = [model.register_forward_pre_hook(pre), model.register_forward_hook(post)]
    ops._forward = op
    try:
        gen(tokens)  # whatever the hooks cost the first time
        sync(device)
        acc.update(dict.fromkeys(acc, 0))
        t0 = time.perf_counter()
        with warnings.catch_warnings(record=True) as caught, GcClock() as collected:
            warnings.simplefilter("always")
            if device == "cuda":
                torch.cuda.set_sync_debug_mode(1)
            try:
                gen(tokens)
            finally:
                if device == "cuda":
                    torch.cuda.set_sync_debug_mode(0)
        sync(device)
        wall = time.perf_counter() - t0
    finally:
        ops._forward = real_op
        for h in hooks:
            h.remove()
    syncs = sum("synchroniz" in str(w.message) for w in caught)
    log(f"  host split, {label}, one generate of {tokens} tokens: wall {wall / tokens * 1e3:.3f} ms/token; inside "
        f"forward {acc['fwd'] / tokens * 1e3:.3f} ms/token ({acc['fwd_n']:.0f} calls); inside the op "
        f"{acc['op'] / max(acc['op_n'], 1) * 1e6:.1f} µs/call ({acc['op_n'] / tokens:.0f} per token); gc "
        f"{collected.seconds * 1e3:.2f} ms in {collected.passes} collections ({collected.full} full); synchronisations "
        f"reported (second generate): {syncs}")


class _StepTimed(Exception):
    """Ends the generate ``time_step`` ran in, once the step is timed."""


def time_step(label, model, gen, device, new_tokens, calls=20, profile=None):
    """The static-cache decode step alone, outside ``generate``'s own work: inside one generate, at its fourth
    decode step, the compiled call transformers made (``model._compiled_call``, a CUDA-graph replay under
    reduce-overhead) is run again ``2 * calls`` times with that step's arguments, then the generate is ended (each
    call moves the static cache on by one position, so fewer calls when the cache, ``new_tokens`` past the prompt,
    has no room). GPU ms per step (CUDA events around each call, queued behind a GPU sleep, so the host's time cannot
    show in them), host ms per call (its wall time while the GPU is still busy), and ms per step back to back
    (synchronised once at the end; with ``profile``, a path, under cProfile: its top functions by own time logged,
    the whole profile written there for pstats).
    Where a path's step is faster on the GPU but its generate is not, this says whether the step or what
    ``generate`` does around it holds it back."""
    compiled, seen, out = model._compiled_call, [0], {}
    cuda, calls = device == "cuda", max(1, min(calls, (new_tokens - 6) // 2))  # room in the cache

    def timed(a, k):
        gpu, host = [], []
        for _ in range(calls):
            if cuda:
                e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(20_000_000)  # GPU spin: the call below is queued, not waited for
                e0.record()
            t0 = time.perf_counter()
            compiled(*a, **k)
            host.append((time.perf_counter() - t0) * 1e3)
            if cuda:
                e1.record()
                e1.synchronize()
                gpu.append(e0.elapsed_time(e1))
        prof = None
        if profile:
            import cProfile

            prof = cProfile.Profile()
            prof.enable()
        t0 = time.perf_counter()
        for _ in range(calls):
            compiled(*a, **k)
        sync(device)
        if prof is not None:
            prof.disable()
            log_profile(f"  step alone, {label}: Python by own time over {calls} calls (cProfile)", prof)
            os.makedirs(os.path.dirname(profile) or ".", exist_ok=True)
            prof.dump_stats(profile)
        out.update(step_gpu_ms=statistics.median(gpu) if gpu else float("nan"), step_host_ms=statistics.median(host),
                   step_back_ms=(time.perf_counter() - t0) / calls * 1e3)

    def recording(*a, **k):
        seen[0] += 1
        if seen[0] == 4:  # the prefill runs eagerly; calls 1-3 are decode steps, replayed already
            sync(device)
            timed(a, k)
            raise _StepTimed
        return compiled(*a, **k)

    model._compiled_call = recording
    try:
        gen(new_tokens)
    except _StepTimed:
        pass
    finally:
        model._compiled_call = compiled
    sync(device)
    if not out:
        log(f"  step alone, {label}: not timed ({seen[0]} compiled calls in a generate of {new_tokens} tokens)")
        return {}
    log(f"  step alone, {label}: GPU {out['step_gpu_ms']:.3f} ms, host per call {out['step_host_ms']:.3f} ms, back to "
        f"back {out['step_back_ms']:.3f} ms per step ({calls} calls each)")
    return out


PROFILED = {(1, "eager"), (1, "patch"), (8, "static"), (8, "static_backend"), (1, "static"), (1, "static_backend")}


def gpu_gaps(events, tokens, stall_us=50.0, per="token"):
    """The GPU's idle time between its kernels (and memsets, copies), per token: gaps up to ``stall_us`` (the
    scheduling between one kernel and the next, also inside a CUDA graph) summed by the kernel that follows them,
    longer ones (the GPU waiting for the host) apart. Where a path's kernels add up to less than another's but its
    step takes longer, this says which kernels the GPU waits before."""
    work = sorted(((e.time_range.start, e.time_range.end, e.name) for e in events if e.device_type.name == "CUDA"
                   and e.time_range.end > e.time_range.start), key=lambda w: w[0])
    if not work:
        return
    by_next, small, stalls, end, busy = {}, 0.0, 0.0, work[0][0], 0.0
    for start, stop, name in work:
        gap = max(0.0, start - end)
        if gap > stall_us:
            stalls += gap
        else:
            small += gap
            n, c = by_next.get(name[:60], (0.0, 0))
            by_next[name[:60]] = (n + gap, c + 1)
        busy += stop - max(start, end) if stop > end else 0.0
        end = max(end, stop)
    log(f"  GPU timeline per {per}: span {(end - work[0][0]) / tokens:.0f} µs, busy {busy / tokens:.0f}, gaps "
        f"<= {stall_us:.0f} µs {small / tokens:.0f}, longer gaps (waiting for the host) {stalls / tokens:.0f}; "
        f"short gaps by the kernel after them, per {per}: µs, count, kernel")
    for name, (g, c) in sorted(by_next.items(), key=lambda kv: -kv[1][0])[:10]:
        log(f"    {g / tokens:9.1f} {c / tokens:6.1f}  {name}")


def profile_decode(label, gen, device, python=False, tokens=16):
    """Where one generate of ``tokens`` new tokens spends its time (after a warm-up generate): GPU kernels by total
    time and count, the CPU side by self time, and with ``python`` the Python functions by own time (cProfile)."""
    import cProfile

    from torch.profiler import ProfilerActivity, profile

    gen(tokens)
    sync(device)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        gen(tokens)
        sync(device)
    ev = prof.key_averages()
    kernels = [e for e in ev if e.device_type.name == "CUDA"]
    total = sum(e.self_device_time_total for e in kernels)
    log(f"  profile {label}, one generate of {tokens} tokens: {total / tokens:.0f} µs of kernels per token, "
        f"{sum(e.count for e in kernels) / tokens:.0f} kernels per token; per token: µs, count, kernel")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:14]:
        log(f"    {e.self_device_time_total / tokens:9.1f} {e.count / tokens:6.1f}  {e.key[:100]}")
    log("  CPU by self time, per token: µs, count, op")
    for e in sorted([e for e in ev if e.self_cpu_time_total > 0], key=lambda e: -e.self_cpu_time_total)[:14]:
        log(f"    {e.self_cpu_time_total / tokens:9.1f} {e.count / tokens:6.1f}  {e.key[:100]}")
    gpu_gaps(prof.events(), tokens)
    if python:
        pr = cProfile.Profile()
        pr.enable()
        gen(tokens)
        sync(device)
        pr.disable()
        log_profile("  Python by own time (cProfile, one generate):", pr, 22)


def log_profile(title, prof, lines=16):
    """The top ``lines`` functions of a cProfile.Profile by own time, logged under ``title``."""
    import io
    import pstats

    s = io.StringIO()
    pstats.Stats(prof, stream=s).sort_stats("tottime").print_stats(lines)
    log(title + "\n" + "\n".join(s.getvalue().splitlines()[6:]))


def model_label(args) -> str:
    label = f"{args.model}{' (tiny)' if args.tiny else ''}"
    full = (MOE_MODELS.get(args.model) or MODELS.get(args.model))["num_hidden_layers"]
    label += f" ({args.layers} of {full} layers)" if args.layers else ""
    label += f", guards: {args.guard_filter} skipped" if getattr(args, "guard_filter", "none") != "none" else ""
    return label + (", frozen" if getattr(args, "freezing", False) else "")


def baseline(results, r):
    """The row ``r`` is compared with: its path's baseline at the same model and phase (of a tuple of paths, the
    fastest), or None."""
    table = MOE_BASELINE if r["model"].split()[0] in MOE_MODELS else BASELINE
    wanted = table.get(r["path"])
    wanted = (wanted,) if isinstance(wanted, str) else wanted or ()
    rows = [b for b in results if b["model"] == r["model"] and b["phase"] == r["phase"] and b["path"] in wanted
            and "ms" in b]
    return min(rows, key=lambda b: b["ms"]) if rows else None


def write(results, out):
    """The table so far, to out/generate.md and out/generate.json (rewritten after every measurement)."""
    lines = ["| model | phase | path | ms | vs baseline | tokens vs eager | warm-up s | memory GiB |", "|---" * 8 + "|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['model']} | {r['phase']} | {r['path']} | {r['error']} | | | | |")
            continue
        base = baseline(results, r)  # decode and prefill rows alike
        base_path = base["path"] if base else None
        vs = f"{base['ms'] / r['ms']:.3f}x {base_path}" if base else ""
        if base and len(r.get("round_ms", ())) == len(base.get("round_ms", ())) > 1:  # paired, round by round
            paired = [b / a for a, b in zip(r["round_ms"], base["round_ms"])]
            vs += f" (rounds {', '.join(f'{q:.3f}' for q in paired)}; paired median {statistics.median(paired):.3f}x)"
        if base and len(r.get("call_ms", ())) == len(base.get("call_ms", ())) > 1:  # a prefill's calls, paired
            vs += f" (paired median {statistics.median(b / a for a, b in zip(r['call_ms'], base['call_ms'])):.3f}x)"
        if r["phase"] == "prefill":
            tok = f"logits rel err {r['logits_rel_err']:.1e}"
            tok += " vs bf16's" if "fp8" in r else ""
            if "logits_rel_err_fp8_ref" in r:
                tok += f", {r['logits_rel_err_fp8_ref']:.1e} vs the FP8 reference's"
        elif r.get("diverges_from"):
            tok = tokens_vs(r)
        elif "diverges_at" not in r:
            tok = "no eager row"
        else:
            tok = "same" if r["diverges_at"] is None else f"diverge at {r['diverges_at']}"
        warm = f"{r['warmup_s']:.0f}" if "warmup_s" in r else ""
        path = r["path"] + (f" ({r['fp8']})" if "fp8" in r else "")
        lines.append(f"| {r['model']} | {r['phase']} | {path} | {r['ms']:.3f} | {vs} | {tok} | {warm} | "
                     f"{memory(r, base)} |")
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, "generate.json"), "w") as f:
        json.dump(results, f, indent=1)
    with open(os.path.join(out, "generate.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    return lines


def memory(r, base) -> str:
    """A row's memory cell: its model's weights, its peak as if alone (CUDA), each against its baseline's."""
    if "weights_gib" not in r:
        return ""
    out = f"weights {r['weights_gib']:.3g}"
    if base and base.get("weights_gib"):
        out += f" ({r['weights_gib'] / base['weights_gib']:.2f}x)"
    if "peak_gib" in r:
        out += f", peak {r['peak_gib']:.3g}"
        if base and base.get("peak_gib"):
            out += f" ({r['peak_gib'] / base['peak_gib']:.2f}x)"
    if "full_layers" in r:
        out += f"; at {r['full_layers']} layers: " + full_depth(r, base)
    return out


def full_depth(r, base) -> str:
    """Memory as if the truncated model had the released depth: weights exactly (the other layers are the first's
    size), the peak between two bounds: the missing layers' weights added (the rest as measured), or the rest
    (static cache, graphs, activations) also scaled by the depth."""
    def est(row):
        extra = (row["full_layers"] - row["layers"]) * row["layer_gib"]
        w = row["weights_gib"] + extra
        if "peak_gib" not in row:
            return w, None
        rest = row["peak_gib"] - row["weights_gib"]
        return w, (w + rest, w + rest * row["full_layers"] / row["layers"])

    w, peak = est(r)
    bw, bpeak = est(base) if base and "full_layers" in base else (None, None)
    text = f"weights {w:.3g}" + (f" ({w / bw:.2f}x)" if bw else "")
    if peak:
        text += f", peak {peak[0]:.3g}–{peak[1]:.3g}"
        if bpeak:
            text += f" ({peak[0] / bpeak[0]:.2f}–{peak[1] / bpeak[1]:.2f}x)"
    return text


def run_parallel(args, argv: list[str], n: int) -> list[dict]:
    """The units spread over ``n`` worker processes, one GPU each, each timing its units as a single process would
    (the paths of a group take turns on one GPU; no ratio mixes GPUs). Their rows are merged in the single-process
    order, and the tokens compared with eager's across workers. A worker that ends early leaves its remaining
    units as "not reached"."""
    from mlp_fuser.tools.bench import spread

    todo = units(args)
    workers = spread(todo, lambda u: UNIT_COST[(u[0], int(u[1]))], n, [sys.executable, os.path.abspath(__file__)], argv,
                     args.out, "generate.json", args.deadline_s, gpus=args.device == "cuda")
    results = []
    for part, sub, code in workers:
        file = os.path.join(sub, "generate.json")
        rows = json.load(open(file)) if os.path.exists(file) else []
        seen = {r["unit"] for r in rows}
        results += rows + [dict(model=model_label(args), phase=phase, path=path, unit=u,
                                error=f"not reached (worker ended, {code})")
                           for u in part if u not in seen for phase, path in unit_rows(args, u)]
    results.sort(key=lambda r: todo.index(r["unit"]))  # stable: a unit's rows keep their order
    return mark_divergence(results)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=sorted(MODELS) + sorted(MOE_MODELS), default="1b")
    ap.add_argument("--layers", type=int, default=None, help="keep the first N decoder layers (compiles take less)")
    ap.add_argument("--new-tokens", type=int, default=64, help="decode ms/token = (t(N tokens) - t(1)) / (N - 1)")
    ap.add_argument("--out", default=os.environ.get("OUT", "bench_out"))
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tiny", action="store_true", help="a tiny config: checks the script itself, times nothing real")
    ap.add_argument("--fp8", action="store_true", help="the FP8 twin's paths against bf16's (default paths "
                    f"{FP8_PATHS}; prefill patch,fp8_patch,fp8_eager,backend,fp8_backend)")
    ap.add_argument("--paths", default=None, help=f"default: {','.join(DECODE_PATHS + ['prefill'])}; for "
                    f"qwen3moe {MOE_PATHS}")
    ap.add_argument("--batches", default="1,8", help="decode batch sizes (default: 1,8)")
    ap.add_argument("--rounds", type=int, default=3, help="decode rounds, the paths taking turns in each (default 3: "
                    "best of 3); more give the paired median more to go on, at ~1 s per path and round")
    ap.add_argument("--budget-s", type=float, default=None, help="start no path group past this many seconds (nor "
                    "one that took longer at the previous batch than what is left); its rows say 'not reached'")
    ap.add_argument("--prefill-paths", default=None, help="the prefill's paths (default: eager,patch,compile,backend; "
                    "for qwen3moe also experts)")
    ap.add_argument("--prefill-logits", choices=("all", "last"), default="all", help="the prefill's logits: every "
                    "position's (default), or the last one's as generate's prefill asks (logits_to_keep=1: no lm_head "
                    "over the prompt)")
    ap.add_argument("--gpus", default="1", help="spread the units of work (a decode group at one batch size, a prefill "
                    "pair) over this many GPUs, one worker process each ('all': every visible GPU)")
    ap.add_argument("--deadline-s", type=float, default=None, help="with --gpus: stop the workers this many seconds "
                    "after they start and merge what they measured (their units left are listed as not reached)")
    ap.add_argument("--quiet-timing", action="store_true", help="with --gpus: a worker's timed rounds wait until no "
                    "other worker warms up (compiles) or times (see host_phase)")
    ap.add_argument("--units", default="", help="only these units, e.g. d0:1,d2:8,p1 (set by --gpus for its workers)")
    ap.add_argument("--profile-cpu", action="store_true", help="the prefill under the profiler, every path: CPU "
                    "ops, kernels, the GPU's idle gaps")
    ap.add_argument("--profile", action="store_true", help="profile the decode paths in PROFILED (kernels, CPU)")
    ap.add_argument("--profile-at", default="", help="profile these decode paths instead, e.g. 1:compile,1:backend")
    ap.add_argument("--host-split", action="store_true", help="decode paths but static: host time inside forward, the "
                    "op, the garbage collector; synchronisations")
    ap.add_argument("--step", action="store_true", help="static paths: time the compiled decode step alone (GPU, "
                    "host per call, back to back), inside a generate but without its own work")
    ap.add_argument("--step-profile", action="store_true", help="with --step: the back-to-back calls under cProfile "
                    "(where a replay's host time goes; that column then includes the profiler's cost), the whole "
                    "profile written to OUT/step_PATH_bBATCH.pstats")
    ap.add_argument("--guard-filter", choices=sorted(GUARD_FILTERS), default="none",
                    help="every compiled path's Dynamo guards: none skipped, or nn_modules (torch.compile's "
                         "guard_filter_fn=torch.compiler.skip_guard_on_all_nn_modules_unsafe: the modules' own guards "
                         "dropped, as people do who never change a compiled model)")
    ap.add_argument("--freezing", action="store_true", help="every compiled path with Inductor's freezing option (the "
                    "weights folded in as constants of inference graphs)")
    ap.add_argument("--time-modules", action="store_true",
                    help="eager and patch: host µs per call inside the MLP and attention modules, in the model "
                         "(decode: one generate; prefill: one forward), and the host's time for the whole call")
    args = ap.parse_args(argv)
    global guard_filter, freezing
    guard_filter, freezing = args.guard_filter, args.freezing
    if args.paths is None:
        args.paths = FP8_PATHS if args.fp8 else MOE_PATHS if is_moe(args) else ",".join(DECODE_PATHS + ["prefill"])
    if args.prefill_paths is None:
        args.prefill_paths = ("patch,fp8_patch,fp8_eager,backend,fp8_backend" if args.fp8 else
                              "eager,patch,experts,compile,backend" if is_moe(args) else "eager,patch,compile,backend")
    args.profiled = ({(int(b), p) for b, p in (a.split(":") for a in args.profile_at.split(","))} if args.profile_at
                     else PROFILED if args.profile else set())
    import logging

    import mlp_fuser
    from mlp_fuser.dispatch import core, experts
    from mlp_fuser.dispatch import dense as dispatch

    logging.basicConfig(level=logging.WARNING, stream=sys.stderr)
    logging.getLogger("mlp_fuser").setLevel(logging.INFO)  # fused counts per graph, and each kernel choice
    # Every compile of one module class shares its forward's code object, and Dynamo keeps 8 entries per code object
    # by default: past that it silently runs eager. This benchmark compiles many variants.
    torch._dynamo.config.recompile_limit = 64
    torch._dynamo.config.accumulated_recompile_limit = 512
    log(f"torch {torch.__version__}, transformers {__import__('transformers').__version__}, mlp_fuser "
        f"{mlp_fuser.__version__}" + (f", {torch.cuda.get_device_name()}" if args.device == "cuda" else "")
        + (f"; compiled paths with guard_filter_fn={GUARD_FILTERS[guard_filter]}" if GUARD_FILTERS[guard_filter]
           else "") + ("; compiled paths with Inductor's freezing" if freezing else ""))
    n = torch.cuda.device_count() if args.gpus == "all" else int(args.gpus)
    if n > 1:
        if args.quiet_timing:  # the workers inherit the lock's path
            os.makedirs(args.out, exist_ok=True)
            os.environ[TIMING_LOCK] = os.path.abspath(os.path.join(args.out, "timing.lock"))
        try:
            results = run_parallel(args, argv, n)
        finally:
            os.environ.pop(TIMING_LOCK, None)
        print("\n".join(write(results, args.out)))
        return 0
    results = []
    run(args, results)
    log("dispatcher's choices:", {dispatch.describe(dispatch.Problem(k[0], k[2], k[7], *k[4:7], k[3], *k[8:10])):
                                  (v.graph.name, v.eager.name) for k, v in core.choices(dispatch.FORWARD).items()})
    if core.choices(experts.EXPERTS):
        log("routed experts' choices:", {f"T<={k[2]} k={k[3]} E={k[4]} H={k[5]} I={k[6]}": v.name
                                         for k, v in core.choices(experts.EXPERTS).items()})
    print("\n".join(write(results, args.out)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
