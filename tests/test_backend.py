"""The torch.compile backend takes every setting torch.compile gives a backend (mode, options), means by each what
``backend="inductor"`` means, resets what the modes create, and works on transformers' static-cache path."""

import copy

import pytest
import torch
from _hf_models import count_ops
from conftest import requires_cuda

import mlp_fuser
from mlp_fuser.graph.backend import inductor_compiler

MODES = ["default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"]


def _tiny_llama(device="cpu", layers=1):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).to(device).eval()


@pytest.fixture
def compile_fx_spy(monkeypatch):
    """The config patches every Inductor compilation of the test ran with."""
    import torch._inductor.compile_fx as cfx

    seen, real = [], cfx.compile_fx

    def spy(gm, example_inputs, *args, config_patches=None, **kwargs):
        seen.append(dict(config_patches or {}))
        return real(gm, example_inputs, *args, config_patches=config_patches, **kwargs)

    monkeypatch.setattr(cfx, "compile_fx", spy)
    return seen


@pytest.mark.parametrize("mode", MODES)
def test_each_mode_matches_eager_and_reaches_inductor(mode, compile_fx_spy):
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(0, 128, (2, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend=mlp_fuser.backend, mode=mode)
        out = compiled(ids).logits
        assert count_ops(lambda: compiled(ids)) == 1  # the MLP ran as the fused op
    torch.testing.assert_close(out, expected)
    # compile_fx applies its patches, then calls itself without them: the outer call carries the mode's config
    assert compile_fx_spy[0] == inductor_compiler(mode, None).config
    assert all(p in (compile_fx_spy[0], {}) for p in compile_fx_spy)
    if mode in ("reduce-overhead", "max-autotune"):
        assert compile_fx_spy[0]["triton.cudagraphs"] is True


@pytest.mark.parametrize("mode, options", [(m, None) for m in MODES] + [(None, {"triton.cudagraphs": True})])
def test_op_calls_take_the_eager_choice_exactly_where_inductor_runs_without_cuda_graphs(mode, options, monkeypatch):
    # Without CUDA graphs every launch costs host time, so the dispatcher's choice for eager calls applies.
    from mlp_fuser.ops import dense as ops

    torch._dynamo.reset()
    seen, real = [], ops._forward
    monkeypatch.setattr(ops, "_forward", lambda *a: seen.append(a[-1]) or real(*a))
    model = _tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 5))
    with torch.no_grad():
        compiled = torch.compile(model, backend=mlp_fuser.backend, mode=mode, options=options)
        out = compiled(ids).logits
        torch.testing.assert_close(out, model(ids).logits)
    graphs = mode in ("reduce-overhead", "max-autotune") or options is not None
    assert seen == [not graphs] * 2
    assert not ops.calls.eager  # and not after the graph ran
    seen.clear()  # without Inductor (as patch(model, per_module=False) runs it): eager calls
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=mlp_fuser.make_backend(inductor=False))(ids)
    assert seen == [True] * 2 and not ops.calls.eager


def test_inductor_code_calls_the_ops_entry_directly_and_the_dispatcher_where_needed(monkeypatch):
    # mlp_fuser.inductor: the generated code calls torch.ops.mlp_fuser._inductor_gated_mlp / _inductor_mlp (no round
    # trip through the dispatcher), which computes right there when nothing needs the dispatcher's layers, calls the
    # registered op under a profiler (so the op's event is still there), and is not used with config.inductor_direct
    # off. Inductor's cache is off: a graph compiled earlier with the other setting must not answer.
    from torch._inductor.utils import run_and_get_code

    from mlp_fuser import compat, config

    plain, real = [], compat.plain_call
    monkeypatch.setattr(compat, "plain_call", lambda *a: plain.append(real(*a)) or plain[-1])
    model = _tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(2))
    w1, w2 = torch.randn(64, 32), torch.randn(32, 64)

    def plain_mlp(x):
        return torch.ops.mlp_fuser.mlp.default(x, w1, None, w2, None, "gelu") * 2

    for direct in (True, False):
        torch._dynamo.reset()
        monkeypatch.setattr(config, "inductor_direct", direct)
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            compiled = torch.compile(model, backend=mlp_fuser.backend)
            out, (code,) = run_and_get_code(lambda c=compiled: c(ids).logits)
            torch.testing.assert_close(out, model(ids).logits)
            x = torch.randn(3, 32)
            y, (code_plain,) = run_and_get_code(torch.compile(plain_mlp, backend=mlp_fuser.backend), x)
            torch.testing.assert_close(y, plain_mlp(x))
            compiled(ids)  # a graph's first run is under AOTAutograd's aliasing check (a dispatch mode); not later ones
            plain.clear()
            compiled(ids)
            calls = list(plain)
            plain.clear()
            assert count_ops(lambda c=compiled: c(ids)) == 2  # under the profiler: the registered op, both layers
        assert code.count("torch.ops.mlp_fuser._inductor_gated_mlp(") == (2 if direct else 0)
        assert code.count("torch.ops.mlp_fuser.gated_mlp.default(") == (0 if direct else 2)
        assert code_plain.count("torch.ops.mlp_fuser._inductor_mlp(") == (1 if direct else 0)
        assert calls == ([True, True] if direct else [])  # computed right there, in both layers
        assert plain == ([False, False] if direct else [])  # the profiler needs the dispatcher
    torch._dynamo.reset()


