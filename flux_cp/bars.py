"""Progress on stderr: tqdm's bars when stderr is a terminal. When it is not (a log file, a pipe), a bar is nothing
but carriage-return updates on one line: there the steps are one plain line every few steps instead (`StepBar`), and
the other bars (the encoding's, the libraries' while they load or write weights) are off (`plain_output`)."""

from __future__ import annotations

import logging
import sys

from tqdm.auto import tqdm

logger = logging.getLogger("flux_cp")

LINES_PER_RUN = 100  # plain lines of a run at most (one every max(1, steps // 100) steps), the first and last step too


def on_terminal() -> bool:
    """Whether stderr is a terminal, where bars redraw in place."""
    return sys.stderr.isatty()


def plain_output() -> None:
    """Off, when stderr is not a terminal: the progress bars of transformers (loading weights), diffusers (loading
    pipelines) and huggingface_hub (downloads, writing shards)."""
    if on_terminal():
        return
    from diffusers.utils import logging as diffusers_logging
    from transformers.utils import logging as transformers_logging

    transformers_logging.disable_progress_bar()  # huggingface_hub's with it
    diffusers_logging.disable_progress_bar()


class StepBar:
    """The optimizer steps `initial + 1 .. total` of the main process (`shown`): tqdm's bar on a terminal, else a line
    `steps: N/total: loss ..., lr ..., s/step, tok/s` for the first step, every `every` steps and the last."""

    def __init__(self, total: int, initial: int, shown: bool, terminal: bool | None = None):
        self.total, self.shown = total, shown
        self.every = max(1, total // LINES_PER_RUN)
        self.first = initial + 1
        terminal = on_terminal() if terminal is None else terminal
        self.bar = None
        if terminal:
            self.bar = tqdm(range(total), initial=initial, desc="steps", disable=not shown, dynamic_ncols=True)
        elif shown and initial < total:
            lines = "every step" if self.every == 1 else f"every {self.every} steps"
            logger.info(f"steps: {initial}/{total}, a line {lines}")

    def step(
        self, step: int, loss: float, lr: float, seconds: float, tokens_per_s: float, mfu: float | None = None
    ) -> None:
        """Optimizer step `step` is done, with these figures (`mfu`: None where the GPU's peak is not known)."""
        if self.bar is not None:
            self.bar.update(1)
            figures = {"loss": f"{loss:.4f}", "lr": f"{lr:.2e}", "s_step": f"{seconds:.2f}"}
            figures["tok_s"] = f"{tokens_per_s:.0f}"
            if mfu is not None:
                figures["mfu"] = f"{mfu:.0%}"
            self.bar.set_postfix(**figures)
        elif self.shown and (step == self.first or step % self.every == 0 or step == self.total):
            more = f", MFU {mfu:.0%}" if mfu is not None else ""
            logger.info(
                f"steps: {step}/{self.total}: loss {loss:.4f}, lr {lr:.2e}, {seconds:.2f} s/step, "
                f"{tokens_per_s:.0f} tok/s{more}"
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
