"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, attention over the full
sequence on heads/u heads, all-to-all back. In the hybrid mode the "full" sequence is that of the
Ulysses block, and the inner attention is a ring across the blocks (`ring_forward` over the ring group; over no
group it is the plain kernel).

Eager (`UlyssesAttention`), the heads can be pipelined in chunks (`Tuning.ulysses_chunks` > 1): the all-to-all
of chunk c+1 (and the return of chunk c-1) then run on the communication stream while chunk c is computed, in
forward and in backward. One chunk is the default (see `_chunks`). On a GPU a chunk's exchange and the previous
chunk's attention kernel become ready at the same moment, and the attention kernel, which takes every SM, would
run first; with `Tuning.exchange_first` the stream yields a moment after each launch and wait of an exchange
(`comm.head_start`) so that the exchange starts first and runs beside it.

Input/output layout `[batch, seq_local, heads, head_dim]`; eager, the attention kernels get
`[batch, heads/u, seq_local * u, head_dim]`, contiguous.

Under torch.compile (`ulysses_traced`) the all-to-alls are functional collectives, which the compiler traces
and schedules, around the `cp::ring_attention` custom op (cp/ring.py), in layouts that need no copy between
exchange and kernel; in several head chunks the chunks form a pipeline in the order the compiler keeps (see the
note above `_sent_first`).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from .comm import head_start
from .mode import CallSpec, Mode
from .ring import ring_backward, ring_forward, ring_op

Tensor = torch.Tensor


# --- eager: pipelined over head chunks --------------------------------------------------------------------------
# Plain Ulysses and the hybrid mode share these buffers (the hybrid's inner attention is the ring). A chunk's q, k
# and v travel in one buffer, `[u, 3, B, h/u, S_l, D]`, and arrive as contiguous `[B, h/u, u*S_l, D]` tensors (one
# copy each way, as every eager kernel takes them). The compiled path's layouts below need no copy on the way in
# because cuDNN reads the transposed view; given to the eager path they would cost a second copy for the kernels that
# take contiguous inputs and for every batch above 1, or hand cuDNN strided inputs in eager mode, which no eager
# measurement covers, so the two keep their own.


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


def _a2a(send: Tensor, group: dist.ProcessGroup, first: bool):
    recv = torch.empty_like(send)
    work = dist.all_to_all_single(recv, send, group=group, async_op=True)
    if first:
        head_start()
    return recv, work


def _wait(work, first: bool) -> None:
    work.wait()
    if first:  # the next chunk's exchange may be ready now too: let it start before the kernel
        head_start()


