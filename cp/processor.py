"""What every CP attention processor shares, whatever the model: the CP context it attends over, diffusers' own
code path where ours cannot apply, and installing the processors on a transformer and keeping them there.

A model's file (`cp/flux.py`, `cp/flux2.py`, or a file outside `cp` for another model) defines its processors (the
same projections, norms and RoPE as the processor it replaces, then `cp.attention`; diffusers' joint text + image
attentions share `JointCPAttnProcessor`) and registers, per attention module class, its processor and the processor
it replaces (`register`). This module knows no model: the `cp` package imports its own model files on first use.
`apply_context_parallel` then installs them on any registered transformer; with a CP group of several ranks every
forward first checks the processors, since diffusers replaces them (IP-Adapter load and unload, FLUX.2 [klein]'s
KV-cache pipeline): a processor rebuilt without arguments joins the context again, diffusers' default processor is
swapped back for ours, and any other processor (which would silently attend within one rank's slice) stops the
forward with a ValueError.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.embeddings import apply_rotary_emb

from .comm import gather, group_size, shard
from .context import CPContext

Tensor = torch.Tensor

# (what diffusers set, how to proceed) for the errors of CPAttnProcessor._refuse
_BACKEND = (
    "an attention backend",
    "Choose backends only without CP, or call reset_attention_backend() before apply_context_parallel.",
)
_PARALLEL = ("diffusers' enable_parallelism", "Use diffusers' context parallelism or flux-cp's, not both.")


def _setting(field: str, what: tuple[str, str]) -> property:
    """A setting diffusers gives every processor that has it, kept in `field` and refused under CP (`_refuse`)."""

    def set_(self, value) -> None:
        self._refuse(what, value, getattr(self, "cp_size", 1))
        setattr(self, field, value)

    return property(lambda self: getattr(self, field), set_)


def as_context(
    context: CPContext | dist.ProcessGroup | None, mode: str | None = None, ulysses_size: int | None = None
) -> CPContext:
    """A `CPContext` from a context (in `mode`, if given) or from a plain group (None: no CP) and `mode` (default
    ring). The hybrid mode's sub-groups are created here when a plain group is given: every rank must call this at
    the same point."""
    if isinstance(context, CPContext):
        return context if mode is None else context.with_mode(mode, ulysses_size)
    return CPContext(context, mode or "ring", ulysses_size)


class CPAttnProcessor:
    """Base of the CP processors: attends with `cp.attention` over a `CPContext`.

    Constructed with no context (or a group of one rank) it is no CP and computes what the diffusers processor it
    replaces computes. Without CP, an attention mask, a backend chosen with diffusers' `set_attention_backend` /
    `attention_backend`, or diffusers' own `enable_parallelism` take diffusers' own code path
    (`_diffusers_path`); with a CP group of several ranks those cannot apply and are refused with a ValueError.

    `context`: a `cp.CPContext`, or a plain process group with `mode` and `ulysses_size` (see `as_context`).
    """

    def __init__(
        self,
        context: CPContext | dist.ProcessGroup | None = None,
        mode: str | None = None,
        ulysses_size: int | None = None,
    ):
        self._backend = None
        self._parallel = None
        if not isinstance(context, CPContext):
            self._admit(group_size(context))  # before the context is built
        self.context = as_context(context, mode, ulysses_size)

    @property
    def context(self) -> CPContext:
        return self._context

    @context.setter
    def context(self, context: CPContext) -> None:
        self._admit(context.size)
        self._context, self.cp_size = context, context.size

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._context.group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        """Join a plain group, in this processor's mode and tuning."""
        self._admit(group_size(group))
        c = self._context
        self.context = CPContext(group, c.mode, c.ulysses_size, tuning=c.tuning, timeout=c.timeout)

    @property
    def mode(self) -> str:
        return self._context.mode

    @property
    def ulysses_size(self) -> int | None:
        return self._context.ulysses_size

    def _admit(self, size: int) -> None:
        if size > 1:
            self._refuse(_BACKEND, self._backend, size)
            self._refuse(_PARALLEL, self._parallel, size)

    # diffusers' set_attention_backend / reset_attention_backend and enable_parallelism set these two
    # attributes on every processor that has them.
    _attention_backend = _setting("_backend", _BACKEND)
    _parallel_config = _setting("_parallel", _PARALLEL)

    @staticmethod
    def _refuse(what: tuple[str, str], value, cp_size: int) -> None:
        if value is not None and cp_size > 1:
            raise ValueError(
                f"{what[0]} ({value}) cannot apply under flux-cp's context parallelism over {cp_size} ranks: its "
                f"attention runs on cp.attention's own kernels. {what[1]}"
            )

    def _diffusers_path(self, attention_mask: Tensor | None) -> bool:
        """Whether this call takes diffusers' own processor code: only without CP, and only when that code would do
        something ours does not (a mask, a chosen backend, diffusers' CP). Raises for a mask under CP."""
        if self.cp_size > 1:
            if attention_mask is not None:
                raise ValueError(
                    f"attention masks are not supported with context parallelism over {self.cp_size} ranks "
                    "(each rank holds a slice of the sequence); pass no attention_mask, or run without CP"
                )
            return False
        if attention_mask is not None or self._backend is not None or self._parallel is not None:
            return True
        return _AttentionBackendRegistry.get_active_backend()[0] != AttentionBackendName.NATIVE

    def _attend(self, query: Tensor, key: Tensor, value: Tensor) -> Tensor:
        """`[B, S, H, D]` q, k, v of this rank's tokens -> its attention output `[B, S, H * D]`."""
        return self._context.attend(query, key, value).flatten(2, 3).to(query.dtype)


