"""A tiny FLUX.2 built locally: the diffusers layout and component classes of black-forest-labs/FLUX.2-dev
(`Flux2Pipeline`: Flux2Transformer2DModel with guidance embedding, AutoencoderKLFlux2 with its batch-norm latent
statistics, a Mistral3ForConditionalGeneration text encoder, FlowMatchEulerDiscreteScheduler) and of FLUX.2 [klein]
(`Flux2KleinPipeline`: the same transformer class without guidance embedding, a Qwen3ForCausalLM text encoder with
a Qwen2 tokenizer). Random weights, tokenizers made from a byte vocabulary, no downloads. For the tests and CPU demos;
the "shapes" folders carry FLUX.2 [dev]'s or [klein]'s transformer config at full size (no transformer weights) with
tiny encoders of the matching output sizes, for `--transformer_init random` benchmarks.

The [dev] folder's `tokenizer` is a plain fast tokenizer with a chat template where FLUX.2-dev has a
`PixtralProcessor`: transformers' PixtralProcessor needs torchvision, which is not a dependency here, and
`Flux2Pipeline` encodes prompts through `tokenizer.apply_chat_template` only, which the tokenizer provides with the
same arguments.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from flux_cp.families.builder import SCHEDULER_CONFIG, TINY_VAE_LAYERS, Recipe, build_once, bytes_to_unicode, home
from flux_cp.families.flux2.recipe import DEV_TEXT_LAYERS, KLEIN_TEXT_LAYERS
from flux_cp.files import write_json

# Bump when the recipe below changes, so cached copies are rebuilt.
TINY_FLUX2_VERSION = 1

# The tiny encoders' width: FLUX.2 stacks three hidden layers of its text encoder, so joint_attention_dim = 3 x it.
TINY_TEXT_DIM = 16
TINY_LATENT_CHANNELS = 4  # x 2x2 patchify = the transformer's 16 input channels (FLUX.2: 32 x 4 = 128)

# A tiny Flux2Transformer2DModel: 4 heads of 16 with 4 RoPE axes of 4 (FLUX.2 rotates all of head_dim: the axes
# sum to attention_head_dim).
TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=4 * TINY_LATENT_CHANNELS,
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=3 * TINY_TEXT_DIM,
    timestep_guidance_channels=32,
    mlp_ratio=3.0,
    axes_dims_rope=(4, 4, 4, 4),
    guidance_embeds=True,
)

# Full-size transformer configs, from diffusers' scripts/convert_flux2_to_diffusers.py, get_flux2_transformer_config
# ("flux2-dev", "klein-4b", "klein-9b"; the values of Flux2Transformer2DModel's defaults for [dev]).
FLUX2_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=128,
    num_layers=8,
    num_single_layers=48,
    attention_head_dim=128,
    num_attention_heads=48,
    joint_attention_dim=15360,
    timestep_guidance_channels=256,
    mlp_ratio=3.0,
    axes_dims_rope=(32, 32, 32, 32),
    rope_theta=2000,
    eps=1e-6,
    guidance_embeds=True,
)
FLUX2_KLEIN_4B_TRANSFORMER = {
    **FLUX2_DEV_TRANSFORMER,
    **dict(num_layers=5, num_single_layers=20, num_attention_heads=24, joint_attention_dim=7680, guidance_embeds=False),
}
FLUX2_KLEIN_9B_TRANSFORMER = {
    **FLUX2_DEV_TRANSFORMER,
    **dict(
        num_layers=8, num_single_layers=24, num_attention_heads=32, joint_attention_dim=12288, guidance_embeds=False
    ),
}

# The tiny encoders have as many layers as the last hidden layer Flux2Pipeline / Flux2KleinPipeline stack by
# default (DEV_TEXT_LAYERS, KLEIN_TEXT_LAYERS), so that the pipelines run with their defaults.

# FLUX.2's VAE is AutoencoderKLFlux2's defaults (the conversion script builds `AutoencoderKLFlux2()`): 32 latent
# channels, 4 blocks (8x), batch norm over the 2x2-patchified 128 channels with eps 1e-4.
FLUX2_LATENT_CHANNELS = 32


def tiny_flux2_transformer(seed: int = 0, **overrides):
    """A randomly initialised tiny `Flux2Transformer2DModel` (fp32)."""
    from diffusers import Flux2Transformer2DModel

    config = {**TRANSFORMER_CONFIG, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Flux2Transformer2DModel(**config)
    return model


def _byte_level_tokenizer(specials: list[str]):
    """A byte-level BPE `tokenizers.Tokenizer` without merges: one token per UTF-8 byte, plus `specials`."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {t: i for i, t in enumerate(specials)}
    for c in bytes_to_unicode().values():
        vocab[c] = len(vocab)
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return tok


