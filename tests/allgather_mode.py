"""A CP mode added from outside `cp`, the way a new mode is added: this one module and one registry line,
`cp.register_mode(ALLGATHER)`, run in every process before anything of the mode is built (tests/test_mode_seam.py).

All-gather of K/V, as torchtitan's Flux CP does it: every rank gathers the whole sequence's K and V with functional
collectives, whose backward is the exact adjoint (a reduce-scatter that sums each chunk's gradients from every rank),
and attends its own queries to them. Its memory grows with the whole sequence and no exchange overlaps compute: a
reference for the seam, not a mode to train with. Its eager path is also the one torch.compile traces (`Mode.traced`).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
import torch.nn.functional as F

import cp
from cp.mode import CallSpec

Tensor = torch.Tensor


class AllGather(cp.Mode):
    name = "allgather"
    summary = "every rank gathers the whole K and V"

    def attention(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        k, v = (funcol.all_gather_tensor_autograd(t.contiguous(), 1, spec.group_name) for t in (k, v))
        out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v)), scale=spec.scale)
        return out.transpose(1, 2)


ALLGATHER = AllGather()
