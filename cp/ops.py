"""Custom ops through which torch.compile traces CP attention: dynamo and AOTAutograd see one op for the
forward and one for the backward (real kernels plus fake kernels that give shapes), so a compiled block keeps
one graph across its attention. The ops run the same ring code as the eager autograd Function (`ring.py`);
the process group travels by name, as the compiler needs plain arguments.

`flux_cp::ring_attention(q, k, v, scale, group_name) -> (out, lse)`: ring attention of `[B, H, S, D]` chunks
over the named group ("" for none: plain attention on one rank); `lse` is the merged log-sum-exp, kept for the
backward. `flux_cp::ring_attention_backward(...) -> (dq, dk, dv)`: its gradients.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import kernels
from .ring import ring_backward, ring_forward

Tensor = torch.Tensor


def group_by_name(name: str) -> dist.ProcessGroup | None:
    if not name:
        return None
    from torch.distributed.distributed_c10d import _resolve_process_group

    return _resolve_process_group(name)


@torch.library.custom_op("flux_cp::ring_attention", mutates_args=())
def ring_attention_op(q: Tensor, k: Tensor, v: Tensor, scale: float, group_name: str) -> tuple[Tensor, Tensor]:
    q, k, v = (t.contiguous() for t in (q, k, v))
    out, lse, _, _ = ring_forward(q, k, v, scale, group_by_name(group_name))
    return out.contiguous(), lse.contiguous()


@ring_attention_op.register_fake
def _(q: Tensor, k: Tensor, v: Tensor, scale: float, group_name: str) -> tuple[Tensor, Tensor]:
    out = torch.empty_like(q, memory_format=torch.contiguous_format)
    return out, q.new_empty(q.shape[:3], dtype=kernels.acc_dtype(q.dtype))


@torch.library.custom_op("flux_cp::ring_attention_backward", mutates_args=())
def ring_attention_backward_op(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, group_name: str
) -> tuple[Tensor, Tensor, Tensor]:
    q, k, v = (t.contiguous() for t in (q, k, v))
    kernel, aux = kernels.used_for(q, k)
    grads = ring_backward(dout, q, k, v, out, lse, scale, group_by_name(group_name), kernel, aux)
    # Outputs of a custom op may not share memory (the ring returns dk and dv as views of one buffer).
    seen: set[int] = set()
    result = []
    for g in grads:
        g = g.contiguous()
        ptr = g.untyped_storage().data_ptr()
        result.append(g.clone() if ptr in seen else g)
        seen.add(ptr)
    return tuple(result)


@ring_attention_backward_op.register_fake
def _(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, group_name: str
) -> tuple[Tensor, Tensor, Tensor]:
    return tuple(torch.empty_like(t, memory_format=torch.contiguous_format) for t in (q, k, v))


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, scale, group_name = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse)
    ctx.scale, ctx.group_name = scale, group_name
    ctx.mark_non_differentiable(lse)


def _backward(ctx, dout: Tensor, _dlse: Tensor | None):
    q, k, v, out, lse = ctx.saved_tensors
    # cuDNN's backward needs a contiguous grad_out; making it so here lets the compiler fuse the copy.
    dq, dk, dv = ring_attention_backward_op(dout.contiguous(), q, k, v, out, lse, ctx.scale, ctx.group_name)
    return dq, dk, dv, None, None


ring_attention_op.register_autograd(_backward, setup_context=_setup_context)
