"""Custom ops through which torch.compile traces CP attention: dynamo and AOTAutograd see one op for the
forward and one for the backward (real kernels plus fake kernels that give shapes), so a compiled block keeps
one graph across its attention. The ops run the same ring code as the eager autograd Function (`ring.py`);
the process group and the context's kernels travel by name, as the compiler needs plain arguments.

`cp::ring_attention(q, k, v, scale, group_name, kernels, exchange_first) -> (out, lse)`: ring attention of
`[B, H, S, D]` chunks over the named group ("" for none: plain attention on one rank), with the kernels of the
order `kernels` (`KernelChoice.key`: names joined by commas, "" for the device's default) and
`Tuning.exchange_first`; `lse` is the merged log-sum-exp, kept for the backward.
`cp::ring_attention_backward(...) -> (dq, dk, dv)`: its gradients.

Layouts: `out` has the strides of `q`, and each gradient those of its input. Without a ring (group ""), q, k and
v may be transposed views of `[B, S, H, D]` memory, the layout in which an all-to-all of sequence chunks
delivers them: cuDNN reads and writes that layout directly (forward and backward, checked on H200s by
benchmarks/archive/probe_layouts.py), so no copy is made on either side of the exchange. Inductor must hand the ops
exactly the strides it traced (`needs_exact_strides`), since the fake kernels derive the output strides from them.
"""

from __future__ import annotations

import torch

from .context import CallSpec
from .kernels import acc_dtype, dense_like, in_layout_of
from .ring import ring_backward, ring_forward

Tensor = torch.Tensor


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
    kernel, aux = spec.kernel_choice().used_for(q, k)
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
