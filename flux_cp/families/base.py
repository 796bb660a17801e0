"""The `Family` interface: what the rest of flux-cp asks of a model family; how a model folder names its family (the
pipeline class of its model_index.json where a family claims it, else the `_class_name` of its transformer's config);
and the registry of the families a run may train (the package registers the built-in ones, flux_cp/families/
__init__.py; `register` adds others).

Everything that differs between families is asked here, never by the family's name or class: the transformer's
block lists (blocks.py, offload, the planner, parameter counts), the LoRA file's scale convention and the layouts it
is written in, the model card's tags and what ComfyUI does with the outputs. A family's attention processors are
`cp`'s (FLUX.1, FLUX.2), or registered with `cp.register` by the family's own module."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from flux_cp.errors import UsageError
from flux_cp.families.flops import StepFlops, step_flops
from flux_cp.families.known import KnownModel
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from PIL import Image

    from flux_cp.config.flags import Config
    from flux_cp.config.training import LoraConfig, ModelConfig
    from flux_cp.families.encoders import Encoders
    from flux_cp.families.lora_format import Origin

Tensor = torch.Tensor


# The sizes of a FLUX VAE's config (AutoencoderKL, AutoencoderKLFlux2), the largest about ten times the released ones'
VAE_SIZES = {
    "in_channels": (1, 30),
    "out_channels": (1, 30),
    "latent_channels": (1, 320),
    "block_out_channels": (1, 5120),
    "decoder_block_out_channels": (1, 5120),
    "layers_per_block": (1, 20),
    "norm_num_groups": (1, 320),
    "sample_size": (1, 10240),
    "patch_size": (1, 16),
}


def vae_rules(vae: dict) -> list[tuple[str, str, str]]:
    """What a VAE config breaks that building it would fail on: one block per channel count, channels in groups."""
    out = []
    channels = vae.get("block_out_channels")
    for key in ("down_block_types", "up_block_types"):
        kinds = vae.get(key)
        if isinstance(channels, (list, tuple)) and isinstance(kinds, (list, tuple)) and len(kinds) != len(channels):
            out.append(("vae", key, f"lists {len(kinds)} blocks and block_out_channels {len(channels)} channel counts"))
    groups = vae.get("norm_num_groups")
    if isinstance(channels, (list, tuple)) and isinstance(groups, int) and any(c % groups for c in channels):
        out.append(("vae", "block_out_channels", f"{list(channels)} do not all divide into norm_num_groups {groups}"))
    return out


def vae_weight_shapes(vae: dict, latent_default: int) -> dict[str, tuple[int, ...]]:
    """The shapes of a FLUX VAE's first and last convolutions for its config (those its config gives)."""
    channels, latent = vae.get("block_out_channels"), vae.get("latent_channels", latent_default)
    decoder = vae.get("decoder_block_out_channels") or channels
    if not (isinstance(channels, (list, tuple)) and channels and isinstance(decoder, (list, tuple)) and decoder):
        return {}
    return {
        "encoder.conv_in.weight": (channels[0], vae.get("in_channels", 3), 3, 3),
        "encoder.conv_out.weight": (2 * latent, channels[-1], 3, 3),
        "decoder.conv_in.weight": (decoder[-1], latent, 3, 3),
        "decoder.conv_out.weight": (vae.get("out_channels", 3), decoder[0], 3, 3),
    }


def transformer_weight_shapes(c: dict) -> dict[str, tuple[int, ...]]:
    """The shapes of the weights both Flux transformers have, for their config: the input, text and output
    projections, and a double and a single block's attention (a family adds its own)."""
    inner, head = c["num_attention_heads"] * c["attention_head_dim"], c["attention_head_dim"]
    return {
        "x_embedder.weight": (inner, c["in_channels"]),
        "context_embedder.weight": (inner, c["joint_attention_dim"]),
        "proj_out.weight": (c["patch_size"] ** 2 * (c.get("out_channels") or c["in_channels"]), inner),
        "transformer_blocks.0.attn.to_q.weight": (inner, inner),
        "transformer_blocks.0.attn.norm_q.weight": (head,),
        "single_transformer_blocks.0.attn.norm_q.weight": (head,),
    }


