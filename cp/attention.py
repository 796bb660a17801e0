"""`cp.attention`: exact non-causal attention over a sequence split across a CP process group."""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from .comm import group_size
from .context import CPContext
from .mode import DEFAULT_MODE, MODES, CallSpec, name_of, validate

Tensor = torch.Tensor

__all__ = ["MODES", "attention", "validate"]


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    mode: str = DEFAULT_MODE,
    ulysses_size: int | None = None,
    scale: float | None = None,
    context: CPContext | None = None,
) -> Tensor:
    """Non-causal, unmasked attention of this rank's sequence chunk against the whole sequence.

    `query/key/value`: this rank's contiguous chunk, `[batch, seq_local, heads, head_dim]`. Every rank
    of the group must hold a chunk of the same length (see `cp.shard`). Returns this rank's output chunk,
    same layout. Gradients w.r.t. the local chunks equal the matching slices of the full gradients.

    The group, mode, kernels and tuning come from `context` (a `cp.CPContext`, built once at setup), or, for the
    modes that make no groups of their own (ring, Ulysses), from `group`, `mode` and `ulysses_size` (a context with
    the default tuning is made on the fly). The hybrid mode needs sub-groups that every rank creates at the same
    point: build a `CPContext` for it and pass `context`. The mode's own module computes it (`cp.MODES`).

    torch.compile traces it without a graph break: each mode has a traced path (the built-in modes' exchanges are
    functional collectives and the ring, or the local attention, a custom op, cp/ring.py), with the same kernels as
    in eager mode.
    """
    if query.shape != key.shape or query.shape != value.shape:
        raise ValueError(
            f"query, key and value must have the same shape [batch, seq, heads, head_dim]; got "
            f"{tuple(query.shape)}, {tuple(key.shape)}, {tuple(value.shape)}"
        )
    if not (query.dtype == key.dtype == value.dtype):
        raise ValueError(f"query, key and value dtypes differ: {query.dtype}, {key.dtype}, {value.dtype}")
    if context is not None and (group is not None or mode != DEFAULT_MODE or ulysses_size is not None):
        raise ValueError("pass either context= or group=/mode=/ulysses_size=, not both (the context holds them)")
    n = group_size(group) if context is None else context.size
    u = validate(tuple(query.shape), n, mode, ulysses_size) if context is None else context.ulysses_size
    if context is None and n > 1 and MODES[mode].needs_context(n, u):
        raise ValueError(
            f"mode {mode!r} over a plain group needs its own sub-groups, which every rank must create at the same "
            f"point: build cp.CPContext(group, mode={mode!r}, ulysses_size={u}) once at setup and pass it as context="
        )
    if context is not None:
        return context.attend(query, key, value, scale)
    # a mode that makes no groups, over `group`, default tuning; groups by name, as the compiled path passes them
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    runs = MODES[mode] if n > 1 else MODES[DEFAULT_MODE]
    ulysses_group, ring_group = runs.groups(group, u, None, None) if n > 1 else (None, None)
    spec = CallSpec(scale, u, name_of(ulysses_group), name_of(ring_group), group_name=name_of(group) if n > 1 else "")
    if torch.compiler.is_compiling():
        return runs.traced(query, key, value, spec)
    return runs.attention(query, key, value, spec)
