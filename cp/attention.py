"""`cp.attention`: exact non-causal attention over a sequence split across a CP process group."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import group_size
from .context import MODES, CallSpec, CPContext, ulysses_degree
from .ops import ring_op
from .ring import ring_attention
from .ulysses import ulysses_attention, ulysses_traced

Tensor = torch.Tensor

__all__ = ["MODES", "attention", "validate"]


def validate(shape: tuple[int, ...], group_size_: int, mode: str, ulysses_size: int | None) -> int | None:
    """Check a CP attention configuration before any communication; returns the Ulysses size used.

    `shape` is `[batch, seq_local, heads, head_dim]`. Raises ValueError naming what to change.
    """
    if mode not in MODES:
        raise ValueError(f"unknown CP mode {mode!r}; choose one of {', '.join(MODES)}")
    if len(shape) != 4:
        raise ValueError(f"CP attention expects [batch, seq, heads, head_dim] tensors, got shape {tuple(shape)}")
    u = ulysses_degree(group_size_, mode, ulysses_size)
    heads = shape[2]
    if u is not None and heads % u:
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
    group: dist.ProcessGroup | None = None,
    mode: str = "ring",
    ulysses_size: int | None = None,
    scale: float | None = None,
    context: CPContext | None = None,
) -> Tensor:
    """Non-causal, unmasked attention of this rank's sequence chunk against the whole sequence.

    `query/key/value`: this rank's contiguous chunk, `[batch, seq_local, heads, head_dim]`. Every rank
    of the group must hold a chunk of the same length (see `cp.shard`). Returns this rank's output chunk,
    same layout. Gradients w.r.t. the local chunks equal the matching slices of the full gradients.

    The group, mode, kernels and tuning come from `context` (a `cp.CPContext`, built once at setup), or, for the
    ring and Ulysses modes, from `group`, `mode` and `ulysses_size` (a context with the default tuning is made on
    the fly). The hybrid mode needs sub-groups that every rank creates at the same point: build a `CPContext` for
    it and pass `context`.

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
    if context is not None and (group is not None or mode != "ring" or ulysses_size is not None):
        raise ValueError("pass either context= or group=/mode=/ulysses_size=, not both (the context holds them)")
    n = group_size(group) if context is None else context.size
    u = validate(tuple(query.shape), n, mode, ulysses_size) if context is None else context.ulysses_size
    if context is None and u is not None and u < n:
        raise ValueError(
            f"mode 'hybrid' over a plain group needs its Ulysses and ring sub-groups, which every rank must "
            f"create at the same point: build cp.CPContext(group, mode='hybrid', ulysses_size={u}) once at "
            "setup and pass it as context="
        )
    if context is not None:
        validate(tuple(query.shape), n, context.mode, u)
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale

    if context is not None:
        spec = context.call_spec(scale)
    else:  # plain ring or Ulysses over `group`, default tuning; groups by name, as the compiled path passes them
        name = group.group_name if n > 1 else ""
        spec = CallSpec(scale, u, "" if u is None else name, name if u is None else "")
    if torch.compiler.is_compiling():
        return _traced(query, key, value, spec)
    if spec.ulysses_size is None:  # ring, or no CP
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        return ring_attention(q, k, v, spec).transpose(1, 2)
    return ulysses_attention(query, key, value, spec)


def _traced(query: Tensor, key: Tensor, value: Tensor, spec: CallSpec) -> Tensor:
    """The same computation in ops that torch.compile traces (forward and backward)."""
    if spec.ulysses_size is None:
        q, k, v = (t.transpose(1, 2).contiguous() for t in (query, key, value))
        out, _ = ring_op(q, k, v, spec)
        return out.transpose(1, 2)
    return ulysses_traced(query, key, value, spec)