def rope_rules(transformer: dict) -> list[tuple[str, str, str]]:
    """RoPE turns pairs of a head's channels, over the whole head; the transformer predicts what it is fed (its
    packed input's width, one token per patch of the latent packed by the trainer)."""
    out = []
    axes, head = transformer.get("axes_dims_rope"), transformer.get("attention_head_dim")
    if isinstance(axes, (list, tuple)) and isinstance(head, int):
        if sum(axes) != head:
            out.append(
                (
                    "transformer",
                    "axes_dims_rope",
                    f"{list(axes)} adds up to {sum(axes)}, not attention_head_dim "
                    f"{head}: RoPE turns the whole of a head",
                )
            )
        elif any(a % 2 for a in axes):
            odd = f"{list(axes)} holds an odd size: RoPE turns pairs of channels"
            out.append(("transformer", "axes_dims_rope", odd))
    if transformer.get("patch_size") not in (1, None):
        out.append(
            (
                "transformer",
                "patch_size",
                f"is {transformer['patch_size']}: the trainer packs the latent's 2x2 "
                "patches itself, for a transformer of patch_size 1 (as every released FLUX model)",
            )
        )
    out_channels, in_channels = transformer.get("out_channels"), transformer.get("in_channels")
    if out_channels is not None and out_channels != in_channels:
        out.append(
            (
                "transformer",
                "out_channels",
                f"is {out_channels}, not in_channels {in_channels}: the "
                "transformer predicts a latent of its input's width",
            )
        )
    return out


# The sequences both Flux transformers take: image tokens and their ids, text tokens and theirs (docs/design.md, data
# flow, rule 2): a Flux family's `cp_plan`.
FLUX_CP_PLAN = {"hidden_states": 1, "img_ids": 0, "encoder_hidden_states": 1, "txt_ids": 0}


