"""Tensor-parallel and FSDP2 models fused per shard: two gloo processes on the CPU, tiny LLaMA MLPs.

One launch runs every check of tests/_distributed_checks.py (a process group's start-up and the imports cost more
than a check); each test below reads its check's result on both ranks. Covered: ``parallelize_module`` (colwise
gate/up, rowwise down) with ``patch`` and the backend, eval and train, its near miss (gate/up all-gathered) and
``explain``; sequence parallel (a named near miss, run as without mlp_fuser); transformers' ``tp_plan="auto"`` the
same; FSDP2 ``fully_shard`` per layer with ``patch`` before and after, the backend, and bf16 mixed precision; FSDP2 +
tensor parallel on a 2-D (dp, tp) mesh. Outputs and gradients (shards and input) against the unsharded model in
float64; fused sites counted from the op nodes in the graph or the op's calls.
"""

import json
import os
import socket
import sys

import pytest
import torch

dist = pytest.importorskip("torch.distributed")
if not dist.is_available() or not dist.is_gloo_available():
    pytest.skip("needs torch.distributed with gloo", allow_module_level=True)

sys.path.insert(0, os.path.dirname(__file__))
import _distributed_checks as checks  # noqa: E402

pytestmark = pytest.mark.slow

WORLD = 2


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def results(tmp_path_factory):
    import torch.multiprocessing as mp
    import transformers

    out = tmp_path_factory.mktemp("distributed")
    hf = str(out / "llama")
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(checks.llama_config()).save_pretrained(hf)
    mp.spawn(checks.run, args=(WORLD, _free_port(), str(out), list(checks.CHECKS), hf), nprocs=WORLD)
    return [json.loads((out / f"rank{r}.json").read_text()) for r in range(WORLD)]


@pytest.mark.parametrize("name", list(checks.CHECKS))
def test_check(results, name):
    for rank, res in enumerate(results):
        assert res.get(name) == "ok", f"rank {rank}: {res.get(name, 'not run')}"
