"""Context parallelism for diffusers' `FluxTransformer2DModel` (FLUX.1, FLUX.1 Kontext): an attention processor
that computes exactly what `FluxAttnProcessor` computes, with the attention itself spread over a CP group.

Every op of the Flux transformer except attention is token-local, and RoPE is computed per token from
`img_ids`/`txt_ids`, so a rank that holds `[its text chunk; its image chunk]` (inputs split with
`cp.shard`) computes its chunk of the full output once attention sees the whole sequence. Attention is
non-causal and unmasked, so the interleaved global order of the chunks does not matter.
"""

from __future__ import annotations

import torch
from diffusers.models.transformers.transformer_flux import FluxAttention, FluxAttnProcessor, _get_qkv_projections

from .processor import JointCPAttnProcessor, register

Tensor = torch.Tensor


class FluxCPAttnProcessor(JointCPAttnProcessor):
    """Drop-in replacement for diffusers' `FluxAttnProcessor` that calls `cp.attention` with a `CPContext`.

    `FluxCPAttnProcessor()` (no context, or a group of one rank) is no CP: it computes what `FluxAttnProcessor`
    computes, bit for bit on CPU in fp32. Masks, backends and diffusers' own parallelism: see `CPAttnProcessor`.
    """

    default = FluxAttnProcessor
    fused_projections = staticmethod(_get_qkv_projections)

    def _project(self, attn: FluxAttention, hidden_states: Tensor, text: Tensor | None):
        if text is None:
            return hidden_states
        text_len = text.shape[1]
        text, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        return hidden_states, attn.to_add_out(text.contiguous())


register(FluxAttention, FluxCPAttnProcessor, FluxAttnProcessor)