class JointCPAttnProcessor(CPAttnProcessor):
    """A joint text + image attention of diffusers' Flux models: diffusers' own processor (`default`) where ours
    cannot apply (`_diffusers_path`), else q, k, v as diffusers computes them (`joint_qkv`, with the model's
    `_get_qkv_projections` for fused projections), `cp.attention`, and the model's output projections (`_project`)."""

    default: type  # diffusers' processor this one replaces
    fused_projections: Callable  # the model's `_get_qkv_projections` (a staticmethod)

    def __call__(
        self,
        attn: torch.nn.Module,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self._diffusers_path(attention_mask):
            return self.default.__call__(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        qkv = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, self.fused_projections)
        return self._project(attn, self._attend(*qkv), encoder_hidden_states)

    def _project(self, attn: torch.nn.Module, hidden_states: Tensor, text: Tensor | None):
        """The attention output `[B, S, H * D]` of `[text; image]` tokens (text: the encoder states given, if any)
        through the module's output projections, as diffusers' processor returns it."""
        raise NotImplementedError


# Per tensor: (image projection, norm, text projection, text norm); None where the tensor has no norm. The names
# of diffusers' Flux attention modules (FLUX.1 and FLUX.2 alike).
_PARTS = {
    "q": ("to_q", "norm_q", "add_q_proj", "norm_added_q"),
    "k": ("to_k", "norm_k", "add_k_proj", "norm_added_k"),
    "v": ("to_v", None, "add_v_proj", None),
}


def joint(attn: torch.nn.Module, which: str, x: Tensor, e: Tensor | None, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    """One of q, k, v ("q", "k" or "v") from its projections of the image tokens `x` and the text tokens `e` (None:
    no text stream), as diffusers' Flux processors compute it: `[text; image]` tokens, `[B, S, H, D]`, normed, RoPE
    applied."""
    _, norm, _, added_norm = _PARTS[which]
    x = x.unflatten(-1, (-1, attn.head_dim))
    if norm:
        x = getattr(attn, norm)(x)
    if e is not None:
        e = e.unflatten(-1, (-1, attn.head_dim))
        if added_norm:
            e = getattr(attn, added_norm)(e)
        x = torch.cat([e, x], dim=1)
    if rope is not None and which != "v":
        x = apply_rotary_emb(x, rope, sequence_dim=1)
    return x


def joint_qkv(attn: torch.nn.Module, hidden: Tensor, text: Tensor | None, rope, fused_projections) -> tuple:
    """q, k, v `[B, S, H, D]` of a joint text + image attention as diffusers' Flux processors compute them (text
    joins when the module has text projections); `fused_projections(attn, hidden, text)`: the model's
    `_get_qkv_projections`, for modules whose projections are fused."""
    text = text if attn.added_kv_proj_dim is not None else None
    if attn.fused_projections:
        q, k, v, eq, ek, ev = fused_projections(attn, hidden, text)
        texts = (eq, ek, ev) if text is not None else (None, None, None)
        return tuple(joint(attn, w, x, e, rope) for w, x, e in zip("qkv", (q, k, v), texts))
    return tuple(projected(attn, w, hidden, text, rope) for w in "qkv")


def projected(attn: torch.nn.Module, which: str, hidden: Tensor, text: Tensor | None, rope) -> Tensor:
    """`joint` of the separate (unfused) projections: one tensor at a time, each finished (projections, norm, text
    + image, RoPE) before the next is projected, so that, compiled, the exchange of q runs while k and v are
    projected."""
    image_proj, _, text_proj, _ = _PARTS[which]
    image_part = getattr(attn, image_proj)(hidden)
    text_part = getattr(attn, text_proj)(text) if text is not None else None
    return joint(attn, which, image_part, text_part, rope)


# --- installing processors ----------------------------------------------------------------------------------------

# attention module class -> (our processor class, the diffusers processor class it replaces)
_PROCESSORS: dict[type, tuple[type, type]] = {}
# transformer class -> a check of each forward's keyword arguments under CP (e.g. a mode CP cannot serve)
_CALL_CHECKS: dict[type, Callable[[dict, int], None]] = {}


def register(attention_cls: type, ours: type, default: type) -> None:
    """Install `ours` on modules of `attention_cls` in place of diffusers' `default` processor."""
    _PROCESSORS[attention_cls] = (ours, default)


def register_call_check(transformer_cls: type, check: Callable[[dict, int], None]) -> None:
    """Under CP over n ranks, `check(forward kwargs, n)` runs before each forward of a `transformer_cls` model."""
    _CALL_CHECKS[transformer_cls] = check


_ORIGINAL = "_flux_cp_original_processor"
_GUARD = "_flux_cp_guard"


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m) in _PROCESSORS]