def test_inductor_gets_the_direct_call_without_our_backend_too():
    # A patched model compiled with torch.compile's default backend: the ops' fake kernels install the direct call
    # while Dynamo traces (Inductor is imported by then), so Inductor's code calls the op's entry as the backend's does.
    from torch._inductor.utils import run_and_get_code

    from mlp_fuser.runtime import inductor

    inductor.uninstall()  # as in a process where our backend never ran
    torch._dynamo.reset()
    model = _tiny_llama(layers=2)
    ids = torch.randint(0, 128, (1, 5), generator=torch.Generator().manual_seed(4))
    try:
        with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
            expected = model(ids).logits
            mlp_fuser.patch(model)
            out, (code,) = run_and_get_code(lambda: torch.compile(model)(ids).logits)
        torch.testing.assert_close(out, expected)
        assert code.count("torch.ops.mlp_fuser._inductor_gated_mlp(") == 2
    finally:
        mlp_fuser.unpatch(model)
        inductor.install()
        torch._dynamo.reset()


def test_options_reach_inductor_and_bad_ones_fail_as_for_inductor(compile_fx_spy):
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 5))
    options = {"epilogue_fusion": False, "max_autotune": False}
    with torch.no_grad():
        out = torch.compile(model, backend=mlp_fuser.backend, options=options)(ids).logits
        torch.testing.assert_close(out, model(ids).logits)
    assert compile_fx_spy[0] == {"epilogue_fusion": False, "max_autotune": False}
    for bad, what in (({"options": {"no_such_option": 1}}, "no_such_option"), ({"mode": "fastest"}, "fastest")):
        torch._dynamo.reset()
        with pytest.raises(Exception, match=what):
            torch.compile(model, backend=mlp_fuser.backend, **bad)(ids)
        with pytest.raises(Exception, match=what):  # the same error as Inductor's own
            torch.compile(model, backend="inductor", **bad)(ids)


def test_make_backend_keeps_its_own_arguments_beside_a_mode():
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(0, 128, (1, 5))
    only_plain = mlp_fuser.make_backend(patterns=["plain"])  # LLaMA's MLP is gated: nothing to fuse
    with torch.no_grad():
        compiled = torch.compile(model, backend=only_plain, mode="reduce-overhead")
        torch.testing.assert_close(compiled(ids).logits, model(ids).logits)
        assert count_ops(lambda: compiled(ids)) == 0


def test_a_mode_without_inductor_is_an_error():
    torch._dynamo.reset()
    eager_only = mlp_fuser.make_backend(inductor=False)
    with pytest.raises(Exception, match="inductor=False"):
        torch.compile(torch.nn.Linear(4, 4), backend=eager_only, mode="reduce-overhead")(torch.randn(2, 4))


def test_dynamo_reset_resets_the_cuda_graph_trees(monkeypatch):
    import torch._inductor.cudagraph_trees as trees

    calls = []
    monkeypatch.setattr(trees, "reset_cudagraph_trees", lambda: calls.append(1))
    torch._dynamo.reset()
    model = _tiny_llama()
    with torch.no_grad():
        torch.compile(model, backend=mlp_fuser.backend, mode="reduce-overhead")(torch.randint(0, 128, (1, 4)))
    calls.clear()
    torch._dynamo.reset()
    assert calls, "torch._dynamo.reset() did not reach the backend's reset"


