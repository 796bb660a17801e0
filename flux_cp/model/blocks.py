"""How the transformer blocks run during training: activation checkpointing (what each block keeps for its
backward, what it recomputes) and torch.compile, applied to the blocks in one place.

Checkpointing is per block: `--gradient_checkpointing N` checkpoints N whole blocks from one end, `all` every block,
`none` none, and `auto` (flux_cp.plan.memory) the fewest that let the planned peak fit the GPU. The end is the one whose
blocks keep the most for their backward (`flux_cp.plan.memory.checkpoint_from_end`; plan_data.json has what each kind
keeps): every block of a model costs the same FLOPs per token to recompute (FLUX.1: 12 D^2 weights, FLUX.2: 13 D^2),
so that end frees the most memory per recomputed FLOP. FLUX.1: the first N (its double blocks keep 18 units per
token compiled, its single blocks 12); FLUX.2: the last N (single blocks 18, double 15).

Eager, a checkpointed block's forward is recomputed in its backward (`torch.utils.checkpoint`, non-reentrant, as
diffusers' `enable_gradient_checkpointing` does for every block). Compiled, the checkpoint goes *inside* each
checkpointed block's graph, which changes three things:

- the recomputation is part of the compiled backward graph, so a block is one forward graph and one backward
  graph; CUDA graphs (`--compile_mode reduce-overhead`) can then replay them, which they cannot while a
  compiled forward is called again from inside the backward;
- the attention is not recomputed: the outputs of the CP attention op and of its sequence/head exchanges are
  saved (the CP modes' `saved_ops`, cp/mode.py), so the backward runs no second attention forward and no second
  round of exchanges.
  The attention forward is about an eighth of a 2048 px LoRA step's FLOPs (14% less step time on 2 H200s,
  docs/benchmarks.md); what it keeps is a few tensors of the attention's size per block (`flux_cp.plan.memory` counts
  them, `--recompute_attention` turns it off);
- everything else (projections, norms, RoPE, the MLP) is recomputed as before.

The values computed are the same either way, for any N; only which of them are kept or computed twice differs.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from cp.mode import saved_ops
from cp.schedule import inductor_options
from cp.tuning import Tuning
from flux_cp.errors import UsageError
from flux_cp.families.base import blocks_of


def transformer_blocks(transformer: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer's blocks in the order they run (its family's block lists)."""
    return [block for _, block in blocks_of(transformer)]


