"""A tiny FLUX.2 built locally (random weights, no downloads): the transformer for the CP tests."""

from __future__ import annotations

import torch

# A tiny Flux2Transformer2DModel: 4 latent channels x 2x2 patchify = 16 input channels; 4 heads of 16 with
# 4 RoPE axes of 4 (FLUX.2 rotates all of head_dim: the axes sum to attention_head_dim).
TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=48,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
)


def tiny_flux2_transformer(seed: int = 0, **overrides):
    """A randomly initialised tiny `Flux2Transformer2DModel` (fp32)."""
    from diffusers import Flux2Transformer2DModel

    config = {**TRANSFORMER_CONFIG, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Flux2Transformer2DModel(**config)
    return model
