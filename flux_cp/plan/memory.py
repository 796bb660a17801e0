"""The memory planner: per-GPU memory of a configuration before anything heavy is loaded, the smallest CP size that
fits, and how many blocks `--gradient_checkpointing auto` checkpoints and `--offload_blocks auto` offloads (the report
of `--plan` that prints it: flux_cp.plan.report).

Weights, gradients and AdamW state are counted exactly from the transformer's config (the model is built on
the meta device, with the LoRA adapters the flags would add). Activations are counted in units of one
token's hidden state in bf16 (2 x D bytes per token; the model family gives D and its blocks, in the order they
run). A block that is not checkpointed keeps what its backward needs: `block_keeps` per block kind, eager and
compiled apart (Inductor fuses away intermediates autograd would keep), counted on CPU by tests/test_plan.py. A
checkpointed block keeps its input (1 unit) and, compiled, its attention's outputs (`saved_attention_units`).
The peak is at the start of the backward: everything kept, plus the temporaries of the first backward
(`backward_start_units`) - or, when the last block is checkpointed too, while a block is recomputed
(`block_peak_units`). Those two are fitted to one measured peak each (FLUX.1-dev, LoRA, one H200); the other
measured peaks check the whole estimate (tests/test_plan.py). The constants and those peaks, with their sources,
are in plan_data.json beside this module.
With --adapter dora or lokr each block also keeps what its adapter keeps beyond LoRA (`adapter_keeps`; LoKr's
update weights, flux_cp.model.adapters.kept_bytes), with one layer's transient on top.
The optimizer step has a peak of its own: torch's multi-tensor AdamW holds sqrt(v) for all of a rank's
trainable parameters at once (fp32), after the activations are freed; it decides full fine-tuning's peak.

The frozen base at --base_precision is counted exactly per block (flux_cp.model.precision.block_bytes: the family's
block lists quantized, the rest as loaded). A block not checkpointed on a torchao base (fp8, int8) also keeps a bf16
copy of its quantized weights for its backward (`dequantized_weights_kept`). --offload_blocks N takes the offloaded
blocks' frozen bytes off the GPU and puts its slots on it (flux_cp.model.offload_plan.plan_offload); their bytes are
pinned host memory per process.

`auto` (--gradient_checkpointing and --offload_blocks) is one decision, here: of the settings (blocks checkpointed,
blocks offloaded) whose planned peak fits, the one with the least modelled step time (`step_seconds`:
flux_cp.plan.speed, with the figures of this GPU measured, or of a GPU class). It never changes --base_precision; when
nothing fits, the start of a run and --plan name the precision that would (`suggestion`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from cp.mode import MODES
from flux_cp.config.fields import PRECISIONS
from flux_cp.errors import UsageError
from flux_cp.families.base import for_transformer
from flux_cp.model import adapters
from flux_cp.model.blocks import Checkpointing, attention_recomputed, checkpointed_blocks, compiled
from flux_cp.model.offload_plan import OffloadPlan, available_host_memory, offload_count, plan_offload
from flux_cp.model.optim import optimizer_name, state_bytes
from flux_cp.model.precision import base_bytes, block_bytes
from flux_cp.plan import speed
from flux_cp.plan.counts import parameter_counts
from flux_cp.shape.run_shape import RunShape, auto_mode

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.families.base import Family

logger = logging.getLogger("flux_cp")

GIB = 2**30
DATA = json.loads((Path(__file__).parent / "plan_data.json").read_text())  # its "notes" say what each constant is
BLOCK_PEAK_UNITS: float = DATA["block_peak_units"]
BACKWARD_START_UNITS: float = DATA["backward_start_units"]
BLOCK_KEEPS: dict[str, dict[str, dict[str, float]]] = DATA["block_keeps"]
ADAPTER_KEEPS: dict[str, dict[str, dict[str, float]]] = DATA["adapter_keeps"]
FSDP_GATHERED_BLOCKS: int = DATA["fsdp_gathered_blocks"]
SAVED_ATTENTION_UNITS: dict[str, float] = DATA["saved_attention_units"]
DEQUANTIZED_KEPT: dict[str, float] = DATA["dequantized_weights_kept"]
MARGIN = 0.9  # of the GPU's memory a plan may use: the estimates are within ~10% of measured peaks
HOST_MARGIN = 0.9  # of the host memory available that pinned offload homes may take (flux_cp.model.offload)


@dataclass
class Estimate:
    weights: float  # on the GPU: the frozen base at its precision less what offload saves (its slots included)
    grads: float
    optimizer: float
    activations: float  # with the blocks checkpointed that the estimate was asked for
    activations_without_ckpt: float
    activations_with_ckpt: float
    step_temporaries: float  # AdamW's sqrt(v) during the optimizer step, when no activations are held
    checkpointed: int = 0  # blocks checkpointed in `activations`
    blocks: int = 0  # blocks of the transformer
    offloaded: int = 0  # blocks whose frozen weights live in pinned host memory (--offload_blocks)
    host: float = 0.0  # pinned host bytes per process for them
    precision: str = "bf16"  # --base_precision
    seconds: float = 0.0  # modelled time of one micro-step (`step_seconds`)
    ideal_seconds: float = 0.0  # the same step at bf16 with nothing checkpointed or offloaded (no copies)

    @property
    def fixed(self) -> float:
        return self.weights + self.grads + self.optimizer

    @property
    def total(self) -> float:
        return self.total_with(self.activations)

    def total_with(self, activations: float) -> float:
        return self.fixed + max(activations, self.step_temporaries)

    @property
    def cost(self) -> float:
        """Modelled step time against the step with the whole bf16 base on the GPU and nothing recomputed."""
        return self.seconds / self.ideal_seconds if self.ideal_seconds else 1.0

    def describe(self) -> str:
        """The setting: 'every block checkpointed and 40 of 57 blocks offloaded'."""
        n, b = self.checkpointed, self.blocks
        ck = "every block" if n == b else ("no block" if n == 0 else f"{n} of {b} blocks")
        return f"{ck} checkpointed" + (f" and {self.offloaded} of {b} blocks offloaded" if self.offloaded else "")


@dataclass(frozen=True)
class FrozenBase:
    """A LoRA run's frozen transformer at one --base_precision, as the planner counts it."""

    kinds: tuple[str, ...]  # every block's kind, in the order the blocks run
    blocks: tuple[int, ...]  # bytes of every block's frozen tensors (what offload moves), in that order
    quantized: tuple[int, ...]  # weights of every block stored in the precision (0 at bf16)
    rest: int  # bytes outside the blocks: embedders, final layer (as loaded), FLUX.2's shared modulations

    @property
    def total(self) -> int:
        return sum(self.blocks) + self.rest


