"""Deliberate failures for the reliability tests: `FLUX_CP_FAULT="rank=1,step=3,kind=raise"`.

kind: raise (an exception), exit (the process dies with code 1), kill (SIGKILL to itself), hang (stops
answering collectives), nan (that rank's loss becomes NaN), kill_in_save (SIGKILL while checkpoint `step` is
half written: shards on disk, no meta.json, not renamed), enospc_in_save (the checkpoint write fails with
"No space left on device"), raise_in_validation (validation images of step `step` fail). Unset in normal runs:
every hook is a no-op.

`FLUX_CP_DISK_BYTES=N` pretends the output disk holds N bytes and nothing but --output_dir (flux_cp.plan.diskspace),
so the disk-space checks can be tested without filling a disk.
"""

from __future__ import annotations

import os
import signal
import time

import torch

from flux_cp.errors import UsageError

KINDS = ("raise", "exit", "kill", "hang", "nan", "kill_in_save", "enospc_in_save", "raise_in_validation")


class Fault:
    def __init__(self, rank: int | None = None, step: int | None = None, kind: str | None = None):
        self.rank, self.step, self.kind = rank, step, kind

    def _now(self, step: int, kinds: tuple[str, ...]) -> bool:
        return self.kind in kinds and step == self.step

    def maybe_corrupt(self, step: int, loss: torch.Tensor) -> torch.Tensor:
        return loss * float("nan") if self._now(step, ("nan",)) else loss

    def maybe_fail(self, step: int) -> None:
        if not self._now(step, ("raise", "exit", "kill", "hang")):
            return
        if self.kind == "raise":
            raise RuntimeError(f"injected fault at step {step} (FLUX_CP_FAULT)")
        if self.kind == "exit":
            os._exit(1)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        while True:  # hang
            time.sleep(60)

    def during_validation(self, step: int) -> None:
        if self._now(step, ("raise_in_validation",)):
            raise RuntimeError(f"injected validation failure at step {step} (FLUX_CP_FAULT)")

    def during_save(self, step: int) -> None:
        """Called by checkpoint.save between writing the shards and writing meta.json."""
        if self._now(step, ("kill_in_save",)):
            os.kill(os.getpid(), signal.SIGKILL)
        if self._now(step, ("enospc_in_save",)):
            import errno

            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), "checkpoint shard")


def parse(spec: str) -> tuple[int, int, str]:
    """(rank, step, kind) of a FLUX_CP_FAULT value; a UsageError naming the variable when any part is wrong."""
    fields: dict[str, str] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        key = key.strip()
        if not sep or key not in ("rank", "step", "kind") or key in fields:
            raise UsageError(
                f"FLUX_CP_FAULT={spec!r}: {part.strip()!r} is not one of rank=R, step=S, kind=K (each once): "
                "fix or unset it (it injects failures, for tests)"
            )
        fields[key] = value.strip()
    kind = fields.get("kind")
    if kind not in KINDS:
        raise UsageError(f"FLUX_CP_FAULT={spec!r}: kind must be one of {', '.join(KINDS)} (got {kind!r})")
    numbers = {}
    for key, default, low in (("rank", "0", 0), ("step", "1", 1)):
        value = fields.get(key, default)
        if not value.isdigit() or int(value) < low:
            raise UsageError(f"FLUX_CP_FAULT={spec!r}: {key} must be a whole number >= {low} (got {value!r})")
        numbers[key] = int(value)
    return numbers["rank"], numbers["step"], kind


def from_env(rank: int) -> Fault:
    spec = os.environ.get("FLUX_CP_FAULT")
    if not spec:
        return Fault()
    fault_rank, step, kind = parse(spec)
    if fault_rank != rank:
        return Fault()
    return Fault(rank, step, kind)