class Family(ABC):
    """One kind of FLUX model. Subclasses fill in the class attributes and the methods below; nothing here loads
    a model until asked."""

    name: str = ""  # short id, e.g. "flux1"
    label: str = ""  # for people, e.g. "FLUX.1"
    pairs_label: str = ""  # what trains on (target, reference) pairs, e.g. "FLUX.1 Kontext"
    max_references: int | None = None  # reference images per target it takes (None: any number, as FLUX.2)
    transformer_class_name: str = ""  # diffusers' class in transformer/config.json
    # model_index.json classes of this family's pipelines; they decide the family when they name one (FLUX.2
    # [dev] and [klein] share the transformer class)
    pipeline_class_names: tuple[str, ...] = ()
    # Pixels per side of one image token: the VAE's downsampling times the 2x2 packing.
    pixels_per_token: int = 16
    # The transformer's blocks, in the order they run: (kind, the transformer's attribute holding that list, the
    # config key of its length). Checkpointing, compile, offload, the planner and parameter counts walk them.
    block_lists: tuple[tuple[str, str, str], ...] = ()
    # The LoRA file's scale alpha / rank: alpha keys beside the weights (True), or multiplied into lora_B for
    # loaders that refuse alpha keys (flux_cp.families.lora_format)
    lora_alpha_keys: bool = True
    lora_layouts: tuple[str, ...] = ("diffusers",)  # the --lora_format values it writes (`lora_layout`)
    card_tags: tuple[str, ...] = ()  # the model card's tags for the family ...
    pairs_card_tags: tuple[str, ...] = ()  # ... and those added for its editing pairs
    # ComfyUI: how its LoRA loader knows the family's diffusers names (None: not known to; the card says nothing), what
    # its loader needs of a full fine-tune's transformer folder, and the layers whose LoRAs it leaves out
    comfyui_mapping: str | None = None
    comfyui_transformer: str = ""
    comfyui_unmapped: tuple[str, ...] = ()
    known: tuple[KnownModel, ...] = ()  # hub ids it knows offline
    # --train_text_encoder: (the text encoder trained, the transformer's forward argument its output feeds, the
    # pipeline's argument and cached encoding of the same); None: the family trains no text encoder
    trained_text_encoder: tuple[str, str, str] | None = None
    trained_text_encoder_targets: tuple[str, ...] = ()  # its layers that get the LoRA of --train_text_encoder
    # The sizes in each component's config.json (component folder -> {key: (smallest, largest)}; a dotted key is
    # nested, a float bound a number rather than an integer), checked before anything is built
    # (flux_cp.families.model_config)
    config_sizes: dict[str, dict[str, tuple[float, float]]] = {}

    # --- components -----------------------------------------------------------------------------------------

    @abstractmethod
    def transformer_class(self) -> type:
        """diffusers' transformer class of this family."""

    @abstractmethod
    def embedded_default(self, pairs: bool) -> str:
        """The tiny model folder trained when no model is named (built locally on first use)."""

    # The transformer's forward inputs that CP splits, each along its sequence dimension, as diffusers' `_cp_plan`
    # declares them: every rank of a CP group takes its equal contiguous chunk of each (flux_cp.data.batches); the
    # other inputs (timestep, guidance, pooled embeddings) stay whole.
    cp_plan: dict[str, int] = {}
    # The folders `python -m flux_cp.tiny` builds of this family: (its --family name for them, --preset) -> builder of
    # a folder at a path (flux_cp/tiny.py); the preset of a full-size transformer config with tiny encoders, and what
    # it is (said where a model must be given offline); --<flag> aliases of a --family name, with their help.
    shapes_preset: tuple[str, str] | None = None
    tiny_aliases: dict[str, tuple[str, str]] = {}

    def tiny_builds(self) -> dict[tuple[str, str], Callable[[str], Path]]:
        """{(--family name, --preset): the builder of that folder at a path} (module note above)."""
        return {}

    def embedded_snippet(self, pairs: bool) -> tuple[str, str]:
        """(import line, expression) that rebuild `embedded_default(pairs)` in a load snippet of the model card and
        the end summary (a run that named no model)."""
        raise NotImplementedError(f"{self.label} has no embedded default")

    def snippet_call(self, pairs: bool, size: int) -> tuple[str, str]:
        """(arguments, comment) that the load snippet adds to the pipeline's call for an image of `size` pixels
        square, when the pipeline would otherwise render another size; none by default."""
        return "", ""

    def encoder_classes(self) -> dict[str, type]:
        """{component folder: class} of the text encoders, in the order they encode, and of the VAE (`vae`): what
        the encoding phase's memory is planned from (flux_cp.plan.encoding)."""
        return {}

    def config_rules(self, configs: dict[str, dict]) -> list[tuple[str, str, str]]:
        """(component, key, what is wrong) for each rule across the keys and components' configs (`configs`:
        component -> its config.json, the transformer's with its class's defaults) that they break."""
        return []

    def weight_shapes(self, component: str, config: dict) -> dict[str, tuple[int, ...]]:
        """The shapes that tensors of the component's weight files have for its `config` (those present in the files
        are compared: flux_cp.families.model_config)."""
        return {}

    def weight_layers(self, component: str) -> tuple[tuple[str, str, bool], ...]:
        """(tensor name prefix of layer N, with `{}` for N; config key of the layer count; whether the files must hold
        exactly that many, or at least) of the component's weight files. The transformer's are its block lists."""
        if component == "transformer":
            return tuple((f"{name}.{{}}", key, True) for _, name, key in self.block_lists)
        return ()

    def card_tags_for(self, pairs: bool) -> list[str]:
        """The model card's tags for this family (and its editing pairs)."""
        return [*self.card_tags, *(self.pairs_card_tags if pairs else ())]

    @abstractmethod
    def load_encoders(self, model: ModelConfig, path: str, dtype: torch.dtype, device: torch.device) -> Encoders:
        """The VAE and the text encoders (an `Encoders`: `prompts`, `latents`, `free_text_encoders`)."""

    def check(self, cfg: Config) -> None:
        """Flags this family cannot honour: a UsageError naming the flag (before anything loads)."""
        if cfg.lora.train_text_encoder and self.trained_text_encoder is None:
            raise UsageError(
                f"--train_text_encoder trains FLUX.1's CLIP; {self.label}'s text encoder is not trained (diffusers' "
                "examples for it do not offer it either): drop --train_text_encoder"
            )
        fmt = cfg.lora.lora_format
        if fmt not in self.lora_layouts:
            readers = f"{self.pipeline_class_names[0]}.load_lora_weights reads it"
            readers += " and ComfyUI loads it" if self.comfyui_mapping else ""
            raise UsageError(
                f"--lora_format {fmt} maps FLUX.1's module names; for {self.label} keep --lora_format "
                f"diffusers (the default: {readers})"
            )

    def check_export(self, config: dict, lora: LoraConfig) -> None:  # noqa: B027 - the diffusers layout: always
        """At start, with the transformer's config: a UsageError when the LoRA file in `lora.lora_format` could not be
        read back whole by its loaders."""

    def check_text(self, cfg: Config, path: str) -> None:  # noqa: B027 - a family without a prompt template
        """The prompt encoding's window against the model's tokenizer (a chat template's own tokens, its rendering):
        a UsageError naming the flag or the file (before any model loads; loads the tokenizer at most)."""

    def output_warnings(self, cfg: Config) -> list[str]:
        """What the run's outputs will lack where users load them (LoRA layers ComfyUI skips); logged at start."""
        skipped = [] if cfg.lora.full_finetune else self.comfyui_skips(cfg.lora.lora_layers or ())
        if not skipped:
            return []
        return [
            f"warning: ComfyUI maps no name for {', '.join(skipped)} of {self.label}: it will leave their LoRAs out "
            "('lora key not loaded'); diffusers loads them all. Drop them from --lora_layers for files ComfyUI "
            "applies whole"
        ]

    def comfyui_skips(self, targets: list[str] | tuple[str, ...]) -> list[str]:
        """The layers of `comfyui_unmapped` that the LoRA targets `targets` (peft's suffix rule) put LoRAs on."""
        return [n for n in self.comfyui_unmapped if any(n == t or n.endswith("." + t) for t in targets)]

    def lora_layout(
        self, fmt: str, state: dict[str, Tensor], lora: LoraConfig, origin: Origin | None, guidance: bool
    ) -> tuple[dict[str, Tensor], dict[str, str]]:
        """(weights, safetensors metadata) of a LoRA file in the family's own layout `fmt` (one of `lora_layouts`
        but diffusers'), from diffusers-format weights `state`."""
        raise ValueError(f"{self.label} writes no {fmt} LoRA files")

    def read_lora_layout(
        self, fmt: str, state: dict[str, Tensor], linears: dict[str, tuple[int, int]], trained: set[str], rank: int
    ) -> tuple[dict, dict]:
        """({module: (lora_A, lora_B)}, {module: scale}) in diffusers' module names of a LoRA file in the family's
        own layout `fmt` (`--network_weights`); `linears`, `trained`, `rank`: the model's linear layers ({module:
        (out, in)}), those the run trains, and its rank. A ValueError saying what does not fit."""
        raise ValueError(f"{self.label} reads no {fmt} LoRA files")

    def known_model(self, name: str | None) -> KnownModel | None:
        """What the family knows of a hub id without downloading anything (the Hub's ids are case-insensitive)."""
        key = name.strip("/").lower() if name else None
        return next((m for m in self.known if m.model_id.lower() == key), None)

    def pairs_warning(self, path: str, pipeline_class: str | None) -> str | None:
        """A warning when pair data trains a model whose folder declares `pipeline_class` (None: nothing to say)."""
        return None

    # --- latents ----------------------------------------------------------------------------------------------

    @abstractmethod
    def normalizer(self, vae) -> Callable[[Tensor], Tensor]:
        """Latents as the VAE gives them `[B, C, H, W]` -> latents as the transformer sees them before packing
        ("model latents", `model_latent_shape`)."""

    def model_latent_shape(self, vae_shape: tuple[int, ...]) -> tuple[int, ...]:
        """The shape `normalizer` turns VAE latents of `vae_shape` (`(C, H, W)`) into: the space the flow-matching
        noise is drawn in. The same by default."""
        return tuple(vae_shape)

    def pipeline_class_name(self, pairs: bool) -> str:
        """diffusers' pipeline class that loads this family's trained weights for inference (the model card's and
        the run summary's snippets). `pairs`: trained on image-editing pairs."""
        return self.pipeline_class_names[0]

    @abstractmethod
    def default_vae_encode_mode(self, pairs: bool) -> str:
        """`--vae_encode_mode` when not given: "sample" (a draw from the VAE's posterior) or "mode" (its mean), as
        diffusers' training example of this family and data does."""

    # --- validation -----------------------------------------------------------------------------------------

    def validation_embeds(self, encoders: Encoders, prompts: list[str], max_sequence_length: int) -> dict:
        """The validation prompts' encodings, named as the validation pipeline's arguments, one row per prompt
        (computed before the text encoders are freed)."""
        return encoders.prompts(prompts, max_sequence_length)

    @abstractmethod
    def validation_pipeline(self, pairs: bool, scheduler, encoders: Encoders, transformer):
        """The diffusers pipeline that renders validation images with these components, from encoded prompts (its
        text encoders left out). `pairs`: it edits a reference image."""

    @abstractmethod
    def reference_inputs(
        self, image: Image.Image | list[Image.Image], encoders: Encoders, device: torch.device
    ) -> dict:
        """The validation pipeline's keyword arguments for editing `image` (the `--validation_image`, already cut to
        `--validation_resolution`^2 by `flux_cp.outputs.validation.reference_image`; a list of them when it is given
        several
        times, for a family that takes several references)."""

    # --- the token sequence ----------------------------------------------------------------------------------

    def image_tokens(self, width: int, height: int) -> int:
        """Image tokens of one `width x height` image."""
        return (width // self.pixels_per_token) * (height // self.pixels_per_token)

    @abstractmethod
    def pack(self, latents: Tensor) -> Tensor:
        """Model latents `[B, C, H, W]` -> tokens `[B, N, D]`, in the order of `image_ids`."""

    @abstractmethod
    def image_ids(self, height: int, width: int, device=None) -> Tensor:
        """Position ids of the tokens of a `height x width` model latent."""

    @abstractmethod
    def reference_ids(self, height: int, width: int, device=None, index: int = 0) -> Tensor:
        """Position ids of the tokens of reference image `index`'s `height x width` model latent (pairs: the
        references follow the target's tokens, in order)."""

    @abstractmethod
    def text_ids(self, length: int, device=None) -> Tensor:
        """Position ids of `length` text tokens."""

    @abstractmethod
    def transformer_inputs(
        self,
        hidden: Tensor,
        img_ids: Tensor,
        text: dict[str, Tensor],
        txt_ids: Tensor,
        timestep: Tensor,
        guidance: Tensor | None,
    ) -> dict:
        """Keyword arguments of the transformer's forward, of whole sequences: CP then splits those of `cp_plan`."""

    # --- training and accounting -----------------------------------------------------------------------------

    @abstractmethod
    def lora_targets(self, pairs: bool, config: dict | None = None) -> tuple[str, ...]:
        """Module name suffixes that get LoRA adapters by default (`--lora_layers`), for a transformer of this
        `config` (None: the family's released model)."""

    def hidden_size(self, config: dict) -> int:
        """Width of a token's hidden state in the transformer blocks (the planner's unit is one of it in bf16)."""
        return config["num_attention_heads"] * config["attention_head_dim"]

    def block_kinds(self, config: dict) -> tuple[tuple[str, int], ...]:
        """The transformer blocks in the order they run, as (kind, count): the planner counts what each kind keeps
        for its backward (`flux_cp/plan/plan_data.json`, by `transformer_class_name` and kind)."""
        return tuple((kind, config[key]) for kind, _, key in self.block_lists)

    @property
    def quantized_parts(self) -> tuple[str, ...]:
        """The transformer's top-level modules whose linears --base_precision quantizes: its block lists (the rest,
        embedders and final layer, stays as loaded: flux_cp.model.precision)."""
        return tuple(name for _, name, _ in self.block_lists)

    def blocks(self, transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
        """(kind, block) of every block of `transformer`, in the order they run."""
        return [(kind, block) for kind, name, _ in self.block_lists for block in getattr(transformer, name)]

    @abstractmethod
    def forward_flops(self, config: dict, image_tokens: int, text_tokens: int, batch: int) -> tuple[float, float]:
        """(linear layers, attention) matmul FLOPs of one forward of `batch` samples of these token counts."""

    def step_flops(
        self,
        config: dict,
        image_tokens: int,
        text_tokens: int,
        batch: int,
        lora: bool,
        ckpt: float,
        attn_recomputed: float,
    ) -> StepFlops:
        """Model and executed FLOPs of one micro-step (`flops.step_flops`; `ckpt`, `attn_recomputed`: the
        share of the blocks that recompute their forward, their attention)."""
        linear, attention = self.forward_flops(config, image_tokens, text_tokens, batch)
        return step_flops(linear, attention, lora, ckpt, attn_recomputed)


def declared_classes(path: str, revision: str | None, cache_dir: str | None = None) -> tuple[str | None, str | None]:
    """(pipeline class of model_index.json, transformer class of transformer/config.json) that a model folder or
    hub id declares, None for what cannot be read; a UsageError when neither can be read. `cache_dir`: the download
    cache."""
    from diffusers import ConfigMixin, DiffusionPipeline  # diffusers at first use (its import takes seconds)

    class AnyModelConfig(ConfigMixin):  # reads a model's config.json without knowing its class
        config_name = "config.json"

    first, names = None, []
    for file, read in (
        ("model_index.json", lambda: DiffusionPipeline.load_config(path, revision=revision, cache_dir=cache_dir)),
        (
            "transformer/config.json",
            lambda: AnyModelConfig.load_config(path, subfolder="transformer", revision=revision, cache_dir=cache_dir),
        ),
    ):
        try:
            config = read()
        except (OSError, ValueError) as e:
            first = first or (str(e).strip().splitlines() or [type(e).__name__])[0]
            names.append(None)
            continue
        if not isinstance(config, dict):
            kind = type(config).__name__
            raise UsageError(
                f"--pretrained_model_name_or_path {path}: its {file} is a JSON {kind}, not an object of settings: pass "
                "a diffusers-layout folder of a FLUX model"
            )
        names.append(config.get("_class_name"))
    if not any(names):
        if first is None:  # both read, neither names a class
            raise UsageError(
                f"--pretrained_model_name_or_path {path}: its transformer/config.json and model_index.json name no "
                "class (_class_name): pass a diffusers-layout folder or hub id of a FLUX model"
            )
        raise UsageError(f"cannot load transformer from --pretrained_model_name_or_path {path}: {first}")
    return names[0], names[1]


def transformer_class_name(path: str, revision: str | None) -> str:
    """The class a model folder or hub id declares for its transformer (transformer/config.json), else the pipeline
    class of its model_index.json; a UsageError when neither can be read."""
    pipeline, transformer = declared_classes(path, revision)
    return transformer or pipeline or ""


def _detect(path: str, revision: str | None, families: tuple[Family, ...], cache_dir: str | None = None) -> Family:
    """The family of the model at `path` (a folder or hub id): the one whose pipelines include the pipeline class
    of its model_index.json, else the first whose transformer class its transformer/config.json names; a UsageError
    naming the classes and the supported ones when no family claims them."""
    pipeline, transformer = declared_classes(path, revision, cache_dir)
    for family in families:
        if pipeline in family.pipeline_class_names:
            return family
    for family in families:
        if transformer == family.transformer_class_name:
            return family
    declared = " with a ".join(printable(n) for n in (pipeline, transformer) if n)
    supported = ", ".join(
        f"{f.label} ({', '.join(f.pipeline_class_names[:1] + (f.transformer_class_name,))})" for f in families
    )
    raise UsageError(f"--pretrained_model_name_or_path {path} is a {declared}; flux-cp trains {supported}")


# --- the registry -----------------------------------------------------------------------------------------------

# The families flux-cp trains, in the order they were registered (the package registers the built-in ones,
# flux_cp/families/__init__.py; `register` adds others).
FAMILIES: list[Family] = []


def register(family: Family) -> None:
    """Train `family`'s models too: `detect` recognises their folders, and every module asking a family of a model
    finds it. Call it in every process of a run before the trainer starts (its CP processors registered with
    `cp.register` by then)."""
    if family not in FAMILIES:
        FAMILIES.append(family)


def detect(path: str, revision: str | None = None, cache_dir: str | None = None) -> Family:
    """The family of the model folder or hub id `path`: its pipeline class decides where a family names it (FLUX.2
    [dev] and [klein] share the transformer class), else its transformer class (a UsageError naming the classes if
    no family trains them). `cache_dir`: the download cache."""
    return _detect(path, revision, tuple(FAMILIES), cache_dir)


def default_family() -> Family:
    """The first family registered (FLUX.1, flux_cp/families/__init__.py): the embedded default's, and the one a
    transformer config that names no class is taken for."""
    return FAMILIES[0]


def for_transformer(config: dict) -> Family:
    """The family whose transformer a transformer config describes (its `_class_name`; when it names none, the first
    family registered, FLUX.1, as the built-in configs of the known FLUX.1 models)."""
    name = config.get("_class_name")
    return next((f for f in FAMILIES if f.transformer_class_name == name), default_family())


def of_model(transformer: torch.nn.Module) -> Family:
    """The family of a transformer (by its class, also under peft's adapters)."""
    names = {cls.__name__ for cls in type(transformer).__mro__}
    found = next((f for f in FAMILIES if f.transformer_class_name in names), None)
    if found is None:
        raise ValueError(f"no registered model family trains a {type(transformer).__name__}")
    return found


def blocks_of(transformer: torch.nn.Module) -> list[tuple[str, torch.nn.Module]]:
    """(kind, block) of every block of a transformer, in the order they run (`Family.blocks`)."""
    return of_model(transformer).blocks(transformer)


def known_model(name: str | None) -> KnownModel | None:
    """What a registered family knows of a hub id offline (`Family.known_model`), else None."""
    return next((k for f in FAMILIES if (k := f.known_model(name)) is not None), None)


def known_models() -> list[KnownModel]:
    """Every hub id a registered family knows offline."""
    return [k for f in FAMILIES for k in f.known]
