"""Context parallelism for diffusers' `Flux2Transformer2DModel` (FLUX.2 [dev] and [klein]): attention processors
that compute exactly what `Flux2AttnProcessor` (double blocks) and `Flux2ParallelSelfAttnProcessor` (single blocks)
compute, with the attention itself spread over a CP group by `cp.attention`.

As in FLUX.1, every op of the model except attention is token-local: the linears, the QK RMS norms, the adaLN
modulation (one set per sample, not per token), the SwiGLU MLPs, and RoPE, which is computed per token from the
four-axis `img_ids` / `txt_ids`. A rank that holds `[its text chunk; its image chunk]` (inputs split with
`cp.shard`) therefore computes its chunk of the full output once attention sees the whole sequence. Attention is
non-causal and unmasked, so the interleaved global order of the chunks does not matter.

The single blocks fuse q, k, v and the MLP input into one matmul (`to_qkv_mlp_proj`) and the attention output and
the MLP output into another (`to_out`); both are token-local, so only the attention part needs the group.
"""

from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist
from diffusers.models.attention_dispatch import AttentionBackendName, _AttentionBackendRegistry
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    _get_qkv_projections,
)

from .attention import attention
from .comm import gather, shard

Tensor = torch.Tensor

# (what diffusers set, how to proceed) for the errors of _Flux2CPProcessor._refuse
_BACKEND = (
    "an attention backend",
    "Choose backends only without CP, or call reset_attention_backend() before apply_flux2_context_parallel.",
)
_PARALLEL = ("diffusers' enable_parallelism", "Use diffusers' context parallelism or flux-cp's, not both.")


class _Flux2CPProcessor:
    """What both FLUX.2 CP processors share: the CP group, and the refusal of diffusers' attention backends, its
    own parallelism and attention masks under CP (they all take diffusers' own code path without CP)."""

    def __init__(self, group: dist.ProcessGroup | None = None, mode: str = "ring", ulysses_size: int | None = None):
        self._backend = None
        self._parallel = None
        self.group = group
        self.mode = mode
        self.ulysses_size = ulysses_size

    @property
    def group(self) -> dist.ProcessGroup | None:
        return self._group

    @group.setter
    def group(self, group: dist.ProcessGroup | None) -> None:
        size = 1 if group is None else dist.get_world_size(group)
        if size > 1:
            self._refuse(_BACKEND, self._backend, size)
            self._refuse(_PARALLEL, self._parallel, size)
        self._group, self.cp_size = group, size

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
        out = attention(query, key, value, group=self.group, mode=self.mode, ulysses_size=self.ulysses_size)
        return out.flatten(2, 3).to(query.dtype)


