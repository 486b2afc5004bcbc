"""mlp_fuser.config: one settings object, set from Python or by the MLP_FUSER_* environment variables."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

import mlp_fuser
from mlp_fuser import compat, config
from mlp_fuser.kernels import quack_gated
from mlp_fuser.ops import moe

DEFAULTS = dict(force_impl=None, triton_on_cpu=False, autotune=True, triton_backward=False, moe_tma=False,
                moe_rows_lowp=True, quack=True, plans=True, sites=True, inductor_direct=True, private_apis=True,
                check_routing=False, fp8_w8a8=True, moe_backward="recompute", fp8_one_launch=True,
                fp8_merge=True, fp8_fused_h=True)
FLIPPED_ENV = {"MLP_FUSER_IMPL": "triton_gemm", "MLP_FUSER_TRITON_ON_CPU": "1", "MLP_FUSER_AUTOTUNE": "0",
               "MLP_FUSER_TRITON_BACKWARD": "1", "MLP_FUSER_MOE_TMA": "1", "MLP_FUSER_MOE_ROWS_LOWP": "0",
               "MLP_FUSER_QUACK": "0",
               "MLP_FUSER_PLANS": "0", "MLP_FUSER_SITES": "0", "MLP_FUSER_INDUCTOR_DIRECT": "0",
               "MLP_FUSER_PRIVATE": "0", "MLP_FUSER_CHECK_ROUTING": "1", "MLP_FUSER_FP8_W8A8": "0",
               "MLP_FUSER_MOE_BACKWARD": "save", "MLP_FUSER_FP8_ONE_LAUNCH": "0",
               "MLP_FUSER_FP8_MERGE": "0", "MLP_FUSER_FP8_FUSED_H": "0"}
FLIPPED = {k: "triton_gemm" if v is None else "save" if v == "recompute" else not v for k, v in DEFAULTS.items()}


def _cuda_ids(low: int):
    """Routing ids as the check sees them on CUDA (where reading them costs a host sync)."""
    return SimpleNamespace(numel=lambda: 4, is_cuda=True, min=lambda: torch.tensor(low))


def test_the_variables_map_onto_the_settings():
    assert config.from_env({}) == DEFAULTS
    assert config.from_env(FLIPPED_ENV) == FLIPPED
    for var, value in FLIPPED_ENV.items():  # each variable moves its own setting only
        (name,) = [n for n, (v, _, _) in config.ENV.items() if v == var]
        assert config.from_env({var: value}) == {**DEFAULTS, name: FLIPPED[name]}


def test_environment_at_import_reaches_the_code_that_reads_it():
    """In a fresh process with every variable set: the settings, and the two once read outside config.py."""
    code = ("import json, torch, mlp_fuser; from types import SimpleNamespace as S\n"
            "from mlp_fuser.ops import moe; from mlp_fuser.kernels import quack_gated\n"
            "ids = S(numel=lambda: 4, is_cuda=True, min=lambda: torch.tensor(-1))\n"
            "try:\n    moe._check_ids(ids); checked = False\n"
            "except ValueError:\n    checked = True\n"
            "print(json.dumps([mlp_fuser.config.settings(), quack_gated.why_not('silu', 64, 64), checked]))")
    env = {**os.environ, **FLIPPED_ENV}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    settings, quack_off, checked = json.loads(out.stdout.strip().splitlines()[-1])
    assert settings == FLIPPED and quack_off == "MLP_FUSER_QUACK=0" and checked


def test_set_in_code_reaches_the_code_that_reads_it(monkeypatch):
    assert mlp_fuser.config is config
    moe._check_ids(_cuda_ids(-1))  # on CUDA the ids are not read by default (a sync per call)
    monkeypatch.setattr(mlp_fuser.config, "check_routing", True)
    with pytest.raises(ValueError, match="topk_ids holds -1"):
        moe._check_ids(_cuda_ids(-1))
    monkeypatch.setattr(mlp_fuser.config, "quack", False)
    assert quack_gated.why_not("silu", 64, 64) == "MLP_FUSER_QUACK=0"


def test_patch_restores_and_unknown_names_raise():
    before = config.settings()
    with config.patch(sites=False, autotune=False):
        assert not config.sites and not config.autotune
    assert config.settings() == before
    with pytest.raises(AttributeError, match="no setting 'site'"):
        config.site = False  # a typo is an error, not a setting nobody reads
    assert not hasattr(config, "site")


def test_private_apis_applies_at_once():
    assert compat.PRIVATE
    with config.patch(private_apis=False):
        assert not compat.PRIVATE
    assert compat.PRIVATE


def test_docstring_documents_every_setting():
    for name, (var, _, _) in config.ENV.items():
        assert f"``{name}`` (``{var}" in config.__doc__