# Mistral's instruct format ([SYSTEM_PROMPT]...[/SYSTEM_PROMPT][INST]...[/INST]) for the messages Flux2Pipeline
# builds (format_input: a system and a user message, each with a list of {"type": "text"} parts).
_MISTRAL_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['content'] is string %}{% set text = m['content'] %}"
    "{% else %}{% set text = m['content'] | selectattr('type', 'equalto', 'text') | map(attribute='text') | join('') %}"
    "{% endif %}"
    "{% if m['role'] == 'system' %}[SYSTEM_PROMPT]{{ text }}[/SYSTEM_PROMPT]"
    "{% elif m['role'] == 'user' %}[INST]{{ text }}[/INST]"
    "{% else %}{{ text }}{{ eos_token }}{% endif %}{% endfor %}"
)
# Qwen3's chat format as Flux2KleinPipeline uses it (one user message, add_generation_prompt, enable_thinking=False).
_QWEN3_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}"
)


def _mistral_tokenizer():
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>", "<pad>", "[INST]", "[/INST]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"]
    return PreTrainedTokenizerFast(
        tokenizer_object=_byte_level_tokenizer(specials),
        unk_token="<unk>",
        bos_token="<s>",
        eos_token="</s>",
        pad_token="<pad>",
        model_max_length=2048,
        chat_template=_MISTRAL_TEMPLATE,
    )


def _qwen_tokenizer():
    from transformers import Qwen2TokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>"]
    tok = _byte_level_tokenizer(specials)
    vocab = tok.get_vocab()
    return Qwen2TokenizerFast(
        vocab=vocab,
        merges=[],
        unk_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        model_max_length=2048,
        chat_template=_QWEN3_TEMPLATE,
    )


# What the tiny language models share: a narrow MLP, two query heads over one key/value head of 8.
TINY_LM = dict(
    intermediate_size=16, num_attention_heads=2, num_key_value_heads=1, head_dim=8, max_position_embeddings=2048
)


def _mistral3_encoder(tokenizer, text_dim: int):
    """A tiny Mistral3ForConditionalGeneration (Mistral text model, Pixtral vision tower) of width `text_dim` with
    the layers Flux2Pipeline reads."""
    from transformers import Mistral3Config, Mistral3ForConditionalGeneration

    config = Mistral3Config(
        text_config=dict(
            model_type="mistral",
            vocab_size=len(tokenizer),
            hidden_size=text_dim,
            num_hidden_layers=max(DEV_TEXT_LAYERS),
            **TINY_LM,
            rms_norm_eps=1e-5,
            sliding_window=None,
            bos_token_id=tokenizer.bos_token_id,
            eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id,
        ),
        vision_config=dict(
            model_type="pixtral",
            hidden_size=16,
            num_hidden_layers=1,
            num_attention_heads=2,
            intermediate_size=16,
            image_size=32,
            patch_size=8,
            num_channels=3,
        ),
        image_token_index=tokenizer.unk_token_id,  # the tiny folders carry no image tokens
        vision_feature_layer=-1,
        spatial_merge_size=1,
    )
    return Mistral3ForConditionalGeneration(config)


