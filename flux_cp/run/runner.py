"""How `train_flux_cp.py` ends: exit codes and one clear line per failure instead of a traceback for
anything the user can fix; a named rank and cause when a peer fails."""

from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable

from flux_cp.distributed import is_distributed
from flux_cp.errors import EXIT_NONFINITE, EXIT_PEER_FAILED, EXIT_USAGE, NonFiniteError, UsageError
from flux_cp.terminal import printable

_PEER_SIGNS = (
    "timed out",
    "timeout",
    "connection closed",
    "connection reset",
    "broken pipe",
    "nccl",
    "peer",
    "socket",
    "gloo",
)


def _say(message: str) -> None:
    """One line on stderr, clear of a progress bar that may be drawing there; what it quotes from files (a class name,
    a meta.json field, a file name) cannot act on the terminal or break the line (flux_cp.terminal)."""
    message = printable(message)
    try:
        from tqdm.auto import tqdm

        tqdm.write(message, file=sys.stderr)
    except ImportError:  # pragma: no cover
        print(message, file=sys.stderr)
    sys.stderr.flush()


def _is_peer_failure(e: BaseException) -> bool:
    import torch.distributed as dist

    names = ("DistError", "DistBackendError", "DistNetworkError")
    dist_errors = tuple(getattr(dist, n) for n in names if hasattr(dist, n))
    return isinstance(e, dist_errors) or (isinstance(e, RuntimeError) and any(s in str(e).lower() for s in _PEER_SIGNS))


def _rank() -> int:
    return int(os.environ.get("RANK", "0"))


# How long another rank waits for the main rank to print an error every rank raised (seconds; it is ended sooner).
MAIN_RANK_GRACE_S = 60.0


def _let_the_main_rank_speak() -> None:
    """An error every rank raised is printed by the main rank alone. A launcher (torchrun, accelerate launch) stops
    every rank as soon as one exits with an error, so a rank that got there first would cut the main rank off
    before its line: wait instead. The launcher ends this process when the main rank exits; the wait is bounded in
    case the main rank is stuck elsewhere."""
    if int(os.environ.get("WORLD_SIZE", "1")) > 1:
        time.sleep(MAIN_RANK_GRACE_S)


def _tell_the_launcher(line: str) -> None:
    """Give torchrun's agent (accelerate launch) the main rank's error line for its failure report, which ends with
    the root cause's message: our line instead of a link to torch's documentation, last on the screen too."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return
    try:
        with open(path, "w", encoding="utf-8") as f:
            json.dump({"message": line, "timestamp": int(time.time())}, f)
    except OSError:  # the report keeps its link; our line is printed already
        pass


def _main_rank_says(line: str) -> None:
    _say(line)
    _tell_the_launcher(printable(line))  # the launcher prints it on the terminal too


def run(main: Callable[[], int]) -> int:
    rank = _rank()
    try:
        return main()
    except UsageError as e:
        if os.environ.get("FLUX_CP_DEBUG"):
            traceback.print_exc()
        # Agreed errors (and those raised before the process group exists, which every rank raises alike)
        # are printed once; an error of one rank alone is printed by that rank, named.
        if rank == 0:
            _main_rank_says(f"error: {e}")
        elif not e.agreed and is_distributed():
            _say(f"error: [rank {rank}] {e}")
        else:
            _let_the_main_rank_speak()
        return EXIT_USAGE
    except NonFiniteError as e:  # found by a collective check: every rank raises it
        if rank == 0:
            _main_rank_says(f"error: {e}")
        else:
            _let_the_main_rank_speak()
        return EXIT_NONFINITE
    except KeyboardInterrupt:
        return 130
    except Exception as e:  # noqa: BLE001
        text = f"{type(e).__name__}: {e}"
        if _is_peer_failure(e):
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            _say(
                f"error: [rank {rank}] a collective operation failed ({first}). Another rank crashed, raised or "
                "stopped responding: the launcher's summary and that rank's log name the cause."
            )
            return EXIT_PEER_FAILED
        _say(f"error: [rank {rank}] {text}")
        traceback.print_exc()
        return 1
    except (SystemExit, GeneratorExit):
        raise
    except BaseException as e:  # noqa: BLE001 - torch's CheckpointException derives from BaseException
        # Its text holds every rank's traceback: keep the first failure's own line.
        lines = [ln for ln in str(e).splitlines() if ln.strip() and not ln.startswith((" ", "Traceback"))]
        cause = lines[-1] if lines else type(e).__name__
        _say(f"error: [rank {rank}] {type(e).__name__}: {cause}")
        if os.environ.get("FLUX_CP_DEBUG"):
            traceback.print_exc()
        return 1
