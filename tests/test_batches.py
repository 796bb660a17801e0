"""The batch builder's data flow on one process: what a rank gets does not depend on the layout, and CP chunks
put back together are the whole sample, with the mean of the chunks' losses equal to the whole loss."""

from __future__ import annotations

import torch

from flux_cp.loss import batch_loss
from tests.fakes import FakeData, H, W, make_batches


def test_a_slot_gets_the_same_sample_noise_and_timestep_on_every_layout():
    data = FakeData(8)
    whole = make_batches(data, dp=1, dp_rank=0, per_rank=2)
    halves = [make_batches(data, dp=2, dp_rank=r) for r in (0, 1)]
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
    ahead, plain = make_batches(data, dp=1, dp_rank=0, per_rank=2), make_batches(data, dp=1, dp_rank=0, per_rank=2)
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


def test_cp_chunks_are_equal_contiguous_parts_and_their_mean_loss_is_the_whole_loss(fake_cp_group):
    group, state = fake_cp_group
    data = FakeData(4)
    whole = make_batches(data, dp=1, dp_rank=0).micro(1)
    chunks = []
    for r in (0, 1):
        state["rank"] = r
        chunks.append(make_batches(data, dp=1, dp_rank=0, cp_size=2, cp_rank=r, group=group).micro(1))
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
    mean_of_chunks = (batch_loss(pred[:, :half], chunks[0]) + batch_loss(pred[:, half:], chunks[1])) / 2
    assert torch.allclose(mean_of_chunks, batch_loss(pred, whole), rtol=1e-6, atol=0)  # the loss is taken in fp32
