"""A tiny FLUX.1 built locally: same diffusers layout and component classes as
black-forest-labs/FLUX.1-dev (transformer with guidance embedding, VAE, CLIP + T5 encoders with their
tokenizers, flow-matching scheduler), random weights, tokenizers made from a byte/character vocabulary.
No downloads (flux_cp.families.builder). Used as the embedded default of `train_flux_cp.py` and by the tests
(`python -m flux_cp.tiny` builds one). The Kontext variant has
the same components saved as a `FluxKontextPipeline` (FLUX.1 Kontext [dev] is FLUX.1-dev's transformer
architecture, fed reference-image tokens after the target's).
"""

from __future__ import annotations

import os
import string
from pathlib import Path

import torch

from flux_cp.families.builder import SCHEDULER_CONFIG, TINY_VAE_LAYERS, Recipe, build_once, bytes_to_unicode, home
from flux_cp.files import write_json

# Bump when the recipe below changes, so cached copies are rebuilt.
TINY_VERSION = 1

# FLUX.1-dev's transformer config (black-forest-labs/FLUX.1-dev, transformer/config.json).
FLUX1_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


# The tiny default: FLUX.1-dev's transformer at a few thousandths of its widths and depths.
TRANSFORMER_CONFIG = dict(
    FLUX1_DEV_TRANSFORMER,
    in_channels=16,  # 4 latent channels x 2x2 packing
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    axes_dims_rope=(4, 6, 6),
)


# FLUX.1-dev's text encoders and VAE (black-forest-labs/FLUX.1-dev: text_encoder/, text_encoder_2/, vae/config.json):
# CLIP ViT-L/14's text tower, the T5 v1.1 XXL encoder, and the 16-channel VAE. The full-shapes preset writes them as
# configs only; the tokenizers stay the tiny ones (their ids are valid in the full vocabularies).
FLUX1_CLIP = dict(
    vocab_size=49408,
    hidden_size=768,
    intermediate_size=3072,
    num_hidden_layers=12,
    num_attention_heads=12,
    max_position_embeddings=77,
    projection_dim=768,
    hidden_act="quick_gelu",
)
FLUX1_T5 = dict(
    vocab_size=32128,
    d_model=4096,
    d_kv=64,
    d_ff=10240,
    num_layers=24,
    num_heads=64,
    relative_attention_num_buckets=32,
    relative_attention_max_distance=128,
    feed_forward_proj="gated-gelu",
    is_gated_act=True,
    dense_act_fn="gelu_new",
    tie_word_embeddings=False,
)
FLUX1_VAE = dict(
    in_channels=3,
    out_channels=3,
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4,
    block_out_channels=(128, 256, 512, 512),
    layers_per_block=2,
    act_fn="silu",
    latent_channels=16,
    norm_num_groups=32,
    sample_size=1024,
    scaling_factor=0.3611,
    shift_factor=0.1159,
    use_quant_conv=False,
    use_post_quant_conv=False,
    force_upcast=True,
)