def apply_context_parallel(
    transformer: torch.nn.Module,
    context: CPContext | dist.ProcessGroup | None,
    mode: str | None = None,
    ulysses_size: int | None = None,
) -> torch.nn.Module:
    """Install the CP processors on every attention module of a FLUX.1 or FLUX.2 transformer (also one wrapped by
    peft or FSDP); the original processors are kept for `remove_context_parallel`. Returns the model.

    `context`: a `cp.CPContext` (in `mode` and `ulysses_size`, if given), or a plain process group (None: no CP)
    with `mode` (default ring) and `ulysses_size`. One context serves every processor; in the hybrid mode building
    it creates the sub-groups, so every rank must call this at the same point."""
    modules = _attention_modules(transformer)
    if not modules:
        known = ", ".join(sorted(c.__name__ for c in _PROCESSORS))
        raise ValueError(f"{type(transformer).__name__} has no attention module of a supported model ({known})")
    context = as_context(context, mode, ulysses_size)
    for _, m in modules:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.processor)
        processor = _PROCESSORS[type(m)][0](context)
        # A backend chosen with set_attention_backend stays chosen (or is refused under CP).
        processor._attention_backend = getattr(m.processor, "_attention_backend", None)
        m.set_processor(processor)
    _remove_guard(transformer)
    if context.size > 1:
        checks = [check for cls, check in _CALL_CHECKS.items() if isinstance(transformer, cls)]
        guard = functools.partial(_keep_context_parallel, modules, context, checks)
        handle = transformer.register_forward_pre_hook(lambda _m, _a, kwargs: guard(kwargs), with_kwargs=True)
        setattr(transformer, _GUARD, handle)
    return transformer


def _keep_context_parallel(
    modules: list[tuple[str, torch.nn.Module]], context: CPContext, checks: list[Callable], kwargs: dict
) -> None:
    for check in checks:
        check(kwargs, context.size)
    for name, m in modules:
        p = m.processor
        ours, default = _PROCESSORS[type(m)]
        if isinstance(p, ours):
            if p.group is None:  # rebuilt by diffusers as `type(processor)()`
                p.context = context
        elif type(p) is default:  # what unload_ip_adapter installs
            m.set_processor(ours(context))
        else:
            raise ValueError(
                f"{name} now has a {type(p).__name__}, which does not support flux-cp's context parallelism "
                f"(the sequence is split over {context.size} ranks). Use diffusers' default processors under CP "
                "(for IP-Adapters: unload_ip_adapter()), or cp.remove_context_parallel(transformer) to run without it."
            )


def _remove_guard(transformer: torch.nn.Module) -> None:
    if hasattr(transformer, _GUARD):
        getattr(transformer, _GUARD).remove()
        delattr(transformer, _GUARD)


def remove_context_parallel(transformer: torch.nn.Module) -> torch.nn.Module:
    """Restore the processors that `apply_context_parallel` replaced."""
    _remove_guard(transformer)
    for _, m in _attention_modules(transformer):
        if hasattr(m, _ORIGINAL):
            m.set_processor(getattr(m, _ORIGINAL))
            delattr(m, _ORIGINAL)
    return transformer


# The inputs split along their sequence dimension, the second to last: `[B, S, C]` states, `[S, n]` ids (FLUX.1)
# or `[B, S, n]` ids (FLUX.2's pipelines).
_SPLITS = ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids")


@contextlib.contextmanager
def full_sequence_io(transformer: torch.nn.Module, group: dist.ProcessGroup | None):
    """Inside this context a CP-enabled transformer takes and returns *full* sequences, as diffusers' pipelines pass
    them (reference-image tokens included, after the generated image's): its inputs are split with `shard` before
    the call and its output is gathered after. Every rank of the group must make the same calls (same latents and
    prompts)."""
    if group is None or dist.get_world_size(group) == 1:
        yield transformer
        return

    def pre(_module, args, kwargs):
        if args:
            raise ValueError("full_sequence_io expects keyword arguments, as diffusers' pipelines pass them")
        for key in _SPLITS:
            value = kwargs.get(key)
            if value is not None:
                kwargs[key] = shard(value, value.ndim - 2, group)
        return args, kwargs

    def post(_module, _args, kwargs, output):
        if isinstance(output, tuple):
            return (gather(output[0], 1, group), *output[1:])
        output.sample = gather(output.sample, 1, group)
        return output

    handles = [
        transformer.register_forward_pre_hook(pre, with_kwargs=True),
        transformer.register_forward_hook(post, with_kwargs=True),
    ]
    try:
        yield transformer
    finally:
        for h in handles:
            h.remove()