def _keep_attention(saved: tuple, _ctx, op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if op in saved else CheckpointPolicy.PREFER_RECOMPUTE


def _recompute_all(_ctx, _op, *_args, **_kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.PREFER_RECOMPUTE


def _checkpointed(forward, policy, *args, **kwargs):
    if not torch.is_grad_enabled():  # validation, inference: nothing to keep or recompute
        return forward(*args, **kwargs)
    context = functools.partial(create_selective_checkpoint_contexts, policy)
    return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)


def _recomputed(forward, *args, **kwargs):
    if not torch.is_grad_enabled():
        return forward(*args, **kwargs)
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def checkpoint_inside(block: torch.nn.Module, keep_attention: bool = True) -> None:
    """Make `block.forward` checkpoint itself, keeping the attention's outputs (the CP modes' `saved_ops`) unless
    `keep_attention` is False, so that a compile of the block traces the checkpoint into its graph. Module names
    and parameters are unchanged."""
    policy = functools.partial(_keep_attention, saved_ops()) if keep_attention else _recompute_all
    block.forward = functools.partial(_checkpointed, block.forward, policy)


def checkpoint_eager(block: torch.nn.Module) -> None:
    """Make `block.forward` recompute itself in its backward (eager blocks: everything, attention included)."""
    block.forward = functools.partial(_recomputed, block.forward)


def checkpointed_blocks(value: str, total: int) -> int | None:
    """Blocks checkpointed for a `--gradient_checkpointing` value on a transformer of `total` blocks; None for
    `auto` (the planner decides, `flux_cp.plan.memory.choose_checkpointing`). A number above `total` is refused at start
    (`check_counts`)."""
    if value == "auto":
        return None
    if value == "all":
        return total
    if value == "none":
        return 0
    return min(int(value), total)


def check_counts(gradient_checkpointing: str, offload_blocks: str, total: int) -> None:
    """One line when --gradient_checkpointing or --offload_blocks names more blocks than the transformer's `total`:
    a count beyond the model is a typo more often than a wish for all of them (the trainer and --plan alike)."""
    for flag, value, other in (
        ("--gradient_checkpointing", gradient_checkpointing, ", or 'all'"),
        ("--offload_blocks", offload_blocks, ""),
    ):
        if value.isdigit() and int(value) > total:
            raise UsageError(f"{flag} {value}: the transformer has {total} blocks; give at most {total}{other}")


def compiled(train) -> bool:
    """Whether a run with these training flags (`TrainConfig`) compiles its blocks: --compile on, or a --compile_mode.
    --compile auto is decided at the start of a run (flux_cp.plan.compiling.decide) and counts as off until then."""
    return train.compile == "on" or bool(train.compile_mode)


def attention_recomputed(train) -> bool:
    """Whether a checkpointed block of a run with these training flags (`TrainConfig`) computes its attention
    forward twice: eager blocks always do; compiled ones keep its outputs unless --recompute_attention."""
    return not compiled(train) or train.recompute_attention


@functools.cache  # asked before every forward of a step
def uses_cuda_graphs(compile_mode: str | None) -> bool:
    import torch._inductor

    return bool(compile_mode) and bool(torch._inductor.list_mode_options(compile_mode).get("triton.cudagraphs"))


def step_begins(compile_mode: str | None) -> None:
    """Call before each forward of a training step: CUDA graph trees may then reuse the memory of the previous
    step's outputs (its loss has been read by then)."""
    if uses_cuda_graphs(compile_mode):
        torch.compiler.cudagraph_mark_step_begin()


def prepare_blocks(
    transformer: torch.nn.Module,
    *,
    checkpointed: range,
    recompute_attention: bool,
    compile: bool,
    compile_mode: str | None,
    cp: int,
    tuning: Tuning | None = None,
) -> None:
    """Activation checkpointing of the transformer blocks whose indices (in the order they run) are in
    `checkpointed` (`flux_cp.plan.memory.checkpointed_indices`) and torch.compile of every block, as described above.
    `tuning`: the CP context's (`CPContext.tuning`), whose overlap choice orders a compiled block's exchanges
    (cp/schedule.py)."""
    options = inductor_options(compile_mode, tuning or Tuning(), cp) if compile else None
    for i, block in enumerate(transformer_blocks(transformer)):
        if i in checkpointed:
            if compile:
                checkpoint_inside(block, keep_attention=not recompute_attention)
            else:
                checkpoint_eager(block)
        if compile:
            block.compile(options=options)


@dataclass(frozen=True)
class Checkpointing:
    """A run's `--gradient_checkpointing` and `--offload_blocks` resolved: which blocks are checkpointed, how many are
    offloaded, and the plan behind the choice."""

    blocks: range  # indices of the checkpointed blocks, in the order the blocks run
    total: int  # blocks of the transformer
    planned_gib: float  # the planned peak per GPU with them
    gpu_gib: float | None  # the memory it was fitted to (None: no GPU and no --gpu_memory_gib)
    fits: bool
    offloaded: int = 0  # blocks offloaded (flux_cp.model.offload applies them)
    host_gib: float = 0.0  # pinned host memory per process for them
    cost: float = 1.0  # modelled step time against the whole bf16 base on the GPU with nothing recomputed
    precision: str = "bf16"
    setting: str = ""  # `Estimate.describe`
    seconds: float = 0.0  # modelled seconds of a micro-step (flux_cp.plan.speed)

    def describe(self, value: str, offload: str = "0") -> str:
        n = len(self.blocks)
        which = "" if n in (0, self.total) else f" ({'the last' if self.blocks.start else 'the first'} {n})"
        gpu = f" of {self.gpu_gib:.1f} GiB" if self.gpu_gib else ""
        how = f"{value}: " if value == "auto" else ""
        peak = f"planned peak {self.planned_gib:.1f} GiB{gpu}"
        line = f"gradient checkpointing {how}{n} of {self.total} blocks{which}, {peak}"
        if offload != "0":
            line += (
                f"; block offload{' auto' if offload == 'auto' else ''}: {self.offloaded} of {self.total} blocks "
                f"({self.host_gib:.1f} GiB of pinned host memory per process)"
            )
        if self.precision != "bf16" or self.offloaded or n:
            line += f"; modelled step ~{self.seconds:.2f} s (base {self.precision}, docs/small_gpus.md)"
        return line
