"""How the transformer blocks run during training: activation checkpointing (what each block keeps for its
backward, what it recomputes) and torch.compile, applied to the blocks in one place.

Eager, checkpointing is diffusers' own (`enable_gradient_checkpointing`: each block's forward is recomputed in
its backward). Compiled, the checkpoint goes *inside* each block's graph, which changes three things:

- the recomputation is part of the compiled backward graph, so a block is one forward graph and one backward
  graph; CUDA graphs (`--compile_mode reduce-overhead`) can then replay them, which they cannot while a
  compiled forward is called again from inside the backward;
- the attention is not recomputed: the outputs of the CP attention op and of its sequence/head exchanges are
  saved (`SAVED_OPS`), so the backward runs no second attention forward and no second round of exchanges.
  The attention forward is about an eighth of a 2048 px LoRA step's FLOPs (14% less step time on 2 H200s,
  docs/benchmarks.md); what it keeps is a few tensors of the attention's size per block (`flux_cp.plan` counts
  them, `--recompute_attention` turns it off);
- everything else (projections, norms, RoPE, the MLP) is recomputed as before.

The values computed are the same either way; only which of them are kept or computed twice differs.
"""

from __future__ import annotations

import functools
import logging
import os
import warnings

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

import cp.ops  # noqa: F401 - registers torch.ops.flux_cp
from cp.comm import exchange_first

from .errors import UsageError

logger = logging.getLogger("flux_cp")

# Ops whose outputs a compiled, checkpointed block keeps for its backward instead of recomputing them.
SAVED_OPS = (
    torch.ops.flux_cp.ring_attention.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    torch.ops._c10d_functional.wait_tensor.default,
)


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    return [*transformer.transformer_blocks, *transformer.single_transformer_blocks]