_META_MODELS: dict[tuple[str, str], torch.nn.Module] = {}
_BASES: dict[tuple, FrozenBase] = {}


def frozen_base(family: Family, config: dict, precision: str, dtype_bytes: int = 2) -> FrozenBase:
    """The frozen transformer of `config` at `precision` (flux_cp.model.precision's byte rule), from a model on the meta
    device; its other tensors at `dtype_bytes` each."""
    text = json.dumps(config, sort_keys=True)
    key = (family.name, text, precision, dtype_bytes)
    if key not in _BASES:
        if (family.name, text) not in _META_MODELS:  # --plan asks at every CP size and precision: build it once
            with torch.device("meta"):
                _META_MODELS[family.name, text] = family.transformer_class().from_config(json.loads(text))
        model = _META_MODELS[family.name, text]
        counted = [(kind, *block_bytes(block, precision, dtype_bytes)) for kind, block in family.blocks(model)]
        total = base_bytes(model, precision, dtype_bytes, parts=family.quantized_parts)
        blocks = tuple(b for _, b, _ in counted)
        kinds, quantized = tuple(k for k, _, _ in counted), tuple(q for _, _, q in counted)
        _BASES[key] = FrozenBase(kinds, blocks, quantized, total - sum(blocks))
    return _BASES[key]


