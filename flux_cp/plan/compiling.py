"""--compile on|off|auto: whether a run's blocks are torch.compile'd, decided once at its start, and a compile that
fails at the first step falling back to eager blocks.

`auto` (the default) compiles on a GPU when the run's steps save more time than compiling takes: the planner's speed
model (flux_cp.plan.speed, this GPU's figures) predicts a step with compiled and with eager blocks, each with the blocks
checkpointed and offloaded that fit it, and compiling's one-time cost (`compile_s`). On the CPU it is off: Inductor's
C++ kernels take minutes there, longer than the demo. The log says what was chosen and why, and once the second step
is done how long compiling took.

A compile fails when the first step runs it (torch.compile compiles lazily: a block's forward graph at its first
call, its backward graph at its first backward). An exception then raised from Dynamo, AOTAutograd or Inductor is
caught once: the step's partial gradients are dropped, the random states and the gradient accumulation's count are
put back as they were before it, every block's compiled call is removed (`Module.compile` only sets one; the block's
own forward, its checkpointing included, is what the compiled graph computed), and the step runs again, eagerly. The
run computes what the same run with --compile off would have (tests/test_compiling.py compares them on CPU).
"""

from __future__ import annotations

import dataclasses
import logging
import traceback
from collections.abc import Callable, Iterable, Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.shape.run_shape import RunShape

logger = logging.getLogger("flux_cp")

# Where a compile failure is raised from: Dynamo's tracing, AOTAutograd's graphs (a backward compiled at the first
# backward) and Inductor's code generation.
COMPILER_PATHS = ("/torch/_dynamo/", "/torch/_functorch/", "/torch/_inductor/")


def with_compile(cfg: Config, value: str) -> Config:
    return dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, compile=value))


@dataclasses.dataclass(frozen=True)
class Choice:
    """What `decide` chose and why, for the log."""

    value: str  # on / off
    line: str | None = None


def decide(
    cfg: Config, shape: RunShape, device: torch.device, gpu_gib: float | None, host_bytes: float | None = None
) -> tuple[Config, Choice]:
    """--compile auto resolved for this run on `device` by the speed model in use (flux_cp.plan.speed.active); other
    values as given."""
    from flux_cp.plan import memory as plan
    from flux_cp.plan import speed

    value = cfg.train.compile
    if value == "auto" and cfg.train.compile_mode:  # a compile mode compiles
        return with_compile(cfg, "on"), Choice("on")
    if value != "auto":
        return cfg, Choice(value)
    if device.type != "cuda":
        return with_compile(cfg, "off"), Choice("off")
    on, off = (plan.checkpointing_for(with_compile(cfg, v), shape, gpu_gib, host_bytes) for v in ("on", "off"))
    fig = speed.active()
    steps = cfg.train.max_train_steps
    saved = off.seconds - on.seconds
    if on.fits != off.fits:  # what fits decides (compiled blocks keep their attention's outputs, eager ones more else)
        pays, why = on.fits, f"only {'compiled' if on.fits else 'eager'} blocks fit {gpu_gib:.1f} GiB"
    elif not on.fits:  # neither: the smaller peak, whose error at start names what would fit
        pays, why = on.planned_gib < off.planned_gib, "neither fits; the smaller planned peak"
    elif steps is None:  # an epoch count: the steps are known once the data set is read
        pays = saved > 0
        why = (
            f"the steps are counted from the data later; it pays after ~{fig.compile_s / saved:.0f} steps"
            if saved > 0
            else "it saves nothing per step"
        )
    else:
        pays = speed.compile_pays(fig, off.seconds, on.seconds, steps)
        why = f"{steps} steps save ~{max(0.0, steps * saved):.0f} s, compiling takes ~{fig.compile_s:.0f} s"
    chosen = "on" if pays else "off"
    line = (
        f"--compile auto: {chosen} (by the speed model, {fig.describe}: ~{on.seconds:.2f} s/step compiled, "
        f"~{off.seconds:.2f} s eager; {why}); --compile on|off to choose"
    )
    return with_compile(cfg, chosen), Choice(chosen, line)


def is_compile_failure(e: BaseException) -> bool:
    """An exception raised while compiling (or from compiled code) at the first step: Dynamo's own, or one raised
    from the compiler's frames. Out of memory, the user's errors and a peer's failure are not."""
    from flux_cp.errors import UsageError

    if not isinstance(e, Exception) or isinstance(e, (torch.OutOfMemoryError, UsageError)):
        return False
    try:
        from torch._dynamo.exc import TorchDynamoException

        if isinstance(e, TorchDynamoException):
            return True
    except ImportError:  # pragma: no cover
        pass
    frames = traceback.extract_tb(e.__traceback__)
    return any(any(p in f.filename.replace("\\", "/") for p in COMPILER_PATHS) for f in frames)


def summary(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return f"{type(e).__name__}: {text[0][:200]}" if text else type(e).__name__


class FirstStep:
    """The first step of a run with compiled blocks: `run` it; on a compile failure, once, the blocks become eager and
    the step runs again from the state it started in."""

    def __init__(
        self,
        blocks: Sequence[torch.nn.Module],
        params: Iterable[torch.nn.Parameter],
        accelerator: Any,
        device: torch.device,
    ):
        self.blocks = list(blocks)
        self.params = list(params)
        self.accelerator = accelerator
        self.device = device
        self.fell_back: str | None = None  # what failed (the exception itself would keep the step's tensors)

    def _state(self) -> tuple:
        cuda = torch.cuda.get_rng_state_all() if self.device.type == "cuda" else None
        return torch.get_rng_state(), cuda, getattr(self.accelerator, "step", None)

    def _restore(self, state: tuple) -> None:
        cpu, cuda, step = state
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)
        if step is not None:
            self.accelerator.step = step
        for p in self.params:  # the first step starts without gradients; drop what the failed one accumulated
            p.grad = None

    def run(self, step: Callable[[], Any]) -> Any:
        state = self._state()
        try:
            return step()
        except Exception as e:
            if not is_compile_failure(e):
                raise
            self.fell_back = summary(e)
        self._restore(state)
        eager(self.blocks)
        logger.warning(
            f"warning: compiling the blocks failed at the first step ({self.fell_back}): the run goes on "
            "with eager blocks, which compute the same; --compile off skips compiling"
        )
        return step()


def eager(blocks: Iterable[torch.nn.Module]) -> None:
    """Undo `Module.compile` on every block: each runs its own forward again (its checkpointing wrapper included)."""
    for block in blocks:
        block._compiled_call_impl = None
    torch._dynamo.reset()  # the failed graphs and their guards go


class CompileTime:
    """Says once, after the second step of this process, how long compiling took: the first step's time less the
    second's."""

    def __init__(self, compiled: bool):
        self.pending = compiled
        self.first: float | None = None

    def step_done(self, seconds: float, fell_back: bool = False) -> str | None:
        if not self.pending:
            return None
        if self.first is None:
            self.first = seconds
            return None
        self.pending = False
        if fell_back:
            return None
        return (
            f"compile: the first step took {self.first:.1f} s and the second {seconds:.2f} s: compiling the blocks "
            f"took ~{max(0.0, self.first - seconds):.0f} s"
        )