def _qwen3_encoder(tokenizer, text_dim: int):
    """A tiny Qwen3ForCausalLM of width `text_dim` with the layers Flux2KleinPipeline reads."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=text_dim,
        num_hidden_layers=max(KLEIN_TEXT_LAYERS),
        **TINY_LM,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    return Qwen3ForCausalLM(config)


def _vae(latent_channels: int):
    """A tiny AutoencoderKLFlux2 with FLUX.2's 8x compression and non-trivial batch-norm latent statistics (the
    pipelines normalise the patchified latents with `bn.running_mean` / `running_var`; identity stats would hide a
    missing normalisation)."""
    from diffusers import AutoencoderKLFlux2

    vae = AutoencoderKLFlux2(
        **TINY_VAE_LAYERS,
        latent_channels=latent_channels,
        norm_num_groups=4,
        sample_size=128,
        use_quant_conv=False,
        use_post_quant_conv=False,
        mid_block_add_attention=False,
    )
    with torch.no_grad():
        vae.bn.running_mean.copy_(torch.randn(vae.bn.num_features) * 0.2)
        vae.bn.running_var.copy_(torch.rand(vae.bn.num_features) * 1.5 + 0.5)
    return vae


def build_tiny_flux2_pipeline(
    seed: int = 0,
    klein: bool = False,
    text_dim: int = TINY_TEXT_DIM,
    latent_channels: int = TINY_LATENT_CHANNELS,
    transformer: bool = True,
    is_distilled: bool = False,
):
    """All components of a tiny `Flux2Pipeline` ([dev]) or `Flux2KleinPipeline` (`klein`), fp32, on CPU. `text_dim`
    and `latent_channels` let the encoders feed a transformer of another size (the shapes presets);
    `transformer=False` leaves the transformer out. `is_distilled` ([klein] only): the pipeline's flag that turns
    classifier-free guidance off (FLUX.2 [klein] step-distilled checkpoints set it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, Flux2KleinPipeline, Flux2Pipeline

    tokenizer = _qwen_tokenizer() if klein else _mistral_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = (_qwen3_encoder if klein else _mistral3_encoder)(tokenizer, text_dim)
        vae = _vae(latent_channels)
    model = None
    if transformer:
        model = tiny_flux2_transformer(
            seed,
            in_channels=4 * latent_channels,
            joint_attention_dim=3 * text_dim,
            guidance_embeds=not klein,
        )
    components = dict(
        scheduler=FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG),
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        transformer=model,
    )
    if klein:
        return Flux2KleinPipeline(**components, is_distilled=is_distilled)
    return Flux2Pipeline(**components)


def default_flux2_cache_dir(klein: bool = False) -> Path:
    return home() / f"tiny-flux2{'-klein' if klein else ''}-v{TINY_FLUX2_VERSION}"


def ensure_tiny_flux2_pipeline(path: str | os.PathLike | None = None, klein: bool = False) -> Path:
    """Return a folder holding the tiny FLUX.2 [dev] pipeline (or [klein]) in diffusers layout, building it once
    (under FLUX_CP_HOME, or ~/.cache/flux_cp, when no path is given)."""
    path = Path(path) if path else default_flux2_cache_dir(klein)
    name = f"tiny-flux2{'-klein' if klein else ''}-v{TINY_FLUX2_VERSION}"
    pipeline = "Flux2KleinPipeline" if klein else "Flux2Pipeline"
    recipe = Recipe(name, pipeline, {**TRANSFORMER_CONFIG, "guidance_embeds": not klein}, __file__)
    return build_once(path, lambda tmp: build_tiny_flux2_pipeline(klein=klein).save_pretrained(tmp), recipe)


def write_flux2_shapes(path: str | os.PathLike, klein: bool = False) -> Path:
    """A pipeline folder whose transformer/config.json is FLUX.2 [dev]'s (or [klein] 4B's), without transformer
    weights (train with `--transformer_init random`), with a tiny VAE of FLUX.2's 32 latent channels and a tiny text
    encoder whose stacked hidden layers give the transformer's joint_attention_dim (Mistral Small 3.x: 5120 x 3 =
    15360; Qwen3-4B: 2560 x 3 = 7680). For benchmarks at FLUX.2 size without downloads. Written like the tiny
    folder (`flux_cp.families.builder.build_once`): only into a new or empty folder, or one built before."""
    config = FLUX2_KLEIN_4B_TRANSFORMER if klein else FLUX2_DEV_TRANSFORMER
    name = f"flux2-{'klein' if klein else 'dev'}-shapes-v{TINY_FLUX2_VERSION}"
    pipeline = "Flux2KleinPipeline" if klein else "Flux2Pipeline"
    recipe = Recipe(name, pipeline, config, __file__)
    return build_once(Path(path), lambda tmp: _write_flux2_shapes(tmp, klein), recipe)