def count_parameters(
    config: dict, lora_rank: int | None, lora_layers: list[str], adapter: str = "lora"
) -> tuple[int, int, int]:
    """(all base parameters, trainable parameters, parameters of the largest block), exact, on the meta device."""
    c = parameter_counts(for_transformer(config), config, lora_rank, lora_layers, adapter)
    return c.base, c.trainable, c.largest_block


def block_keeps(family: Family, compiled: bool, adapter: str = "lora") -> dict[str, float]:
    """Units each block kind of `family` keeps for its backward without checkpointing (plan_data.json, by transformer
    class), with `adapter` (--adapter) what its layers keep beyond LoRA's (`adapter_keeps`, counted eager, taken for
    compiled blocks too). A family without measured counts gets the most that any measured block keeps, for every
    kind of its blocks: an estimate on the safe side (`unmeasured` says so)."""
    how = "compiled" if compiled else "eager"
    keeps = BLOCK_KEEPS.get(family.transformer_class_name)
    extra = ADAPTER_KEEPS.get(family.transformer_class_name, {}).get(adapter)
    if extra is None:
        most = max((u for measured in ADAPTER_KEEPS.values() for u in measured.get(adapter, {}).values()), default=0)
        extra = {kind: most for kind, _, _ in family.block_lists}
    if keeps is None:
        most = max(units for measured in BLOCK_KEEPS.values() for units in measured[how].values())
        return {kind: most + extra[kind] for kind, _, _ in family.block_lists}
    return {kind: units + extra[kind] for kind, units in keeps[how].items()}


def unmeasured(family: Family) -> str | None:
    """What to say when the planner has no measured activation counts for the family's blocks (None: it has)."""
    if family.transformer_class_name in BLOCK_KEEPS:
        return None
    return (
        f"the memory planner has no measured activation counts for {family.transformer_class_name}: it counts every "
        "block as keeping what the most demanding measured block keeps (an estimate on the safe side)"
    )


def checkpoint_from_end(kinds: tuple[tuple[str, int], ...], keeps: dict[str, float]) -> bool:
    """Whether partial checkpointing takes the last blocks rather than the first: the end whose blocks keep the
    most frees the most memory per block recomputed (every block of FLUX.1 and FLUX.2 costs the same FLOPs per
    token). FLUX.1: the double blocks (first); FLUX.2: the single blocks (last)."""
    return keeps[kinds[-1][0]] > keeps[kinds[0][0]]


def checkpointed_indices(blocks: int, checkpointed: int, from_end: bool) -> range:
    """Indices (in the order the blocks run) of the `checkpointed` blocks checkpointed."""
    n = max(0, min(checkpointed, blocks))
    return range(blocks - n, blocks) if from_end else range(n)


def activation_units(
    kinds: tuple[tuple[str, int], ...], keeps: dict[str, float], checkpointed: int, saved_attention: float
) -> float:
    """Units held at the peak with `checkpointed` blocks checkpointed, from the end `checkpoint_from_end` picks."""
    order = [kind for kind, n in kinds for _ in range(n)]
    chosen = checkpointed_indices(len(order), checkpointed, checkpoint_from_end(kinds, keeps))
    held = len(chosen) * (1 + saved_attention) + sum(keeps[k] for i, k in enumerate(order) if i not in chosen)
    # The backward starts at the last block: its recomputation, or the temporaries of a block that kept everything.
    return held + (BLOCK_PEAK_UNITS if len(order) - 1 in chosen else BACKWARD_START_UNITS)


