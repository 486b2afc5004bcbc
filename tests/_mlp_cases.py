"""Random MLP problems shared by the op tests: weights in every storage layout, fresh values, no zeros."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from mlp_fuser.dispatch.dense import MLPArgs
from mlp_fuser.reference import reference_gate_up, reference_mlp


@dataclass
class Case:
    x: Tensor
    wg: Tensor
    bg: Tensor | None
    wu: Tensor | None
    bu: Tensor | None
    wd: Tensor
    bd: Tensor | None
    act: str

    @property
    def gated(self) -> bool:
        return self.wu is not None

    def args(self) -> tuple:
        """Arguments of the op (mlp or gated_mlp) for this case."""
        if self.gated:
            return (self.x, self.wg, self.bg, self.wu, self.bu, self.wd, self.bd, self.act)
        return (self.x, self.wg, self.bg, self.wd, self.bd, self.act)

    def record(self, **fields) -> MLPArgs:
        """The case as the record the op passes inside (``dispatch.MLPArgs``), ``fields`` replaced."""
        return MLPArgs(self.x, self.wg, self.bg, self.wu, self.bu, self.wd, self.bd, self.act)._replace(**fields)

    def op(self):
        return torch.ops.mlp_fuser.gated_mlp.default if self.gated else torch.ops.mlp_fuser.mlp.default

    def _float64(self) -> list[Tensor | None]:
        """x, wg, bg, wu, bu, wd, bd in float64."""
        tensors = (self.x, self.wg, self.bg, self.wu, self.bu, self.wd, self.bd)
        return [None if t is None else t.double() for t in tensors]

    def reference64(self) -> Tensor:
        return reference_mlp(*self._float64(), self.act)

    def rounded_once(self) -> Tensor:
        """The MLP in float64 with h rounded to the case's dtype once and the output once: what a kernel that keeps
        its sums in fp32 and stores h in x's dtype (as the op does) computes, short of its fp32 rounding."""
        d = self._float64()
        h = reference_gate_up(*d[:5], self.act).to(self.x.dtype).double()
        return F.linear(h, d[5], d[6]).to(self.x.dtype)

    def unfused(self) -> Tensor:
        """What the unfused nn.Linear modules compute in the case's own dtype."""
        return reference_mlp(self.x, self.wg, self.bg, self.wu, self.bu, self.wd, self.bd, self.act)


def make_case(M, K, I, O, *, gated=True, act="silu", dtype=torch.float32, device="cpu", bias=(True, True, True),
              layout="linear", lead=(), x_noncontig=False) -> Case:
    """layout: "linear" (out, in) weights; "conv1d" (in, out) storage passed as .t() views;
    "merged" one (2I, K) gate_up weight passed as two views (gated only)."""
    g = torch.Generator(device=device).manual_seed(torch.randint(0, 2**31, ()).item())

    def rnd(*shape, scale=1.0):
        t = torch.randn(*shape, generator=g, device=device, dtype=torch.float32) * scale
        return t.to(dtype)

    kx = max(K, 1) ** -0.5
    if layout == "conv1d":
        wg = rnd(K, I, scale=kx).t()
        wu = rnd(K, I, scale=kx).t() if gated else None
        wd = rnd(I, O, scale=I**-0.5).t()
    elif layout == "merged":
        assert gated
        w = rnd(2 * I, K, scale=kx)
        wg, wu = w[:I], w[I:]
        wd = rnd(O, I, scale=I**-0.5)
    else:
        wg = rnd(I, K, scale=kx)
        wu = rnd(I, K, scale=kx) if gated else None
        wd = rnd(O, I, scale=I**-0.5)
    bg = rnd(I, scale=0.5) if bias[0] else None
    bu = rnd(I, scale=0.5) if bias[1] and gated else None
    bd = rnd(O, scale=0.5) if bias[2] else None
    if x_noncontig:
        x = rnd(*lead, M, 2 * K)[..., ::2]
    else:
        x = rnd(*lead, M, K)
    return Case(x, wg, bg, wu, bu, wd, bd, act)
