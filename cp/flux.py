"""Context parallelism for diffusers' `FluxTransformer2DModel`: an attention processor that computes
exactly what `FluxAttnProcessor` computes, with the attention itself spread over a CP group.

Every op of the Flux transformer except attention is token-local, and RoPE is computed per token from
`img_ids`/`txt_ids`, so a rank that holds `[its text chunk; its image chunk]` (inputs split with
`cp.shard`) computes its chunk of the full output once attention sees the whole sequence. Attention is
non-causal and unmasked, so the interleaved global order of the chunks does not matter.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, _get_qkv_projections

from .attention import attention
from .comm import gather, group_size, shard
from .context import CPContext

Tensor = torch.Tensor

# (what diffusers set, how to proceed) for the errors of FluxCPAttnProcessor._refuse
_BACKEND = (
    "an attention backend",
    "Choose backends only without CP, or call reset_attention_backend() before apply_context_parallel.",
)
_PARALLEL = ("diffusers' enable_parallelism", "Use diffusers' context parallelism or flux-cp's, not both.")


def as_context(
    context: CPContext | dist.ProcessGroup | None, mode: str | None = None, ulysses_size: int | None = None
) -> CPContext:
    """A `CPContext` from a context (in `mode`, if given) or from a plain group (None: no CP) and `mode` (default
    ring). The hybrid mode's sub-groups are created here when a plain group is given: every rank must call this at
    the same point."""
    if isinstance(context, CPContext):
        return context if mode is None else context.with_mode(mode, ulysses_size)
    return CPContext(context, mode or "ring", ulysses_size)


class FluxCPAttnProcessor:
    """Drop-in replacement for diffusers' `FluxAttnProcessor` that calls `cp.attention` with a `CPContext`.

    `FluxCPAttnProcessor()` (no context, or a group of one rank) is no CP: it computes what `FluxAttnProcessor`
    computes, bit for bit on CPU in fp32. Without CP, an attention mask, a backend chosen with diffusers'
    `set_attention_backend` / `attention_backend`, or diffusers' own `enable_parallelism` take diffusers' own
    code path. With a CP group of several ranks those cannot apply and are refused with a ValueError.

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
    @property
    def _attention_backend(self):
        return self._backend

    @_attention_backend.setter
    def _attention_backend(self, backend) -> None:
        self._refuse(_BACKEND, backend, getattr(self, "cp_size", 1))
        self._backend = backend

    @property
    def _parallel_config(self):
        return self._parallel

    @_parallel_config.setter
    def _parallel_config(self, config) -> None:
        self._refuse(_PARALLEL, config, getattr(self, "cp_size", 1))
        self._parallel = config

    @staticmethod
    def _refuse(what: tuple[str, str], value, cp_size: int) -> None:
        if value is not None and cp_size > 1:
            raise ValueError(
                f"{what[0]} ({value}) cannot apply under flux-cp's context parallelism over {cp_size} ranks: its "
                f"attention runs on cp.attention's own kernels. {what[1]}"
            )

    def _diffusers_path(self, attention_mask: Tensor | None) -> bool:
        """Whether this call takes `FluxAttnProcessor`'s own code: only without CP, and only when that code would
        do something ours does not (a mask, a chosen backend, diffusers' CP). Raises for a mask under CP."""
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

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self._diffusers_path(attention_mask):
            return FluxAttnProcessor.__call__(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        joint_text = encoder_hidden_states is not None and attn.added_kv_proj_dim is not None
        if attn.fused_projections:
            q, k, v, eq, ek, ev = _get_qkv_projections(attn, hidden_states, encoder_hidden_states)
            query, key, value = (
                _joint(attn, w, x, e if joint_text else None, image_rotary_emb)
                for w, x, e in zip("qkv", (q, k, v), (eq, ek, ev))
            )
        else:
            # One tensor at a time, each finished (projections, norm, text + image, RoPE) before the next is
            # projected: compiled, the exchange of q can then run while k and v are projected.
            query, key, value = (
                _joint(attn, w, getattr(attn, _PARTS[w][0])(hidden_states),
                       getattr(attn, _PARTS[w][2])(encoder_hidden_states) if joint_text else None, image_rotary_emb)
                for w in "qkv"
            )  # fmt: skip
        hidden_states = attention(query, key, value, context=self._context)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states


# Per tensor: (image projection, norm, text projection, text norm); None where the tensor has no norm.
_PARTS = {
    "q": ("to_q", "norm_q", "add_q_proj", "norm_added_q"),
    "k": ("to_k", "norm_k", "add_k_proj", "norm_added_k"),
    "v": ("to_v", None, "add_v_proj", None),
}


def _joint(attn: FluxAttention, which: str, x: Tensor, e: Tensor | None, rope: tuple[Tensor, Tensor] | None) -> Tensor:
    """One of q, k, v from its projections of the image tokens `x` and the text tokens `e` (None: no text stream),
    as `FluxAttnProcessor` computes it: `[text; image]` tokens, `[B, S, H, D]`, normed, RoPE applied."""
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


_ORIGINAL = "_flux_cp_original_processor"
_GUARD = "_flux_cp_guard"


def _flux_attention_modules(model: torch.nn.Module) -> list[FluxAttention]:
    return [m for m in model.modules() if isinstance(m, FluxAttention)]


def apply_context_parallel(
    transformer: torch.nn.Module,
    context: CPContext | dist.ProcessGroup | None,
    mode: str | None = None,
    ulysses_size: int | None = None,
) -> torch.nn.Module:
    """Install `FluxCPAttnProcessor` on every attention module of a Flux transformer (also one wrapped by
    peft or FSDP); the original processors are kept for `remove_context_parallel`. Returns the model.

    `context`: a `cp.CPContext` (in `mode` and `ulysses_size`, if given), or a plain process group (None: no CP)
    with `mode` (default ring) and `ulysses_size`. One context serves every processor; in the hybrid mode
    building it creates the sub-groups, so every rank must call this at the same point.

    With a CP group of several ranks, every forward first checks the processors, since diffusers replaces
    them (IP-Adapter load and unload): a processor rebuilt without arguments joins the context again,
    diffusers' `FluxAttnProcessor` is swapped back for the CP one, and any other processor (which would
    silently attend within one rank's slice) stops the forward with a ValueError."""
    modules = _flux_attention_modules(transformer)
    if not modules:
        raise ValueError(f"{type(transformer).__name__} has no FluxAttention modules: is it a Flux transformer?")
    context = as_context(context, mode, ulysses_size)
    for m in modules:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.processor)
        processor = FluxCPAttnProcessor(context)
        # A backend chosen with set_attention_backend stays chosen (or is refused under CP).
        processor._attention_backend = getattr(m.processor, "_attention_backend", None)
        m.set_processor(processor)
    _remove_guard(transformer)
    if processor.cp_size > 1:
        names = [(n, m) for n, m in transformer.named_modules() if isinstance(m, FluxAttention)]
        guard = functools.partial(_keep_context_parallel, names, context)
        setattr(transformer, _GUARD, transformer.register_forward_pre_hook(lambda *_: guard()))
    return transformer