def estimate(
    config: dict,
    *,
    tokens: int,
    batch: int,
    lora_rank: int | None,
    lora_layers: list[str],
    world: int,
    cp: int,
    checkpointing: bool = True,
    checkpointed: int | None = None,
    compiled: bool = False,
    weight_bytes: int = 2,
    fsdp: bool | None = None,
    saved_attention: float = 0.0,
    family: Family | None = None,
    optimizer: str = "adamw",
    precision: str = "bf16",
    offloaded: int = 0,
    text_tokens: int = 512,
    adapter: str = "lora",
    how: str | None = None,
) -> Estimate:
    """Bytes per GPU. `tokens` per sample (image + text); FSDP (default: world > 1) shards weights, gradients
    and optimizer state over all `world` ranks; each rank holds tokens / cp of each of its `batch` samples.
    `checkpointed`: blocks checkpointed (default: all with `checkpointing`, else none); `compiled`: torch.compile'd
    blocks (they keep less without checkpointing); `saved_attention`: units each checkpointed block keeps of its
    attention (`saved_attention_units`). `family`: default the one the config names. `optimizer`: whose state
    (flux_cp.model.optim.state_bytes; AdamW by default). `precision`: the frozen base's (--base_precision, LoRA);
    `offloaded`: blocks offloaded (--offload_blocks, LoRA without FSDP); `text_tokens` of the `tokens`, for the
    FLOPs of the speed model; `adapter`: --adapter's kind (its trainable parameters); `how`: the blocks' execution
    mode for the speed model (default: `compiled`'s, without CUDA graphs)."""
    family = family or for_transformer(config)
    counts = parameter_counts(family, config, lora_rank, lora_layers, adapter)
    trainable, block = counts.trainable, counts.largest_block
    fsdp = world > 1 if fsdp is None else fsdp
    shard = world if fsdp else 1
    kinds, keeps = family.block_kinds(config), block_keeps(family, compiled, adapter if lora_rank else "lora")
    blocks = sum(n for _, n in kinds)
    frozen = frozen_base(family, config, precision, weight_bytes) if lora_rank is not None else None
    offload = plan_offload(frozen.kinds, frozen.blocks, offloaded) if frozen and offloaded and not fsdp else None
    weights = (frozen.total if frozen else 0) / shard + trainable * 4 / shard
    if fsdp:
        weights += FSDP_GATHERED_BLOCKS * block * weight_bytes
    if offload is not None:
        weights -= offload.saved_bytes
    grads = trainable * 4 / shard
    optimizer_bytes = trainable * state_bytes(optimizer) / shard
    step_temporaries = trainable * 4 / shard
    unit = batch * math.ceil(tokens / cp) * family.hidden_size(config) * 2
    if checkpointed is None:
        checkpointed = blocks if checkpointing else 0
    from_end = checkpoint_from_end(kinds, keeps)
    kept = DEQUANTIZED_KEPT[precision] * weight_bytes if frozen else 0
    # --adapter's weight-sized memory (flux_cp.model.adapters): what each block keeps (LoKr's update weights), what the
    # layers outside the blocks keep, and one layer's moment in its forward
    layers = adapters.adapted_layers(family, config, lora_layers) if lora_rank and adapter != "lora" else ((),)
    adapter_kept = [adapters.kept_bytes(adapter, b, weight_bytes) for b in layers]
    adapter_fixed = adapter_kept.pop() + adapters.transient_bytes(adapter, sum(layers, ()), weight_bytes)
    # block_peak_units (a block's recomputation) is LoRA's: a recomputed block keeps its adapter's units on top
    recomputed = keeps[kinds[-1][0]] - block_keeps(family, compiled)[kinds[-1][0]]

    def activations(n: int) -> float:
        held = unit * activation_units(kinds, keeps, n, saved_attention) + adapter_fixed
        chosen = checkpointed_indices(blocks, n, from_end)
        if kept:  # torchao's blocks keep their weights dequantized; a checkpointed one while it is recomputed
            held += kept * sum(q for i, q in enumerate(frozen.quantized) if i not in chosen or i == blocks - 1)
        if any(adapter_kept):  # the same rule for what an adapter keeps of its weights
            held += sum(b for i, b in enumerate(adapter_kept) if i not in chosen or i == blocks - 1)
        return held + (unit * recomputed if blocks - 1 in chosen else 0)

    n = min(checkpointed, blocks)
    sizes = dict(tokens=tokens, text_tokens=text_tokens, batch=batch, cp=cp)
    timed = step_seconds(
        family,
        config,
        **sizes,
        lora=lora_rank is not None,
        checkpointed=checkpointed_indices(blocks, n, from_end),
        attention_recomputed=saved_attention == 0,
        precision=precision,
        offload=offload,
        gathered_from=world if fsdp and world > 1 else 1,
        dtype_bytes=weight_bytes,
        how=how or speed.mode(compiled, None),
    )
    held = activations(n), activations(0), activations(blocks)  # as asked, with no block and every block checkpointed
    moved = (len(offload.offloaded), offload.host_bytes) if offload else (0, 0.0)
    return Estimate(weights, grads, optimizer_bytes, *held, step_temporaries, n, blocks, *moved, precision, *timed)


