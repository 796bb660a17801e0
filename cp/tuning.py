"""How CP runs, never what it computes: the settings of `Tuning` (kernel order, overlap pass, exchange-first, Ulysses
head chunks), held by each `CPContext`, and what makes a combination of them refused."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from .kernels import KERNELS

# How a compiled block orders its exchanges against its compute (cp/schedule.py says what each does).
OVERLAPS = ("fill", "passes", "compute", "scheduler", "none")


@dataclass(frozen=True)
class Tuning:
    """How CP runs, never what it computes: every setting gives the same results.

    kernels: attention kernel names in order of preference (the first that serves an input is used); empty: the
        device's default order (`cp.kernels.DEFAULT_PREFERENCE`).
    overlap: how a compiled block orders its exchanges against its compute (`cp.schedule.inductor_options`).
    exchange_first: after launching each exchange and after each wait for one, the compute stream waits ~0.5 us
        (`cp.comm.head_start`), so that an exchange kernel that becomes ready with a compute kernel starts first and
        runs beside it instead of after it. Off by default: its effect on a training step is not measured.
    ulysses_chunks: head chunks of the Ulysses attention, pipelined so that the exchange of one chunk runs beside
        the attention of another (reduced until the chunks' heads divide over the group). 1 by default: the
        pipeline's gain on two GPUs is not measured.
    """

    kernels: tuple[str, ...] = ()
    overlap: str = "fill"
    exchange_first: bool = False
    ulysses_chunks: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "kernels", tuple(self.kernels))
        problem = refusal(self.kernels, self.overlap, self.exchange_first, self.ulysses_chunks)
        if problem:
            raise ValueError(problem)


def refusal(
    kernels: tuple[str, ...],
    overlap: str,
    exchange_first: bool,
    ulysses_chunks: int,
    names: Mapping[str, str] | None = None,
) -> str | None:
    """Why these `Tuning` settings cannot run, or None. `names`: what to call each setting in the message (by field
    name; a trainer passes its flags), the field's own name for those it leaves out."""
    n = {f: (names or {}).get(f, f) for f in ("kernels", "overlap", "exchange_first", "ulysses_chunks")}
    unknown = [k for k in kernels if k not in KERNELS]
    if unknown:
        return f"{n['kernels']}: unknown kernel {', '.join(unknown)}; choose from {', '.join(sorted(KERNELS))}"
    if overlap not in OVERLAPS:
        return f"unknown {n['overlap']} {overlap!r}; choose one of {', '.join(OVERLAPS)}"
    if isinstance(ulysses_chunks, bool) or not isinstance(ulysses_chunks, int) or ulysses_chunks < 1:
        return f"{n['ulysses_chunks']} must be a whole number >= 1, got {ulysses_chunks!r}"
    if exchange_first and overlap == "scheduler":
        return (
            f"{n['exchange_first']} is added beside the reordering passes, which {n['overlap']} scheduler replaces: "
            f"choose another {n['overlap']} or drop {n['exchange_first']}"
        )
    return None