def _keep_context_parallel(modules: list[tuple[str, FluxAttention]], context: CPContext) -> None:
    for name, m in modules:
        p = m.processor
        if isinstance(p, FluxCPAttnProcessor):
            if p.group is None:  # rebuilt by diffusers as `type(processor)()`
                p.context = context
        elif type(p) is FluxAttnProcessor:  # what unload_ip_adapter installs
            m.set_processor(FluxCPAttnProcessor(context))
        else:
            raise ValueError(
                f"{name} now has a {type(p).__name__}, which does not support flux-cp's context parallelism "
                f"(the sequence is split over {context.size} ranks). IP-Adapters work without CP: "
                "call unload_ip_adapter() to train or sample with CP again, or cp.remove_context_parallel(transformer)."
            )


def _remove_guard(transformer: torch.nn.Module) -> None:
    if hasattr(transformer, _GUARD):
        getattr(transformer, _GUARD).remove()
        delattr(transformer, _GUARD)


def remove_context_parallel(transformer: torch.nn.Module) -> torch.nn.Module:
    """Restore the processors that `apply_context_parallel` replaced."""
    _remove_guard(transformer)
    for m in _flux_attention_modules(transformer):
        if hasattr(m, _ORIGINAL):
            m.set_processor(getattr(m, _ORIGINAL))
            delattr(m, _ORIGINAL)
    return transformer


_SPLITS = (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0))


@contextlib.contextmanager
def full_sequence_io(transformer: torch.nn.Module, group: dist.ProcessGroup | None):
    """Inside this context a CP-enabled Flux transformer takes and returns *full* sequences, as
    `FluxPipeline` passes them: its inputs are split with `shard` before the call and its output is
    gathered after. Every rank of the group must make the same calls (same latents and prompts)."""
    if group is None or dist.get_world_size(group) == 1:
        yield transformer
        return

    def pre(_module, args, kwargs):
        if args:
            raise ValueError("full_sequence_io expects keyword arguments, as FluxPipeline passes them")
        for key, dim in _SPLITS:
            if kwargs.get(key) is not None:
                kwargs[key] = shard(kwargs[key], dim, group)
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