class Flux2CPAttnProcessor(_Flux2CPProcessor):
    """Drop-in replacement for diffusers' `Flux2AttnProcessor` (the double blocks' joint text + image attention)
    that calls `cp.attention` over `group`.

    `Flux2CPAttnProcessor()` (no group, or a group of one rank) is no CP: it computes what `Flux2AttnProcessor`
    computes, bit for bit on CPU. Without CP, an attention mask, a backend chosen with diffusers'
    `set_attention_backend`, or diffusers' own `enable_parallelism` take diffusers' own code path; with a CP group
    of several ranks they cannot apply and are refused with a ValueError.
    """

    def __call__(
        self,
        attn: Flux2Attention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if self._diffusers_path(attention_mask):
            return Flux2AttnProcessor.__call__(
                self, attn, hidden_states, encoder_hidden_states, attention_mask, image_rotary_emb
            )
        # Flux2AttnProcessor joins the text stream whenever the module has text projections (added_kv_proj_dim).
        joint_text = attn.added_kv_proj_dim is not None
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
        hidden_states = self._attend(query, key, value)

        if encoder_hidden_states is not None:
            text_len = encoder_hidden_states.shape[1]
            encoder_hidden_states, hidden_states = hidden_states.split_with_sizes(
                [text_len, hidden_states.shape[1] - text_len], dim=1
            )
            encoder_hidden_states = attn.to_add_out(encoder_hidden_states)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        if encoder_hidden_states is not None:
            return hidden_states, encoder_hidden_states
        return hidden_states


class Flux2CPParallelSelfAttnProcessor(_Flux2CPProcessor):
    """Drop-in replacement for diffusers' `Flux2ParallelSelfAttnProcessor` (the single blocks' fused attention + MLP)
    that calls `cp.attention` over `group`; the fused projections and the MLP stay local to each rank's tokens.
    Without a group it computes what `Flux2ParallelSelfAttnProcessor` computes, bit for bit on CPU; masks, backends
    and diffusers' parallelism as for `Flux2CPAttnProcessor`."""

    def __call__(
        self,
        attn: Flux2ParallelSelfAttention,
        hidden_states: Tensor,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor:
        if self._diffusers_path(attention_mask):
            return Flux2ParallelSelfAttnProcessor.__call__(self, attn, hidden_states, attention_mask, image_rotary_emb)
        hidden_states = attn.to_qkv_mlp_proj(hidden_states)
        # Split by the global q/k/v : MLP ratio, as diffusers does (the same under its tensor parallelism).
        qkv_dim = 3 * attn.inner_dim
        mlp_dim = attn.mlp_hidden_dim * attn.mlp_mult_factor
        local_qkv = hidden_states.shape[-1] * qkv_dim // (qkv_dim + mlp_dim)
        qkv, mlp_hidden_states = torch.split(hidden_states, [local_qkv, hidden_states.shape[-1] - local_qkv], dim=-1)
        query, key, value = (_joint(attn, w, x, None, image_rotary_emb) for w, x in zip("qkv", qkv.chunk(3, dim=-1)))
        hidden_states = self._attend(query, key, value)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))


# Per tensor: (image projection, norm, text projection, text norm); None where the tensor has no norm.
_PARTS = {
    "q": ("to_q", "norm_q", "add_q_proj", "norm_added_q"),
    "k": ("to_k", "norm_k", "add_k_proj", "norm_added_k"),
    "v": ("to_v", None, "add_v_proj", None),
}


def _joint(
    attn: torch.nn.Module, which: str, x: Tensor, e: Tensor | None, rope: tuple[Tensor, Tensor] | None
) -> Tensor:
    """One of q, k, v from its projections of the image tokens `x` and the text tokens `e` (None: no text stream),
    as diffusers' FLUX.2 processors compute it: `[text; image]` tokens, `[B, S, H, D]`, normed, RoPE applied."""
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


# Per attention module class: (our processor, the diffusers processor it replaces and may swap back for).
_PROCESSORS: dict[type, tuple[type, type]] = {
    Flux2Attention: (Flux2CPAttnProcessor, Flux2AttnProcessor),
    Flux2ParallelSelfAttention: (Flux2CPParallelSelfAttnProcessor, Flux2ParallelSelfAttnProcessor),
}
_ORIGINAL = "_flux_cp_original_processor"
_GUARD = "_flux_cp_guard"


def _attention_modules(model: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    return [(n, m) for n, m in model.named_modules() if type(m) in _PROCESSORS]


def apply_flux2_context_parallel(
    transformer: torch.nn.Module,
    group: dist.ProcessGroup | None,
    mode: str = "ring",
    ulysses_size: int | None = None,
) -> torch.nn.Module:
    """Install `Flux2CPAttnProcessor` on every `Flux2Attention` and `Flux2CPParallelSelfAttnProcessor` on every
    `Flux2ParallelSelfAttention` of a FLUX.2 transformer (also one wrapped by peft or FSDP); the original processors
    are kept for `remove_flux2_context_parallel`. Returns the model.

    With a CP group of several ranks, every forward first checks the processors, since diffusers replaces them
    (`Flux2KleinKVPipeline` installs its KV-cache processors): a processor rebuilt without arguments joins the
    group again, diffusers' default FLUX.2 processors are swapped back for the CP ones, and any other processor
    (which would silently attend within one rank's slice) or a `kv_cache_mode` argument stops the forward with a
    ValueError."""
    modules = _attention_modules(transformer)
    if not modules:
        raise ValueError(
            f"{type(transformer).__name__} has no Flux2Attention modules: is it a FLUX.2 transformer "
            "(Flux2Transformer2DModel)?"
        )
    for _, m in modules:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.processor)
        processor = _PROCESSORS[type(m)][0](group, mode=mode, ulysses_size=ulysses_size)
        # A backend chosen with set_attention_backend stays chosen (or is refused under CP).
        processor._attention_backend = getattr(m.processor, "_attention_backend", None)
        m.set_processor(processor)
    _remove_guard(transformer)
    if processor.cp_size > 1:
        guard = functools.partial(_keep_context_parallel, modules, group, mode, ulysses_size)
        handle = transformer.register_forward_pre_hook(lambda _m, _a, kwargs: guard(kwargs), with_kwargs=True)
        setattr(transformer, _GUARD, handle)
    return transformer


