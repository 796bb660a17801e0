"""The optimizer step's non-finite policy: stop, or skip the update (and say so in the metrics)."""

from __future__ import annotations

import math

import pytest
import torch

from flux_cp.errors import NonFiniteError
from flux_cp.optim import apply_update


def _setup():
    p = torch.nn.Parameter(torch.ones(3))
    optimizer = torch.optim.SGD([p], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1 / (1 + s))
    p.grad = torch.ones(3)
    return p, optimizer, scheduler


def test_a_finite_step_updates():
    p, optimizer, scheduler = _setup()
    assert apply_update(optimizer, scheduler, 0.5, 1.0, "stop", 1) is False
    assert torch.allclose(p.detach(), torch.full((3,), 0.9)) and p.grad is None and scheduler.last_epoch == 1


@pytest.mark.filterwarnings("ignore:Detected call of `lr_scheduler.step\\(\\)` before:UserWarning")  # skipped
@pytest.mark.parametrize("loss, grad_norm", [(math.nan, 1.0), (0.5, math.inf), (0.5, math.nan)])
def test_a_non_finite_loss_or_gradient_norm_alone_skips_the_update(loss, grad_norm):
    """A finite loss with a non-finite gradient norm is skipped too, and reported as skipped."""
    p, optimizer, scheduler = _setup()
    assert apply_update(optimizer, scheduler, loss, grad_norm, "skip", 3) is True
    assert torch.equal(p.detach(), torch.ones(3)) and p.grad is None
    assert scheduler.last_epoch == 1, "the schedule advances with the step count"
    p.grad = torch.ones(3)
    with pytest.raises(NonFiniteError, match=r"at step 3; no checkpoint was written for it"):
        apply_update(optimizer, scheduler, loss, grad_norm, "stop", 3)
    assert torch.equal(p.detach(), torch.ones(3))


def step_fused_and_reference(device: str, shapes: list[tuple], steps: int = 5, rtol: float = 1e-6, atol: float = 1e-7):
    """The trainer's AdamW (make_optimizer: fused) and torch's reference AdamW (foreach=False) from the same start
    with the same gradients: the weights must move, and the two must agree."""
    from flux_cp.config import TrainConfig
    from flux_cp.optim import make_optimizer

    g = torch.Generator(device=device).manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(s, device=device, generator=g)) for s in shapes]
    ref = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    start = [p.detach().clone() for p in ours]
    train = TrainConfig(learning_rate=1e-2, adam_weight_decay=1e-2)
    opt = make_optimizer(train, ours, global_batch=1)
    assert opt.defaults["fused"] is True
    ref_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(train.adam_beta1, train.adam_beta2), weight_decay=1e-2,
                                eps=train.adam_epsilon, foreach=False)  # fmt: skip
    for _ in range(steps):
        for p, q in zip(ours, ref):
            grad = torch.randn(p.shape, device=device, generator=g)
            p.grad, q.grad = grad.clone(), grad
        opt.step()
        ref_opt.step()
    for p, q, p0 in zip(ours, ref, start):
        assert (p.detach() - p0).abs().mean() > 1e-3  # the weights moved: the comparison below means something
        torch.testing.assert_close(p.detach(), q.detach(), rtol=rtol, atol=atol)


def test_the_trainers_adamw_is_fused_and_steps_like_the_reference_adamw():
    """make_optimizer uses the fused AdamW (fewer host-side launches); it must update as torch's default AdamW."""
    step_fused_and_reference("cpu", [(16, 4), (4, 16), (7,), (3, 3, 2)])
