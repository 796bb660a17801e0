"""A model family that is not FLUX, added the way a third family would be: this one module (a small DiT with one
block list, its own attention module and CP processor registered with `cp.register`, and its `Family`) and one
registry line, `families.register(DIT)`, in every process before the trainer runs. It trains through the trainer
unchanged, with CP over 2 ranks and three of its four blocks offloaded (--offload_blocks: their frozen weights in host
memory, copied in before each use) giving one process's losses and LoRA weights. It reuses the tiny FLUX.1's VAE and
text encoders (CLIP, T5) for its latents and text.

Run as a script (`accelerate launch tests/test_family_seam.py FLAGS`) it is `train_flux_cp.py` with the family
registered."""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders import PeftAdapterMixin

import cp
from flux_cp.errors import UsageError
from flux_cp.families import FLUX1
from flux_cp.families.base import Family

Tensor = torch.Tensor


# --- the model: a DiT with one list of blocks over [text; image] tokens -----------------------------------------


class DiTAttention(torch.nn.Module):
    """Self-attention over the joint sequence; its processor computes it (diffusers' convention)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.to_q, self.to_k, self.to_v, self.to_out = (torch.nn.Linear(dim, dim) for _ in range(4))
        self.processor = DiTAttnProcessor()

    def set_processor(self, processor) -> None:
        self.processor = processor

    def forward(self, x: Tensor) -> Tensor:
        return self.processor(self, x)

    def qkv(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q, k, v `[B, S, H, D]` of this rank's tokens (every op before the attention is token-local)."""
        return tuple(p(x).unflatten(-1, (self.heads, self.head_dim)) for p in (self.to_q, self.to_k, self.to_v))


class DiTAttnProcessor:
    """The model's own processor: attention over the whole sequence held by this process."""

    def __call__(self, attn: DiTAttention, x: Tensor) -> Tensor:
        q, k, v = (t.transpose(1, 2) for t in attn.qkv(x))
        return attn.to_out(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2))


class DiTCPAttnProcessor(cp.CPAttnProcessor):
    """The same attention with the sequence split over a CP group (`cp.attention` through the processor's context)."""

    def __call__(self, attn: DiTAttention, x: Tensor) -> Tensor:
        return attn.to_out(self._attend(*attn.qkv(x)))


cp.register(DiTAttention, DiTCPAttnProcessor, DiTAttnProcessor)


class DiTBlock(torch.nn.Module):
    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.norm1 = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.attn = DiTAttention(dim, heads)
        self.norm2 = torch.nn.LayerNorm(dim, elementwise_affine=False)
        self.mlp = torch.nn.Sequential(torch.nn.Linear(dim, 4 * dim), torch.nn.GELU(), torch.nn.Linear(4 * dim, dim))
        self.modulation = torch.nn.Linear(dim, 4 * dim)  # adaLN from the timestep and pooled text, per sample

    def forward(self, h: Tensor, t: Tensor) -> Tensor:
        shift, gate, shift2, gate2 = self.modulation(F.silu(t)).unsqueeze(1).chunk(4, dim=-1)
        h = h + gate * self.attn(self.norm1(h) + shift)
        return h + gate2 * self.mlp(self.norm2(h) + shift2)


