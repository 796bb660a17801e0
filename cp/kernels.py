"""Block attention kernels that return the log-sum-exp (LSE) of each query row.

Ring attention computes attention of the local queries against one K/V block at a time and merges
the partial results with their LSE, so it needs kernels that return it, and backward kernels that
accept the *merged* output and LSE. The aten SDPA ops do both. All kernels here take and return
the `[batch, heads, seq, head_dim]` shape and return the LSE as `[batch, heads, seq]` in the accumulation
dtype (fp32, or fp64 for fp64 inputs). cuDNN reads q, k, v in the strides it is given (contiguous, or
transposed views of `[batch, seq, heads, head_dim]` memory) and writes the output and gradients in the
same layout; the other kernels get contiguous copies.

A kernel that cannot serve an input (dtype, head_dim, device) raises on its first call; we then
fall back to the next kernel in the preference list and remember the choice per input signature
(`KernelChoice`, held by each `CPContext`).
The last resort, `math`, is plain matmul + softmax and serves everything.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

aten = torch.ops.aten

Tensor = torch.Tensor


def acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """Dtype in which partial results and LSEs are merged: fp64 stays fp64, all else fp32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@dataclass(frozen=True)
class Kernel:
    """forward(q, k, v, scale) -> (out, lse [B, H, S], aux); backward(dout, q, k, v, out, lse, scale, aux)."""

    name: str
    forward: Callable[..., tuple[Tensor, Tensor, tuple]]
    backward: Callable[..., tuple[Tensor, Tensor, Tensor]]
    devices: tuple[str, ...] = ("cuda", "cpu")  # device types it can run on at all (what else it serves is tried)
    # Input dtypes it serves (None: any). Checked before the call rather than left to the op: called directly, an
    # aten kernel does not always check the dtype the way SDPA's dispatcher does before choosing it.
    dtypes: tuple[torch.dtype, ...] | None = None

    def refuses(self, dtype: torch.dtype) -> str | None:
        """Why this kernel does not serve inputs of `dtype`, or None."""
        if self.dtypes is None or dtype in self.dtypes:
            return None
        return f"takes {' or '.join(str(d).removeprefix('torch.') for d in self.dtypes)}, not {dtype}"


# --- math: reference implementation, any device and dtype -----------------------------------------


def _math_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    acc = acc_dtype(q.dtype)
    s = torch.matmul(q.to(acc), k.to(acc).transpose(-1, -2)) * scale
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), v.to(acc))
    return out.to(q.dtype), lse, ()


def _math_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple = ()
) -> tuple[Tensor, Tensor, Tensor]:
    acc = acc_dtype(q.dtype)
    qa, ka, va, da = q.to(acc), k.to(acc), v.to(acc), dout.to(acc)
    p = torch.exp(torch.matmul(qa, ka.transpose(-1, -2)) * scale - lse.to(acc).unsqueeze(-1))
    dv = torch.matmul(p.transpose(-1, -2), da)
    dp = torch.matmul(da, va.transpose(-1, -2))
    delta = (da * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta) * scale
    dq = torch.matmul(ds, ka)
    dk = torch.matmul(ds.transpose(-1, -2), qa)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


# --- layouts ---------------------------------------------------------------------------------------------


def _same_strides(shape: torch.Size, a: tuple[int, ...], b: tuple[int, ...]) -> bool:
    """Whether two stride tuples lay out a tensor of `shape` alike (the stride of a size-1 dim is never read)."""
    return all(sa == sb for sa, sb, n in zip(a, b, shape) if n > 1)


def dense_strides(t: Tensor) -> tuple[int, ...]:
    """Strides that lay out `t`'s dims in the order of `t`'s own strides, with no gaps: `t`'s strides when `t` is
    dense. q, k and v that are views of one exchanged buffer (gaps between the rows of each) thus give an output
    and gradients laid out like one of them alone, where `empty_like` would fall back to contiguous."""
    broadcast = any(st == 0 and n > 1 for st, n in zip(t.stride(), t.shape))  # no order to follow: contiguous
    order = list(range(t.dim())) if broadcast else sorted(range(t.dim()), key=t.stride, reverse=True)  # stable
    strides = [0] * t.dim()
    step = 1
    for i in reversed(order):
        strides[i] = step
        step *= t.shape[i]
    return tuple(strides)


