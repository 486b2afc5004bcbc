"""The command line: ``python -m mlp_fuser {demo,explain,bench}`` and the helpers in ``mlp_fuser.tools.models``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import mlp_fuser
from mlp_fuser import cli
from mlp_fuser.tools import models as _hf

ROOT = Path(__file__).resolve().parents[1]
HAS_CUDA = torch.cuda.is_available()


def _env() -> dict[str, str]:
    """The environment of a user's shell: no Triton interpreter (conftest sets it for the kernel tests)."""
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MLP_FUSER_TRITON_ON_CPU")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    return env


def run_cli(*args: str, timeout: int = 900) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "mlp_fuser", *args],
        cwd=ROOT,
        env=_env(),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_help_lists_the_subcommands():
    r = run_cli("--help", timeout=300)
    assert r.returncode == 0, r.stderr
    for sub in ("demo", "explain", "bench"):
        assert sub in r.stdout


def test_version(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    assert e.value.code == 0
    assert mlp_fuser.__version__ in capsys.readouterr().out


def test_no_subcommand_is_a_usage_error(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main([])
    assert e.value.code == 2


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_bench_without_cuda_exits_2_with_a_clear_message(capsys):
    assert cli.main(["bench"]) == 2
    err = capsys.readouterr().err
    assert "CUDA" in err and "GPU" in err


@pytest.mark.skipif(HAS_CUDA, reason="checks the message given without a GPU")
def test_bench_subprocess_exit_code():
    r = run_cli("bench", "--quick", timeout=300)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "CUDA" in r.stderr


@pytest.mark.parametrize("model_type", ["llama", "gpt2"])
def test_explain_model_type(model_type, capsys):
    assert cli.main(["explain", model_type]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip(), "the report goes to stdout"
    assert "building a tiny random" in cap.err, "progress goes to stderr"


def test_explain_matches_the_api():
    model = _hf.tiny_model("qwen3")
    expected = str(mlp_fuser.explain(model, *_hf.example_inputs(model)))
    assert cli.explain("qwen3").strip() == expected.strip()


def test_explain_local_checkpoint(tmp_path, capsys):
    model = _hf.tiny_model("llama")
    model.save_pretrained(tmp_path / "ckpt")
    assert cli.main(["explain", str(tmp_path / "ckpt")]) == 0
    cap = capsys.readouterr()
    assert cap.out.strip()
    assert "loading checkpoint" in cap.err


def test_explain_unknown_target(capsys):
    assert cli.main(["explain", "no_such_model_type"]) == 2
    err = capsys.readouterr().err
    assert "no_such_model_type" in err and len(err) < 400


def test_explain_refuses_a_toy_that_is_not_tiny(capsys):
    """gemma3's toy keeps its full-size vision tower (2.7B parameters, 11 GB in fp32): counted on the meta device and
    refused with what to run instead, before anything is allocated."""
    assert cli.main(["explain", "gemma3"]) == 2
    err = capsys.readouterr().err
    assert "gemma3_text" in err and "M parameters" in err and len(err) < 600, err


def test_explain_subprocess():
    r = run_cli("explain", "gpt2", timeout=600)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() and "[mlp_fuser]" in r.stderr and "[mlp_fuser]" not in r.stdout


# ---- _hf helpers ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("model_type", ["llama", "gpt2", "qwen3", "gemma2", "phi3", "opt", "bert", "mixtral", "falcon",
                                        "ministral", "gpt_neo", "qwen3_next", "gemma4_text", "deepseek_v2",
                                        "deepseek_v3", "kimi_linear", "jamba"])
def test_tiny_config_is_tiny_and_runs(model_type):
    cfg = _hf.tiny_config(model_type)
    assert cfg.model_type == model_type
    assert cfg.hidden_size == 64 and cfg.num_hidden_layers == 2 and cfg.vocab_size == 512
    assert cfg.hidden_size % cfg.num_attention_heads == 0
    model = _hf.tiny_model(model_type)
    assert sum(p.numel() for p in model.parameters()) < 2_000_000
    with torch.no_grad():
        out = model(*_hf.example_inputs(model))
    assert out[0].shape[:2] == (1, 8)


def test_tiny_config_keeps_every_kind_of_layer():
    """A hybrid's toy keeps each kind of layer its family has (Qwen3-Next: linear attention in three of every four
    layers; the first two alone would leave the cache no attention layer), and a family of one kind stays so."""
    assert _hf.tiny_config("qwen3_next").layer_types == ["linear_attention", "full_attention"]
    assert _hf.tiny_config("gemma2").layer_types == ["sliding_attention", "full_attention"]
    assert getattr(_hf.tiny_config("llama"), "layer_types", None) is None  # none to keep


def test_tiny_config_latent_attention_and_routed_experts():
    """Multi-head latent attention (DeepSeek-V2/V3, Kimi) keeps a key per query head and its rotary part at the toy's
    head_dim; DeepSeek's routing gets its expert count in one group, and a MoE second layer whose shared and routed
    experts explain finds (DeepSeek-V2's own default leaves the experts per token None)."""
    for t in ("deepseek_v2", "deepseek_v3"):
        cfg = _hf.tiny_config(t)
        assert cfg.num_key_value_heads == cfg.num_attention_heads and cfg.qk_rope_head_dim == cfg.head_dim == 16
        assert (cfg.n_routed_experts, cfg.num_experts_per_tok, cfg.first_k_dense_replace) == (4, 2, 1)
        model = _hf.tiny_model(t)
        report = mlp_fuser.explain(model, *_hf.example_inputs(model))
        assert [(f.path, f.pattern) for f in report.fused] == [
            ("model.layers.0.mlp", "gated"), ("model.layers.1.mlp.shared_experts", "gated"),
            ("model.layers.1.mlp.experts", "routed_experts")], report


def test_tiny_config_jamba_has_an_attention_layer():
    """Jamba's toy puts attention (and experts) in its second layer: with the family's period of 8 from the 5th, two
    layers hold only Mamba, and the cache then refuses to give a sequence length."""
    cfg = _hf.tiny_config("jamba")
    assert (cfg.attn_layer_period, cfg.attn_layer_offset) == (2, 1)
    model = _hf.tiny_model("jamba")
    report = mlp_fuser.explain(model, *_hf.example_inputs(model))
    assert [(f.path, f.pattern) for f in report.fused] == [
        ("model.layers.0.feed_forward", "gated"), ("model.layers.1.feed_forward.experts", "routed_experts")], report


def test_tiny_config_overrides():
    cfg = _hf.tiny_config("gpt2", hidden_size=32, num_hidden_layers=1)
    assert (cfg.n_embd, cfg.n_layer) == (32, 1)


def test_example_inputs_encoder_decoder():
    model = _hf.tiny_model("t5")
    inputs = _hf.example_inputs(model, seq_len=6)
    assert inputs[0].shape == (1, 6) and inputs[-1] is not None
    with torch.no_grad():
        model(*inputs)


def test_smollm2_gguf_is_found():
    d, name = _hf.smollm2_gguf()
    assert os.path.getsize(os.path.join(d, name)) > 50_000_000


# The demo's end-to-end test is tests/test_smollm2.py::test_demo_end_to_end: it shares that file's loaded SmolLM2.
