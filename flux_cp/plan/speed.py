"""The planner's speed model: the seconds of one training step, from what one block of each kind costs on the GPU.

    step = sum over the blocks of (forward + backward (+ the recomputed forward of a checkpointed block))
           + the step outside the blocks (embedders, final layer, loss, optimizer)
           + what offload's copies and FSDP2's all-gathers add where the compute beside them does not hide them

A block's pass costs its linear layers' FLOPs at `matmul_tflops`, its attention's at `attention_tflops` (the backward
2.5x the forward's FLOPs: families/flops.py), its elementwise work (norms, RoPE, modulation, activations,
residuals: per token and hidden feature, `elementwise_ps`), the dequantization of a quantized base per weight
(`dequant_ms_per_gweight`) and a fixed `pass_ms`. What compiling changes is per execution mode: `eager`, `compiled`
(--compile) and `graphs` (CUDA graphs, --compile_mode reduce-overhead); the matrix products and the attention kernel
are the same in every mode. Offload and FSDP2 are played out block by block (`_passes`): a block computes once the
block before it has and its weights are there; offload copies a block into its slot once the slot's last occupant has
computed and the copy before it is done (flux_cp/model/offload.py's schedule), FSDP2 gathers a block while the one
before it computes.

Where the figures come from (`Figures.describe` says which, in --plan and the log): a GPU class's file in
speed_data/ (h100, h200, rtx4090), each value with its source: measured by `python -m benchmarks.bench_speed_model`,
fitted to measured steps, or sourced from datasheets; or, on a GPU without a file fitted to its steps (and with
--gpu_class measure), measured on it by flux_cp/plan/speed_measure.py (cached on disk; `times_this_gpu` says
when). What is not modelled: CP's exchanges (a CP rank is timed as one GPU computing its share), the data loader,
validation, checkpoints.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

GIB = 2**30
MODES = ("eager", "compiled", "graphs")
CLASSES = ("h100", "h200", "rtx4090")  # the files of speed_data/
DATA = Path(__file__).parent / "speed_data"
# The attention backward's FLOPs against its forward's: 4 matmuls of the forward's 2, and the scores again inside
# flash-style kernels (flux_cp.families.flops.step_flops counts it the same way).
ATTENTION_BACKWARD = 2.5
# GPU names (torch.cuda.get_device_name) to classes: the first entry contained in the name wins.
NAMES = (("H200", "h200"), ("GH200", "h200"), ("H100", "h100"), ("4090", "rtx4090"))


def mode(compiled: bool, compile_mode: str | None) -> str:
    """The execution mode of a run's blocks: eager, compiled, or CUDA graphs (a compile mode that uses them)."""
    if not compiled:
        return "eager"
    from flux_cp.model.blocks import uses_cuda_graphs

    return "graphs" if uses_cuda_graphs(compile_mode) else "compiled"


@dataclass(frozen=True)
class Figures:
    """A GPU's speed figures (a speed_data/*.json file's "figures", or measured on this GPU)."""

    matmul_tflops: float  # FLOP/s (1e12) of a block's matrix products (bf16)
    attention_tflops: float  # forward FLOP/s (1e12) of the attention kernel
    elementwise_ps: dict[str, float]  # mode -> picoseconds per token and hidden feature of a block pass
    pass_ms: dict[str, float]  # mode -> fixed milliseconds of one block pass (forward, backward or recomputation)
    dequant_ms_per_gweight: dict[str, dict[str, Sequence[float]]]  # precision -> mode -> (forward, backward) ms / 1e9
    h2d_gib_per_s: float  # host-to-GPU copies from pinned memory (offload)
    link_gib_per_s: float  # all-gathers between the GPUs (FSDP2)
    step_ms: dict[str, float]  # mode -> the step outside the blocks: embedders' launch, loss, optimizer
    compile_s: float  # compiling the blocks once, at the first step
    gpu: str = ""  # the GPU they describe
    describe: str = ""  # where they come from, one line
    sources: dict[str, str] = field(default_factory=dict)  # per value (dotted key): how it was obtained

    def dequant(self, precision: str, how: str) -> tuple[float, float]:
        """(forward, backward) seconds per quantized weight of a pass at `precision` in mode `how`."""
        if precision == "bf16":
            return 0.0, 0.0
        f, b = self.dequant_ms_per_gweight[precision][how]
        return f * 1e-12, b * 1e-12

    def to_json(self) -> dict:
        keys = (
            "matmul_tflops",
            "attention_tflops",
            "elementwise_ps",
            "pass_ms",
            "dequant_ms_per_gweight",
            "h2d_gib_per_s",
            "link_gib_per_s",
            "step_ms",
            "compile_s",
        )
        return {k: getattr(self, k) for k in keys}

    @classmethod
    def from_json(cls, figures: dict, *, gpu: str = "", describe: str = "", sources: dict | None = None) -> Figures:
        f = dict(figures)
        f["dequant_ms_per_gweight"] = {
            p: {m: tuple(v) for m, v in by.items()} for p, by in f["dequant_ms_per_gweight"].items()
        }
        return cls(**f, gpu=gpu, describe=describe, sources=dict(sources or {}))


