"""Ring attention: K/V blocks travel around the CP group while each rank attends to them in turn.

Forward, on rank r of n: at step i it holds the K/V block of rank r-i; the block for step i+1 is
already in flight (async send to r+1, recv from r-1) while step i is computed. Partial outputs are
merged with their log-sum-exp in fp32 (fp64 for fp64 inputs).

Backward: the same K/V rotation again, plus a dK/dV accumulator that travels with each block: rank
r adds its contribution for the block it holds and passes the sum on to r+1. After n steps the
accumulator for rank s's block has visited every rank and arrives back at s. dQ stays local.
The accumulator's send overlaps the next block's backward computation.

Tensors here are `[batch, heads, seq, head_dim]`, contiguous.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .comm import RingComm, group_size
from .context import CallSpec

Tensor = torch.Tensor

_KV_TAG, _DKV_TAG = 0, 1


def _merge(out: Tensor | None, lse: Tensor | None, blk_out: Tensor, blk_lse: Tensor) -> tuple[Tensor, Tensor]:
    """Merge a block's (out, lse) into the running (out, lse). The first block is kept as the kernel gave
    it (no copy when there is only one); merged results are in the LSE's dtype (fp32, or fp64).
    out' = out - w (out - blk) with w = sigmoid(lse_blk - lse), lse' = lse - logsigmoid(lse - lse_blk)."""
    if out is None:
        return blk_out, blk_lse
    w = torch.sigmoid(blk_lse - lse).unsqueeze(-1)
    out = out.to(blk_lse.dtype)
    out = out - w * (out - blk_out.to(blk_lse.dtype))
    return out, lse - F.logsigmoid(lse - blk_lse)


def ring_forward(q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> tuple[Tensor, Tensor, kernels.Kernel, tuple]:
    """(out, merged LSE, kernel, aux): the forward of ring attention over the spec's ring group (none: the kernel
    alone), shared by the eager autograd Function and the compiled path's custom op."""
    group, choice, scale = spec.ring_group(), spec.kernel_choice(), spec.scale
    n = group_size(group)
    ring = RingComm(group, spec.exchange_first) if n > 1 else None
    kv = torch.stack([k, v]) if n > 1 else None
    out = lse = None
    kernel = aux = None
    blk_k, blk_v = k, v
    for step in range(n):
        if step < n - 1:
            next_kv, works = ring.start(kv, _KV_TAG)
        blk_out, blk_lse, kernel, aux = choice.forward(q, blk_k, blk_v, scale)
        out, lse = _merge(out, lse, blk_out, blk_lse)
        if step < n - 1:
            ring.wait(works)
            kv = next_kv
            blk_k, blk_v = kv[0], kv[1]
    return out.to(q.dtype), lse, kernel, aux


def ring_backward(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, spec: CallSpec,
                  kernel: kernels.Kernel, aux: tuple) -> tuple[Tensor, Tensor, Tensor]:  # fmt: skip
    """(dq, dk, dv) of ring attention given the forward's output and merged LSE; `kernel`, `aux`: the forward's."""
    group, scale = spec.ring_group(), spec.scale
    n = group_size(group)
    if n == 1:  # the kernel takes the layouts it is given (see kernels.backward)
        return kernels.backward(kernel, dout, q, k, v, out, lse, scale, aux)
    dout = dout.contiguous()

    ring = RingComm(group, spec.exchange_first)
    acc = kernels.acc_dtype(q.dtype)
    kv = torch.stack([k, v])
    dq = torch.zeros_like(q, dtype=acc)
    dkv_in = dkv_works = None
    for step in range(n):
        if step < n - 1:
            next_kv, kv_works = ring.start(kv, _KV_TAG)
        blk_dq, blk_dk, blk_dv = kernels.backward(kernel, dout, q, kv[0], kv[1], out, lse, scale, aux)
        dq += blk_dq
        blk_dkv = torch.stack([blk_dk, blk_dv]).to(acc)
        if dkv_in is None:
            dkv = blk_dkv
        else:
            ring.wait(dkv_works)
            dkv = dkv_in + blk_dkv
        # Pass the accumulator for the block we hold to the next rank; after the last step it
        # arrives at its owner, complete, and the owner only rounds it to k's dtype: rounding before
        # the last hop gives the same result and halves the one transfer nothing can hide (bf16).
        last = step == n - 1
        dkv_in, dkv_works = ring.start(dkv.to(k.dtype) if last else dkv, _DKV_TAG)
        if step < n - 1:
            ring.wait(kv_works)
            kv = next_kv
    ring.wait(dkv_works)
    return dq.to(q.dtype), dkv_in[0].to(k.dtype), dkv_in[1].to(v.dtype)


class RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        out, lse, kernel, aux = ring_forward(q, k, v, spec)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.spec, ctx.kernel, ctx.aux = spec, kernel, aux
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        return *ring_backward(dout, q, k, v, out, lse, ctx.spec, ctx.kernel, ctx.aux), None


def ring_attention(q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
    """Ring attention on `[B, H, S_local, D]` contiguous chunks over the spec's ring group (none, or one rank:
    plain attention)."""
    return RingAttention.apply(q, k, v, spec)
