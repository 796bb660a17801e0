"""Stand-ins and references that several test modules share (a test module imports helpers from here,
tests/launch.py or tests/distributed.py, never from another test module): a data set of fixed encodings and the
trainer's batches built from it, and torch's reference AdamW to check the trainer's optimizer against."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from diffusers import FlowMatchEulerDiscreteScheduler

from flux_cp.config.training import DataConfig, TrainConfig
from flux_cp.data.batches import Batches
from flux_cp.data.schedule import BatchSchedule
from flux_cp.families import FLUX1
from flux_cp.layout import Layout

C, H, W, L, D = 4, 8, 12, 8, 32  # latent channels and size, text tokens and width


class FakeData:
    """A TrainingData with a fixed encoding per sample; records the (index, flip, epoch) it is asked for."""

    def __init__(self, n: int):
        g = torch.Generator().manual_seed(0)
        self.samples = [
            {"latent_mean": torch.randn(C, H, W, generator=g), "latent_std": torch.rand(C, H, W, generator=g) + 0.1,
             "prompt_embeds": torch.randn(L, D, generator=g), "pooled_prompt_embeds": torch.randn(D, generator=g)}
            for _ in range(n)
        ]  # fmt: skip
        self.buckets = [0] * n
        self.calls: list[tuple[int, bool, int]] = []

    def load(self, index: int, flip: bool, epoch: int) -> dict:
        self.calls.append((index, flip, epoch))
        s = self.samples[index]
        return {k: (v.flip(-1) if flip and k.startswith("latent") else v) for k, v in s.items()}


def make_batches(data, dp: int, dp_rank: int, cp_size: int = 1, cp_rank: int = 0, group=None, per_rank: int = 1,
                 data_config: DataConfig | None = None, classes=None):  # fmt: skip
    train = TrainConfig(train_batch_size=per_rank, seed=4, weighting_scheme="logit_normal")
    world = dp * cp_size
    layout = Layout(world, dp_rank * cp_size + cp_rank, cp_size, dp, dp_rank, cp_rank, group)
    schedule = BatchSchedule(data.buckets, per_rank * dp, seed=4)
    vae = SimpleNamespace(config=SimpleNamespace(shift_factor=0.1, scaling_factor=0.5))
    return Batches(data, schedule, layout, data_config or DataConfig(random_flip=True), train,
                   FlowMatchEulerDiscreteScheduler(), FLUX1, FLUX1.normalizer(vae), True, torch.device("cpu"),
                   classes=classes)  # fmt: skip


def step_fused_and_reference(device: str, shapes: list[tuple], steps: int = 5, rtol: float = 1e-6, atol: float = 1e-7):
    """The trainer's AdamW (make_optimizer: fused) and torch's reference AdamW (foreach=False) from the same start
    with the same gradients: the weights must move, and the two must agree."""
    from flux_cp.config.training import TrainConfig
    from flux_cp.model.optim import make_optimizer

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
