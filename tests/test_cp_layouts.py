"""The compiled Ulysses path's layouts: what an all-to-all delivers is read by the attention op as a view, its
output goes back out as a view, and the op returns outputs and gradients in the strides of its inputs (the
fake kernels promise the compiler exactly that)."""

from __future__ import annotations

import torch

from cp.kernels import dense_strides
from cp.ring import ring_attention_backward_op, ring_attention_op
from cp.ulysses import _heads_to_send, _received_as_heads, _sent_first, _sent_rest


def test_exchange_layouts_are_views_at_batch_one_and_round_trip():
    u, c, s_l, h, d = 2, 3, 3, 12, 4
    hc = h // (c * u)
    qkv = [torch.randn(1, s_l, h, d) for _ in range(3)]  # one rank's sequence chunk
    first = [_sent_first(t, u, c) for t in qkv]
    rest = _sent_rest(qkv, u, c)
    assert all(f.shape == (u, 1, s_l, hc, d) and f.is_contiguous() for f in first)
    assert rest.shape == (u, 1, s_l, c - 1, 3, hc, d) and rest.is_contiguous()
    # what rank j receives from every rank is its heads of each rank's chunk; with one rank standing for all (u
    # identical chunks) the received buffer is u copies of what was sent to j
    for j in range(u):
        recv_rest = torch.stack([rest[j]] * u)  # [u, B, S_l, c-1, 3, h, D]
        for i in range(c):
            for n, t in enumerate(qkv):
                recv = torch.stack([first[n][j]] * u) if i == 0 else recv_rest[:, :, :, i - 1, n]
                heads = _received_as_heads(recv)
                assert heads.shape == (1, hc, u * s_l, d)
                assert heads.untyped_storage().data_ptr() == recv.untyped_storage().data_ptr(), (
                    "the kernel's input is not a view of the received buffer"
                )
                mine = t[0, :, (i * u + j) * hc : (i * u + j + 1) * hc].transpose(0, 1)
                assert torch.equal(heads[0, :, :s_l], mine) and torch.equal(heads[0, :, s_l:], mine)
                out = torch.empty_strided(heads.shape, dense_strides(heads)).copy_(heads)  # as the op returns it
                back = _heads_to_send(out, u)
                assert back.data_ptr() == out.data_ptr(), "the output is copied before it is sent back"
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


def test_attention_op_takes_q_k_v_interleaved_in_one_buffer():
    """The joint exchange of the later head chunks delivers q, k and v as views of one `[B, S, 3, H, D]`-like
    buffer: the op returns the output and gradients dense, in the dim order of q (no copy before they go back)."""
    b, s, h, d = 1, 6, 2, 4
    buf = torch.randn(b, s, 3, h, d, dtype=torch.float64)
    q, k, v = (buf[:, :, i].transpose(1, 2) for i in range(3))
    dout = torch.randn(b, s, h, d, dtype=torch.float64).transpose(1, 2)
    dense = dense_strides(q)
    assert dense == dout.stride() and dense != q.stride()
    out, lse = ring_attention_op(q, k, v, 0.5, "")
    assert out.stride() == dense
    ref = torch.softmax(q @ k.transpose(-1, -2) * 0.5, -1) @ v
    torch.testing.assert_close(out, ref, rtol=1e-12, atol=1e-12)
    grads = ring_attention_backward_op(dout, q, k, v, out, lse, 0.5, "")
    leaves = [t.detach().clone().requires_grad_(True) for t in (q, k, v)]
    (torch.softmax(leaves[0] @ leaves[1].transpose(-1, -2) * 0.5, -1) @ leaves[2]).backward(dout)
    for g, leaf in zip(grads, leaves):
        assert g.stride() == dense
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


def test_dense_strides_follow_the_order_of_the_strides_without_gaps():
    packed = torch.empty(1, 5, 3, 2, 4)[:, :, 1].transpose(1, 2)  # [B, H, S, D] view with gaps between rows
    assert dense_strides(packed) == (40, 4, 8, 1)
    plain = torch.empty(2, 5, 3, 4)
    assert dense_strides(plain) == plain.stride() and dense_strides(plain.transpose(1, 2)) == (60, 4, 12, 1)
    assert dense_strides(torch.empty(5, 1, 4).expand(5, 3, 4)) == (12, 4, 1)  # broadcast: contiguous