def _keep_context_parallel(
    modules: list[tuple[str, torch.nn.Module]],
    group: dist.ProcessGroup,
    mode: str,
    ulysses_size: int | None,
    kwargs: dict,
) -> None:
    n = dist.get_world_size(group)
    if kwargs.get("kv_cache_mode") is not None:
        raise ValueError(
            f"kv_cache_mode={kwargs['kv_cache_mode']!r} (the reference-image KV cache of Flux2KleinKVPipeline) is not "
            f"supported under flux-cp's context parallelism over {n} ranks; use Flux2KleinPipeline, or run without CP"
        )
    for name, m in modules:
        p = m.processor
        ours, default = _PROCESSORS[type(m)]
        if isinstance(p, ours):
            if p.group is None:  # rebuilt by diffusers as `type(processor)()`
                p.group, p.mode, p.ulysses_size = group, mode, ulysses_size
        elif type(p) is default:
            m.set_processor(ours(group, mode=mode, ulysses_size=ulysses_size))
        else:
            raise ValueError(
                f"{name} now has a {type(p).__name__}, which does not support flux-cp's context parallelism (the "
                f"sequence is split over {n} ranks). Use diffusers' default FLUX.2 processors under CP, or call "
                "remove_flux2_context_parallel(transformer) to run without it."
            )


def _remove_guard(transformer: torch.nn.Module) -> None:
    if hasattr(transformer, _GUARD):
        getattr(transformer, _GUARD).remove()
        delattr(transformer, _GUARD)


def remove_flux2_context_parallel(transformer: torch.nn.Module) -> torch.nn.Module:
    """Restore the processors that `apply_flux2_context_parallel` replaced."""
    _remove_guard(transformer)
    for _, m in _attention_modules(transformer):
        if hasattr(m, _ORIGINAL):
            m.set_processor(getattr(m, _ORIGINAL))
            delattr(m, _ORIGINAL)
    return transformer


# The sequence dimension of each split input: `Flux2Pipeline` passes ids as [B, S, 4]; [S, 4] is accepted too.
_SPLITS = ("hidden_states", "encoder_hidden_states", "img_ids", "txt_ids")


@contextlib.contextmanager
def full_sequence_io(transformer: torch.nn.Module, group: dist.ProcessGroup | None):
    """Inside this context a CP-enabled FLUX.2 transformer takes and returns *full* sequences, as `Flux2Pipeline`
    and `Flux2KleinPipeline` pass them (reference-image tokens included, after the generated image's): its inputs
    (`hidden_states`, `encoder_hidden_states` `[B, S, C]`, `img_ids`, `txt_ids` `[B, S, 4]` or `[S, 4]`) are split
    along the sequence with `shard` before the call, and its output `sample` is gathered after. Every rank of the
    group must make the same calls (same latents and prompts)."""
    if group is None or dist.get_world_size(group) == 1:
        yield transformer
        return

    def pre(_module, args, kwargs):
        if args:
            raise ValueError("full_sequence_io expects keyword arguments, as Flux2Pipeline passes them")
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
