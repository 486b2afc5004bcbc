"""What a patched model feeds the compiled static-cache decode step as graph inputs. CUDA-graph trees copy every
non-static input into the graph's buffer on each replay and only check static ones' addresses: a tensor our patch
created and kept outside the model's parameters and buffers (a transposed scale, a plan's scratch, a split counter)
would become one more non-static input, copied at every step of the FP8 Qwen3-MoE decode (benchmarks/NOTES.md,
"Inputs of the compiled step")."""

from __future__ import annotations

import torch
from test_bench import _bench_generate

import mlp_fuser

# The step's own arguments that CUDA graphs copy at each replay; the static cache's tensors are step arguments too,
# marked static by transformers.
STEP_ARGS = ("input_ids", "position_ids", "attention_mask")


def _decode_graph_inputs(model) -> list[tuple[str, torch.Tensor, bool]]:
    """(placeholder, example value, static for CUDA graphs) of the graph Dynamo hands the backend for ``model``'s
    static-cache decode step, compiled as bench_generate's static paths compile it (one graph, fullgraph)."""
    graphs = []

    def record(gm, example_inputs, **kwargs):  # mode="reduce-overhead" from CompileConfig: nothing to compile here
        graphs.append([(n.name, e, bool(n.meta.get("tensor_dict", {}).get("_dynamo_static_input_type")))
                       for n, e in zip(gm.graph.find_nodes(op="placeholder"), example_inputs)])
        return gm.forward

    from transformers import CompileConfig

    cc = CompileConfig(fullgraph=True, backend=record)
    cc._compile_all_devices = True  # transformers compiles on CUDA only unless told
    ids = torch.randint(3, 200, (1, 6), generator=torch.Generator().manual_seed(0))
    torch._dynamo.reset()
    try:
        with torch.no_grad():
            model.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=torch.ones_like(ids),
                           cache_implementation="static", compile_config=cc)
    finally:
        torch._dynamo.reset()
    assert len(graphs) == 1, f"the decode step compiled to {len(graphs)} graphs"
    return graphs[0]


def test_fp8_decode_step_inputs_are_the_models_tensors_or_its_arguments():
    """The FP8 Qwen3-MoE twin (attention's FP8Linear, the router, FP8Experts), patched: every input of the compiled
    decode step is one of the model's parameters or buffers (static for CUDA graphs) or the step's own arguments;
    the only non-static ones are the step's token ids, positions and mask, as unpatched bf16. Each FP8 layer is one
    input (its packed buffer: ``patch.packed``), never its float8 weight or scales apart, so the FP8 step has no more
    inputs than the bf16 model's (each input costs host time on every call: benchmarks/NOTES.md, "FP8 weights")."""
    from mlp_fuser.patch import packed

    bg = _bench_generate()
    bf16 = bg.build("qwen3moe", "cpu", torch.bfloat16, True, 2)
    mlp_fuser.patch(bf16)
    model = bg.fp8_twin(bg.build("qwen3moe", "cpu", torch.bfloat16, True, 2))
    mlp_fuser.patch(model)
    ours = {id(t) for t in (*model.parameters(), *model.buffers())}
    inputs = _decode_graph_inputs(model)
    strays = [name for name, e, _ in inputs
              if not (id(e) in ours or "past_key_values" in name or any(a in name for a in STEP_ARGS))]
    assert not strays, f"graph inputs that are neither the model's tensors nor the step's arguments: {strays}"
    copied = sorted(name for name, _, static in inputs if not static)
    assert copied == sorted(f"l_kwargs_{a}_" for a in STEP_ARGS), f"non-static inputs (copied each replay): {copied}"
    apart = [name for name, e, _ in inputs if id(e) in ours and packed.BUFFER not in name
             and (e.dtype == torch.float8_e4m3fn or "scale" in name)]
    assert not apart, f"float8 weights or scales as inputs of their own: {apart}"
    packs = [name for name, e, _ in inputs if packed.BUFFER in name]
    assert len(packs) == 2 * 5, f"the packed FP8 layers as inputs: {packs}"  # q, k, v, o, the experts a layer
    assert len(inputs) <= len(_decode_graph_inputs(bf16))