def dense_like(t: Tensor, dtype: torch.dtype | None = None) -> Tensor:
    """An empty tensor of `t`'s shape in `dense_strides(t)`."""
    return torch.empty_strided(t.shape, dense_strides(t), dtype=dtype or t.dtype, device=t.device)


def in_layout_of(t: Tensor, like: Tensor) -> Tensor:
    """`t` in the strides of `dense_like(like)`: `t` itself when it already is, else a copy."""
    strides = dense_strides(like)
    if _same_strides(t.shape, t.stride(), strides):
        return t
    return torch.empty_strided(like.shape, strides, dtype=t.dtype, device=like.device).copy_(t)


# --- CPU flash --------------------------------------------------------------------------------------


def _cpu_flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse = aten._scaled_dot_product_flash_attention_for_cpu(q, k, v, 0.0, False, scale=scale)
    return out, lse, ()


def _cpu_flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    dq, dk, dv = aten._scaled_dot_product_flash_attention_for_cpu_backward(
        dout.contiguous(), q, k, v, out.contiguous(), lse.contiguous(), 0.0, False, scale=scale
    )
    return dq, dk, dv


# --- CUDA: cuDNN, flash, memory-efficient ------------------------------------------------------------
# Each forward also returns `aux`: the op's bookkeeping outputs (sequence offsets, RNG state, the LSE's
# native shape), handed back to its backward exactly as torch's own autograd formula does. Every block
# of one ring has the same shapes, so the aux of one block serves them all.


def _cudnn_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_cudnn_attention(
        q, k, v, None, True, 0.0, False, False, scale=scale
    )
    # Depending on the torch version the LSE is [B, H, S] or [B, H, S, 1].
    return out, lse.reshape(q.shape[:3]), (tuple(lse.shape), cum_q, cum_k, max_q, max_k, seed, offset)


def _cudnn_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    lse_shape, cum_q, cum_k, max_q, max_k, seed, offset = aux
    # cuDNN's backward reads grad_out in the output's layout: a grad_out in another layout (a transposed one
    # beside a contiguous output) ends in an illegal memory access on torch 2.11.
    dout, lse = in_layout_of(dout, out), lse.reshape(lse_shape).contiguous()
    dq, dk, dv = aten._scaled_dot_product_cudnn_attention_backward(
        dout, q, k, v, out, lse, seed, offset, None, cum_q, cum_k, max_q, max_k, 0.0, False, scale=scale
    )
    return dq, dk, dv


def _flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, cum_q, cum_k, max_q, max_k, seed, offset, _ = aten._scaled_dot_product_flash_attention(
        q, k, v, 0.0, False, False, scale=scale
    )
    return out, lse, (cum_q, cum_k, max_q, max_k, seed, offset)


def _flash_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    cum_q, cum_k, max_q, max_k, seed, offset = aux
    dout, out, lse = dout.contiguous(), out.contiguous(), lse.contiguous()
    dq, dk, dv = aten._scaled_dot_product_flash_attention_backward(
        dout, q, k, v, out, lse, cum_q, cum_k, max_q, max_k, 0.0, False, seed, offset, scale=scale
    )
    return dq, dk, dv


