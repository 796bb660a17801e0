"""What the trainer does on the host to keep the GPU busy, on a GPU: batches built ahead of their step (copied from
pinned memory without waiting for the kernels queued before them) are the batches built on demand, the fused
AdamW steps as torch's reference AdamW does, and the end of a step (gradient norm, update, its non-finite check,
its timing mark) is queued without the host waiting for the GPU."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flux_cp.config.training import DataConfig, TrainConfig
from flux_cp.data.batches import Batches
from flux_cp.data.schedule import BatchSchedule
from flux_cp.families import FLUX1
from flux_cp.layout import Layout
from tests.fakes import FakeData, step_fused_and_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KEYS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids", "guidance")


def _batches(data: FakeData, device: torch.device) -> Batches:
    train = TrainConfig(train_batch_size=2, seed=4, weighting_scheme="logit_normal")
    layout = Layout(1, 0, 1, 1, 0, 0, None)
    vae = SimpleNamespace(config=SimpleNamespace(shift_factor=0.1, scaling_factor=0.5))
    return Batches(data, BatchSchedule(data.buckets, 2, seed=4), layout, DataConfig(random_flip=True), train,
                   FlowMatchEulerDiscreteScheduler(), FLUX1, FLUX1.normalizer(vae), True, device,
                   torch.bfloat16)  # fmt: skip


def test_batches_prefetched_behind_running_kernels_are_the_batches_built_on_demand():
    cuda, data = torch.device("cuda"), FakeData(8)
    ahead, on_demand, on_cpu = _batches(data, cuda), _batches(data, cuda), _batches(data, torch.device("cpu"))
    x = torch.randn(4096, 4096, device=cuda)
    for m in range(8):
        for _ in range(20):  # ~tens of ms of kernels queued ahead of the batch's copies, as in a training step
            x = torch.tanh(x @ x)
        ahead.prefetch(m)
        got = ahead.micro(m)
        torch.cuda.synchronize()
        want, host = on_demand.micro(m), on_cpu.micro(m)
        for key in KEYS:
            assert got.inputs[key].device.type == "cuda", key
            assert torch.equal(got.inputs[key], want.inputs[key]), (m, key)
            torch.testing.assert_close(got.inputs[key].cpu(), host.inputs[key])
        assert torch.equal(got.target, want.target) and torch.equal(got.weighting, want.weighting)
        torch.testing.assert_close(got.target.cpu(), host.target)
    assert torch.isfinite(x).all()


def test_the_fused_adamw_on_the_gpu_steps_like_the_reference_adamw():
    step_fused_and_reference("cuda", [(3072, 16), (16, 3072), (7,), (64, 64)], rtol=1e-5, atol=1e-6)


def test_the_end_of_a_step_is_queued_without_waiting_for_the_gpu():
    """clip_grad_norm, apply_update (a non-finite step dropped on the device) and StepTimer.mark make no host
    synchronisation (torch's sync debug mode turns one into an error); the values they leave are right."""
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import apply_update, clip_grad_norm, make_optimizer
    from flux_cp.outputs.metrics import StepTimer

    cuda = torch.device("cuda")
    params = [torch.nn.Parameter(torch.randn(s, device=cuda)) for s in [(3072, 16), (16, 3072), (7,)]]
    optimizer = make_optimizer(TrainConfig(learning_rate=1e-2), params, global_batch=1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0)
    accelerator = SimpleNamespace(unscale_gradients=lambda: None)
    timer = StepTimer(cuda)
    x = torch.randn(4096, 4096, device=cuda)
    results = []
    for bad in (False, False, True, False):  # the first step loads the kernels (lazily, which may wait)
        start = [p.detach().clone() for p in params]
        for p in params:
            p.grad = torch.full_like(p, 3.0)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            for _ in range(50):  # ~0.1 s of kernels queued ahead, as the step's backward would be
                x = torch.tanh(x @ x)
            loss = x.mean() * (float("nan") if bad else 1.0)
            norm = clip_grad_norm(accelerator, params, 1.0)
            skipped = apply_update(optimizer, scheduler, loss, norm)
            end = timer.mark()
            queued = not end.query()
            with pytest.raises(RuntimeError, match="synchroniz"):  # the mode catches a host read
                skipped.item()
        finally:
            torch.cuda.set_sync_debug_mode(0)
        assert timer.seconds(end) > 0
        moved = [not torch.equal(p.detach(), s) for p, s in zip(params, start)]
        results.append((bool(skipped), moved, norm.item(), queued))
    results = results[1:]
    assert all(r[3] for r in results), "the step's end was queued while the kernels before it still ran"
    assert [r[0] for r in results] == [False, True, False]
    assert all(results[0][1]) and not any(results[1][1]) and all(results[2][1])
    assert results[0][2] == pytest.approx(3.0 * (3072 * 16 * 2 + 7) ** 0.5, rel=1e-5)
    assert [optimizer.state[p]["step"].item() for p in params] == [3, 3, 3]