def _keep_attention(_ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in SAVED_OPS else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(_ctx, _op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, policy, *args, **kwargs):
    if not torch.is_grad_enabled():  # validation, inference: nothing to keep or recompute
        return forward(*args, **kwargs)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def checkpoint_inside(block: torch.nn.Module, keep_attention: bool = True) -> None:
    """Make `block.forward` checkpoint itself, keeping the attention's outputs (`SAVED_OPS`) unless
    `keep_attention` is False, so that a compile of the block traces the checkpoint into its graph. Module names
    and parameters are unchanged."""
    policy = _keep_attention if keep_attention else _recompute_all
    block.forward = functools.partial(_checkpointed, block.forward, policy)


def attention_recomputed(train) -> bool:
    """Whether a run with these training flags (`TrainConfig`) computes each attention forward twice."""
    compiled = bool(train.compile or train.compile_mode)
    return train.gradient_checkpointing and (not compiled or train.recompute_attention)


@functools.cache  # asked before every forward of a step
def uses_cuda_graphs(compile_mode: str | None) -> bool:
    import torch._inductor

    return bool(compile_mode) and bool(torch._inductor.list_mode_options(compile_mode).get("triton.cudagraphs"))


def step_begins(compile_mode: str | None) -> None:
    """Call before each forward of a training step: CUDA graph trees may then reuse the memory of the previous
    step's outputs (its loss has been read by then)."""
    if uses_cuda_graphs(compile_mode):
        torch.compiler.cudagraph_mark_step_begin()


def inductor_options(mode: str | None, overlap: str, cp: int = 2, sms: int = 0, first: bool = False) -> dict:
    """Inductor options for a block: those of torch.compile's `mode`, plus the reordering that lets the CP
    exchanges overlap compute. `overlap`: "fill" (the trainer's default) starts each exchange as soon as its input
    exists and adds our own pass (flux_cp/overlap.py), which moves ready compute, such as a block's feed-forward
    backward, beside each exchange of a `cp`-rank group by a cost model; "passes" starts each exchange as soon as
    its input exists and waits for it only where its output is first read;
    "compute" moves compute that does not need an exchange to run beside it, by Inductor's runtime estimates
    (`reorder_compute_for_overlap`); "scheduler" is Inductor's
    estimate-driven overlap scheduler; "none" keeps the graph's order. `sms` > 0 and `first` add a pass that
    makes the products launched while an exchange is in flight leave that many SMs free for it
    (FLUX_CP_SM_CARVEOUT), and lets each exchange kernel start before the compute behind it
    (FLUX_CP_EXCHANGE_FIRST)."""
    import torch._inductor

    options = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    if overlap == "passes":
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = ["sink_waits", "raise_comms"]
    elif overlap == "compute":
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = ["reorder_compute_for_overlap"]
    elif overlap == "fill":
        from flux_cp.overlap import fill_exchanges

        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = ["raise_comms", functools.partial(fill_exchanges, cp=cp)]
    elif overlap == "scheduler":
        options["aten_distributed_optimizations.enable_overlap_scheduling"] = True
    elif overlap != "none":
        raise UsageError(f"FLUX_CP_OVERLAP={overlap!r}: choose passes, fill, compute, scheduler or none")
    if sms or first:
        if overlap == "scheduler":
            raise UsageError(
                "FLUX_CP_SM_CARVEOUT and FLUX_CP_EXCHANGE_FIRST work with the reordering passes: unset them or "
                "FLUX_CP_OVERLAP"
            )
        from flux_cp.overlap import around_exchanges

        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = [
            *options.get("reorder_for_compute_comm_overlap_passes", []),
            functools.partial(around_exchanges, sms=sms, first=first),
        ]
    return options


def sm_carveout(count: str | None) -> int:
    """FLUX_CP_SM_CARVEOUT=N: how many streaming multiprocessors the matrix products launched beside an exchange
    leave free for it (0: none). A product's kernel otherwise takes every SM until it ends, and an exchange that
    becomes ready beside it waits for that end (benchmarks/probe_sms.py); the carveout lets it start at once, at
    the cost of a slower product (5-8% with 8 of an H200's 132 SMs)."""
    if not count:
        return 0
    try:
        n = int(count)
    except ValueError:
        n = -1
    if n < 0:
        raise UsageError(f"FLUX_CP_SM_CARVEOUT={count!r}: give a number of streaming multiprocessors, e.g. 8")
    return n


def exchange_settings(cp: int) -> tuple[str, int, bool]:
    """The exchange settings from the environment, checked: FLUX_CP_OVERLAP (default fill), FLUX_CP_SM_CARVEOUT and
    FLUX_CP_EXCHANGE_FIRST; without CP none of them applies."""
    if cp <= 1:
        return "none", 0, False
    try:
        first = exchange_first()
    except ValueError as e:
        raise UsageError(str(e)) from None
    return os.environ.get("FLUX_CP_OVERLAP", "fill"), sm_carveout(os.environ.get("FLUX_CP_SM_CARVEOUT")), first


def prepare_blocks(
    transformer: torch.nn.Module,
    *,
    gradient_checkpointing: bool,
    recompute_attention: bool,
    compile: bool,
    compile_mode: str | None,
    cp: int,
) -> None:
    """Activation checkpointing and torch.compile of every transformer block, as described above."""
    overlap, sms, first = exchange_settings(cp)  # eager, cp/ reads FLUX_CP_EXCHANGE_FIRST itself on each call
    if not compile:
        if sms:
            logger.warning("FLUX_CP_SM_CARVEOUT applies to compiled blocks only (--compile or --compile_mode)")
        if gradient_checkpointing:
            transformer.enable_gradient_checkpointing()
        return
    if sms:
        warnings.filterwarnings("ignore", message="Setting the SM carveout")  # torch: "experimental"; docs say so
        if torch.cuda.is_available():
            torch.backends.cuda.preferred_blas_library("cublaslt")  # cuBLAS ignores the carveout; same kernels else
    options = inductor_options(compile_mode, overlap, cp, sms, first)
    for block in transformer_blocks(transformer):
        if gradient_checkpointing:
            checkpoint_inside(block, keep_attention=not recompute_attention)
        block.compile(options=options)
