"""Ring attention: K/V blocks travel around the CP group while each rank attends to them in turn.

Forward, on rank r of n: at step i it holds the K/V block of rank r-i; the block for step i+1 is
already in flight (async send to r+1, recv from r-1) while step i is computed. Partial outputs are
merged with their log-sum-exp in fp32 (fp64 for fp64 inputs).

Backward: the same K/V rotation again, plus a dK/dV accumulator that travels with each block: rank
r adds its contribution for the block it holds and passes the sum on to r+1. After n steps the
accumulator for rank s's block has visited every rank and arrives back at s. dQ stays local.
The accumulator's send overlaps the next block's backward computation.

Compiled, torch.compile traces it through two custom ops (`ring_op`, below), which run the same code: dynamo and
AOTAutograd see one op for the forward and one for the backward (real kernels plus fake kernels that give shapes), so
a compiled block keeps one graph across its attention. The Ulysses and hybrid modes run their attention through the
same functions and ops (over no ring group, or the hybrid mode's ring group).

Tensors here are `[batch, heads, seq, head_dim]`, contiguous (the custom ops also take other layouts, below).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import kernels
from .comm import RingComm, group_size
from .kernels import KernelChoice, acc_dtype, dense_like, in_layout_of
from .mode import CallSpec, Mode

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
    group, choice, scale = spec.ring_group(), KernelChoice.from_key(spec.kernels), spec.scale
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


def ring_backward(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    spec: CallSpec,
    kernel: kernels.Kernel,
    aux: tuple,
) -> tuple[Tensor, Tensor, Tensor]:
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


# --- traced by torch.compile: the ring as custom ops ---------------------------------------------------------------
# The ops run the same ring code as the eager autograd Function above; the process group and the context's kernels
# travel by name, as the compiler needs plain arguments.
#
# `cp::ring_attention(q, k, v, scale, group_name, kernels, exchange_first) -> (out, lse)`: ring attention of
# `[B, H, S, D]` chunks over the named group ("" for none: plain attention on one rank), with the kernels of the
# order `kernels` (`KernelChoice.key`: names joined by commas, "" for the device's default) and
# `Tuning.exchange_first`; `lse` is the merged log-sum-exp, kept for the backward.
# `cp::ring_attention_backward(...) -> (dq, dk, dv)`: its gradients.
#
# Layouts: `out` has the strides of `q`, and each gradient those of its input. Without a ring (group ""), q, k and
# v may be transposed views of `[B, S, H, D]` memory, the layout in which an all-to-all of sequence chunks
# delivers them: cuDNN reads and writes that layout directly (forward and backward, checked on H200s by
# benchmarks/archive/probe_layouts.py), so no copy is made on either side of the exchange. Inductor must hand the ops
# exactly the strides it traced (`needs_exact_strides`), since the fake kernels derive the output strides from them.


def ring_op(q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> tuple[Tensor, Tensor]:
    """`cp::ring_attention` of a call's spec: its ring group, kernels and exchange_first, unpacked here alone."""
    return ring_attention_op(q, k, v, *_plain(spec))


def _plain(spec: CallSpec) -> tuple:
    return spec.scale, spec.ring_group_name, spec.kernels, spec.exchange_first


def _spec(scale: float, group_name: str, kernels: str = "", exchange_first: bool = False) -> CallSpec:
    """The ops' plain arguments as the ring's spec (no Ulysses: the ops run the ring, or the kernel alone)."""
    return CallSpec(scale, ring_group_name=group_name, kernels=kernels, exchange_first=exchange_first)


_EXACT_STRIDES = tuple(t for t in (getattr(torch._C.Tag, "needs_exact_strides", None),) if t is not None)


@torch.library.custom_op("cp::ring_attention", mutates_args=(), tags=_EXACT_STRIDES)
def ring_attention_op(
    q: Tensor, k: Tensor, v: Tensor, scale: float, group_name: str, kernels: str = "", exchange_first: bool = False
) -> tuple[Tensor, Tensor]:
    q0 = q
    if group_name:  # the ring sends whole contiguous blocks
        q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse, _, _ = ring_forward(q, k, v, _spec(scale, group_name, kernels, exchange_first))
    return in_layout_of(out, q0), lse.contiguous()


@ring_attention_op.register_fake
def _(q: Tensor, *_plain_args) -> tuple[Tensor, Tensor]:
    return dense_like(q), q.new_empty(q.shape[:3], dtype=acc_dtype(q.dtype))


@torch.library.custom_op("cp::ring_attention_backward", mutates_args=(), tags=_EXACT_STRIDES)
def ring_attention_backward_op(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    scale: float,
    group_name: str,
    kernels: str = "",
    exchange_first: bool = False,
) -> tuple[Tensor, Tensor, Tensor]:
    spec = _spec(scale, group_name, kernels, exchange_first)
    inputs = (q, k, v)
    if group_name:
        q, k, v, out, dout = (t.contiguous() for t in (q, k, v, out, dout))
    kernel, aux = KernelChoice.from_key(spec.kernels).used_for(q, k)
    grads = ring_backward(dout, q, k, v, out, lse, spec, kernel, aux)
    # Outputs of a custom op may not share memory (the ring returns dk and dv as views of one buffer).
    seen: set[int] = set()
    result = []
    for g, like in zip(grads, inputs):
        g = in_layout_of(g, like)
        ptr = g.untyped_storage().data_ptr()
        result.append(g.clone() if ptr in seen else g)
        seen.add(ptr)
    return tuple(result)


@ring_attention_backward_op.register_fake
def _(dout: Tensor, q: Tensor, k: Tensor, v: Tensor, *_rest) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(dense_like(t) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, *plain = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.spec = _spec(*plain)
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    # cuDNN's backward reads grad_out in the output's layout (another layout can fault on torch 2.11); a copy
    # made here, where one is needed, is one the compiler can fuse.
    dq, dk, dv = ring_attention_backward_op(in_layout_of(dout, out), q, k, v, out, lse, *_plain(ctx.spec))
    return dq, dk, dv, None, None, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


# --- the mode ------------------------------------------------------------------------------------------------------


def _heads_first(q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(t.transpose(1, 2).contiguous() for t in (q, k, v))


class Ring(Mode):
    """K/V blocks travel around the whole CP group (its ring group): any group size, any head count."""

    name = "ring"
    summary = "K/V blocks passed around the group"
    # Last for `auto`: it serves every group size and head count, but Ulysses matched or beat it at every sequence
    # length on 2 and 4 H200s (cp/ulysses.py), and the hybrid mode sat between the two on 4.
    auto_rank = 2
    saved_ops = (torch.ops.cp.ring_attention.default,)

    def auto(self, heads: int, size: int) -> tuple[str, int | None]:
        return self.name, None

    def groups(self, group, degree, timeout, cp_groups):
        return None, group

    def attention(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        return ring_attention(*_heads_first(q, k, v), spec).transpose(1, 2)

    def traced(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        out, _ = ring_op(*_heads_first(q, k, v), spec)
        return out.transpose(1, 2)


RING = Ring()