def step_blocks(
    family: Family,
    config: dict,
    *,
    tokens: int,
    text_tokens: int,
    batch: int,
    cp: int,
    precision: str,
    dtype_bytes: int = 2,
) -> tuple[list[speed.Block], float]:
    """The blocks of a micro-step on a rank as the speed model takes them (their FLOPs on the rank's share of the
    tokens, flux_cp.families' forward_flops split evenly over the blocks as it counts them; their quantized weights
    and frozen bytes at `precision`), and the forward FLOPs of the linear layers outside the blocks."""
    key = (family.name, json.dumps(config, sort_keys=True), tokens, text_tokens, batch, cp, precision, dtype_bytes)
    if key not in _STEP_BLOCKS:  # --plan asks for every setting it compares
        _STEP_BLOCKS[key] = _step_blocks(family, config, tokens, text_tokens, batch, cp, precision, dtype_bytes)
    return _STEP_BLOCKS[key]


_STEP_BLOCKS: dict[tuple, tuple[list[speed.Block], float]] = {}


def _step_blocks(
    family: Family, config: dict, tokens: int, text_tokens: int, batch: int, cp: int, precision: str, dtype_bytes: int
) -> tuple[list[speed.Block], float]:
    text = min(text_tokens, tokens)
    linear, attention = family.forward_flops(config, tokens - text, text, batch)
    outside, _ = family.forward_flops(
        {**config, **{key: 0 for _, _, key in family.block_lists}}, tokens - text, text, batch
    )
    frozen = frozen_base(family, config, precision, dtype_bytes)
    n = len(frozen.kinds)
    # one byte per weight at fp8 (and a scale per row): the count of the quantized weights, near enough
    weights = frozen_base(family, config, "fp8", dtype_bytes).quantized if precision != "bf16" else (0,) * n
    features = batch * tokens * family.hidden_size(config) / cp
    blocks = [
        speed.Block(kind, (linear - outside) / n / cp, attention / n / cp, features, w, b)
        for kind, w, b in zip(frozen.kinds, weights, frozen.blocks)
    ]
    return blocks, outside / cp


def step_seconds(
    family: Family,
    config: dict,
    *,
    tokens: int,
    text_tokens: int,
    batch: int,
    cp: int,
    lora: bool,
    checkpointed: Sequence[int],
    attention_recomputed: bool,
    precision: str = "bf16",
    offload: OffloadPlan | None = None,
    gathered_from: int = 1,
    dtype_bytes: int = 2,
    how: str = "compiled",
) -> tuple[float, float]:
    """(modelled seconds of one micro-step on a rank, those of the same step at bf16 with nothing checkpointed or
    offloaded) by the speed model in use (flux_cp.plan.speed.active: this GPU's figures, or a GPU class's). `how`: the
    blocks' execution mode (flux_cp.plan.speed.MODES); `offload`: the blocks offloaded; `gathered_from`: FSDP2's
    ranks."""
    fig = speed.active()
    shape = dict(tokens=tokens, text_tokens=text_tokens, batch=batch, cp=cp)
    blocks, outside = step_blocks(family, config, precision=precision, dtype_bytes=dtype_bytes, **shape)
    groups = offload.groups if offload is not None else ()
    step = speed.step_seconds(
        fig,
        blocks,
        precision=precision,
        how=how,
        lora=lora,
        checkpointed=checkpointed,
        attention_recomputed=attention_recomputed,
        outside_flops=outside,
        offloaded=groups,
        slots=offload.slots if offload is not None else 2,
        gathered_from=gathered_from,
    )
    plain, _ = step_blocks(family, config, precision="bf16", dtype_bytes=dtype_bytes, **shape)
    ideal = speed.step_seconds(fig, plain, precision="bf16", how=how, lora=lora, outside_flops=outside)
    return step.seconds, ideal.seconds


