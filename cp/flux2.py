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

import torch
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2ParallelSelfAttention,
    Flux2ParallelSelfAttnProcessor,
    Flux2Transformer2DModel,
    _get_qkv_projections,
)

from .processor import CPAttnProcessor, JointCPAttnProcessor, joint, register, register_call_check

Tensor = torch.Tensor


class Flux2CPAttnProcessor(JointCPAttnProcessor):
    """Drop-in replacement for diffusers' `Flux2AttnProcessor` (the double blocks' joint text + image attention)
    that calls `cp.attention` with a `CPContext`.

    `Flux2CPAttnProcessor()` (no context, or a group of one rank) is no CP: it computes what `Flux2AttnProcessor`
    computes, bit for bit on CPU. Masks, backends and diffusers' own parallelism: see `CPAttnProcessor`.
    """

    default = Flux2AttnProcessor
    fused_projections = staticmethod(_get_qkv_projections)

    def _project(self, attn: Flux2Attention, hidden_states: Tensor, text: Tensor | None):
        if text is not None:
            text_len = text.shape[1]
            text, hidden_states = hidden_states.split_with_sizes([text_len, hidden_states.shape[1] - text_len], dim=1)
            text = attn.to_add_out(text)
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states))
        return (hidden_states, text) if text is not None else hidden_states


class Flux2CPParallelSelfAttnProcessor(CPAttnProcessor):
    """Drop-in replacement for diffusers' `Flux2ParallelSelfAttnProcessor` (the single blocks' fused attention + MLP)
    that calls `cp.attention` with a `CPContext`; the fused projections and the MLP stay local to each rank's
    tokens. Without CP it computes what `Flux2ParallelSelfAttnProcessor` computes, bit for bit on CPU."""

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
        query, key, value = (joint(attn, w, x, None, image_rotary_emb) for w, x in zip("qkv", qkv.chunk(3, dim=-1)))
        hidden_states = self._attend(query, key, value)
        mlp_hidden_states = attn.mlp_act_fn(mlp_hidden_states)
        return attn.to_out(torch.cat([hidden_states, mlp_hidden_states], dim=-1))


def _no_kv_cache(kwargs: dict, n: int) -> None:
    if kwargs.get("kv_cache_mode") is not None:
        raise ValueError(
            f"kv_cache_mode={kwargs['kv_cache_mode']!r} (the reference-image KV cache of Flux2KleinKVPipeline) is not "
            f"supported under flux-cp's context parallelism over {n} ranks; use Flux2KleinPipeline, or run without CP"
        )


register(Flux2Attention, Flux2CPAttnProcessor, Flux2AttnProcessor)
register(Flux2ParallelSelfAttention, Flux2CPParallelSelfAttnProcessor, Flux2ParallelSelfAttnProcessor)
register_call_check(Flux2Transformer2DModel, _no_kv_cache)
