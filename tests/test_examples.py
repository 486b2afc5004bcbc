"""Every file in examples/ runs, as a user would run it, and says what it promises."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXAMPLES = sorted(p.name for p in (ROOT / "examples").glob("*.py"))

# name: (arguments, what the output must contain, slow)
EXPECT = {
    "compile_backend.py": ([], ["compiled with mlp_fuser.backend: OK"], False),
    "static_cache_generate.py": ([], ["both backends generated the same 12 tokens", "ms/token decode"], False),
    "training_step.py": ([], ["gradients match the unfused model", "mlp_fuser.patch(backward='save')"], False),
    "merge_gate_up.py": ([], ["gate and up stored as one: True", "round trip keeps the weights: True",
                              "merge_gate_up: OK"], False),
    "moe_experts.py": ([], ["generate with the mlp_fuser experts: the same 8 tokens", "mlp_fuser.patch: max",
                        "routed experts through mlp_fuser: OK"], False),
    "fp8_checkpoint.py": ([], ["the FP8 model: FP8Linear torch.float8_e4m3fn, FP8Experts torch.float8_e4m3fn",
                               "model.layers.0.mlp          gated (fp8_e4m3 128x128 blocks)",
                               "model.layers.1.mlp.experts  routed_experts (fp8_e4m3 128x128 blocks)",
                               "8 other FP8 linear layer(s) run through mlp_fuser's FP8 GEMM",
                               "FP8 checkpoint through mlp_fuser: OK"], False),
    "moe_finetune.py": ([], ["one step: mlp_fuser::moe_mlp 4 calls", "mlp_fuser::moe_mlp_backward 2",
                             "patched with LoRA on: fused model.layers.0.mlp.experts, model.layers.1.mlp.experts",
                             "mixture of experts fine-tuned through mlp_fuser: OK"], False),
    "explain_models.py": ([], ["llama", "gpt2", "qwen3", "summary"], True),
    "generate_smollm2.py": (["--tokens", "12"], ["all variants generated the same 12 tokens", "ms/token"], True),
}


def test_every_example_is_tested():
    assert EXAMPLES, "examples/ is empty"
    assert set(EXAMPLES) == set(EXPECT), "add the new example to EXPECT in tests/test_examples.py"


@pytest.mark.parametrize(
    "name", [pytest.param(n, marks=[pytest.mark.slow] if EXPECT.get(n, ([], [], True))[2] else []) for n in EXAMPLES]
)
def test_example_runs(name):
    args, expected, _ = EXPECT[name]
    # A user's environment: no Triton interpreter (conftest turns it on for the kernel tests in this process).
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "MLP_FUSER_TRITON_ON_CPU")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", PYTHONPATH=str(ROOT))
    r = subprocess.run(
        [sys.executable, str(ROOT / "examples" / name), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=1500,
    )
    assert r.returncode == 0, f"{name} failed:\n{r.stdout[-4000:]}\n{r.stderr[-4000:]}"
    for s in expected:
        assert s in r.stdout, f"{name}: {s!r} not in its output:\n{r.stdout[-4000:]}"