def choose(
    estimate_with: Callable[[int, int], Estimate],
    gpu_bytes: float,
    checkpointed: Sequence[int],
    offloaded: Sequence[int] = (0,),
    host_bytes: float | None = None,
) -> tuple[Estimate, bool]:
    """`auto`: of the settings (n checkpointed from `checkpointed`, o offloaded from `offloaded`) whose planned peak
    fits `MARGIN` of `gpu_bytes` (and whose pinned host memory fits `host_bytes`, when given), the one with the least
    modelled step time (ties: fewer offloaded, then fewer checkpointed), and True; when none fits, the one with the
    least memory, and False. `estimate_with(n, o)` is the estimate of a setting. For one count offloaded, memory
    falls and time rises with each block checkpointed, so the fewest that fit is that count's fastest."""
    ns = sorted(checkpointed)
    best: Estimate | None = None
    least: Estimate | None = None
    for o in offloaded:
        most = estimate_with(ns[-1], o)
        if least is None or most.total < least.total:
            least = most
        if most.total > MARGIN * gpu_bytes or (o and host_bytes is not None and most.host > host_bytes):
            continue
        lo, hi = 0, len(ns) - 1  # the first n that fits (the last one does)
        while lo < hi:
            mid = (lo + hi) // 2
            if estimate_with(ns[mid], o).total <= MARGIN * gpu_bytes:
                hi = mid
            else:
                lo = mid + 1
        e = estimate_with(ns[lo], o)
        if best is None or (e.seconds, e.offloaded, e.checkpointed) < (best.seconds, best.offloaded, best.checkpointed):
            best = e
    return (best, True) if best is not None else (least, False)


def choose_checkpointing(estimate_with: Callable[[int], Estimate], gpu_bytes: float) -> tuple[Estimate, bool]:
    """`--gradient_checkpointing auto` alone (nothing offloaded): the fewest checkpointed blocks whose total fits
    `MARGIN` of `gpu_bytes`, and whether one fits (if none does: every block checkpointed). `estimate_with(n)` is
    the estimate with n blocks checkpointed."""
    blocks = estimate_with(0).blocks
    return choose(lambda n, _o: estimate_with(n), gpu_bytes, range(blocks + 1))


def offload_options(value: str, allowed: bool, base: FrozenBase | None) -> list[int]:
    """The counts of offloaded blocks an --offload_blocks value leaves to choose from: `auto` every count that saves
    GPU memory (and 0) where offload applies (`allowed`: LoRA without FSDP2), a number itself."""
    n = offload_count(value)
    if n is not None:
        return [n]
    if not allowed or base is None:
        return [0]
    return [0] + [k for k in range(1, len(base.blocks) + 1) if plan_offload(base.kinds, base.blocks, k).saved_bytes > 0]


def run_estimate(cfg: Config, shape: RunShape) -> Callable[..., Estimate]:
    """The estimate of a run of these flags and this shape with n blocks checkpointed and o offloaded
    (`estimate_with(n, o=0)`), for its largest sample."""
    train, lora, on = cfg.train, cfg.lora, compiled(cfg.train)
    batch, rank = train.train_batch_size * cfg.data.samples_per_slot, None if lora.full_finetune else lora.rank
    weight_bytes = 4 if train.mixed_precision == "no" else 2
    saved = saved_attention_units(train, shape.cp_mode, shape.cp)
    # the same for every setting: the sizes, the model and its adapter, how its blocks run and what they keep
    fixed = dict(tokens=shape.largest_sequence, text_tokens=shape.text_tokens, batch=batch, world=shape.world)
    fixed |= dict(cp=shape.cp, family=shape.family, lora_rank=rank, lora_layers=list(lora.lora_layers))
    fixed |= dict(adapter=lora.adapter, precision=cfg.model.base_precision, optimizer=optimizer_name(train))
    fixed |= dict(compiled=on, how=speed.mode(on, train.compile_mode), fsdp=shape.sharded and shape.world > 1)
    fixed |= dict(weight_bytes=weight_bytes, saved_attention=saved)

    def estimate_with(n: int | None, o: int = 0) -> Estimate:
        return estimate(shape.transformer_config, checkpointed=n, offloaded=o, **fixed)

    return estimate_with


