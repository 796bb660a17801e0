"""`cp.attention`: exact non-causal attention over a sequence split across a CP process group."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import group_size, hybrid_group_names, hybrid_groups
from .ops import ring_attention_op
from .ring import ring_attention
from .ulysses import ulysses_attention, ulysses_traced

Tensor = torch.Tensor

MODES = ("ring", "ulysses", "hybrid")


def validate(shape: tuple[int, ...], group_size_: int, mode: str, ulysses_size: int | None) -> int | None:
    """Check a CP attention configuration before any communication; returns the Ulysses size used.

    `shape` is `[batch, seq_local, heads, head_dim]`. Raises ValueError naming what to change.
    """
    if mode not in MODES:
        raise ValueError(f"unknown CP mode {mode!r}; choose one of {', '.join(MODES)}")
    if len(shape) != 4:
        raise ValueError(f"CP attention expects [batch, seq, heads, head_dim] tensors, got shape {tuple(shape)}")
    heads = shape[2]
    n = group_size_
    if mode == "ring" or n == 1:
        return None
    if mode == "ulysses":
        if ulysses_size not in (None, n):
            raise ValueError(f"mode 'ulysses' uses the whole CP group: ulysses_size must be None or {n}")
        u = n
    else:
        if ulysses_size is None:
            raise ValueError("mode 'hybrid' needs ulysses_size (the Ulysses degree inside each ring step)")
        u = ulysses_size
        if u < 1 or n % u:
            divisors = [d for d in range(2, n) if n % d == 0]
            raise ValueError(
                f"ulysses_size {u} does not divide the CP group size {n}; choose one of {divisors or 'none'}"
                + ("" if divisors else f" ({n} is prime: use mode 'ring' or 'ulysses')")
            )
    if heads % u:
        raise ValueError(
            f"{heads} attention heads are not divisible by the Ulysses size {u}: Ulysses splits heads "
            f"across ranks. Use mode 'ring', or a Ulysses size that divides {heads}."
        )
    return u


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | None,
    mode: str = "ring",
    ulysses_size: int | None = None,
    scale: float | None = None,
) -> Tensor:
    """Non-causal, unmasked attention of this rank's sequence chunk against the whole sequence.

    `query/key/value`: this rank's contiguous chunk, `[batch, seq_local, heads, head_dim]`. Every rank
    of `group` must hold a chunk of the same length (see `cp.shard`). Returns this rank's output chunk,
    same layout. Gradients w.r.t. the local chunks equal the matching slices of the full gradients.

    torch.compile traces it without a graph break: the exchanges become functional collectives and the
    ring (or the local attention) a custom op (`cp/ops.py`), with the same kernels as in eager mode.
    """
    if query.shape != key.shape or query.shape != value.shape:
        raise ValueError(
            f"query, key and value must have the same shape [batch, seq, heads, head_dim]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    n = group_size(group)
    u = validate(tuple(query.shape), n, mode, ulysses_size)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    if torch.compiler.is_compiling():
        return _traced(query, key, value, group, n, mode, u, scale)
    if n == 1 or mode == "ring":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        return ring_attention(q, k, v, group if n > 1 else None, scale).transpose(1, 2)
    if u == n:
        return ulysses_attention(query, key, value, group, scale)
    u_group, r_group = hybrid_groups(group, u)
    return ulysses_attention(query, key, value, u_group, scale, ring_group=r_group)


def _traced(
    query: Tensor, key: Tensor, value: Tensor, group: dist.ProcessGroup | None, n: int, mode: str, u: int | None,
    scale: float,
) -> Tensor:  # fmt: skip
    """The same computation in ops that torch.compile traces (forward and backward)."""
    if n == 1 or mode == "ring":
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        out, _ = ring_attention_op(q, k, v, scale, group.group_name if n > 1 else "")
        return out.transpose(1, 2)
    if u == n:
        return ulysses_traced(query, key, value, group, u, scale)
    u_name, r_name = hybrid_group_names(group.group_name, u)
    return ulysses_traced(query, key, value, u_name, u, scale, ring_group_name=r_name)
