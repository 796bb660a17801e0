"""`--cp_exchange_first` (`cp.Tuning.exchange_first`) on a GPU, in a compiled graph: each exchange's launch and wait
are followed by the short kernel that gives the exchange its head start. One GPU: a one-rank NCCL group still puts
the exchange and its wait into the graph, which is all the passes look at."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from cp import Tuning
from cp.schedule import inductor_options

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _kernels(tmp_path, first: bool = False) -> list[tuple[str, int]]:
    """The name and number of blocks of each kernel of one call, in launch order."""

    def f(x: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor, b2: torch.Tensor):
        sent = funcol.all_to_all_single(x * 2, None, None, dist.group.WORLD)
        beside = torch.nn.functional.linear(x, w2, b2)  # needs no exchange: the fill pass puts it beside one
        after = torch.nn.functional.linear(sent, w1, b1)
        return beside, after

    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(8448, 3072, device="cuda", dtype=torch.bfloat16, generator=g)
    w1, w2 = (torch.randn(12288, 3072, device="cuda", dtype=torch.bfloat16, generator=g) * 0.02 for _ in "12")
    b1, b2 = (torch.randn(12288, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "12")
    options = {**inductor_options(None, Tuning(exchange_first=first), 2), "fx_graph_cache": False}
    torch._dynamo.reset()
    compiled = torch.compile(f, fullgraph=True, options=options)
    for _ in range(3):
        compiled(x, w1, b1, w2, b2)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        compiled(x, w1, b1, w2, b2)
        torch.cuda.synchronize()
    path = tmp_path / f"trace_{first}.json"
    prof.export_chrome_trace(str(path))
    events = json.loads(path.read_text())["traceEvents"]
    kernels = sorted((e for e in events if e.get("cat") == "kernel"), key=lambda e: e["ts"])
    return [(e["name"], math.prod(e["args"]["grid"])) for e in kernels]


def test_each_exchange_launch_and_wait_is_followed_by_a_head_start(one_rank_group, tmp_path):
    names = [name for name, _ in _kernels(tmp_path, first=True)]
    spins = [i for i, name in enumerate(names) if "sleep" in name.lower() or "spin" in name.lower()]
    assert len(spins) == 2, names  # one exchange: after its launch and after its wait
    products = [i for i, name in enumerate(names) if "nvjet" in name]
    assert spins[0] < products[0], names  # the product beside the exchange comes after the first