def gpu_memory_gib(cfg: Config, device: torch.device) -> float | None:
    """The memory `auto` fits: --gpu_memory_gib, else the GPU's own (None on the CPU without it: nothing to fit)."""
    gpu = cfg.plan.gpu_memory_gib
    if gpu is None and device.type == "cuda":
        gpu = torch.cuda.get_device_properties(device).total_memory / GIB
    return gpu


def host_limit(processes: int, given_gib: float | None = None) -> float | None:
    """Pinned host bytes one of `processes` processes of this machine may take (flux_cp.model.offload refuses more): of
    --host_memory_gib when given, else of the memory available now (None: unknown)."""
    available = given_gib * GIB if given_gib is not None else available_host_memory()
    return None if available is None else HOST_MARGIN * available / max(processes, 1)


def local_processes(shape: RunShape) -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", shape.world))


def checkpointing_for_run(cfg: Config, shape: RunShape, device: torch.device) -> Checkpointing:
    """The trainer's `--gradient_checkpointing` and `--offload_blocks` on `device`: counts as given, or `auto`'s choice
    for --gpu_memory_gib, else the GPU's memory (on the CPU, without either: nothing to fit, nothing checkpointed or
    offloaded), within the host memory pinned homes may take. Logged, with what the choice rests on; run_config.json
    records it."""
    gpu = gpu_memory_gib(cfg, device)
    ckpt = checkpointing_for(cfg, shape, gpu, host_limit(local_processes(shape), cfg.plan.host_memory_gib))
    value, offload = cfg.train.gradient_checkpointing, cfg.train.offload_blocks
    if value != "none" or offload != "0":  # asked for: say what it resolved to
        logger.info(ckpt.describe(value, offload))
    if note := unmeasured(shape.family):
        logger.info(f"flux-cp: {note}")
    if not ckpt.fits:
        logger.warning(f"warning: {does_not_fit(cfg, shape, ckpt)}: expect out-of-memory")
    return ckpt


def check_fits(cfg: Config, shape: RunShape, device: torch.device) -> None:
    """At start, before any model loads: `auto` (--gradient_checkpointing or --offload_blocks) with no setting that
    fits the GPU is refused in one line naming the --base_precision that would fit. Counts given by hand are run as
    given (with a warning when they do not fit: checkpointing_for_run)."""
    if "auto" not in (cfg.train.gradient_checkpointing, cfg.train.offload_blocks):
        return
    gpu = gpu_memory_gib(cfg, device)
    if gpu is None:
        return
    ckpt = checkpointing_for(cfg, shape, gpu, host_limit(local_processes(shape), cfg.plan.host_memory_gib))
    if not ckpt.fits:
        raise UsageError(does_not_fit(cfg, shape, ckpt), agreed=True)  # every rank plans alike


def does_not_fit(cfg: Config, shape: RunShape, ckpt: Checkpointing) -> str:
    """One line: what does not fit, with how little it takes at best, and what would fit (`suggestion`)."""
    gpu = ckpt.gpu_gib or 0.0
    line = (
        f"{shape.family.label} does not fit 90% of {_size(gpu)} at --base_precision {cfg.model.base_precision} "
        f"(planned {_size(ckpt.planned_gib)} with {ckpt.setting})"
    )
    better = suggestion(cfg, shape, gpu)
    if better is not None:
        flags, alt = better
        return (
            f"{line}; {flags} fits: {_size(alt.planned_gib)} with {alt.setting}, ~{alt.seconds:.2f} s/step by the "
            f"speed model: add {flags} (docs/small_gpus.md), or use more GPUs (--cp_size)"
        )
    return f"{line}; no --base_precision fits either: use more GPUs (--cp_size) or a lower --resolution"


