"""--use_ema: the EMA's math against diffusers' EMAModel, its update interval, swapping it into the weights, and the
same EMA of weights sharded as FSDP2 shards them (DTensors over two gloo ranks) as of whole ones."""

from __future__ import annotations

import pytest
import torch

from flux_cp.model.ema import EMA, decay_at
from tests.distributed import run


def _params(seed: int = 0) -> list[tuple[str, torch.nn.Parameter]]:
    g = torch.Generator().manual_seed(seed)
    return [(f"w{k}", torch.nn.Parameter(torch.randn(6, 4, generator=g))) for k in range(3)]


def _train(params: list[torch.nn.Parameter], step: int) -> None:
    """A stand-in optimizer step: every weight moves by a draw keyed by the step."""
    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g) * 0.1)


@pytest.mark.parametrize("max_decay", [0.9999, 0.5])
def test_decay_is_diffusers_ema_models(max_decay):
    from diffusers.training_utils import EMAModel

    reference = EMAModel([torch.nn.Parameter(torch.zeros(1))], decay=max_decay)
    assert [decay_at(s, max_decay) for s in range(1, 60)] == [reference.get_decay(s) for s in range(1, 60)]


def test_every_step_the_shadow_is_ema_models_bit_for_bit():
    from diffusers.training_utils import EMAModel

    named = _params()
    params = [p for _, p in named]
    ema = EMA(named, 0.9, 1)
    reference = EMAModel(params, decay=0.9, foreach=True)
    for step in range(1, 31):
        _train(params, step)
        ema.update(step)
        reference.step(params)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, reference.shadow_params))
    assert not torch.equal(ema.shadow[0], params[0]), "the EMA is the weights: the check would be blind"


def test_an_interval_updates_after_every_kth_step_with_that_steps_decay():
    """SimpleTuner's --ema_update_interval: its EMAModel takes the global step as its count, so the decay is that of
    the step the update follows."""
    from diffusers.training_utils import EMAModel

    named = _params(1)
    params = [p for _, p in named]
    ema = EMA(named, 0.95, 3)
    reference = EMAModel(params, decay=0.95, foreach=True)
    for step in range(1, 20):
        _train(params, step)
        ema.update(step)
        if step % 3 == 0:
            reference.optimization_step = step - 1  # step() counts one up first
            reference.step(params)
    assert all(torch.equal(a, b) for a, b in zip(ema.shadow, reference.shadow_params))


def test_applied_swaps_the_ema_in_and_back_exactly():
    named = _params(2)
    params = [p for _, p in named]
    ema = EMA(named, 0.9, 1)
    for step in range(1, 6):
        _train(params, step)
        ema.update(step)
    raw = [p.detach().clone() for p in params]
    shadow = [s.clone() for s in ema.shadow]
    with ema.applied():
        assert all(torch.equal(p, s) for p, s in zip(params, shadow))
    assert all(torch.equal(p, r) for p, r in zip(params, raw))
    assert all(torch.equal(s, t) for s, t in zip(ema.shadow, shadow))
    assert ema.state_dict().keys() == {"w0", "w1", "w2"}


def _sharded(rank: int, world: int) -> list:
    """The EMA of DTensor parameters sharded over the ranks (dim 0, as FSDP2 shards), gathered, and the parameters
    gathered inside `applied`, as lists (tensors cannot leave the rank's process)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (world,))
    named = [(n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [Shard(0)]))) for n, p in _params(3)]
    params = [p for _, p in named]
    ema = EMA(named, 0.8, 2)
    assert all(type(s).__name__ == "DTensor" for s in ema.shadow), "the shadow is not sharded like its parameter"
    for step in range(1, 12):
        _train_sharded(params, step)
        ema.update(step)
    with ema.applied():
        inside = [p.detach().full_tensor().tolist() for p in params]
    return [s.detach().full_tensor().tolist() for s in ema.shadow], inside


def _train_sharded(params: list, step: int) -> None:
    from torch.distributed.tensor import distribute_tensor

    g = torch.Generator().manual_seed(1000 + step)
    with torch.no_grad():
        for p in params:
            p.add_(distribute_tensor(torch.randn(p.shape, generator=g) * 0.1, p.device_mesh, p.placements))


@pytest.mark.distributed
def test_the_ema_of_sharded_weights_is_that_of_whole_ones():
    named = _params(3)
    params = [p for _, p in named]
    ema = EMA(named, 0.8, 2)
    for step in range(1, 12):
        _train(params, step)
        ema.update(step)
    for shadow, inside in run(_sharded, 2):
        assert all(torch.equal(torch.tensor(a), b) for a, b in zip(shadow, ema.shadow))
        assert all(torch.equal(torch.tensor(a), b) for a, b in zip(inside, ema.shadow))
