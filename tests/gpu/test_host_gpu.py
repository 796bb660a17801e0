"""What the trainer does on the host to keep the GPU busy, on a GPU: batches built ahead of their step (copied from
pinned memory without waiting for the kernels queued before them) are the batches built on demand, and the
fused AdamW steps as torch's reference AdamW does."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flux_cp.batches import Batches
from flux_cp.config import DataConfig, TrainConfig
from flux_cp.data import BatchSchedule
from flux_cp.parallel import Layout
from tests.test_batches import FakeData
from tests.test_optim import step_fused_and_reference

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

KEYS = ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids", "txt_ids", "guidance")


def _batches(data: FakeData, device: torch.device) -> Batches:
    train = TrainConfig(train_batch_size=2, seed=4, weighting_scheme="logit_normal")
    layout = Layout(1, 0, 1, 1, 0, 0, None)
    vae = SimpleNamespace(shift_factor=0.1, scaling_factor=0.5)
    return Batches(data, BatchSchedule(data.buckets, 2, seed=4), layout, DataConfig(random_flip=True), train,
                   FlowMatchEulerDiscreteScheduler(), vae, True, device, torch.bfloat16)  # fmt: skip


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
