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

from .processor import CPAttnProcessor, joint_qkv, register

Tensor = torch.Tensor


class FluxCPAttnProcessor(CPAttnProcessor):
    """Drop-in replacement for diffusers' `FluxAttnProcessor` that calls `cp.attention` with a `CPContext`.

    `FluxCPAttnProcessor()` (no context, or a group of one rank) is no CP: it computes what `FluxAttnProcessor`
    computes, bit for bit on CPU in fp32. Masks, backends and diffusers' own parallelism: see `CPAttnProcessor`.
    """

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
        qkv = joint_qkv(attn, hidden_states, encoder_hidden_states, image_rotary_emb, _get_qkv_projections)
        hidden_states = self._attend(*qkv)

        if encoder_hidden_states is None:
            return hidden_states
        text_len = encoder_hidden_states.shape[1]
        encoder_hidden_states, hidden_states = hidden_states[:, :text_len], hidden_states[:, text_len:]
        hidden_states = attn.to_out[1](attn.to_out[0](hidden_states.contiguous()))
        encoder_hidden_states = attn.to_add_out(encoder_hidden_states.contiguous())
        return hidden_states, encoder_hidden_states


register(FluxAttention, FluxCPAttnProcessor, FluxAttnProcessor)
