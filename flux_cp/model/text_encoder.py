"""--train_text_encoder: a LoRA on the text encoder the model family trains (`Family.trained_text_encoder`: FLUX.1's
CLIP, as diffusers' FLUX.1 LoRA example trains it, on the layers the family names with the transformer's --rank,
--lora_alpha and --lora_dropout, at --text_encoder_lr), written into the LoRA file as the `text_encoder.*` keys the
pipeline's `save_lora_weights` writes.

CLIP runs every step on the captions of the rank's samples (its cached encodings are not used; T5's are). Under CP
every rank of a group holds the same samples, so each runs CLIP on the same captions, and its backward gives CLIP the
gradient of that rank's share of the loss. Those gradients are averaged over all ranks exactly as DDP averages the
transformer's (docs/design.md, rule 4), which gives the full-sequence gradient: CP equals no CP. CLIP is small, so it
is kept whole on every rank, outside accelerate's prepare (no DDP wrapper: one code path for every layout), and its
gradients are averaged here once per optimizer step."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from flux_cp.errors import UsageError
from flux_cp.rng import Stream, generator

if TYPE_CHECKING:
    from flux_cp.config.training import LoraConfig
    from flux_cp.families.encoders import Encoders

Tensor = torch.Tensor


def check_sharding(train_text_encoder: bool, sharded: bool) -> None:
    """With FSDP2, accelerate's prepare maps every parameter of the optimizer to the transformer's shards and fails on
    any other (`fsdp2_switch_optimizer_parameters`: KeyError), so the text encoder's LoRA cannot join the optimizer
    there. A LoRA run holds its weights whole under DDP, the config for LoRA here anyway."""
    if train_text_encoder and sharded:
        raise UsageError(
            "--train_text_encoder is not supported with FSDP (accelerate's FSDP2 prepares the transformer's weights "
            "alone and cannot put the text encoder's LoRA in the same optimizer): launch with a DDP config "
            "(accelerate_configs/ddp_*.yaml, or gpu1.yaml on one GPU), where a LoRA run keeps its weights whole",
            agreed=True,
        )


class TrainedTextEncoder:
    """The text encoder `name` of `encoders` with LoRA adapters on its layers `targets`, its trainable weights in fp32
    (`names`, `targets`: the family's `trained_text_encoder` and `trained_text_encoder_targets`). `argument`: the
    transformer's forward argument its output feeds, `entry`: the pipeline's argument (and the cached encoding's
    name) of the same (FLUX.1: CLIP's pooled embedding, `pooled_projections` and `pooled_prompt_embeds`)."""

    def __init__(
        self, encoders: Encoders, names: tuple[str, str, str], targets: tuple[str, ...], lora: LoraConfig, seed: int
    ):
        from peft import LoraConfig as PeftLoraConfig

        self.encoders = encoders
        self.name, self.argument, self.entry = names
        self.module = module = encoders.text_encoders[self.name]
        config = PeftLoraConfig(
            r=lora.rank,
            lora_alpha=lora.lora_alpha,
            lora_dropout=lora.lora_dropout,
            init_lora_weights="gaussian",
            target_modules=list(targets),
        )
        # Seeded apart from the transformer's adapters (flux_cp.model.lora.add_lora): every layout starts alike.
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(generator(Stream.TEXT_ENCODER_LORA, seed).initial_seed())
            module.add_adapter(config)
        for p in self.parameters():
            p.data = p.data.float()
        module.train()  # as diffusers' example (CLIP has no dropout; --lora_dropout applies)

    def named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        return [(n, p) for n, p in self.module.named_parameters() if p.requires_grad]

    def parameters(self) -> list[torch.nn.Parameter]:
        return [p for _, p in self.named_parameters()]

    def inputs(self, captions: list[str], dtype: torch.dtype) -> dict[str, Tensor]:
        """The transformer's argument this encoder feeds, for `captions`, with gradients to its LoRA."""
        return {self.argument: self.encoders.trained_text(self.module, captions).to(dtype)}

    @torch.no_grad()
    def pipeline_inputs(self, prompts: list[str], dtype: torch.dtype) -> dict[str, Tensor]:
        """The pipeline's argument this encoder gives, for validation `prompts`, with the current weights."""
        self.module.eval()
        try:
            return {self.entry: self.encoders.trained_text(self.module, prompts).to(dtype)}
        finally:
            self.module.train()

    def average_gradients(self) -> None:
        """Average the LoRA's gradients over all ranks (the mean DDP takes of the transformer's); a rank whose
        backward left a gradient unset contributes zeros. One all-reduce of one flat buffer."""
        params = self.parameters()
        for p in params:
            if p.grad is None:
                p.grad = torch.zeros_like(p)
        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat)
        flat /= dist.get_world_size()
        offset = 0
        for p in params:
            n = p.numel()
            p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
            offset += n

    def lora_weights(self) -> dict[str, Tensor]:
        """The LoRA's weights as `FluxPipeline.save_lora_weights` names them (`text_encoder.<module>.lora_A.weight`),
        on the CPU."""
        from peft.utils import get_peft_model_state_dict

        state = get_peft_model_state_dict(self.module, save_embedding_layers=False)
        return {f"{self.name}.{k}": v.detach().float().cpu().clone() for k, v in state.items()}  # a copy (EMA swaps)

    def adapter_config(self) -> dict | None:
        """The peft LoraConfig of the adapter, as a dict (the LoRA file's adapter metadata)."""
        config = getattr(self.module, "peft_config", {}).get("default")
        return config.to_dict() if config is not None else None
