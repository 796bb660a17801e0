"""A CP mode that is not built in, added the way a new mode is: one module (tests/allgather_mode.py, all-gather of
K/V) and one registry line, `cp.register_mode(ALLGATHER)`, in every process. Nothing else changes: `cp.attention`,
`cp.CPContext`, the Flux processors and flux-cp's --cp_mode (its choices, help and checks) all read the registry, and
the mode computes what attention without CP computes, forward and backward, at CP sizes 2, 3 and 4."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import cp
from flux_cp.config.flags import ParallelConfig
from flux_cp.config.parser import build_parser, parse_config
from flux_cp.errors import UsageError
from flux_cp.shape.build import choose_cp_mode
from flux_cp.shape.run_shape import auto_mode
from tests import distributed
from tests.allgather_mode import ALLGATHER
from tests.test_cp_flux import _model_errors


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _errors(rank: int, world: int) -> dict:
    """The mode's errors against no CP: attention alone in fp64 (out, dq, dk, dv; through a context and through a plain
    group), and the tiny Flux transformer with LoRA in fp32 (output and every parameter's gradient)."""
    cp.register_mode(ALLGATHER)  # the one line, in every process
    calls = []
    attend = ALLGATHER.attention
    ALLGATHER.attention = lambda *args: calls.append(1) or attend(*args)  # counted: the mode computed every case
    group = dist.group.WORLD
    g = torch.Generator().manual_seed(world)
    shape = (2, 5 * world, 6, 8)  # [batch, sequence, heads, head_dim]: 6 heads, which Ulysses could not split 4 ways
    q, k, v, dout = (torch.randn(shape, generator=g, dtype=torch.float64) * 1.5 for _ in range(4))
    ref = [t.clone().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref)).transpose(1, 2)
    ref_out.backward(dout)
    errors = {}
    for how in ("context", "group"):
        local = [cp.shard(t, 1, group).requires_grad_(True) for t in (q, k, v)]
        if how == "context":
            out = cp.attention(*local, context=cp.CPContext(group, "allgather"))
        else:
            out = cp.attention(*local, group=group, mode="allgather")
        out.backward(cp.shard(dout, 1, group))
        pairs = [(out, ref_out)] + [(t.grad, r.grad) for t, r in zip(local, ref)]
        errors[how] = max(_rel(a, cp.shard(b.detach(), 1, group)) for a, b in pairs)
    errors["calls"] = len(calls)
    errors["flux"] = _model_errors(rank, world, "allgather", None, None)
    errors["flux calls"] = len(calls) - errors["calls"]
    return errors


@pytest.mark.distributed
@pytest.mark.parametrize("world", [2, 3, 4])
def test_a_mode_added_by_one_module_computes_what_attention_without_cp_computes(world):
    for rank, errors in enumerate(distributed.run(_errors, world)):
        assert errors["context"] < 1e-12 and errors["group"] < 1e-12 and errors["calls"] == 2, (rank, errors)
        assert errors["flux calls"] == 4, errors  # every attention of the tiny model: 2 double and 2 single blocks
        flux = errors["flux"]
        assert flux["n_lora"] > 0 and flux["out"] < 2e-5 and flux["grad"] < 2e-5, (rank, flux)
        assert flux["restored"], flux


@pytest.fixture
def allgather():
    """The mode registered in this process for one test (the registry is global: other tests see the built-ins)."""
    cp.register_mode(ALLGATHER)
    yield ALLGATHER
    del cp.MODES[ALLGATHER.name]


def _cp_mode_flag():
    return next(a for a in build_parser()._actions if a.dest == "cp_mode")


def test_cp_mode_flag_derives_from_the_registry(allgather):
    flag = _cp_mode_flag()
    assert flag.choices == ("auto", *cp.MODES) and "allgather" in flag.choices
    assert "allgather (every rank gathers the whole K and V)" in flag.help
    cfg = parse_config(["--cp_size", "2", "--cp_mode", "allgather"])
    assert choose_cp_mode(cfg.parallel, 12, 2) == ("allgather", None)
    assert cp.CPContext(None, "allgather").describe() == "no CP"  # one rank: no exchange, whatever the mode
    # It takes no Ulysses size and is never picked by auto (it has no auto_rank).
    with pytest.raises(UsageError, match="--ulysses_size is only used with --cp_mode hybrid .got --cp_mode allgather"):
        ParallelConfig(cp_size=4, cp_mode="allgather", ulysses_size=2).check()
    assert all(auto_mode(heads, n)[0] != "allgather" for heads in (1, 6, 24) for n in (1, 2, 3, 5, 16))
    with pytest.raises(ValueError, match="a CP mode needs a name of its own: 'allgather' is taken"):
        cp.register_mode(type(allgather)())


def test_cp_mode_flag_without_the_mode_refuses_it():
    assert "allgather" not in _cp_mode_flag().choices and "allgather" not in cp.MODES
    with pytest.raises(UsageError, match="invalid choice: 'allgather'"):
        parse_config(["--cp_size", "2", "--cp_mode", "allgather"])
