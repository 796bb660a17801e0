"""FLUX.1's tokens: latents packed into 2x2-patch tokens and their position ids, as `FluxPipeline` computes them
(`_pack_latents`, `_prepare_latent_image_ids`), text ids, and FLUX.1 Kontext's reference ids (`FluxKontextPipeline`:
the target's ids with the first coordinate set to 1)."""

from __future__ import annotations

import torch

Tensor = torch.Tensor


def pack_latents(latents: Tensor) -> Tensor:
    """`[B, C, H, W]` -> `[B, H/2 * W/2, 4C]` (2x2 patches become tokens), as `FluxPipeline._pack_latents`."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: Tensor, height: int, width: int) -> Tensor:
    """Inverse of `pack_latents` for a latent of `height x width`."""
    b, _, d = tokens.shape
    x = tokens.view(b, height // 2, width // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, height, width)


def image_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """Position ids `[H/2 * W/2, 3]` of the packed latent tokens, as `FluxPipeline._prepare_latent_image_ids`."""
    h, w = height // 2, width // 2
    ids = torch.zeros(h, w, 3, device=device, dtype=dtype)
    ids[..., 1] += torch.arange(h, device=device, dtype=dtype)[:, None]
    ids[..., 2] += torch.arange(w, device=device, dtype=dtype)[None, :]
    return ids.reshape(h * w, 3)


def text_ids(length: int, device=None, dtype=torch.float32) -> Tensor:
    return torch.zeros(length, 3, device=device, dtype=dtype)


# First position-id coordinate of the reference tokens (the target's is 0), as FluxKontextPipeline.
REFERENCE_INDEX = 1


def reference_ids(height: int, width: int, device=None, dtype=torch.float32) -> Tensor:
    """FLUX.1 Kontext: position ids `[H/2 * W/2, 3]` of a reference latent of `height x width`: the target's ids
    with the first coordinate set to 1, so RoPE tells the two images apart while their pixels stay aligned."""
    ids = image_ids(height, width, device=device, dtype=dtype)
    ids[:, 0] = REFERENCE_INDEX
    return ids