def _size(gib: float) -> str:
    return f"{gib:.1f} GiB" if gib >= 0.1 else f"{gib * 1024:.1f} MiB"


def suggestion(cfg: Config, shape: RunShape, gpu_gib: float) -> tuple[str, Checkpointing] | None:
    """The fastest setting that fits where the flags' does not: another --base_precision (LoRA with DDP: FSDP2 cannot
    shard a quantized base), or --offload_blocks auto at the flags' precision where offload is off; (the flags to add,
    its plan), or None."""
    train, precision = cfg.train, cfg.model.base_precision
    if cfg.lora.full_finetune:
        return None
    options = []
    offloads = [train.offload_blocks] + (["auto"] if train.offload_blocks == "0" and not shape.sharded else [])
    for p in PRECISIONS if not shape.sharded else (precision,):
        for off in offloads:
            if (p, off) == (precision, train.offload_blocks):
                continue
            model = dataclasses.replace(cfg.model, base_precision=p)
            alt = dataclasses.replace(cfg, model=model, train=dataclasses.replace(train, offload_blocks=off))
            added = [f"--base_precision {p}"] if p != precision else []
            added += ["--offload_blocks auto"] if off != train.offload_blocks else []
            options.append((" ".join(added), checkpointing_for(alt, shape, gpu_gib)))
    fitting = [(c.cost, i, flags, c) for i, (flags, c) in enumerate(options) if c.fits]
    if not fitting:
        return None
    _, _, flags, c = min(fitting)
    return flags, c


def checkpointing_for(
    cfg: Config, shape: RunShape, gpu_gib: float | None, host_bytes: float | None = None
) -> Checkpointing:
    """`--gradient_checkpointing` and `--offload_blocks` for a GPU of `gpu_gib` (None: nothing to fit, nothing
    checkpointed or offloaded for `auto`); `host_bytes`: the pinned host memory a process may take."""
    train, family = cfg.train, shape.family
    estimate_with = run_estimate(cfg, shape)
    value = train.gradient_checkpointing
    first = estimate_with(0)
    fixed = checkpointed_blocks(value, first.blocks)
    ns = range(first.blocks + 1) if fixed is None else [fixed]
    config, weight_bytes = shape.transformer_config, 4 if train.mixed_precision == "no" else 2
    base = None if cfg.lora.full_finetune else frozen_base(family, config, cfg.model.base_precision, weight_bytes)
    allowed = base is not None and not (shape.sharded and shape.world > 1)
    os_ = offload_options(train.offload_blocks, allowed, base)
    if gpu_gib is None:  # nothing to fit: auto takes nothing
        e, fits = estimate_with(ns[0] if fixed is not None else 0, os_[0] if len(os_) == 1 else 0), True
    else:
        e, fits = choose(estimate_with, gpu_gib * GIB, ns, os_, host_bytes)
    kinds = family.block_kinds(config)
    from_end = checkpoint_from_end(kinds, block_keeps(family, compiled(train)))
    blocks = checkpointed_indices(e.blocks, e.checkpointed, from_end)
    planned, host = e.total / GIB, e.host / GIB
    return Checkpointing(
        blocks, e.blocks, planned, gpu_gib, fits, e.offloaded, host, e.cost, e.precision, e.describe(), e.seconds
    )


def saved_attention_units(train, mode: str, cp: int) -> float:
    """Units of its attention a compiled, checkpointed block keeps with these training flags (`TrainConfig`) and CP
    mode."""
    if attention_recomputed(train):
        return 0.0
    return SAVED_ATTENTION_UNITS["exchanged" if cp > 1 and MODES[mode].exchanges_kept else "local"]


def shape_at(cfg: Config, shape: RunShape, cp: int, world: int) -> RunShape:
    """The run shape at CP size `cp`: its world (at least `cp`), and the mode the heads allow there."""
    w = max(world, cp)
    mode = cfg.parallel.cp_mode if cfg.parallel.cp_mode != "auto" else auto_mode(shape.heads, cp)[0]
    return dataclasses.replace(shape, world=w, dp=w // cp, cp=cp, cp_mode=mode)
