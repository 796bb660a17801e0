"""Block offload's wait for a block's copy (flux_cp/model/offload.py), made deterministic on a CUDA GPU:
`python -m pytest -q tests/gpu/test_offload_race_gpu.py`.

A block computes once the compute stream has waited for its copy into its slot. Copies are fast, so a schedule that
forgot the wait would mostly still read the right weights, and a test of the results would pass by luck. Here every
copy is made late on purpose: the copy stream sleeps (`torch.cuda._sleep`, a kernel that spins) before each copy, far
longer than a block computes. With the wait, training is bit for bit that without offload; with the wait removed (the
same schedule, one line less), the blocks read their slots' previous occupants and the losses differ: the test would
catch the missing wait every time. (On the CPU the copies run when issued: there is no stream to race.)
"""

from __future__ import annotations

import gc

import pytest
import torch

from flux_cp.model.offload import BlockOffload, offload_blocks
from tests.gpu.test_offload_gpu import OFFLOADED, _batches, _model, _train

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

LATE_S = 0.05  # each copy starts this long after it is issued: tens of times a block's compute here


def _late_copies(monkeypatch) -> None:
    """Every copy into a slot waits on the copy stream for LATE_S first (after what it waits for already)."""
    issue = BlockOffload._issue
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    torch.cuda._sleep(10**7)  # how long a number of the GPU's cycles takes
    end.record()
    end.synchronize()
    cycles = int(LATE_S / (start.elapsed_time(end) / 1e3 / 10**7))

    def late(self, blk):
        if self.stream is not None:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                torch.cuda._sleep(cycles)
        return issue(self, blk)

    monkeypatch.setattr(BlockOffload, "_issue", late)


def _without_the_wait(self, blk, clock) -> None:
    """BlockOffload._ensure less its one line that makes the compute stream wait for the block's copy."""
    g, s = blk.group, blk.slot
    if g.occupant[s] is not blk:
        self._issue(blk)
    g.busy[s] = clock


def _run(offloaded: bool) -> list[torch.Tensor]:
    model = _model()
    off = None
    if offloaded:
        model.cpu()
        torch.cuda.empty_cache()
        off = offload_blocks(model, OFFLOADED, "cuda")
    got, _ = _train(model, _batches(2), steps=2, accumulation=1, offload=off)
    del model, off
    gc.collect()
    torch.cuda.empty_cache()
    return got


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # two runs can then agree bit for bit
    yield
    torch.use_deterministic_algorithms(before)
    gc.collect()
    torch.cuda.empty_cache()


def test_a_block_waits_for_its_late_copy_and_a_missing_wait_is_caught(monkeypatch):
    reference = _run(offloaded=False)
    _late_copies(monkeypatch)
    waited = _run(offloaded=True)
    for i, (a, b) in enumerate(zip(reference, waited)):
        assert torch.equal(a, b), f"item {i} (losses first, then LoRA weights): {(a - b).abs().max().item()}"
    monkeypatch.setattr(BlockOffload, "_ensure", _without_the_wait)
    raced = _run(offloaded=True)
    # the first forward's third offloaded block already reads its slot before its copy lands: the first loss differs
    assert not torch.equal(reference[0], raced[0]), "without the wait the blocks read their own weights: not late"
