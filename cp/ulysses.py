"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, attention over the full
sequence on heads/u heads, all-to-all back. In the hybrid mode the "full" sequence is that of the
Ulysses block, and the inner attention is a ring across the blocks.

Plain Ulysses can be pipelined over head chunks (FLUX_CP_ULYSSES_CHUNKS > 1): the all-to-all of chunk c+1
(and the return of chunk c-1) then run on the communication stream while chunk c is computed, in forward
and in backward. One chunk is the default (see `_chunks`). On a GPU a chunk's exchange and the previous
chunk's attention kernel become ready at the same moment, and the attention kernel, which takes every SM,
would run first; with FLUX_CP_EXCHANGE_FIRST=1 the stream yields a moment after each launch and wait of an
exchange (`comm.head_start`) so that the exchange starts first and runs beside it.

Input/output layout `[batch, seq_local, heads, head_dim]`; the attention kernels get
`[batch, heads/u, seq_local * u, head_dim]`, contiguous.

Under torch.compile (`ulysses_traced`) the all-to-alls are functional collectives, which the compiler traces
and schedules, around the `flux_cp::ring_attention` custom op (cp/ops.py), in layouts that need no copy
between exchange and kernel; with FLUX_CP_ULYSSES_CHUNKS the chunks form a pipeline in the order the compiler
keeps (see the note above `_sent_first`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from . import kernels
from .comm import all_to_all, exchange_first, head_start
from .ring import ring_attention

Tensor = torch.Tensor


def _seq_to_heads(qkv: Tensor, group: dist.ProcessGroup) -> Tensor:
    """`[3, B, S_l, H, D]` sequence chunk -> `[3, B, H/u, u*S_l, D]` head group of the whole sequence."""
    u = dist.get_world_size(group)
    three, b, s, h, d = qkv.shape
    # Chunk j (heads j*H/u ... ) goes to rank j; what arrives from rank i is sequence chunk i.
    x = qkv.view(three, b, s, u, h // u, d).permute(3, 0, 1, 4, 2, 5)  # [u, 3, B, H/u, S_l, D]
    x = all_to_all(x.contiguous(), group)
    return x.permute(1, 2, 3, 0, 4, 5).reshape(three, b, h // u, u * s, d)


def _heads_to_seq(out: Tensor, group: dist.ProcessGroup) -> Tensor:
    """`[B, H/u, u*S_l, D]` -> `[B, S_l, H, D]`, the inverse of `_seq_to_heads` for one tensor."""
    u = dist.get_world_size(group)
    b, hu, s_full, d = out.shape
    s = s_full // u
    x = out.view(b, hu, u, s, d).permute(2, 0, 3, 1, 4)  # [u, B, S_l, H/u, D]: chunk j -> rank j
    x = all_to_all(x.contiguous(), group)  # [u (head group of rank i), B, S_l, H/u, D]
    return x.permute(1, 2, 0, 3, 4).reshape(b, s, u * hu, d)


# --- pipelined plain Ulysses -------------------------------------------------------------------------


def _send_buffer(ts: list[Tensor], u: int) -> Tensor:
    """Sequence-sharded `[B, S_l, h, D]` tensors -> a2a send buffer `[u, len(ts), B, h/u, S_l, D]`."""
    b, s, h, d = ts[0].shape
    buf = torch.empty((u, len(ts), b, h // u, s, d), dtype=ts[0].dtype, device=ts[0].device)
    for j, t in enumerate(ts):
        buf[:, j].copy_(t.reshape(b, s, u, h // u, d).permute(2, 0, 3, 1, 4))
    return buf


def _recv_to_heads(buf: Tensor) -> list[Tensor]:
    """a2a receive buffer `[u, n, B, h/u, S_l, D]` -> n head-sharded `[B, h/u, u*S_l, D]` tensors."""
    u, n, b, hu, s, d = buf.shape
    return [buf[:, j].permute(1, 2, 0, 3, 4).reshape(b, hu, u * s, d) for j in range(n)]


def _heads_send_buffer(ts: list[Tensor], u: int) -> Tensor:
    """Head-sharded `[B, h/u, u*S_l, D]` tensors -> a2a send buffer `[u, n, B, S_l, h/u, D]`."""
    b, hu, s_full, d = ts[0].shape
    s = s_full // u
    buf = torch.empty((u, len(ts), b, s, hu, d), dtype=ts[0].dtype, device=ts[0].device)
    for j, t in enumerate(ts):
        buf[:, j].copy_(t.view(b, hu, u, s, d).permute(2, 0, 3, 1, 4))
    return buf


def _recv_to_seq(buf: Tensor, out: list[Tensor], heads: slice) -> None:
    """a2a receive buffer `[u, n, B, S_l, h/u, D]` -> write into `out[j][:, :, heads]` (`[B, S_l, H, D]`)."""
    u, n, b, s, hu, d = buf.shape
    for j in range(n):
        out[j][:, :, heads].copy_(buf[:, j].permute(1, 2, 0, 3, 4).reshape(b, s, u * hu, d))


def _a2a(send: Tensor, group: dist.ProcessGroup):
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    if exchange_first():
        head_start()
    return recv, work


def _wait(work) -> None:
    work.wait()
    if exchange_first():  # the next chunk's exchange may be ready now too: let it start before the kernel
        head_start()


def _chunks(heads: int, u: int) -> int:
    """Head chunks of the pipeline: FLUX_CP_ULYSSES_CHUNKS, reduced until each chunk's heads divide over the
    group. Default 1: on H200s the eager pipeline's 2 chunks gained 2% at 16,896 tokens on 2 GPUs and lost 2-15%
    elsewhere, and compiled chunks before `ulysses_traced` became a pipeline lost 1% (docs/benchmarks.md); the
    pipeline is not measured on two GPUs yet (its kernels alone cost 0.7% more in 2 or 4 chunks at 16,896 tokens
    on one H200)."""
    c = max(1, int(os.environ.get("FLUX_CP_ULYSSES_CHUNKS", "1")))
    while c > 1 and (heads % c or (heads // c) % u):
        c -= 1
    return c


class UlyssesAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, group: dist.ProcessGroup) -> Tensor:
        u = dist.get_world_size(group)
        h = q.shape[2]
        c = _chunks(h, u)
        hc = h // c
        heads = [slice(i * hc, (i + 1) * hc) for i in range(c)]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        pending_in = _a2a(_send_buffer([t[:, :, heads[0]] for t in (q, k, v)], u), group)
        pending_out = []
        saved = []
        for i in range(c):
            recv, work = pending_in
            if i + 1 < c:  # next chunk's exchange runs while this chunk is computed
                pending_in = _a2a(_send_buffer([t[:, :, heads[i + 1]] for t in (q, k, v)], u), group)
            _wait(work)
            qh, kh, vh = _recv_to_heads(recv)
            o, lse, kernel, aux = kernels.forward(qh, kh, vh, scale)
            o = o.to(q.dtype)
            saved += [qh, kh, vh, o, lse]
            ctx.kernel, ctx.aux = kernel, aux
            pending_out.append((_a2a(_heads_send_buffer([o], u), group), heads[i]))
        for (recv, work), hs in pending_out:
            work.wait()
            _recv_to_seq(recv, [out], hs)
        ctx.save_for_backward(*saved)
        ctx.scale, ctx.group, ctx.heads, ctx.u = scale, group, heads, u
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        u, heads, group = ctx.u, ctx.heads, ctx.group
        saved = ctx.saved_tensors
        dq, dk, dv = (torch.empty(dout.shape, dtype=dout.dtype, device=dout.device) for _ in range(3))
        pending_in = _a2a(_send_buffer([dout[:, :, heads[0]]], u), group)
        pending_out = []
        for i in range(len(heads)):
            recv, work = pending_in
            if i + 1 < len(heads):
                pending_in = _a2a(_send_buffer([dout[:, :, heads[i + 1]]], u), group)
            _wait(work)
            (doh,) = _recv_to_heads(recv)
            qh, kh, vh, o, lse = saved[5 * i : 5 * i + 5]
            grads = kernels.backward(ctx.kernel, doh, qh, kh, vh, o, lse, ctx.scale, ctx.aux)
            pending_out.append((_a2a(_heads_send_buffer([g.to(dout.dtype) for g in grads], u), group), heads[i]))
        for (recv, work), hs in pending_out:
            work.wait()
            _recv_to_seq(recv, [dq, dk, dv], hs)
        return dq, dk, dv, None, None


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    scale: float,
    ring_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Ulysses over `group`; the inner attention is a ring over `ring_group` (None: local attention,
    pipelined over head chunks)."""
    if ring_group is None:
        return UlyssesAttention.apply(q, k, v, scale, group)
    qkv = _seq_to_heads(torch.stack([q, k, v]), group)
    out = ring_attention(qkv[0], qkv[1], qkv[2], ring_group, scale)
    return _heads_to_seq(out, group)


# --- traced by torch.compile -----------------------------------------------------------------------------
# Layouts are chosen so that nothing is copied between the exchanges and the attention kernel: a tensor is
# sent as `[u, B, S_l, h, D]` (destination rank first), so what arrives is `[B, u*S_l, h, D]` memory, the whole
# sequence for h heads, which the attention op reads as a transposed view (for batch 1; a larger batch costs a
# copy). Its output comes back in the same layout and goes out again without a copy.
#
# With c > 1 head chunks (FLUX_CP_ULYSSES_CHUNKS) the chunks form a pipeline. Inductor issues the collectives in
# program order, each after the previous one's wait, so an exchange can only run beside compute that is issued
# between its launch and its wait. Hence the order written here: the first chunk's q, k and v (each as soon as it
# exists), then the q, k and v of all other chunks as one exchange (beside the first chunk's attention), then each
# chunk's attention and the return of its output (beside the next chunk's attention). The backward mirrors it:
# each chunk's output gradient comes in beside the attention backward of the chunk after it, the gradients of the
# other chunks' q, k, v go back together beside the first chunk's attention backward. Exposed: the first chunk's
# q, k, v and the last chunk's output, 1/c of the exchanges each way, where one chunk exposes all of them.
# The joint exchange interleaves q, k and v (`[u, B, S_l, c-1, 3, h, D]`): each is a view with gaps between its
# rows, which cuDNN reads as it is (benchmarks/probe_layouts.py, "packed").


def _by_chunk(t: Tensor, u: int, c: int) -> Tensor:
    """`[B, S_l, H, D]` -> `[B, S_l, c, u, H/(c u), D]` (a view): head (i u + j) H/(c u) + m is chunk i's share of
    rank j."""
    b, s, h, d = t.shape
    return t.reshape(b, s, c, u, h // (c * u), d)


def _sent_first(t: Tensor, u: int, c: int) -> Tensor:
    """`[B, S_l, H, D]` -> `[u, B, S_l, H/(c u), D]`: the first head chunk, what goes to each rank."""
    return _by_chunk(t, u, c)[:, :, 0].permute(2, 0, 1, 3, 4).contiguous()


def _sent_rest(qkv: list[Tensor], u: int, c: int) -> Tensor:
    """q, k, v `[B, S_l, H, D]` -> `[u, B, S_l, c-1, 3, H/(c u), D]`: head chunks 1.. of all three, what goes to
    each rank, in one buffer."""
    x = torch.stack([_by_chunk(t, u, c)[:, :, 1:] for t in qkv], dim=4)  # [B, S_l, c-1, u, 3, H/(c u), D]
    return x.permute(3, 0, 1, 2, 4, 5, 6).contiguous()


def _received_as_heads(x: Tensor) -> Tensor:
    """An all-to-all's `[u, B, S_l, h, D]` (sequence chunk i from rank i) -> `[B, h, u*S_l, D]`, a view."""
    u, b, s, h, d = x.shape
    return x.transpose(0, 1).reshape(b, u * s, h, d).transpose(1, 2)


def _heads_to_send(o: Tensor, u: int) -> Tensor:
    """`[B, h, u*S_l, D]` attention output -> `[u, B, S_l, h, D]`, sequence chunk j for rank j."""
    b, h, s_full, d = o.shape
    return o.transpose(1, 2).reshape(b, u, s_full // u, h, d).transpose(0, 1).contiguous()


class _ExchangeQKV(torch.autograd.Function):
    """q, k and v go out as three all-to-alls (each can leave as soon as it is made, while the next is computed);
    their gradients come back as one. Inductor orders collectives one after another, each after the previous
    one's wait, so three gradient exchanges in a row run back to back with nothing beside the first two; one
    exchange can run beside the compute of the backward that does not need it (FLUX_CP_GRAD_EXCHANGE=joint)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, group_name: str) -> tuple[Tensor, Tensor, Tensor]:
        ctx.group_name = group_name
        return tuple(funcol.all_to_all_single(t, None, None, group_name) for t in (q, k, v))

    @staticmethod
    def backward(ctx, dq: Tensor, dk: Tensor, dv: Tensor):
        grads = torch.stack([dq, dk, dv], dim=1)  # [u, 3, ...]: the destination rank stays the leading dim
        back = funcol.all_to_all_single(grads, None, None, ctx.group_name)
        return back[:, 0], back[:, 1], back[:, 2], None


def _exchange(sent: list[Tensor], group: dist.ProcessGroup | str) -> list[Tensor]:
    """The all-to-alls of q, k, v (`[u, B, S_l, h, D]` each) with autograd."""
    how = os.environ.get("FLUX_CP_GRAD_EXCHANGE", "separate")
    if how not in ("separate", "joint"):
        raise ValueError(f"FLUX_CP_GRAD_EXCHANGE={how!r}: choose separate or joint")
    if how == "joint":
        name = group if isinstance(group, str) else group.group_name
        return list(_ExchangeQKV.apply(*sent, name))
    return [funcol.all_to_all_single_autograd(x, None, None, group) for x in sent]


def ulysses_traced(
    q: Tensor, k: Tensor, v: Tensor, group: dist.ProcessGroup | str, u: int, scale: float, ring_group_name: str = ""
) -> Tensor:
    """Ulysses for torch.compile, over `group` (a group or its name; `u` its size): each of q, k, v is exchanged
    as soon as it is given (so the exchange of q can run while k and v are produced, if the caller produces
    them after), attention runs on heads/u heads (a ring over `ring_group_name` in the hybrid mode), and the
    output goes back; in c > 1 head chunks, pipelined as described above. Autograd: each all-to-all's backward is
    the inverse all-to-all."""
    from .ops import ring_attention_op

    b, s, h, d = q.shape
    c = _chunks(h, u)
    received = [_exchange([_sent_first(t, u, c) for t in (q, k, v)], group)]
    if c > 1:
        rest = funcol.all_to_all_single_autograd(_sent_rest([q, k, v], u, c), None, None, group)
        received += [[rest[:, :, :, i, j] for j in range(3)] for i in range(c - 1)]
    back = []
    for qkv in received:
        qh, kh, vh = (_received_as_heads(x) for x in qkv)
        out, _ = ring_attention_op(qh, kh, vh, scale, ring_group_name)
        back.append(funcol.all_to_all_single_autograd(_heads_to_send(out, u), None, None, group))
    # [c, u, B, S_l, H/(c u), D] -> [B, S_l, H, D]: head (i, j, m) is head (i u + j) H/(c u) + m
    return torch.stack(back).permute(2, 3, 0, 1, 4, 5).reshape(b, s, h, d)