def used_chunks(heads: int, u: int, requested: int) -> int:
    """Head chunks of the pipeline: the largest count up to `requested` (`Tuning.ulysses_chunks`) whose chunks' heads
    divide over the group of `u` (at most `heads` counts are tried, whatever is requested). The default is 1: on
    H200s the eager pipeline's 2 chunks gained 2% at 16,896 tokens on 2 GPUs and lost 2-15% elsewhere, and compiled
    chunks before `ulysses_traced` became a pipeline lost 1% (docs/benchmarks.md); the pipeline is not measured on
    two GPUs yet (its kernels alone cost 0.7% more in 2 or 4 chunks at 16,896 tokens on one H200)."""
    fits = [c for c in range(1, min(max(1, requested), heads) + 1) if heads % c == 0 and (heads // c) % u == 0]
    return max(fits, default=1)


_chunks = used_chunks


class UlyssesAttention(torch.autograd.Function):
    """Ulysses over the spec's Ulysses group, the attention of each head chunk a ring over its ring group (none: the
    kernel alone)."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        group, first = spec.ulysses_group(), spec.exchange_first
        u = dist.get_world_size(group)
        h = q.shape[2]
        c = _chunks(h, u, spec.chunks)
        hc = h // c
        heads = [slice(i * hc, (i + 1) * hc) for i in range(c)]
        out = torch.empty_like(q, memory_format=torch.contiguous_format)
        pending_in = _a2a(_send_buffer([t[:, :, heads[0]] for t in (q, k, v)], u), group, first)
        pending_out = []
        saved = []
        for i in range(c):
            recv, work = pending_in
            if i + 1 < c:  # next chunk's exchange runs while this chunk is computed
                pending_in = _a2a(_send_buffer([t[:, :, heads[i + 1]] for t in (q, k, v)], u), group, first)
            _wait(work, first)
            qh, kh, vh = _recv_to_heads(recv)
            o, lse, kernel, aux = ring_forward(qh, kh, vh, spec)
            saved += [qh, kh, vh, o, lse]
            ctx.kernel, ctx.aux = kernel, aux
            pending_out.append((_a2a(_heads_send_buffer([o], u), group, first), heads[i]))
        for (recv, work), hs in pending_out:
            work.wait()
            _recv_to_seq(recv, [out], hs)
        ctx.save_for_backward(*saved)
        ctx.spec, ctx.group, ctx.heads, ctx.u = spec, group, heads, u
        return out

    @staticmethod
    def backward(ctx, dout: Tensor):
        u, heads, group, first = ctx.u, ctx.heads, ctx.group, ctx.spec.exchange_first
        saved = ctx.saved_tensors
        dq, dk, dv = (torch.empty(dout.shape, dtype=dout.dtype, device=dout.device) for _ in range(3))
        pending_in = _a2a(_send_buffer([dout[:, :, heads[0]]], u), group, first)
        pending_out = []
        for i in range(len(heads)):
            recv, work = pending_in
            if i + 1 < len(heads):
                pending_in = _a2a(_send_buffer([dout[:, :, heads[i + 1]]], u), group, first)
            _wait(work, first)
            (doh,) = _recv_to_heads(recv)
            qh, kh, vh, o, lse = saved[5 * i : 5 * i + 5]
            grads = ring_backward(doh, qh, kh, vh, o, lse, ctx.spec, ctx.kernel, ctx.aux)
            sent = _heads_send_buffer([g.to(dout.dtype) for g in grads], u)
            pending_out.append((_a2a(sent, group, first), heads[i]))
        for (recv, work), hs in pending_out:
            work.wait()
            _recv_to_seq(recv, [dq, dk, dv], hs)
        return dq, dk, dv, None


def ulysses_attention(q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
    """Ulysses over the spec's Ulysses group in its head chunks (`Tuning.ulysses_chunks`); the inner attention is a
    ring over its ring group (the hybrid mode) or, with none, the kernel alone."""
    return UlyssesAttention.apply(q, k, v, spec)


# --- traced by torch.compile -----------------------------------------------------------------------------
# Layouts are chosen so that nothing is copied between the exchanges and the attention kernel: a tensor is
# sent as `[u, B, S_l, h, D]` (destination rank first), so what arrives is `[B, u*S_l, h, D]` memory, the whole
# sequence for h heads, which the attention op reads as a transposed view (for batch 1; a larger batch costs a
# copy). Its output comes back in the same layout and goes out again without a copy.
#
# With c > 1 head chunks (`Tuning.ulysses_chunks`) the chunks form a pipeline. Inductor issues the collectives in
# program order, each after the previous one's wait, so an exchange can only run beside compute that is issued
# between its launch and its wait. Hence the order written here: the first chunk's q, k and v (each as soon as it
# exists), then the q, k and v of all other chunks as one exchange (beside the first chunk's attention), then each
# chunk's attention and the return of its output (beside the next chunk's attention). The backward mirrors it:
# each chunk's output gradient comes in beside the attention backward of the chunk after it, the gradients of the
# other chunks' q, k, v go back together beside the first chunk's attention backward. Exposed: the first chunk's
# q, k, v and the last chunk's output, 1/c of the exchanges each way, where one chunk exposes all of them.
# The joint exchange interleaves q, k and v (`[u, B, S_l, c-1, 3, h, D]`): each is a view with gaps between its
# rows, which cuDNN reads as it is (benchmarks/archive/probe_layouts.py, "packed").


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


def ulysses_traced(q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
    """Ulysses for torch.compile, over the spec's Ulysses group (by name; `spec.ulysses_size` its size): each of q, k,
    v is exchanged as soon as it is given (so the exchange of q can run while k and v are produced, if the caller
    produces them after), attention runs on heads/u heads (a ring over the spec's ring group in the hybrid mode), and
    the output goes back; in the spec's head chunks, pipelined as described above. The spec's exchange_first applies
    to the ring's transfers (in compiled blocks the exchanges' head starts are added by a pass, cp/schedule.py).
    Autograd: each all-to-all's backward is the inverse all-to-all."""
    group, u = spec.ulysses_group_name, spec.ulysses_size
    b, s, h, d = q.shape
    c = _chunks(h, u, spec.chunks)
    received = [[funcol.all_to_all_single_autograd(_sent_first(t, u, c), None, None, group) for t in (q, k, v)]]
    if c > 1:
        rest = funcol.all_to_all_single_autograd(_sent_rest([q, k, v], u, c), None, None, group)
        received += [[rest[:, :, :, i, j] for j in range(3)] for i in range(c - 1)]
    back = []
    for qkv in received:
        qh, kh, vh = (_received_as_heads(x) for x in qkv)
        out, _ = ring_op(qh, kh, vh, spec)
        back.append(funcol.all_to_all_single_autograd(_heads_to_send(out, u), None, None, group))
    # [c, u, B, S_l, H/(c u), D] -> [B, S_l, H, D]: head (i, j, m) is head (i u + j) H/(c u) + m
    return torch.stack(back).permute(2, 3, 0, 1, 4, 5).reshape(b, s, h, d)


# --- the mode ------------------------------------------------------------------------------------------------------


def check_heads(heads: int, degree: int | None) -> None:
    """Ulysses splits the heads over its group: a ValueError when `degree` does not divide them."""
    if degree is not None and heads % degree:
        raise ValueError(
            f"{heads} attention heads are not divisible by the Ulysses size {degree}: Ulysses splits heads "
            f"across ranks. Use mode 'ring', or a Ulysses size that divides {heads}."
        )


# What a compiled, checkpointed block keeps of an attention through Ulysses: the exchanged q, k, v, the attention's
# output (the ring's op, over no group or the hybrid mode's ring group) and its exchange back.
SAVED_OPS = (
    torch.ops.cp.ring_attention.default,
    torch.ops._c10d_functional.all_to_all_single.default,
    torch.ops._c10d_functional_autograd.all_to_all_single.default,
    torch.ops._c10d_functional.wait_tensor.default,
)


class Ulysses(Mode):
    """All-to-all from sequence-sharded to head-sharded over the whole CP group, full-sequence attention on
    heads/size heads, all-to-all back: the heads must divide over the group."""

    name = "ulysses"
    summary = "all-to-all over heads"
    # First for `auto`, wherever the heads divide over the group: fewer, larger messages. Compiled, on 2 H200s, its
    # attention beat the ring's at 16,896 and 66,048 tokens on three machines (12.36 / 173.3 against 13.62 / 180.8 ms
    # on the latest; 12.07 / 173.8 against 13.71 / 180.2 ms; 12.25 / 174.1 against 13.59 / 181.5 ms before the
    # exchanges moved to the kernel's layout). Eager, it matched or beat the ring at every size (LoRA step at
    # 2048 px: 1.98 against 2.21 s; at 1024 px: 0.87 against 0.99 s; attention at 16,896 / 66,048 tokens: 12.9 / 176
    # against 14.1 / 183 ms); on 4, at every size too (attention 3.09 / 6.86 / 90.2 ms against the ring's 6.52 /
    # 10.5 / 95.6 ms at 4,608 / 16,896 / 66,048 tokens). One earlier run on 4 H200s had the ring ahead at 1024 px on
    # 2 of them (0.815 against 0.893 s); the next did not reproduce it, so no exception is made for short sequences
    # (benchmarks/archive/history.md).
    auto_rank = 0
    exchanges_kept = True
    saved_ops = SAVED_OPS

    def degree(self, size: int, ulysses_size: int | None) -> int:
        if ulysses_size not in (None, size):
            raise ValueError(f"mode 'ulysses' uses the whole CP group: ulysses_size must be None or {size}")
        return size

    def check_heads(self, heads: int, degree: int | None) -> None:
        check_heads(heads, degree)

    def auto(self, heads: int, size: int) -> tuple[str, int | None] | None:
        return (self.name, None) if heads % size == 0 else None

    def groups(self, group, degree, timeout, cp_groups):
        return group, None

    def attention(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        return ulysses_attention(q, k, v, spec)

    def traced(self, q: Tensor, k: Tensor, v: Tensor, spec: CallSpec) -> Tensor:
        return ulysses_traced(q, k, v, spec)


ULYSSES = Ulysses()
