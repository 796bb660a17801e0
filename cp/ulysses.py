"""Ulysses attention: all-to-all from sequence-sharded to head-sharded, attention over the full
sequence on heads/u heads, all-to-all back. In the hybrid mode the "full" sequence is that of the
Ulysses block, and the inner attention is a ring across the blocks.

Input/output layout `[batch, seq_local, heads, head_dim]`; the inner attention gets
`[batch, heads/u, seq_local * u, head_dim]`, contiguous.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from .comm import all_to_all
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


def ulysses_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    group: dist.ProcessGroup,
    scale: float,
    ring_group: dist.ProcessGroup | None = None,
) -> Tensor:
    """Ulysses over `group`; the inner attention is a ring over `ring_group` (None: local attention)."""
    qkv = _seq_to_heads(torch.stack([q, k, v]), group)
    out = ring_attention(qkv[0], qkv[1], qkv[2], ring_group, scale)
    return _heads_to_seq(out, group)
