"""The optimizer step's non-finite policy: stop, or skip the update (and say so in the metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from flux_cp.errors import NonFiniteError
from flux_cp.optim import apply_update, check_finite
from tests.fakes import step_fused_and_reference


def _setup(kind: str = "sgd"):
    p = torch.nn.Parameter(torch.ones(3))
    if kind == "sgd":  # not fused: apply_update reads the flag on the host
        optimizer = torch.optim.SGD([p], lr=0.1)
    else:  # the trainer's AdamW, fused: the flag stays on the device
        from flux_cp.config import TrainConfig
        from flux_cp.optim import make_optimizer

        optimizer = make_optimizer(TrainConfig(learning_rate=0.1), [p], global_batch=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    p.grad = torch.ones(3)
    return p, optimizer, scheduler


def _t(x: float) -> torch.Tensor:
    return torch.tensor(x)


def test_a_finite_step_updates():
    p, optimizer, scheduler = _setup()
    assert apply_update(optimizer, scheduler, _t(0.5), _t(1.0)).item() is False
    assert torch.allclose(p.detach(), torch.full((3,), 0.9)) and p.grad is None and scheduler.last_epoch == 1
    check_finite(0.5, 1.0, "stop", 1)  # a finite step: nothing to say


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # skipped
@pytest.mark.parametrize("kind", ["sgd", "fused_adamw"])
@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (0.5, math.inf), (0.5, math.nan)])
def test_a_non_finite_loss_or_gradient_norm_alone_skips_the_update(kind, loss, grad_norm, caplog):
    """A finite loss with a non-finite gradient norm is skipped too, and reported as skipped."""
    p, optimizer, scheduler = _setup(kind)
    assert apply_update(optimizer, scheduler, _t(loss), _t(grad_norm)).item() is True
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None
    assert scheduler.last_epoch == 1, "the schedule advances with the step count"
    with caplog.at_level("WARNING", logger="flux_cp"):
        check_finite(loss, grad_norm, "skip", 3)
    assert "step 3: non-finite loss or gradient norm, update skipped" in caplog.text
    with pytest.raises(NonFiniteError, match=r"at step 3; no checkpoint was written for it"):
        check_finite(loss, grad_norm, "stop", 3)


def test_a_dropped_fused_step_leaves_no_trace_in_adamw_and_reads_nothing_on_the_host(monkeypatch):
    """On the device path a dropped step leaves weights, moments and step count as they were: the next finite
    step equals that of an AdamW that never saw the bad one. And the decision is never read by the host."""
    p, optimizer, scheduler = _setup("fused_adamw")
    q, ref, ref_scheduler = _setup("fused_adamw")
    apply_update(optimizer, scheduler, _t(0.5), _t(1.0))
    apply_update(ref, ref_scheduler, _t(0.5), _t(1.0))

    def no_host_read(*args, **kwargs):
        raise AssertionError("apply_update read a tensor on the host")

    p.grad = torch.full((3,), 2.0)
    with monkeypatch.context() as m:
        m.setattr(torch.Tensor, "item", no_host_read)
        m.setattr(torch.Tensor, "__bool__", no_host_read)
        m.setattr(torch.Tensor, "tolist", no_host_read)
        dropped = apply_update(optimizer, scheduler, _t(math.nan), _t(1.0))
    assert dropped.item() is True
    assert optimizer.state[p]["step"].item() == 1 and torch.equal(p.detach(), q.detach())
    torch.testing.assert_close(optimizer.state[p]["exp_avg"], ref.state[q]["exp_avg"], rtol=0, atol=0)
    p.grad, q.grad = torch.full((3,), 0.5), torch.full((3,), 0.5)
    apply_update(optimizer, scheduler, _t(0.5), _t(1.0))
    ref_scheduler.step()  # the dropped step advanced the schedule: so does the reference's
    apply_update(ref, ref_scheduler, _t(0.5), _t(1.0))
    assert not torch.equal(p.detach(), torch.ones(3))  # it moved: the comparison means something
    torch.testing.assert_close(p.detach(), q.detach(), rtol=0, atol=0)
    assert optimizer.state[p]["step"].item() == ref.state[q]["step"].item() == 2


def test_the_trainers_adamw_is_fused_and_steps_like_the_reference_adamw():
    """make_optimizer uses the fused AdamW (fewer host-side launches); it must update as torch's default AdamW."""
    step_fused_and_reference("cpu", [(16, 4), (4, 16), (7,), (3, 3, 2)])