def _static_generate(model, ids, backend, device_all=True):
    from transformers import CompileConfig

    cc = CompileConfig(backend=backend)
    cc._compile_all_devices = device_all  # transformers compiles on CUDA only unless told
    return model.generate(ids, max_new_tokens=8, do_sample=False, cache_implementation="static", compile_config=cc)


def test_transformers_static_cache_compile_config():
    torch._dynamo.reset()
    model = _tiny_llama()
    ids = torch.randint(1, 128, (2, 5), generator=torch.Generator().manual_seed(3))
    expected = _static_generate(model, ids, "inductor")
    fused_calls = []
    torch._dynamo.reset()
    got = _static_generate(model, ids, mlp_fuser.backend)
    fused_calls.append(count_ops(lambda: _static_generate(model, ids, mlp_fuser.backend)))
    assert torch.equal(got, expected)
    assert fused_calls[0] >= 7  # every decode step ran the compiled forward with the fused op


# ---- on the GPU: reduce-overhead replays CUDA graphs with the op inside ---------------------------


@requires_cuda
def test_gpu_reduce_overhead_replays_cuda_graphs(monkeypatch):
    replays = []
    real = torch.cuda.CUDAGraph.replay
    monkeypatch.setattr(torch.cuda.CUDAGraph, "replay", lambda self: replays.append(1) or real(self))
    torch._dynamo.reset()
    model = _tiny_llama("cuda", layers=2)
    ids = torch.randint(0, 128, (2, 6), device="cuda")
    with torch.no_grad():
        expected = model(ids).logits
        compiled = torch.compile(model, backend=mlp_fuser.backend, mode="reduce-overhead")
        for _ in range(4):  # warm-up, record, then replays
            out = compiled(ids).logits.clone()
    assert replays, "no CUDA graph was replayed"
    torch.testing.assert_close(out, expected, rtol=1e-4, atol=1e-4)
    torch._dynamo.reset()


@requires_cuda
@pytest.mark.parametrize("batch", [1, 3])
def test_gpu_static_cache_bf16_same_tokens_as_inductor(batch):
    torch._dynamo.reset()
    model = _tiny_llama("cuda", layers=2).to(torch.float32)
    ids = torch.randint(1, 128, (batch, 5), device="cuda")
    expected = _static_generate(model, ids, "inductor", device_all=None)
    torch._dynamo.reset()
    got = _static_generate(model, ids, mlp_fuser.backend, device_all=None)
    assert torch.equal(got, expected)


@requires_cuda
def test_gpu_inductor_code_calls_the_ops_entry_directly(monkeypatch):
    # On the GPU and its torch: Inductor's code for a graph run without CUDA graphs calls torch.ops.mlp_fuser.
    # _inductor_gated_mlp, which computes the op right there (its launch plan from the second call on), within the
    # unfused model's error against float64.
    from torch._inductor.utils import run_and_get_code

    from mlp_fuser import compat
    from mlp_fuser.reference import rel_err

    plain, real = [], compat.plain_call
    monkeypatch.setattr(compat, "plain_call", lambda *a: plain.append(real(*a)) or plain[-1])
    torch._dynamo.reset()
    model = _tiny_llama("cuda", layers=2).to(torch.bfloat16)
    ids = torch.randint(0, 128, (2, 6), device="cuda")
    with torch.no_grad(), torch._inductor.config.patch(fx_graph_cache=False):
        expected = copy.deepcopy(model).double()(ids).logits
        unfused = model(ids).logits
        compiled = torch.compile(model, backend=mlp_fuser.backend)
        out, (code,) = run_and_get_code(lambda: compiled(ids).logits)
        for _ in range(2):
            compiled(ids)
        plain.clear()
        out2 = compiled(ids).logits
    assert code.count("torch.ops.mlp_fuser._inductor_gated_mlp(") == 2
    assert plain == [True, True]
    for o in (out, out2):
        assert rel_err(o, expected) <= 1.25 * rel_err(unfused, expected)
    torch._dynamo.reset()
