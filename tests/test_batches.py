"""The batch builder's data flow on one process: what a rank gets does not depend on the layout, and CP chunks
put back together are the whole sample, with the mean of the chunks' losses equal to the whole loss."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler

import cp.comm
from flux_cp.batches import Batches
from flux_cp.config import DataConfig, TrainConfig
from flux_cp.data import BatchSchedule
from flux_cp.families import FLUX1
from flux_cp.parallel import Layout

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


def _batches(data, dp: int, dp_rank: int, cp_size: int = 1, cp_rank: int = 0, group=None, per_rank: int = 1):
    train = TrainConfig(train_batch_size=per_rank, seed=4, weighting_scheme="logit_normal")
    world = dp * cp_size
    layout = Layout(world, dp_rank * cp_size + cp_rank, cp_size, dp, dp_rank, cp_rank, group)
    schedule = BatchSchedule(data.buckets, per_rank * dp, seed=4)
    vae = SimpleNamespace(config=SimpleNamespace(shift_factor=0.1, scaling_factor=0.5))
    return Batches(data, schedule, layout, DataConfig(random_flip=True), train, FlowMatchEulerDiscreteScheduler(),
                   FLUX1, FLUX1.normalizer(vae), True, torch.device("cpu"))  # fmt: skip


def test_a_slot_gets_the_same_sample_noise_and_timestep_on_every_layout():
    data = FakeData(8)
    whole = _batches(data, dp=1, dp_rank=0, per_rank=2)
    halves = [_batches(data, dp=2, dp_rank=r) for r in (0, 1)]
    for m in range(6):  # more than one epoch (4 global batches of 2)
        a = whole.micro(m)
        parts = [h.micro(m) for h in halves]
        for key in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "guidance"):
            assert torch.equal(a.inputs[key], torch.cat([p.inputs[key] for p in parts])), (m, key)
        assert torch.equal(a.target, torch.cat([p.target for p in parts]))
        assert a.epoch == parts[0].epoch == m // 4
    flips = {(i, e): f for i, f, e in data.calls}
    assert len(set(flips.values())) == 2, "--random_flip should flip some samples and not others"
    assert all(flips[(i, e)] == f for i, f, e in data.calls), "a sample's flip must not depend on the layout"


def test_a_prefetched_batch_is_the_batch_built_on_demand():
    """The trainer builds the next micro-step's batch while the GPU runs the backward: it must be the same batch,
    and a prefetch of another micro-step must not be handed out in its place."""
    data = FakeData(8)
    ahead, plain = _batches(data, dp=1, dp_rank=0, per_rank=2), _batches(data, dp=1, dp_rank=0, per_rank=2)
    for m in range(6):
        ahead.prefetch(m)
        got, want = ahead.micro(m), plain.micro(m)
        for key in ("hidden_states", "encoder_hidden_states", "pooled_projections", "timestep", "img_ids"):
            assert torch.equal(got.inputs[key], want.inputs[key]), (m, key)
        assert torch.equal(got.target, want.target) and torch.equal(got.weighting, want.weighting)
        assert got.epoch == want.epoch
    ahead.prefetch(3)
    assert torch.equal(ahead.micro(4).target, plain.micro(4).target)  # not the prefetched micro-step 3
    assert torch.equal(ahead.micro(3).target, plain.micro(3).target)


@pytest.fixture
def fake_cp_group(monkeypatch):
    """cp.shard's view of a CP group of 2 (which chunk this rank keeps), without a process group."""
    state = {"rank": 0}
    group = object()
    real_size, real_rank = cp.comm.group_size, cp.comm.group_rank
    monkeypatch.setattr(cp.comm, "group_size", lambda g: 2 if g is group else real_size(g))
    monkeypatch.setattr(cp.comm, "group_rank", lambda g: state["rank"] if g is group else real_rank(g))
    return group, state


def test_cp_chunks_are_equal_contiguous_parts_and_their_mean_loss_is_the_whole_loss(fake_cp_group):
    group, state = fake_cp_group
    data = FakeData(4)
    whole = _batches(data, dp=1, dp_rank=0).micro(1)
    chunks = []
    for r in (0, 1):
        state["rank"] = r
        chunks.append(_batches(data, dp=1, dp_rank=0, cp_size=2, cp_rank=r, group=group).micro(1))
    tokens = {"hidden_states": 1, "encoder_hidden_states": 1, "img_ids": 0, "txt_ids": 0}
    for key, dim in tokens.items():
        a, b = chunks[0].inputs[key], chunks[1].inputs[key]
        assert a.shape == b.shape, key  # equal chunks: every rank's loss weighs the same number of tokens
        assert torch.equal(torch.cat([a, b], dim), whole.inputs[key]), key
    for key in ("pooled_projections", "timestep", "guidance"):  # per sample, not per token: every rank has it all
        assert torch.equal(chunks[0].inputs[key], whole.inputs[key])
    assert torch.equal(torch.cat([c.target for c in chunks], 1), whole.target)
    assert chunks[0].image_tokens == whole.image_tokens == (H // 2) * (W // 2)
    pred = torch.randn_like(whole.target)
    half = pred.shape[1] // 2
    mean_of_chunks = (chunks[0].loss(pred[:, :half]) + chunks[1].loss(pred[:, half:])) / 2
    assert torch.allclose(mean_of_chunks, whole.loss(pred), rtol=1e-6, atol=0)  # the loss is taken in fp32
