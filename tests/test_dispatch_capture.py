"""The one policy for a key's first call inside a CUDA-graph capture (``core.pick``), where nothing can be timed: the
family's ``first_capture`` row runs untimed, nothing is kept, one warning; once a plain call has timed the key, calls
take the eager row and captures the graph row. CUDA stood in for by the problem's device and a patched capture flag."""

import pytest
import torch

from mlp_fuser import config
from mlp_fuser.dispatch import core, experts, fp8_experts
from mlp_fuser.reference import Gate

FAMILIES = {  # registry, choose, chosen, a CUDA problem, the row a first captured call runs, what the warning says
    "experts": (experts.EXPERTS, experts.choose, experts.chosen,
                experts.Problem("cuda", torch.float16, 3, 2, 4, 8, 16, Gate("silu"), False),
                "reference", "running the unfused aten path"),
    # the first candidate, not the fallback (aten_dequantize would copy every expert's weights dequantized)
    "fp8_experts": (fp8_experts.FP8_EXPERTS, fp8_experts.choose, fp8_experts.chosen,
                    fp8_experts.Problem("cuda", 0, 1, (None, None), 1, ("test_dispatch_capture",)),
                    "plain", "plain runs it untimed"),
}


def stub_timing(monkeypatch, capturing: bool):
    """Two rows, "plain" and "graph", that timing (recorded in the list returned) gives to plain calls and captures;
    the capture flag a one-item list to flip."""
    plain, graph = (core.Impl(name, lambda *a: None, None, None) for name in ("plain", "graph"))
    monkeypatch.setattr(config, "force_impl", None)
    monkeypatch.setattr(config, "autotune", True)
    monkeypatch.setattr(core, "candidates", lambda reg, p: [plain, graph])
    timed = []
    monkeypatch.setattr(core, "time_candidates", lambda reg, found, args, p: timed.append(p) or ("graph", "plain"))
    flag = [capturing]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: flag[0])
    return timed, flag


@pytest.mark.parametrize("family", FAMILIES)
def test_first_call_inside_a_capture_then_timed_choice(family, monkeypatch, caplog):
    reg, choose, chosen, p, first_row, says = FAMILIES[family]
    timed, capturing = stub_timing(monkeypatch, True)
    monkeypatch.setattr(core, "_warned", set())
    core.reset(reg)
    try:
        with caplog.at_level("WARNING", logger="mlp_fuser"):
            assert [choose(p, ()).name for _ in range(2)] == [first_row] * 2
        warned = [r.getMessage() for r in caplog.records if "inside a CUDA-graph capture" in r.getMessage()]
        assert len(warned) == 1 and says in warned[0], warned
        assert timed == [] and chosen(p) is None  # untimed, nothing kept: the next plain call times it
        capturing[0] = False
        assert choose(p, ()).name == "plain" and timed == [p]
        capturing[0] = True
        assert choose(p, ()).name == "graph" and len(timed) == 1
        assert chosen(p) == "plain (graphs: graph)"
    finally:
        core.reset(reg)


def test_registry_rejects_an_unknown_first_capture():
    with pytest.raises(ValueError, match="first_capture"):
        core.Registry("toy", [], None, first_capture="aten")


@pytest.mark.parametrize("family", ["experts", "dense"])
def test_backward_rows_follow_the_capture(family, monkeypatch):
    """The backward tables take ``core.pick``'s rule as the forwards do: once timed, plain calls run the eager row and
    calls being captured the graph row (the experts' backward ran the eager row in captures, the dense one the graph
    row in plain calls)."""
    from mlp_fuser.dispatch import dense

    timed, capturing = stub_timing(monkeypatch, False)
    x = torch.randn(3, 8)
    if family == "experts":
        reg = experts.BACKWARD
        p = experts.StepProblem("cuda", torch.float16, 3, 2, 4, 8, 16, Gate("silu"), False, True, True)
        row = lambda: experts.choose_backward(p, (x,)).name  # noqa: E731
    else:
        reg = dense.BACKWARD
        monkeypatch.setattr(dense, "_resolved", {})
        row = lambda: dense.resolve_backward(torch.device("cuda"), torch.float16, 3, 16, 8, True, (x,)).name  # noqa: E731
    core.reset(reg)
    try:
        assert [row(), row()] == ["plain", "plain"] and len(timed) == 1
        capturing[0] = True
        assert [row(), row()] == ["graph", "graph"] and len(timed) == 1
        capturing[0] = False
        assert row() == "plain"
    finally:
        core.reset(reg)