def tiny_transformer(seed: int = 0, **overrides):
    """A randomly initialised tiny `FluxTransformer2DModel` (fp32)."""
    from diffusers import FluxTransformer2DModel

    config = {**TRANSFORMER_CONFIG, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FluxTransformer2DModel(**config)
        # diffusers zero-initialises nothing here, but make the output layer non-trivial anyway so that
        # tests see gradients flow through every block.
        torch.nn.init.normal_(model.proj_out.weight, std=0.02)
    return model


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = list(bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in string.ascii_letters + string.digits + string.punctuation:
        pieces += [(c, -3.0), ("\u2581" + c, -3.5)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def build_tiny_pipeline(
    seed: int = 0,
    clip_dim: int = 32,
    t5_dim: int = 32,
    latent_channels: int | None = None,
    transformer: bool = True,
    kontext: bool = False,
):
    """All components of a tiny FluxPipeline (FluxKontextPipeline with `kontext`), fp32, on CPU. The dims let
    the encoders feed a transformer of another size (the flux1-dev-shapes preset); `transformer=False` leaves
    the transformer out."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=clip_dim,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=clip_dim,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=t5_dim,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
                decoder_start_token_id=0,
            )
        )
        vae = AutoencoderKL(
            **TINY_VAE_LAYERS,
            latent_channels=latent_channels or TRANSFORMER_CONFIG["in_channels"] // 4,
            norm_num_groups=4,
            sample_size=128,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    transformer = tiny_transformer(seed) if transformer else None
    scheduler = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    return (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def default_cache_dir(kontext: bool = False) -> Path:
    return home() / f"tiny-flux{'-kontext' if kontext else ''}-v{TINY_VERSION}"


def ensure_tiny_pipeline(path: str | os.PathLike | None = None, kontext: bool = False) -> Path:
    """Return a folder holding the tiny pipeline (or its Kontext variant) in diffusers layout, building it once."""
    path = Path(path) if path else default_cache_dir(kontext)
    name = f"tiny-flux1{'-kontext' if kontext else ''}-v{TINY_VERSION}"
    pipeline = "FluxKontextPipeline" if kontext else "FluxPipeline"
    recipe = Recipe(name, pipeline, TRANSFORMER_CONFIG, __file__)
    return build_once(path, lambda tmp: build_tiny_pipeline(kontext=kontext).save_pretrained(tmp), recipe)


def write_flux1_dev_full_shapes(path: str | os.PathLike, kontext: bool = False) -> Path:
    """A pipeline folder of FLUX.1-dev's configs for every component - the transformer, CLIP-L, the T5-XXL encoder and
    the VAE - and no weights (train with `--transformer_init random`, which builds each component from its config with
    random weights): the encoding phase and validation at full size, for benchmarks without downloads. The tokenizers
    and the scheduler are the tiny folder's. `kontext`: saved as a FluxKontextPipeline."""
    name = f"flux1-dev-full-shapes{'-kontext' if kontext else ''}-v{TINY_VERSION}"
    pipeline = "FluxKontextPipeline" if kontext else "FluxPipeline"
    recipe = Recipe(name, pipeline, FLUX1_DEV_TRANSFORMER, __file__)
    return build_once(Path(path), lambda tmp: _write_flux1_dev_full_shapes(tmp, kontext), recipe)


def _write_flux1_dev_full_shapes(path: Path, kontext: bool) -> None:
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, T5Config

    pipe = build_tiny_pipeline(transformer=False)
    for name in ("tokenizer", "tokenizer_2", "scheduler"):
        getattr(pipe, name).save_pretrained(path / name)
    tok, tok2 = pipe.tokenizer, pipe.tokenizer_2
    CLIPTextConfig(
        **FLUX1_CLIP,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        architectures=["CLIPTextModel"],
    ).save_pretrained(path / "text_encoder")
    T5Config(
        **FLUX1_T5,
        pad_token_id=tok2.pad_token_id,
        eos_token_id=tok2.eos_token_id,
        decoder_start_token_id=0,
        architectures=["T5EncoderModel"],
    ).save_pretrained(path / "text_encoder_2")
    with torch.device("meta"):
        AutoencoderKL(**FLUX1_VAE).save_config(path / "vae")
        FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER).save_config(path / "transformer")
    index = {
        "_class_name": "FluxKontextPipeline" if kontext else "FluxPipeline",
        "_diffusers_version": __import__("diffusers").__version__,
        "scheduler": ["diffusers", type(pipe.scheduler).__name__],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "text_encoder_2": ["transformers", "T5EncoderModel"],
        "tokenizer": ["transformers", type(tok).__name__],
        "tokenizer_2": ["transformers", type(tok2).__name__],
        "transformer": ["diffusers", "FluxTransformer2DModel"],
        "vae": ["diffusers", "AutoencoderKL"],
    }
    write_json(path / "model_index.json", index)


def write_flux1_dev_shapes(path: str | os.PathLike, kontext: bool = False) -> Path:
    """A pipeline folder whose transformer/config.json is FLUX.1-dev's (no transformer weights: train with
    `--transformer_init random`), with tiny VAE and text encoders of the matching output sizes (16 latent
    channels, CLIP 768, T5 4096). For benchmarks and equivalence runs at FLUX.1 size without downloads.
    `kontext`: the same folder as a FluxKontextPipeline (FLUX.1 Kontext [dev] has FLUX.1-dev's transformer
    config). Written like the tiny folder (`build_once`): only into a new or empty folder, or one built before."""
    name = f"flux1-dev-shapes{'-kontext' if kontext else ''}-v{TINY_VERSION}"
    pipeline = "FluxKontextPipeline" if kontext else "FluxPipeline"
    recipe = Recipe(name, pipeline, FLUX1_DEV_TRANSFORMER, __file__)
    return build_once(Path(path), lambda tmp: _write_flux1_dev_shapes(tmp, kontext), recipe)


def _write_flux1_dev_shapes(path: Path, kontext: bool) -> None:
    from diffusers import FluxTransformer2DModel

    pipe = build_tiny_pipeline(clip_dim=768, t5_dim=4096, latent_channels=16, transformer=False)
    for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        getattr(pipe, name).save_pretrained(path / name)
    with torch.device("meta"):
        meta = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER)
    meta.save_config(path / "transformer")
    index = {
        "_class_name": "FluxKontextPipeline" if kontext else "FluxPipeline",
        "_diffusers_version": __import__("diffusers").__version__,
    }
    for name, obj in [
        ("scheduler", pipe.scheduler),
        ("text_encoder", pipe.text_encoder),
        ("text_encoder_2", pipe.text_encoder_2),
        ("tokenizer", pipe.tokenizer),
        ("tokenizer_2", pipe.tokenizer_2),
        ("vae", pipe.vae),
        ("transformer", meta),
    ]:
        lib = "diffusers" if type(obj).__module__.startswith("diffusers") else "transformers"
        index[name] = [lib, type(obj).__name__]
    write_json(path / "model_index.json", index)