# FLUX.2's text encoders at full size: [dev]'s Mistral Small 3.1 24B (Mistral3ForConditionalGeneration: the language
# model and the Pixtral vision tower) and [klein] 4B's Qwen3-4B, as their published configs give them; 3 stacked hidden
# layers of their width are the transformers' joint_attention_dim (15360, 7680).
MISTRAL_SMALL_TEXT = dict(
    model_type="mistral",
    vocab_size=131072,
    hidden_size=5120,
    intermediate_size=32768,
    num_hidden_layers=40,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=1e9,
    sliding_window=None,
)
PIXTRAL_VISION = dict(
    model_type="pixtral",
    hidden_size=1024,
    num_hidden_layers=24,
    num_attention_heads=16,
    intermediate_size=4096,
    image_size=1540,
    patch_size=14,
    num_channels=3,
    rope_theta=10000.0,
)
QWEN3_4B = dict(
    vocab_size=151936,
    hidden_size=2560,
    intermediate_size=9728,
    num_hidden_layers=36,
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    max_position_embeddings=40960,
    rms_norm_eps=1e-6,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def write_flux2_full_shapes(path: str | os.PathLike, klein: bool = False) -> Path:
    """A pipeline folder of FLUX.2 [dev]'s (or [klein] 4B's) configs for every component - the transformer, the text
    encoder (Mistral Small 3.1 24B, or Qwen3-4B) and the VAE - and no weights (train with `--transformer_init random`,
    which builds each component from its config with random weights). The tokenizer and the scheduler are the tiny
    folder's."""
    config = FLUX2_KLEIN_4B_TRANSFORMER if klein else FLUX2_DEV_TRANSFORMER
    name = f"flux2-{'klein' if klein else 'dev'}-full-shapes-v{TINY_FLUX2_VERSION}"
    pipeline = "Flux2KleinPipeline" if klein else "Flux2Pipeline"
    recipe = Recipe(name, pipeline, config, __file__)
    return build_once(Path(path), lambda tmp: _write_flux2_full_shapes(tmp, klein), recipe)


def _write_flux2_full_shapes(path: Path, klein: bool) -> None:
    from diffusers import AutoencoderKLFlux2, Flux2Transformer2DModel
    from transformers import Mistral3Config, Qwen3Config

    pipe = build_tiny_flux2_pipeline(klein=klein, transformer=False)
    tok = pipe.tokenizer
    for name in ("tokenizer", "scheduler"):
        getattr(pipe, name).save_pretrained(path / name)
    ids = dict(pad_token_id=tok.pad_token_id, eos_token_id=tok.eos_token_id)
    if klein:
        text = Qwen3Config(**QWEN3_4B, **ids, architectures=["Qwen3ForCausalLM"])
    else:
        text = Mistral3Config(
            text_config={**MISTRAL_SMALL_TEXT, **ids, "bos_token_id": tok.bos_token_id},
            vision_config=PIXTRAL_VISION,
            image_token_index=tok.unk_token_id,
            spatial_merge_size=2,
            vision_feature_layer=-1,
            architectures=["Mistral3ForConditionalGeneration"],
        )
    text.save_pretrained(path / "text_encoder")
    config = FLUX2_KLEIN_4B_TRANSFORMER if klein else FLUX2_DEV_TRANSFORMER
    with torch.device("meta"):
        AutoencoderKLFlux2().save_config(path / "vae")
        Flux2Transformer2DModel(**config).save_config(path / "transformer")
    index = {"_class_name": type(pipe).__name__, "_diffusers_version": __import__("diffusers").__version__}
    if klein:
        index["is_distilled"] = pipe.config.is_distilled
    index.update(
        scheduler=["diffusers", type(pipe.scheduler).__name__],
        tokenizer=["transformers", type(tok).__name__],
        text_encoder=["transformers", text.architectures[0]],
        vae=["diffusers", "AutoencoderKLFlux2"],
        transformer=["diffusers", "Flux2Transformer2DModel"],
    )
    write_json(path / "model_index.json", index)


def _write_flux2_shapes(path: Path, klein: bool) -> None:
    from diffusers import Flux2Transformer2DModel

    config = FLUX2_KLEIN_4B_TRANSFORMER if klein else FLUX2_DEV_TRANSFORMER
    pipe = build_tiny_flux2_pipeline(
        klein=klein,
        text_dim=config["joint_attention_dim"] // 3,
        latent_channels=config["in_channels"] // 4,
        transformer=False,
    )
    for name in ("vae", "text_encoder", "tokenizer", "scheduler"):
        getattr(pipe, name).save_pretrained(path / name)
    with torch.device("meta"):
        meta = Flux2Transformer2DModel(**config)
    meta.save_config(path / "transformer")
    index = {
        "_class_name": type(pipe).__name__,
        "_diffusers_version": __import__("diffusers").__version__,
    }
    if klein:
        index["is_distilled"] = pipe.config.is_distilled
    for name in ("scheduler", "text_encoder", "tokenizer", "vae"):
        obj = getattr(pipe, name)
        lib = "diffusers" if type(obj).__module__.startswith("diffusers") else "transformers"
        index[name] = [lib, type(obj).__name__]
    index["transformer"] = ["diffusers", type(meta).__name__]
    write_json(path / "model_index.json", index)
