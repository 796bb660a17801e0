"""Atomic writes, and the collective "did any rank fail" check on 2 gloo processes."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from flux_cp import distributed, files
from flux_cp.errors import UsageError
from tests import distributed as spawn

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)


def test_atomic_writes_replace_whole_files_and_leave_nothing_behind_on_failure(tmp_path):
    target = tmp_path / "sub" / "a.json"
    files.write_json(target, {"x": 1})
    files.write_json(target, {"x": 2})
    assert json.loads(target.read_text()) == {"x": 2}

    def broken(tmp: str) -> None:
        with open(tmp, "w") as f:
            f.write("half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        files.write_with(target, broken)
    assert json.loads(target.read_text()) == {"x": 2}, "a failed write must leave the old file"
    assert sorted(p.name for p in target.parent.iterdir()) == ["a.json"], "no temporary file may remain"
    files.write_safetensors(tmp_path / "t.safetensors", {"w": torch.arange(4.0).view(2, 2).t()})
    assert torch.equal(load_file(tmp_path / "t.safetensors")["w"], torch.arange(4.0).view(2, 2).t())


def test_single_process_helpers_need_no_process_group():
    assert not distributed.is_distributed() and distributed.world_size() == 1
    distributed.barrier()
    assert distributed.any_rank(True) and not distributed.any_rank(False)
    assert distributed.all_gather({"a": 1}) == [{"a": 1}]
    distributed.check_all_ranks(True, "unused")
    with pytest.raises(UsageError, match="bad data"):
        distributed.check_all_ranks(False, "bad data")


def _check(rank: int, world: int) -> tuple[bool, str, bool]:
    failed = distributed.any_rank(rank == 1)
    try:
        distributed.check_all_ranks(rank == 0, f"rank {rank}: bad image")
    except UsageError as e:
        return failed, str(e), e.agreed
    return failed, "", False


def test_every_rank_raises_the_failing_ranks_messages():
    results = spawn.run(_check, 3)
    assert results == [(True, "rank 1: bad image; rank 2: bad image", True)] * 3