class TinyDiT(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """Image tokens (packed latents) after the text tokens, positions from the ids (token-local), one block list."""

    _no_split_modules = ["DiTBlock"]

    @register_to_config
    def __init__(self, in_channels: int = 16, num_layers: int = 2, num_attention_heads: int = 4,
                 attention_head_dim: int = 8, joint_attention_dim: int = 32,
                 pooled_projection_dim: int = 32):  # fmt: skip
        super().__init__()
        dim = num_attention_heads * attention_head_dim
        self.x_embedder = torch.nn.Linear(in_channels, dim)
        self.context_embedder = torch.nn.Linear(joint_attention_dim, dim)
        self.positions = torch.nn.Linear(3, dim)
        self.time = torch.nn.Sequential(torch.nn.Linear(1, dim), torch.nn.SiLU(), torch.nn.Linear(dim, dim))
        self.pooled = torch.nn.Linear(pooled_projection_dim, dim)
        self.blocks = torch.nn.ModuleList(DiTBlock(dim, num_attention_heads) for _ in range(num_layers))
        self.norm_out = torch.nn.LayerNorm(dim)
        self.proj_out = torch.nn.Linear(dim, in_channels)

    def forward(self, hidden_states, encoder_hidden_states, pooled_projections, timestep, img_ids, txt_ids,
                return_dict: bool = False):  # fmt: skip
        x = self.x_embedder(hidden_states) + self.positions(img_ids.to(hidden_states.dtype))
        text = self.context_embedder(encoder_hidden_states) + self.positions(txt_ids.to(hidden_states.dtype))
        t = self.time(timestep[:, None].to(hidden_states.dtype)) + self.pooled(pooled_projections)
        h = torch.cat([text, x], dim=1)
        for block in self.blocks:
            h = block(h, t)
        return (self.proj_out(self.norm_out(h[:, text.shape[1] :])),)


# --- the family: everything else the trainer asks, FLUX.1's tiny encoders and tokens reused ---------------------


class DiTFamily(Family):
    name = "test-dit"
    label = pairs_label = "the test DiT"
    transformer_class_name = "TinyDiT"
    pipeline_class_names = ("TinyDiTPipeline",)
    block_lists = (("block", "blocks", "num_layers"),)

    def transformer_class(self) -> type:
        return TinyDiT

    def embedded_default(self, pairs: bool) -> str:
        raise UsageError("the test DiT has no embedded default")

    def load_encoders(self, model, path, dtype, device):
        return FLUX1.load_encoders(model, path, dtype, device)

    def normalizer(self, vae):
        return FLUX1.normalizer(vae)

    def default_vae_encode_mode(self, pairs: bool) -> str:
        return "sample"

    def validation_pipeline(self, pairs, scheduler, encoders, transformer):
        raise NotImplementedError("the test DiT has no pipeline")

    def reference_inputs(self, image, encoders, device) -> dict:
        raise NotImplementedError("the test DiT edits no images")

    def pack(self, latents: Tensor) -> Tensor:
        return FLUX1.pack(latents)

    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        return FLUX1.image_ids(height, width, device)

    def reference_ids(self, height: int, width: int, device=None, index: int = 0) -> Tensor:
        return FLUX1.reference_ids(height, width, device, index)

    def text_ids(self, length: int, device=None) -> Tensor:
        return FLUX1.text_ids(length, device)

    cp_plan = {"hidden_states": 1, "img_ids": 0, "encoder_hidden_states": 1, "txt_ids": 0}  # what CP splits

    def transformer_inputs(self, hidden, img_ids, text, txt_ids, timestep, guidance) -> dict:
        return dict(hidden_states=hidden, encoder_hidden_states=text["prompt_embeds"],
                    pooled_projections=text["pooled_prompt_embeds"], timestep=timestep, img_ids=img_ids,
                    txt_ids=txt_ids, return_dict=False)  # fmt: skip

    def lora_targets(self, pairs: bool, config: dict | None = None) -> tuple[str, ...]:
        return ("attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out")

    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        d, s = config["num_attention_heads"] * config["attention_head_dim"], image_tokens + text_tokens
        return float(2 * 12 * d * d * s * config["num_layers"] * batch), float(4 * s * s * d * config["num_layers"])


DIT = DiTFamily()


def write_model(folder: Path) -> Path:
    """A model folder of the test DiT: the tiny FLUX.1's VAE, text encoders, tokenizers and scheduler beside a
    randomly initialised TinyDiT, named a `TinyDiTPipeline` in model_index.json."""
    from flux_cp.families.flux1.tiny import ensure_tiny_pipeline

    tiny = ensure_tiny_pipeline()
    for part in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        shutil.copytree(tiny / part, folder / part)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        TinyDiT(num_layers=4).save_pretrained(folder / "transformer")
    index = json.loads((tiny / "model_index.json").read_text())
    index.update(_class_name="TinyDiTPipeline", transformer=["test_family_seam", "TinyDiT"])
    (folder / "model_index.json").write_text(json.dumps(index))
    return folder


# --- the test ---------------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_a_family_added_by_one_module_trains_through_the_trainer_with_cp_and_offload_equal_to_one_process(tmp_path):
    from tests.launch import ROOT, assert_same_trajectory, ok, run_args, train

    # The script imports train_flux_cp and this module's family from the repository root.
    root = {"PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)}
    model = write_model(tmp_path / "dit")
    flags = ["--pretrained_model_name_or_path", str(model), "--resolution", "64", "--max_sequence_length", "32",
             "--train_batch_size", "2", "--learning_rate", "1e-2", "--rank", "4"]  # fmt: skip
    ok(train(1, *run_args(tmp_path, "one", 10, *flags), script=Path(__file__), extra_env=root))
    offloaded = [*flags, "--cp_size", "2", "--offload_blocks", "3"]
    result = ok(train(2, *run_args(tmp_path, "cp2", 10, *offloaded), script=Path(__file__), extra_env=root))
    assert "context parallel: ulysses (ulysses 2) over 2 ranks" in result.stderr
    assert "block offload: 3 blocks' frozen weights in pinned host memory" in result.stderr
    assert "no measured activation counts for TinyDiT" in result.stderr  # the planner's estimate, said
    assert_same_trajectory(tmp_path / "cp2", tmp_path / "one")
    card = (tmp_path / "cp2" / "README.md").read_text()
    assert "# the test DiT LoRA" in card and "ComfyUI" not in card
    assert math.isfinite(json.loads((tmp_path / "cp2" / "metrics.jsonl").read_text().splitlines()[-1])["loss"])


if __name__ == "__main__":  # `train_flux_cp.py` with the test DiT's family registered
    import train_flux_cp
    from flux_cp import families
    from flux_cp.run import runner

    families.register(DIT)
    sys.exit(runner.run(train_flux_cp.main))
