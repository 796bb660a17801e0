"""benchmarks/fake_peers.py's loopback process group: one process stands for a CP group of n ranks whose peers hold
what it holds at every collective, so each collective returns, value for value, what it returns among ranks that
all hold this rank's tensors; CP attention over it gives exactly known values. Run in a subprocess: the group
becomes that process's default group. (Compiled, the same group ran the trainer's compiled blocks on a GPU:
benchmarks/archive/history.md, host time per step.)"""

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

    def attend(mode):  # output and input gradients of sum(o^2), fp64
        q, k, v = (a.clone().requires_grad_(True) for a in qkv)
        o = cp.attention(q, k, v, group=dist.group.WORLD if mode else None, mode=mode or "ring")
        o.square().sum().backward()
        return [o.detach(), q.grad, k.grad, v.grad]

    qkv = [torch.randn(1, 12, 6, 8, generator=g, dtype=torch.float64) for _ in range(3)]
    local = attend(None)
    exact = dict(rtol=1e-12, atol=1e-12)
    # The ring over identical peers attends to this rank's keys n times over: the same softmax as attending once,
    # forward and backward.
    for got, want in zip(attend("ring"), local):
        torch.testing.assert_close(got, want, **exact)
    # Ulysses: the rank attends its first head chunk (of n) over n copies of its sequence, the work of a rank of n,
    # and every peer hands back what this rank holds: each head chunk of the output, and of the input gradients, is
    # the first chunk's, as attention without CP computes it.
    def first_chunk_everywhere(full):
        return full[:, :, : 6 // n].repeat(1, 1, n, 1)

    for got, want in zip(attend("ulysses"), local):
        torch.testing.assert_close(got, first_chunk_everywhere(want), **exact)
    print("ok")
    """
)


@pytest.mark.distributed
def test_loopback_peers_compute_what_identical_ranks_would():
    done = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0 and done.stdout.strip().endswith("ok"), done.stderr[-3000:]