def class_file(name: str) -> Path:
    return DATA / f"{name}.json"


def load_class(name: str) -> Figures:
    """The figures of a GPU class (speed_data/NAME.json), described with their status and file; read once per
    version of the file (the planner asks for them at every setting it estimates)."""
    path = class_file(name)
    key = (name, path.stat().st_mtime_ns)
    if key not in _LOADED:
        _LOADED[key] = _load(name, path)
    return _LOADED[key]


_LOADED: dict[tuple[str, int], Figures] = {}


def _load(name: str, path: Path) -> Figures:
    data = json.loads(path.read_text())
    status = {
        "measured": "measured on it",
        "fitted": "fitted to its measured steps",
        "sourced": "sourced from datasheets, not measured",
    }.get(data["status"], data["status"])
    return Figures.from_json(
        data["figures"],
        gpu=data["gpu"],
        describe=f"{name} class figures ({data['gpu']}: {status}; flux_cp/plan/speed_data/{path.name})",
        sources=data.get("sources"),
    )


def class_status(name: str) -> str:
    """How a class file's figures were obtained: measured, fitted (to whole measured steps) or sourced."""
    return json.loads(class_file(name).read_text())["status"]


def class_of_gpu(device_name: str) -> str | None:
    """The class of a GPU by its name (torch.cuda.get_device_name), None when no class matches."""
    return next((c for name, c in NAMES if name.lower() in device_name.lower()), None)


def class_for_memory(gib: float) -> str:
    """Without a GPU: the class a GPU of this much memory most likely is (a 24 GB card up to 32 GiB, an H100 up to
    100 GiB, else an H200)."""
    return "rtx4090" if gib <= 32 else "h100" if gib <= 100 else "h200"


# --- the model in use ---------------------------------------------------------------------------------------------

_ACTIVE: list[Figures] = []


def active() -> Figures:
    """The figures the planner uses now: those set by `use`, else the H200 class's (--plan's default GPU)."""
    return _ACTIVE[-1] if _ACTIVE else load_class("h200")


@contextlib.contextmanager
def using(figures: Figures) -> Iterator[Figures]:
    """Plan with `figures` inside the block."""
    _ACTIVE.append(figures)
    try:
        yield figures
    finally:
        _ACTIVE.pop()


def use(figures: Figures) -> None:
    """Plan with `figures` from now on (the start of a run: every later plan of the process is this GPU's)."""
    _ACTIVE[:] = [figures]


# --- one step -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Block:
    """One block of a step, on one rank."""

    kind: str
    linear: float  # forward FLOPs of its linear layers on the rank's tokens
    attention: float  # forward FLOPs of its attention on the rank's queries
    features: float  # tokens x hidden features of a pass on the rank (its elementwise work)
    weights: int  # weights of its quantized linears (what a quantized base dequantizes at every pass)
    nbytes: int  # its frozen bytes at the run's precision (what offload copies and FSDP2 gathers)


@dataclass(frozen=True)
class Step:
    """The modelled seconds of one micro-step on a rank."""

    seconds: float
    compute: float  # the blocks and the rest, as if every copy and all-gather were hidden
    stall: float  # what the copies and all-gathers add

    @property
    def hidden(self) -> bool:
        return self.stall <= 1e-3 * self.seconds


def block_seconds(
    fig: Figures, block: Block, precision: str, how: str, lora: bool, attention_recomputed: bool
) -> tuple[float, float, float]:
    """(forward, backward, recomputation) seconds of a block. The backward of a LoRA run computes its input's
    gradients only (the frozen weights get none: the linear FLOPs once); full fine-tuning's also the weights' (twice).
    A checkpointed block computes its forward again in its backward, its attention too where `attention_recomputed`
    (eager blocks, --recompute_attention)."""
    lin = block.linear / (fig.matmul_tflops * 1e12)
    att = block.attention / (fig.attention_tflops * 1e12)
    dq_f, dq_b = fig.dequant(precision, how)
    fixed = block.features * fig.elementwise_ps[how] * 1e-12 + fig.pass_ms[how] * 1e-3
    forward = lin + att + block.weights * dq_f + fixed
    backward = lin * (1 if lora else 2) + ATTENTION_BACKWARD * att + block.weights * dq_b + fixed
    recompute = lin + (att if attention_recomputed else 0.0) + block.weights * dq_f + fixed
    return forward, backward, recompute


