"""Context parallelism for diffusers' `FluxTransformer2DModel`: an attention processor that computes
exactly what `FluxAttnProcessor` computes, with the attention itself spread over a CP group.

Every op of the Flux transformer except attention is token-local, and RoPE is computed per token from
`img_ids`/`txt_ids`, so a rank that holds `[its text chunk; its image chunk]` (inputs split with
`cp.shard`) computes its chunk of the full output once attention sees the whole sequence. Attention is
non-causal and unmasked, so the interleaved global order of the chunks does not matter.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist
from diffusers.models.embeddings import apply_rotary_emb
from diffusers.models.transformers.transformer_flux import FluxAttention, _get_qkv_projections

from .attention import attention
from .comm import gather, shard

Tensor = torch.Tensor


class FluxCPAttnProcessor:
    """Drop-in replacement for diffusers' `FluxAttnProcessor` that calls `cp.attention` over `group`."""

    def __init__(self, group: dist.ProcessGroup | None, mode: str = "ring", ulysses_size: int | None = None):
        self.group = group
        self.mode = mode
        self.ulysses_size = ulysses_size

    def __call__(
        self,
        attn: FluxAttention,
        hidden_states: Tensor,
        encoder_hidden_states: Tensor | None = None,
        attention_mask: Tensor | None = None,
        image_rotary_emb: tuple[Tensor, Tensor] | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        if attention_mask is not None:
            raise ValueError("FluxCPAttnProcessor does not support attention masks (Flux training uses none)")
        query, key, value, encoder_query, encoder_key, encoder_value = _get_qkv_projections(
            attn, hidden_states, encoder_hidden_states
        )
        query = attn.norm_q(query.unflatten(-1, (-1, attn.head_dim)))
        key = attn.norm_k(key.unflatten(-1, (-1, attn.head_dim)))
        value = value.unflatten(-1, (-1, attn.head_dim))

        if attn.added_kv_proj_dim is not None:
            encoder_query = attn.norm_added_q(encoder_query.unflatten(-1, (-1, attn.head_dim)))
            encoder_key = attn.norm_added_k(encoder_key.unflatten(-1, (-1, attn.head_dim)))
            encoder_value = encoder_value.unflatten(-1, (-1, attn.head_dim))
            query = torch.cat([encoder_query, query], dim=1)
            key = torch.cat([encoder_key, key], dim=1)
            value = torch.cat([encoder_value, value], dim=1)

        if image_rotary_emb is not None:
            query = apply_rotary_emb(query, image_rotary_emb, sequence_dim=1)
            key = apply_rotary_emb(key, image_rotary_emb, sequence_dim=1)

        hidden_states = attention(query, key, value, group=self.group, mode=self.mode, ulysses_size=self.ulysses_size)
        hidden_states = hidden_states.flatten(2, 3).to(query.dtype)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states


_ORIGINAL = "_flux_cp_original_processor"


def _flux_attention_modules(model: torch.nn.Module) -> list[FluxAttention]:
    return [m for m in model.modules() if isinstance(m, FluxAttention)]


def apply_context_parallel(
    transformer: torch.nn.Module,
    group: dist.ProcessGroup | None,
    mode: str = "ring",
    ulysses_size: int | None = None,
) -> torch.nn.Module:
    """Install `FluxCPAttnProcessor` on every attention module of a Flux transformer (also one wrapped by
    peft or FSDP); the original processors are kept for `remove_context_parallel`. Returns the model."""
    modules = _flux_attention_modules(transformer)
    if not modules:
        raise ValueError(f"{type(transformer).__name__} has no FluxAttention modules: is it a Flux transformer?")
    for m in modules:
        if not hasattr(m, _ORIGINAL):
            setattr(m, _ORIGINAL, m.processor)
        m.set_processor(FluxCPAttnProcessor(group, mode=mode, ulysses_size=ulysses_size))
    return transformer


def remove_context_parallel(transformer: torch.nn.Module) -> torch.nn.Module:
    """Restore the processors that `apply_context_parallel` replaced."""
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