def _efficient_forward(q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    out, lse, seed, offset = aten._scaled_dot_product_efficient_attention(q, k, v, None, True, 0.0, False, scale=scale)
    # The LSE comes padded to a multiple of 32 rows.
    return out, lse[..., : q.shape[2]], (lse.shape[-1], seed, offset)


def _efficient_backward(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    padded, seed, offset = aux
    lse = torch.nn.functional.pad(lse, (0, padded - lse.shape[-1])).contiguous()
    dout, out = dout.contiguous(), out.contiguous()
    grads = [True, True, True, False]  # dq, dk, dv; no bias
    dq, dk, dv, _ = aten._scaled_dot_product_efficient_attention_backward(
        dout, q, k, v, None, out, lse, seed, offset, 0.0, grads, False, scale=scale
    )
    return dq, dk, dv


_HALF = (torch.float16, torch.bfloat16)
KERNELS: dict[str, Kernel] = {
    "cudnn": Kernel("cudnn", _cudnn_forward, _cudnn_backward, ("cuda",), _HALF),
    "flash": Kernel("flash", _flash_forward, _flash_backward, ("cuda",), _HALF),
    "efficient": Kernel("efficient", _efficient_forward, _efficient_backward, ("cuda",), (*_HALF, torch.float32)),
    "cpu_flash": Kernel("cpu_flash", _cpu_flash_forward, _cpu_flash_backward, ("cpu",)),
    "math": Kernel("math", _math_forward, _math_backward),
}

# cuDNN first on CUDA: about 590 TFLOP/s forward + backward at Flux shapes on H200s, 1.8x the flash backend's.
DEFAULT_PREFERENCE = {"cuda": ("cudnn", "flash", "efficient", "math"), "cpu": ("cpu_flash", "math")}


def check_names(names: tuple[str, ...]) -> None:
    """A ValueError naming the unknown kernels and the valid ones."""
    unknown = [n for n in names if n not in KERNELS]
    if unknown:
        raise ValueError(f"unknown attention kernels {', '.join(unknown)}; choose from {', '.join(sorted(KERNELS))}")


@dataclass(frozen=True)
class _Spec:
    shape: tuple[int, ...]
    dtype: torch.dtype
    device: torch.device


def _keep(aux: tuple) -> tuple:
    return tuple(_Spec(tuple(a.shape), a.dtype, a.device) if isinstance(a, Tensor) else a for a in aux)


def _shape_key(q: Tensor, k: Tensor) -> tuple:
    return (q.device, q.dtype, tuple(q.shape), tuple(k.shape))


def _strided(kernel: Kernel) -> bool:
    """Whether the kernel takes inputs in any layout (else it gets contiguous ones)."""
    return kernel.name == "cudnn"


def _contiguous(*ts: Tensor) -> tuple[Tensor, ...]:
    return tuple(t.contiguous() for t in ts)


def _forward(kernel: Kernel, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, tuple]:
    return kernel.forward(*((q, k, v) if _strided(kernel) else _contiguous(q, k, v)), scale)


class KernelChoice:
    """The attention kernels in an order of preference, and what that order chose so far: for each input signature
    the first kernel that could serve it, and for each exact input shape the aux of the latest forward (the compiled
    path's backward op, cp/ring.py, cannot receive it through the graph). A `CPContext` holds one
    (`CPContext.kernels`); contexts with the same order share it (`KernelChoice.of`).

    Without dropout the aux of one call (sequence offsets, the LSE's native shape, RNG seed and offset, which no
    kernel reads when dropout is 0) serves every call of the same shapes. Its tensors are kept as shapes only and
    made afresh, zero-filled, for each backward: a tensor kept from a forward inside a CUDA graph tree would sit in
    the graph's memory pool, which the tree refuses ("tensors in the cudagraph pool not tracked as outputs")."""

    def __init__(self, names: tuple[str, ...] = ()):
        check_names(names)
        self.names = tuple(names)  # empty: the device's default order (DEFAULT_PREFERENCE)
        self._chosen: dict[tuple, Kernel] = {}
        self._last: dict[tuple, tuple[Kernel, tuple]] = {}

    # The compiled path's custom ops take plain arguments only (torch's rule for custom ops): they receive the
    # order as text and find its choice here, as torch finds a process group by its name. One entry per order used
    # in the process; what it holds depends on the order and the input shapes alone.
    _BY_ORDER: dict[tuple[str, ...], KernelChoice] = {}

    @classmethod
    def of(cls, names: tuple[str, ...] = ()) -> KernelChoice:
        """The choice for an order of kernel names (empty: the device's default)."""
        names = tuple(names)
        if names not in cls._BY_ORDER:
            cls._BY_ORDER[names] = cls(names)
        return cls._BY_ORDER[names]

    @property
    def key(self) -> str:
        """The order as text, as the custom ops take it ("" for the default)."""
        return ",".join(self.names)

    @classmethod
    def from_key(cls, key: str) -> KernelChoice:
        return cls.of(tuple(n for n in key.split(",") if n))

    def order(self, device_type: str) -> tuple[str, ...]:
        return self.names or DEFAULT_PREFERENCE.get(device_type, ("math",))

    def forward(self, q: Tensor, k: Tensor, v: Tensor, scale: float) -> tuple[Tensor, Tensor, Kernel, tuple]:
        """Attention of q against one K/V block, inputs `[B, H, S, D]` (see the module's note on layouts).

        Returns (out, lse in the accumulation dtype, kernel used, aux for that kernel's backward). A kernel that
        cannot serve the input is skipped, and the next one is remembered for the input's signature.
        """
        sig = (q.device.type, q.dtype, q.shape[-1], q.shape[2], k.shape[2])
        kernel = self._chosen.get(sig)
        if kernel is not None:
            out, lse, aux = _forward(kernel, q, k, v, scale)
            self._last[_shape_key(q, k)] = (kernel, _keep(aux))
            return out, lse.to(acc_dtype(q.dtype)), kernel, aux
        errors = []
        for name in self.order(q.device.type):
            kernel = KERNELS[name]
            refused = kernel.refuses(q.dtype)
            if refused:
                errors.append(f"{name}: {refused}")
                continue
            try:
                out, lse, aux = _forward(kernel, q, k, v, scale)
            except (RuntimeError, NotImplementedError) as e:  # this kernel cannot serve the input: try the next
                errors.append(f"{name}: {str(e).splitlines()[0] if str(e) else type(e).__name__}")
                continue
            self._chosen[sig] = kernel
            self._last[_shape_key(q, k)] = (kernel, _keep(aux))
            return out, lse.to(acc_dtype(q.dtype)), kernel, aux
        raise RuntimeError("no attention kernel could serve this input: " + "; ".join(errors))

    def used_for(self, q: Tensor, k: Tensor) -> tuple[Kernel, tuple]:
        """(kernel, aux) that the latest `forward` with these shapes used; its backward needs both."""
        try:
            kernel, aux = self._last[_shape_key(q, k)]
        except KeyError:
            shapes = f"{tuple(q.shape)}, {tuple(k.shape)}"
            raise RuntimeError(f"attention backward before any forward of shapes {shapes}") from None
        aux = tuple(torch.zeros(a.shape, dtype=a.dtype, device=a.device) if isinstance(a, _Spec) else a for a in aux)
        return kernel, aux

    def chosen(self) -> dict[str, str]:
        """Which kernel served each input signature so far (for logs and benchmarks)."""
        return {str(sig): k.name for sig, k in self._chosen.items()}


def backward(
    kernel: Kernel, dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, scale: float, aux: tuple
) -> tuple[Tensor, Tensor, Tensor]:
    """Gradients of one block given the *merged* output and LSE of the full attention row.

    With the merged (not the block's own) output and LSE, the block backward yields exactly this
    block's share of dQ and the full dK/dV of the block, as in flash-attention's backward.
    """
    try:
        if not _strided(kernel):
            dout, q, k, v, out = _contiguous(dout, q, k, v, out)
        return kernel.backward(dout, q, k, v, out, lse, scale, aux)
    except (RuntimeError, NotImplementedError):
        if kernel.name == "math":
            raise
        # Same function, more memory: never a wrong answer, never a crash over a kernel's limits.
        return _math_backward(dout, q, k, v, out, lse, scale)


def chosen_kernels() -> dict[str, str]:
    """Which kernel served each input signature so far, for every order used in this process (logs, benchmarks)."""
    return {sig: name for choice in KernelChoice._BY_ORDER.values() for sig, name in choice.chosen().items()}
