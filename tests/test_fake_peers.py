"""benchmarks/fake_peers.py's loopback process group: one process stands for a CP group of n ranks whose peers hold
what it holds, so every collective returns what it returns among identical ranks. Run in a subprocess: the group
becomes that process's default group. (Compiled, the same group ran the trainer's compiled blocks on a GPU:
docs/benchmarks.md, host time per step.)"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

SCRIPT = textwrap.dedent(
    """
    import torch
    import torch.distributed as dist

    import cp
    from benchmarks.fake_peers import init_loopback

    n = 3
    init_loopback(n)
    g = torch.Generator().manual_seed(0)
    x = torch.randn(n * 4, 5, generator=g)

    t = x.clone(); dist.all_reduce(t); torch.testing.assert_close(t, n * x)  # the sum over n equal ranks
    t = x.clone(); dist.all_reduce(t, op=dist.ReduceOp.MAX); assert torch.equal(t, x)
    out = torch.empty(n * x.shape[0], 5); dist.all_gather_into_tensor(out, x); assert torch.equal(out, x.repeat(n, 1))
    out = torch.empty(4, 5); dist.reduce_scatter_tensor(out, x); torch.testing.assert_close(out, n * x[:4])
    out = torch.empty_like(x); dist.all_to_all_single(out, x)  # each peer sends this rank its own first share
    assert torch.equal(out, x[:4].repeat(n, 1))
    out = torch.empty(n * 2, 5)  # unequal input splits: every peer sends its first piece, 2 rows
    dist.all_to_all_single(out, x[:9], output_split_sizes=[2] * n, input_split_sizes=[2, 3, 4])
    assert torch.equal(out, x[:2].repeat(n, 1))
    try:
        dist.all_to_all_single(torch.empty(9, 5), x[:9], output_split_sizes=[2, 3, 4], input_split_sizes=[2, 3, 4])
        raise AssertionError("output splits that identical peers cannot fill were accepted")
    except ValueError as e:
        assert "every peer sends 2 rows" in str(e), e
    seen = [None] * n; dist.all_gather_object(seen, {"rank": dist.get_rank()}); assert seen == [{"rank": 0}] * n

    # The ring over identical peers attends to this rank's keys n times over: the same softmax as attending once.
    q, k, v = (torch.randn(1, 12, 6, 8, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(3))
    local = cp.attention(q, k, v, group=None)
    ring = cp.attention(q, k, v, group=dist.group.WORLD, mode="ring")
    torch.testing.assert_close(ring, local, rtol=1e-12, atol=1e-12)
    for mode in ("ulysses", "ring"):  # finite, the real magnitude, and differentiable
        o = cp.attention(q, k, v, group=dist.group.WORLD, mode=mode)
        o.square().sum().backward()
        assert all(torch.isfinite(t.grad).all() for t in (q, k, v)), mode
        assert 0.1 < o.abs().mean() / local.abs().mean() < 10, mode
        q.grad = k.grad = v.grad = None
    print("ok")
    """
)


@pytest.mark.distributed
def test_loopback_peers_compute_what_identical_ranks_would():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