def step_seconds(
    fig: Figures,
    blocks: Sequence[Block],
    *,
    precision: str,
    how: str,
    lora: bool,
    checkpointed: Sequence[int] = (),
    attention_recomputed: bool = True,
    outside_flops: float = 0.0,
    offloaded: Sequence[Sequence[int]] = (),
    slots: int = 2,
    gathered_from: int = 1,
) -> Step:
    """One micro-step. `checkpointed`: indices of the checkpointed blocks; `outside_flops`: forward FLOPs of the
    linear layers outside the blocks (embedders, final projection; their backward as the blocks'); `offloaded`: the
    groups of offloaded blocks (flux_cp.model.offload_plan.OffloadPlan.groups), `slots` per group; `gathered_from`:
    FSDP2's ranks (each block all-gathered before it computes, forward and backward) or 1."""
    ck = set(checkpointed)
    fwd, bwd = [], []
    for i, b in enumerate(blocks):
        f, bw, r = block_seconds(fig, b, precision, how, lora, attention_recomputed)
        fwd.append(f)
        bwd.append(bw + (r if i in ck else 0.0))
    outside = outside_flops * (2 if lora else 3) / (fig.matmul_tflops * 1e12) + fig.step_ms[how] * 1e-3
    compute = sum(fwd) + sum(bwd) + outside
    if offloaded:
        copy = [b.nbytes / (fig.h2d_gib_per_s * GIB) for b in blocks]
        seconds = _passes(fwd, bwd, copy, offloaded, slots) + outside
    elif gathered_from > 1:
        gather = [b.nbytes * (gathered_from - 1) / gathered_from / (fig.link_gib_per_s * GIB) for b in blocks]
        seconds = _passes(fwd, bwd, gather, [range(len(blocks))], slots=0) + outside
    else:
        seconds = compute
    return Step(seconds, compute, max(0.0, seconds - compute))


def _passes(
    fwd: Sequence[float], bwd: Sequence[float], move: Sequence[float], groups: Sequence[Sequence[int]], slots: int
) -> float:
    """Forward then backward with weights moved onto the GPU ahead of use, on one stream of copies beside the
    compute. `slots` > 0 (offload): each group's blocks share that many slots; at the start of a pass the group's
    first `slots` blocks of the pass are in them (the pass before left them there), and the others are copied in
    the order the blocks run, each once its slot's occupant has computed. `slots` 0 (FSDP2): every block is gathered,
    at most one ahead of the block computing."""
    total = 0.0
    for times, order in ((fwd, range(len(fwd))), (bwd, range(len(bwd) - 1, -1, -1))):
        position = {i: n for n, i in enumerate(order)}
        if slots:  # the block a slot held before each copied one, in this pass
            previous = {}
            for g in groups:
                members = sorted(g, key=position.__getitem__)
                previous.update({members[j]: members[j - slots] for j in range(slots, len(members))})
        else:
            previous = {i: None for g in groups for i in g}
        end: dict[int, float] = {}
        clock = copies = 0.0  # the compute stream's time; the end of the last copy
        last = None  # the block computing before the one whose weights move
        for i in order:
            if i in previous:
                if slots:
                    free = end[previous[i]]
                else:  # FSDP2: gathered once the block before the previous one is done with its weights
                    free = end[last] - times[last] if last is not None else 0.0
                copies = max(copies, free) + move[i]
                clock = max(clock, copies)
            clock += times[i]
            end[i] = clock
            last = i
        total += clock
    return total


def copy_seconds(fig: Figures, nbytes: float) -> float:
    return nbytes / (fig.h2d_gib_per_s * GIB)


def compile_pays(fig: Figures, eager: float, compiled: float, steps: int) -> bool:
    """Whether compiling the blocks saves more over `steps` steps than compiling them costs."""
    return steps * (eager - compiled) > fig.compile_s


def rounded(x: float) -> float:
    """A figure as the files keep it: four significant digits."""
    return float(f"{x:.4g}") if x and math.isfinite(x) else x
