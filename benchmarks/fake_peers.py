"""train_flux_cp.py as rank 0 of a CP group whose peers are copies of it, on one device: what a CP rank spends
besides waiting for its peers.

    accelerate launch --config_file accelerate_configs/gpu1.yaml -m benchmarks.fake_peers --cp_size 2 ...

(from the repository root: the script imports train_flux_cp from there).

The rank joins a process group of --cp_size ranks of which it is the only process (`LoopbackGroup`): every peer is
taken to hold what this rank holds, so a collective needs no other process and returns what it would return among
identical ranks (an all-to-all hands back this rank's own share from every peer, one copy on the device). The
rank thus computes on its 1/N of the tokens with the same model, compile passes, host work and optimizer as in a
real CP run (less the data-parallel wrapper's gradient all-reduce, as for one process), on data of the real
run's magnitude, and waits for no peer. Against the one-GPU run of the same flags, t1 / (N t_fake) is the
efficiency CP would reach if every exchange were free; the real run's time above t_fake is what the exchanges
cost. (torch's own `fake` backend leaves every exchanged tensor unset: the losses turn NaN from the second step,
and a GPU computing on NaNs runs faster than on real data: a 2048 px rank step took 0.99 s so, 1.20 s with these
peers, on two H200s of the same kind; benchmarks/archive/history.md, host time per step.)
The losses are not those of any real run, and no checkpoint is written; `benchmarks/bench_trainer.py --fake_peers`
stops the run once its steps are logged.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import _create_work_from_future
from torch.futures import Future

import cp

Tensor = torch.Tensor


def _done(result: object = None) -> dist.Work:
    future: Future = Future()
    future.set_result(result)
    return _create_work_from_future(future)


class LoopbackGroup(dist.ProcessGroup):
    """A process group of `size` ranks held by one process, rank 0, whose peers are copies of it: each collective
    computes what it computes when every rank holds this rank's tensors. Ring transfers deliver what this rank
    sent (its previous rank sent the same bytes)."""

    def __init__(self, rank: int, size: int):
        super().__init__(rank, size)
        self._rank, self._size = rank, size
        self._in_flight: dict[int, list[Tensor]] = {}  # tag -> tensors sent, awaiting the matching receive

    def size(self) -> int:
        return self._size

    def getBackendName(self) -> str:
        return "loopback"

    @property
    def group_name(self) -> str:  # what functional collectives resolve the group by
        return dist.distributed_c10d._world.pg_names[self]

    # --- collectives, each as among identical ranks ---

    def allreduce(self, tensors: list[Tensor], opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        for t in tensors:
            if op == dist.ReduceOp.SUM:
                t.mul_(self._size)
            elif op == dist.ReduceOp.PRODUCT:
                t.pow_(self._size)
            # AVG, MIN, MAX, BAND, BOR of equal values: the value itself
        return _done(tensors)

    def allreduce_coalesced(self, tensors: list[Tensor], opts=None) -> dist.Work:
        return self.allreduce(tensors, opts)

    def broadcast(self, tensors: list[Tensor], opts=None) -> dist.Work:
        return _done(tensors)

    def barrier(self, opts=None) -> dist.Work:
        return _done()

    def allgather(self, outputs: list[list[Tensor]], inputs: list[Tensor], opts=None) -> dist.Work:
        for outs, x in zip(outputs, inputs):
            for o in outs:
                o.copy_(x)
        return _done(outputs)

    def all_gather_single(self, output: Tensor, input: Tensor, opts=None) -> dist.Work:
        output.view(self._size, -1).copy_(input.reshape(1, -1).expand(self._size, -1))
        return _done([output])

    _allgather_base = all_gather_single

    def reduce_scatter_single(self, output: Tensor, input: Tensor, opts=None) -> dist.Work:
        own = input.reshape(self._size, -1)[self._rank].view_as(output)
        output.copy_(own)
        return self.allreduce([output], opts)

    _reduce_scatter_base = reduce_scatter_single

    def all_to_all_single(
        self, output: Tensor, input: Tensor, output_splits: list[int], input_splits: list[int], opts=None
    ) -> dist.Work:
        # Every peer sends this rank the share this rank sends itself (its piece `rank` of dim 0).
        rows_in = list(input_splits) or [input.shape[0] // self._size] * self._size
        rows_out = list(output_splits) or [output.shape[0] // self._size] * self._size
        own = input.split(rows_in)[self._rank]
        if any(n != own.shape[0] for n in rows_out):
            raise ValueError(
                f"all-to-all among identical ranks: every peer sends {own.shape[0]} rows (input splits {rows_in}), "
                f"but the output splits are {rows_out}"
            )
        output.view(self._size, *own.shape).copy_(own.unsqueeze(0).expand(self._size, *own.shape))
        return _done([output])

    alltoall_base = all_to_all_single

    def send(self, tensors: list[Tensor], dst: int, tag: int) -> dist.Work:
        self._in_flight.setdefault(tag, []).extend(tensors)
        return _done()

    def recv(self, tensors: list[Tensor], src: int, tag: int) -> dist.Work:
        sent = self._in_flight.get(tag)
        if not sent or len(sent) < len(tensors):
            raise RuntimeError(f"LoopbackGroup: a receive (tag {tag}) with no send before it")
        for t in tensors:
            t.copy_(sent.pop(0))
        return _done(tensors)


def _create(store: dist.Store, rank: int, size: int, timeout: timedelta) -> LoopbackGroup:
    return LoopbackGroup(rank, size)


def _let_dynamo_trace_it() -> None:
    """torch.compile of torch <= 2.12 knows a process group by its exact type, so a compiled, checkpointed block
    would stop at this Python subclass (a graph break at the checkpoint); later versions treat every group alike."""
    try:
        from torch._dynamo.variables.distributed import ProcessGroupVariable
    except ImportError:
        return
    known = getattr(ProcessGroupVariable, "is_process_group", None)
    if known is not None:
        ProcessGroupVariable.is_process_group = staticmethod(lambda v: isinstance(v, LoopbackGroup) or known(v))


def init_loopback(size: int) -> None:
    """The default process group: `size` ranks, this process rank 0 of them, its peers copies of it."""
    if "loopback" not in dist.Backend.backend_list:
        dist.Backend.register_backend("loopback", _create, devices=["cpu", "cuda"])
        _let_dynamo_trace_it()
    dist.init_process_group("loopback", rank=0, world_size=size, store=dist.HashStore())


def main(argv: list[str] | None = None) -> int:
    from flux_cp.config.parser import parse_config
    from flux_cp.layout import Layout
    from flux_cp.run.trainer import Trainer, logger

    cfg = parse_config(sys.argv[1:] if argv is None else argv)
    n = cfg.parallel.cp_size
    if n < 2:
        raise SystemExit("benchmarks.fake_peers: pass --cp_size 2 or more (the CP group this rank stands in for)")
    if int(os.environ.get("WORLD_SIZE", "1")) != 1:
        raise SystemExit("benchmarks.fake_peers runs as one process: launch it with accelerate_configs/gpu1.yaml")
    init_loopback(n)

    class LoopbackTrainer(Trainer):
        """The trainer as rank 0 of a launch of n processes and a CP group of n, ..."""

        def launched_world_size(self) -> int:
            return n

        def make_layout(self, accelerator) -> Layout:
            group, shape, timeout = dist.group.WORLD, self.shape, timedelta(seconds=cfg.parallel.collective_timeout)
            context = cp.CPContext(group, shape.cp_mode, shape.ulysses_size, tuning=self.tuning, timeout=timeout)
            return Layout(world=n, rank=0, cp=n, dp=1, dp_rank=0, cp_rank=0, cp_group=group, cp_context=context)

        def encode_share(self) -> tuple[int, int]:
            return 0, 1  # ... that encodes the whole data set itself (no peer encodes a share)

        def save_checkpoint(self, step: int) -> None:
            # No checkpoint: its weights would be nobody's, and DCP's own collectives need a real backend.
            logger.info(f"fake peers: no checkpoint at step {step}")

    LoopbackTrainer(cfg).run()
    return 0


if __name__ == "__main__":
    from flux_cp.run import runner

    sys.exit(runner.run(main))
