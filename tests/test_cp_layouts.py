"""The compiled Ulysses path's layouts: what an all-to-all delivers is read by the attention op as a view, its
output goes back out as a view, and the op returns outputs and gradients in the strides of its inputs (the
fake kernels promise the compiler exactly that)."""

from __future__ import annotations

import torch

from cp.ops import ring_attention_backward_op, ring_attention_op
from cp.ulysses import _heads_to_send, _received_as_heads, _sent


def test_exchange_layouts_are_views_at_batch_one_and_round_trip():
    u, c, s_l, h, d = 2, 2, 3, 8, 4
    q = torch.randn(1, s_l, h, d)  # one rank's sequence chunk
    sent = _sent(q, u, c)
    assert sent.shape == (c, u, 1, s_l, h // (c * u), d) and sent.is_contiguous()
    # what rank j receives of chunk i from every rank is its heads (i, j) of each rank's chunk; with one rank
    # standing for all (u identical chunks) the received buffer is u copies of sent[i, j]
    for i in range(c):
        for j in range(u):
            recv = torch.stack([sent[i, j]] * u)  # [u, B, S_l, h, D]
            heads = _received_as_heads(recv)
            assert heads.shape == (1, h // (c * u), u * s_l, d)
            assert heads.data_ptr() == recv.data_ptr(), "the kernel's input is not a view of the received buffer"
            first = q[0, :, (i * u + j) * (h // (c * u)) : (i * u + j + 1) * (h // (c * u))].transpose(0, 1)
            assert torch.equal(heads[0, :, :s_l], first)
            back = _heads_to_send(heads, u)
            assert back.data_ptr() == heads.data_ptr(), "the output is copied before it is sent back"
            assert torch.equal(back, recv)


def test_attention_op_keeps_its_inputs_layout_forward_and_backward():
    b, s, h, d = 1, 6, 2, 4
    q, k, v, dout = (torch.randn(b, s, h, d, dtype=torch.float64).transpose(1, 2) for _ in range(4))
    assert not q.is_contiguous()
    out, lse = ring_attention_op(q, k, v, 0.5, "")
    assert out.stride() == q.stride() and lse.shape == (b, h, s)
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = ring_attention_backward_op(dout, q, k, v, out, lse, 0.5, "")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    (torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) * 0.5, -1) @ leaves[2]).backward(dout)
    for g, leaf, t in zip(grads, leaves, (q, k, v)):
        assert g.stride() == t.stride()
        torch.testing.assert_close(g, leaf.grad, rtol=1e-10, atol=1e-12)


def test_a_size_one_dims_stride_does_not_force_a_copy():
    from cp.kernels import in_layout_of

    # batch 1 as a view of an exchange's buffer gives: any stride on the batch dim, the rest dense
    base = torch.randn(72).as_strided((1, 6, 3, 4), (144, 12, 4, 1))
    like = torch.empty(1, 6, 3, 4)
    assert base.stride()[0] != like.stride()[0]
    assert in_layout_of(base, like) is base
    t = base.transpose(1, 2)  # another layout: copied into like's
    moved = in_layout_of(t, like.transpose(1, 2).contiguous())
    assert moved is not t and moved.is_contiguous() and torch.equal(moved, t)
