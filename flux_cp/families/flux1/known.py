"""The FLUX.1 models on the Hugging Face Hub that this trainer knows without downloading anything: their
transformer configs (so `--plan` works offline for them) and their pipelines and licenses (the model card).

FLUX.1 [schnell] is FLUX.1 [dev]'s architecture without the guidance embedding (diffusers'
scripts/convert_flux_to_diffusers.py sets `guidance_embeds` only when the checkpoint has `guidance_in` weights);
FLUX.1 Kontext [dev] has FLUX.1 [dev]'s transformer config.
"""

from __future__ import annotations

from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
from flux_cp.families.known import KnownModel

_DEV_LICENSE = "flux-1-dev-non-commercial-license"


def _dev_licensed(model_id: str) -> dict:
    return {
        "license": "other",
        "license_name": _DEV_LICENSE,
        "license_link": f"https://huggingface.co/{model_id}/blob/main/LICENSE.md",
    }


_DEV, _SCHNELL, _KONTEXT = (
    "black-forest-labs/FLUX.1-dev",
    "black-forest-labs/FLUX.1-schnell",
    "black-forest-labs/FLUX.1-Kontext-dev",
)
KNOWN = (
    KnownModel(_DEV, dict(FLUX1_DEV_TRANSFORMER), "FluxPipeline", **_dev_licensed(_DEV)),
    KnownModel(_SCHNELL, {**FLUX1_DEV_TRANSFORMER, "guidance_embeds": False}, "FluxPipeline", "apache-2.0"),
    KnownModel(_KONTEXT, dict(FLUX1_DEV_TRANSFORMER), "FluxKontextPipeline", **_dev_licensed(_KONTEXT)),
)
