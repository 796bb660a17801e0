"""Communication for context parallelism: sharding, an autograd-correct gather, ring P2P, the exchanges' head start.
(The Ulysses all-to-alls live in cp/ulysses.py; the hybrid mode's sub-groups are made with its `CPContext`,
cp/context.py.)

Only explicit `torch.distributed` calls live here (no `torch.distributed.nn`, whose all_gather has
wrong gradients on gloo), each wrapped in an autograd Function whose backward is the exact adjoint.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

Tensor = torch.Tensor
ProcessGroup = dist.ProcessGroup


def group_size(group: ProcessGroup | None) -> int:
    """Size of a CP group; `None` (or an uninitialised default group) means no CP: size 1."""
    if group is None or not dist.is_available() or not dist.is_initialized():
        return 1
    return dist.get_world_size(group)


def group_rank(group: ProcessGroup | None) -> int:
    return 0 if group_size(group) == 1 else dist.get_rank(group)


def check_divisible(length: int, group: ProcessGroup | None, what: str = "sequence length") -> None:
    """Raise a ValueError that says what to change when `length` does not split evenly over the group."""
    n = group_size(group)
    if length % n:
        lo, hi = (length // n) * n, (length // n + 1) * n
        raise ValueError(
            f"{what} {length} is not divisible by the context-parallel size {n}: every rank must hold an equal "
            f"chunk. Use a {what} that is a multiple of {n} (e.g. {lo or hi} or {hi}) or another CP size."
        )


def shard(tensor: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """This rank's equal, contiguous chunk of `tensor` along `dim` (a view-free copy-safe slice)."""
    n = group_size(group)
    if n == 1:
        return tensor
    check_divisible(tensor.shape[dim], group, what=f"size of dim {dim}")
    return tensor.chunk(n, dim=dim)[group_rank(group)].contiguous()


# torch 2.13 renamed these (the old names warn); torch 2.11 on the GPU machines has only the old ones.
_all_gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class _AllGather(torch.autograd.Function):
    """Concatenate every rank's chunk along `dim`. Backward: reduce-scatter (sum), the exact adjoint."""

    @staticmethod
    def forward(ctx, x: Tensor, dim: int, group: ProcessGroup) -> Tensor:
        ctx.dim, ctx.group = dim, group
        n = dist.get_world_size(group)
        x = x.movedim(dim, 0).contiguous()
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        _all_gather(out, x, group=group)
        return out.movedim(0, dim)

    @staticmethod
    def backward(ctx, grad: Tensor):
        n = dist.get_world_size(ctx.group)
        g = grad.movedim(ctx.dim, 0).contiguous()
        out = torch.empty((g.shape[0] // n, *g.shape[1:]), dtype=g.dtype, device=g.device)
        _reduce_scatter(out, g, op=dist.ReduceOp.SUM, group=ctx.group)
        return out.movedim(0, ctx.dim), None, None


def gather(tensor: Tensor, dim: int, group: ProcessGroup | None) -> Tensor:
    """Concatenation of all ranks' chunks along `dim`, autograd-correct.

    The backward sums, for each chunk, the gradients that all ranks computed for it (the adjoint of
    all-gather). So if every rank of the group computes the same loss on the gathered tensor, the
    gradients must be *averaged* over the group (as DDP/FSDP do) to equal the non-CP gradient.
    """
    if group_size(group) == 1:
        return tensor
    return _AllGather.apply(tensor, dim, group)


# ~0.5 us at an H200's clock; 1000 and 4000 measured the same (benchmarks/archive/probe_sms.py)
HEAD_START_CYCLES = 1000


def head_start() -> None:
    """Hold the current CUDA stream for a moment (a one-thread kernel of ~0.5 us). Call it right after launching
    an exchange, or waiting for one: an exchange kernel that becomes ready at the same moment as the next compute
    kernel is then dispatched first. Otherwise the compute kernel (a matrix product, cuDNN's attention) takes
    every SM and the exchange starts only when it ends, even when launched first; started first, the exchange
    runs beside it and slows it by about its share of the SMs (benchmarks/archive/probe_sms.py). No-op without CUDA."""
    if torch.cuda.is_available():
        torch.cuda._sleep(HEAD_START_CYCLES)


class RingComm:
    """Sends to the next rank of the group and receives from the previous one, asynchronously.

    Rank r sends to r+1 and receives from r-1 (mod n), so after i steps rank r holds the block that
    rank r-i started with. Backward accumulators travel the same way and arrive at their owner after
    n steps (see ring.py); getting this direction wrong is invisible at n=2.
    """

    def __init__(self, group: ProcessGroup, first: bool = False):
        self.group = group
        self.first = first  # Tuning.exchange_first: a head start after each launch and wait
        self.size = dist.get_world_size(group)
        rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (rank + 1) % self.size)
        self.prev = dist.get_global_rank(group, (rank - 1) % self.size)

    def start(self, send: Tensor, tag: int = 0) -> tuple[Tensor, list]:
        """Post send(send -> next) and recv(prev -> returned buffer); returns (buffer, works)."""
        recv = torch.empty_like(send)
        ops = [
            dist.P2POp(dist.isend, send, self.next, self.group, tag),
            dist.P2POp(dist.irecv, recv, self.prev, self.group, tag),
        ]
        works = dist.batch_isend_irecv(ops)
        if self.first:  # the transfer beside this step's attention: let it start before the kernel
            head_start()
        return recv, works

    def wait(self, works: list) -> None:
        for w in works:
            w.wait()
        if works and self.first:
            head_start()
