"""Command-line flags of `train_flux_cp.py` as typed, frozen config sections, parsed once.

Each section is a frozen dataclass; each of its fields is the flag `--<field name>` (diffusers' Flux
examples' names where they exist). Adding a flag is one field with `flag(...)` in the section whose module
uses it: the parser, `--help`, the run's `run_config.json` and the trackers' hyperparameters all follow.
Defaults that depend on other flags (the embedded tiny model's resolution, `--lora_alpha` = `--rank`,
`--validation_resolution` = `--resolution`) are resolved while parsing (`derive=`), so sections always hold
final values. Checks that need only the flags (no model, data or GPU) live in each section's `check()`.
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import os
import re
import sys
import types
import typing
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from cp.context import OVERLAPS, Tuning, refusal
from cp.kernels import DEFAULT_PREFERENCE, KERNELS
from cp.modes import MODES

from . import adapters, config_file, hub
from .checkpoint import named_folder, saved_run
from .errors import UsageError
from .flag_ranges import check_ranges, given_flags, unused_flags
from .path_flags import as_typed
from .precision import PRECISIONS, check_flags, check_installed
from .terminal import printable

# The choices of the flags that name one (the modules that use them import them from here).
OPTIMIZERS = ("adamw", "prodigy")
LR_SCHEDULERS = ("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup")
WEIGHTING_SCHEMES = ("none", "sigma_sqrt", "logit_normal", "mode", "cosmap")  # diffusers' examples' (flux_cp.flow)
LORA_FORMATS = ("diffusers", "kohya")  # flux_cp.lora_format
ADAPTERS = ("lora", "dora", "lokr")  # flux_cp.adapters


def flag(
    default: Any,
    help: str | Callable[[], str] | None = None,  # noqa: A002 - argparse's name
    *,
    choices: tuple | Callable[[], tuple] | None = None,
    derive: Callable[[dict], Any] | None = None,
    parse: Callable[[str], Any] | None = None,
    repeat: bool = False,
    secret: bool = False,
    const: Any = None,
    record: bool = True,
) -> Any:
    """A dataclass field that is also the flag `--<field name>`.

    help: one line for --help; a flag whose default is None or derived says what it defaults to ("Default: ..."),
        the others get their default appended. help and choices may be functions, called when the parser is built
        (for those read from a registry that may grow after this module is imported: the CP modes). derive:
        computes the value from the other raw flag values when the flag is not given (the parser's default is then
        None, so "not given" is seen). parse: converts the
        command-line string (the field keeps the converted value). repeat: the flag may be given several times (a
        tuple of values). secret: kept out of `Config.flat()`, so out of run_config.json, checkpoints and trackers.
        const: the value of the flag given without one (its value is then optional). record=False: kept out of
        `Config.flat()` too, for a flag whose effect the other flags record (--config)."""
    meta = {"help": help, "choices": choices, "derive": derive, "parse": parse, "repeat": repeat, "secret": secret,
            "const": const, "record": record}  # fmt: skip
    return field(default=default, metadata=meta)


DEFAULT_ENCODINGS_DIR = "~/.cache/flux_cp/encodings"


def _is_embedded(raw: dict) -> bool:
    return raw["pretrained_model_name_or_path"] is None


BUNDLED = Path(__file__).resolve().parent.parent / "data"  # the bundled data sets (tiny_shapes, tiny_pairs)


@dataclass(frozen=True)
class Demo:
    """The settings of a demo: the embedded default (no model named) on one of the bundled data sets with no step
    count given, trained so that its loss curve visibly falls within a minute on 2 CPU cores, with validation
    images before and after (the README's figures, checked by tests/test_readme_demos.py). Flags given still win;
    other runs get the usual defaults (docs/design.md lists those that differ from diffusers' examples)."""

    name: str
    data: Path | None  # the --dataset_name that selects it (None: none given, the bundled data/tiny_shapes)
    steps: int
    learning_rate: float
    batch: int  # samples per data-parallel rank per step
    prompts: tuple[str, ...]
    validation_image: Path | None = None  # FLUX.1 Kontext: the reference the prompts edit


DEMO = Demo(
    "the demo", None, steps=200, learning_rate=1e-3, batch=4,
    prompts=("a white circle on a black background", "a yellow triangle on a purple background"),
)  # fmt: skip
KONTEXT_DEMO = Demo(
    "the FLUX.1 Kontext demo", BUNDLED / "tiny_pairs", steps=100, learning_rate=2e-3, batch=4,
    prompts=("make the circle purple", "make the circle orange"),
    validation_image=BUNDLED / "tiny_pairs" / "00_blue_circle.png",  # its pair's target is the purple circle
)  # fmt: skip
DEMOS = (DEMO, KONTEXT_DEMO)
TINY_TEXT_TOKENS = 48  # --max_sequence_length of the embedded default: divisible by every CP size up to 8
DEMO_STEPS, DEMO_LEARNING_RATE, DEMO_BATCH, DEMO_PROMPTS = DEMO.steps, DEMO.learning_rate, DEMO.batch, DEMO.prompts
# Flags that turn a demo's settings off when given (with the embedded default): a step count, or other data.
DEMO_OFF_FLAGS = ("max_train_steps", "num_train_epochs", "dataset_name", "instance_data_dir")
_DEMO = "_demo"  # key in the raw flag values: decided on the flags as given, before any default is derived


def _same_folder(given: str | None, bundled: Path | None) -> bool:
    if given is None or bundled is None:
        return given is None and bundled is None
    return os.path.realpath(given) == str(bundled.resolve())


def _demo_of(raw: dict) -> Demo | None:
    """The demo these flags (as given) select, if any."""
    if not _is_embedded(raw) or raw["max_train_steps"] is not None or raw["num_train_epochs"] is not None:
        return None
    return next((d for d in DEMOS if _same_folder(raw["dataset_name"], d.data)), None)


def _demo(raw: dict) -> Demo | None:
    return raw[_DEMO]


# The flags a demo sets (when not given): what a resumed demo run takes from its checkpoint instead.
DEMO_FLAGS = ("max_train_steps", "learning_rate", "train_batch_size", "validation_prompt", "validation_image")


def _resumed_demo(raw: dict) -> tuple[Demo, str, dict] | None:
    """When these flags resume a run of a demo (the embedded default on its data set, as its checkpoint records
    them): (the demo, the checkpoint, {flag: the checkpoint's value} of the flags the demo sets and these flags do
    not give). A step count given to extend it then keeps the demo's batch, learning rate and validation images, as
    the run had them. Reads the checkpoint's meta.json only; None for anything else."""
    if not _is_embedded(raw) or raw["resume_from_checkpoint"] is None:
        return None
    demo = next((d for d in DEMOS if _same_folder(raw["dataset_name"], d.data)), None)
    if demo is None:
        return None
    saved = saved_run(raw["resume_from_checkpoint"], raw["output_dir"])
    if saved is None:
        return None
    path, meta = saved
    args = meta.get("args") or {}
    # Checkpoints name their demo; older ones are recognised by the demo's batch and validation prompts.
    prompts = args.get("validation_prompt")
    prompts = tuple(prompts) if isinstance(prompts, list) else prompts
    was = meta.get("demo", demo.name if (args.get("train_batch_size"), prompts or ()) ==
                   (demo.batch, demo.prompts) else None)  # fmt: skip
    if was != demo.name or args.get("pretrained_model_name_or_path") is not None:
        return None
    kept = {f: tuple(args[f]) if isinstance(args[f], list) else args[f]
            for f in DEMO_FLAGS if raw[f] is None and f in args}  # fmt: skip
    for flag, value in kept.items():
        if not _DEMO_FLAG_TYPES[flag](value):
            raise UsageError(
                f"--resume_from_checkpoint {path}: meta.json's args.{flag} is {printable(repr(value))[:80]}, not a "
                f"value of --{flag}; the checkpoint is damaged or was not written by train_flux_cp.py: give --{flag}, "
                "or resume from another checkpoint-N folder"
            )
    return demo, str(path), kept


def _strings(value: object) -> bool:
    return value is None or (isinstance(value, tuple) and all(isinstance(v, str) for v in value))


# What each of DEMO_FLAGS may hold, as a resumed demo takes it from its checkpoint's meta.json
_DEMO_FLAG_TYPES = {
    "max_train_steps": lambda v: v is None or (type(v) is int),
    "learning_rate": lambda v: type(v) in (int, float),
    "train_batch_size": lambda v: type(v) is int,
    "validation_prompt": _strings,
    "validation_image": _strings,
}


def boolean(text: str) -> bool:
    """A flag's true/false value (true, false, yes, no, on, off, 1, 0; any case). diffusers' examples parse these
    flags with `type=bool`, which makes every given value true: here `--prodigy_decouple false` turns it off."""
    value = {"true": True, "yes": True, "on": True, "1": True, "false": False, "no": False, "off": False, "0": False}
    try:
        return value[text.strip().lower()]
    except KeyError:
        raise argparse.ArgumentTypeError(f"{text!r} is not true or false") from None


def _comma_list(text: str) -> tuple[str, ...]:
    return tuple(t.strip() for t in text.split(",") if t.strip())


def _resolutions(text: str) -> tuple[int, ...]:
    """--resolution's value: one size or several, comma-separated ("1024,2048"), kept in ascending order (the same
    set trains the same in any order)."""
    parts = _comma_list(text)
    try:
        values = [int(p) for p in parts]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in pixels, e.g. 1024 or 1024,2048") from None
    if not values:
        raise argparse.ArgumentTypeError(f"{text!r}: give sizes in pixels, e.g. 1024 or 1024,2048")
    twice = sorted({v for v in values if values.count(v) > 1})
    if twice:
        raise argparse.ArgumentTypeError(f"{text!r} names {', '.join(map(str, twice))} more than once")
    return tuple(sorted(values))


def _checkpointing(text: str) -> str:
    """--gradient_checkpointing's value: auto, all, none, or a number of blocks (kept as text: "12")."""
    value = text.strip().lower()
    if value in ("auto", "all", "none"):
        return value
    if value.isdigit():
        return str(int(value))
    raise argparse.ArgumentTypeError(f"{text!r}: give auto, all, none or a number of blocks")


def _on_off_auto(text: str) -> str:
    """--compile's value: on, off or auto (true/false, yes/no and 1/0 also read as on/off)."""
    value = text.strip().lower()
    if value == "auto":
        return value
    try:
        return "on" if boolean(value) else "off"
    except argparse.ArgumentTypeError:
        raise argparse.ArgumentTypeError(f"{text!r}: give on, off or auto") from None


def _offload_blocks(text: str) -> str:
    """--offload_blocks' value: auto, or a number of blocks (kept as text: "12"; none is "0")."""
    value = text.strip().lower()
    if value in ("auto", "none"):
        return "0" if value == "none" else value
    if value.isdigit():
        return str(int(value))
    raise argparse.ArgumentTypeError(f"{text!r}: give auto, none or a number of blocks")


# --- the sections ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ModelConfig:
    """Which FLUX model to load (flux_cp.model; the family is read from the model folder)."""

    pretrained_model_name_or_path: str | None = flag(
        None,
        "Diffusers-layout folder or hub id of a FLUX.1, FLUX.1 Kontext or FLUX.2 ([dev], [klein]) model; its "
        "model_index.json says which. Default: a tiny FLUX.1 built locally.",
    )
    revision: str | None = flag(
        None, "Revision of pretrained model identifier from huggingface.co/models. Default: the main branch."
    )
    variant: str | None = flag(
        None, "Variant of the model files of the pretrained model, e.g. fp16. Default: the plain weight files."
    )
    transformer_init: str = flag(
        "pretrained",
        "'random': build the transformer from its config with seeded random weights, and so every other component "
        "whose folder holds a config but no weights (benchmarks and equivalence runs of full-sized models without "
        "downloading them: python -m flux_cp.tiny --preset ...).",
        choices=("pretrained", "random"),
    )
    base_precision: str = flag(
        "bf16",
        "How the frozen transformer's linear weights are stored while a LoRA trains: 'bf16' as loaded, 'fp8' or "
        "'int8' (torchao: one byte per weight), 'nf4' (bitsandbytes' 4-bit NormalFloat, as QLoRA). Embedders, norms "
        "and the final layer stay as loaded. For GPUs the bf16 base does not fit (docs/small_gpus.md); needs pip "
        "install -e .[quant].",
        choices=PRECISIONS,
    )
    text_encoder_offload: str = flag(
        "auto",
        "Keep a text encoder's weights in host memory and stream each layer to the GPU for its forward while prompts "
        "encode (exact; slower): 'auto' for a text encoder whose weights and activations do not fit the GPU "
        "(--gpu_memory_gib, else the GPU's own, less a tenth of headroom; FLUX.2 [dev]'s 24B Mistral on a 24 GiB "
        "card), 'on', 'off'. docs/small_gpus.md.",
        choices=("auto", "on", "off"),
    )
    vae_tiling: str = flag(
        "auto",
        "Encode and decode with the VAE in overlapping tiles (diffusers' enable_tiling; tiles blend, so the latents "
        "and images differ slightly from whole ones): 'auto' where the whole image would not fit the GPU (encoding "
        "at --resolution, validation images beside the transformer), 'on', 'off'. docs/small_gpus.md.",
        choices=("auto", "on", "off"),
    )
    cache_dir: str | None = flag(
        None,
        "Where downloaded models and hub data sets are stored, as --cache_dir of diffusers' examples. Default: the "
        "Hugging Face cache (HF_HOME). Deprecated other use, for this release: without --encodings_dir, the encodings "
        "are also cached here (as --cache_dir did before).",
    )

    @property
    def embedded_default(self) -> bool:
        """No model named: the tiny Flux built locally, trained on the bundled data set."""
        return self.pretrained_model_name_or_path is None

    def check(self) -> None:
        path = self.pretrained_model_name_or_path
        if self.revision is not None and path is not None and os.path.isdir(path):
            raise UsageError(
                f"--revision {self.revision} with the local model folder {path}: a revision is a branch, tag or commit "
                "of a hub repository, and a folder holds one version of its files (diffusers ignores --revision "
                "there); drop --revision, or pass the hub id to load that revision"
            )


@dataclass(frozen=True)
class LoraConfig:
    """LoRA adapters or full fine-tuning (flux_cp.lora, flux_cp.model). `rank` is the LoRA rank (the process
    rank is `Layout.rank`)."""

    full_finetune: bool = flag(False, "Train all transformer weights instead of LoRA.")
    rank: int = flag(16, "The dimension of the LoRA update matrices (LoRA rank).")
    lora_alpha: int = flag(
        16, "LoRA alpha: the update is scaled by alpha / rank. Default: the rank.", derive=lambda raw: raw["rank"]
    )
    lora_dropout: float = flag(0.0, "Dropout probability for LoRA layers.")
    lora_layers: tuple[str, ...] | None = flag(
        None,
        "Comma-separated module name suffixes that get LoRA adapters. Default: diffusers' LoRA example's for the "
        "model family: FLUX.1 the attention projections and MLPs of both streams (Kontext pairs add proj_mlp); "
        "FLUX.2 to_k,to_q,to_v,to_out.0,to_qkv_mlp_proj and every single block's attn.to_out.",
        parse=_comma_list,
    )
    adapter: str = flag(
        "lora",
        "The adapter trained on --lora_layers, through peft: lora; dora (LoRA with a trained magnitude per output "
        "feature: --use_dora of diffusers' and SimpleTuner's scripts, LyCORIS' dora_wd); lokr (a Kronecker product: "
        "LyCORIS' algo=lokr in kohya's and SimpleTuner's scripts, ai-toolkit's network type lokr). --rank and "
        "--lora_alpha apply to each.",
        choices=ADAPTERS,
    )
    lora_format: str = flag(
        "diffusers",
        "Layout of pytorch_lora_weights.safetensors: 'diffusers' (the pipeline's load_lora_weights, ComfyUI) or "
        "'kohya' (kohya / BFL names: ComfyUI, Forge, kohya's tools; FLUX.1 only).",
        choices=LORA_FORMATS,
    )

    network_weights: str | None = flag(
        None,
        "A LoRA file (.safetensors, in diffusers' layout, or kohya's for FLUX.1) to start the LoRA from, as kohya's "
        "--network_weights: it must hold LoRAs on the --lora_layers of this run, of --rank, at its --lora_alpha; the "
        "optimizer and LR schedule start fresh at step 0. (--resume_from_checkpoint continues a flux-cp checkpoint "
        "instead.) Default: none (LoRA weights drawn from --seed).",
    )

    train_text_encoder: bool = flag(
        False,
        "Also train a LoRA on the CLIP text encoder (FLUX.1 and FLUX.1 Kontext), as diffusers' FLUX.1 LoRA example: "
        "on its q_proj, k_proj, v_proj and out_proj with --rank, --lora_alpha and --lora_dropout, at "
        "--text_encoder_lr. CLIP then runs every step (its prompt encodings are not cached; T5's still are) and the "
        "LoRA file holds its text_encoder.* keys. DDP configs only.",
    )

    def check(self) -> None:
        if self.train_text_encoder and self.full_finetune:
            raise UsageError(
                "--train_text_encoder trains a CLIP LoRA written into the LoRA file; --full_finetune writes a "
                "transformer folder and no LoRA: drop one of the two"
            )
        if self.train_text_encoder and self.lora_format != "diffusers":
            raise UsageError(
                f"--train_text_encoder with --lora_format {self.lora_format}: the {self.lora_format} layout written "
                "here holds the transformer's LoRA only; keep --lora_format diffusers (FluxPipeline.load_lora_weights "
                "loads both) or drop --train_text_encoder"
            )
        if self.network_weights is not None:
            if self.full_finetune:
                raise UsageError(
                    "--network_weights starts a LoRA from a LoRA file; --full_finetune trains every weight and no "
                    "LoRA: drop one of the two"
                )
            if self.train_text_encoder:
                raise UsageError(
                    "--network_weights starts the transformer's LoRA, not the text encoder's of --train_text_encoder: "
                    "drop one of the two"
                )
            if not os.path.isfile(self.network_weights):
                raise UsageError(f"--network_weights {self.network_weights}: no such file (a LoRA .safetensors file)")
        if self.full_finetune and self.lora_format != "diffusers":
            raise UsageError(
                f"--lora_format {self.lora_format} applies to LoRA files; --full_finetune writes a transformer "
                "folder in diffusers' layout: drop one of the two"
            )


@dataclass(frozen=True)
class DataConfig:
    """Images, captions and their encodings (flux_cp.data, flux_cp.encode)."""

    dataset_name: str | None = flag(
        None,
        "Hub data set id, or a local folder of images with metadata.jsonl or a .txt caption beside each image. "
        "Default: the bundled data set (or --instance_data_dir).",
    )
    instance_data_dir: str | None = flag(
        None,
        "A local folder of training images, as diffusers' DreamBooth examples name it: the same as --dataset_name "
        "with a folder (give one of the two). Default: none.",
    )
    dataset_config_name: str | None = flag(
        None, "The config of the hub data set. Default: its only config (leave unset when it has one)."
    )
    image_column: str = flag("image", "The column of the data set holding the (target) image.")
    caption_column: str = flag("text", "The column of the data set holding each image's caption.")
    cond_image_column: str | None = flag(
        None,
        "Pair data (FLUX.1 Kontext, FLUX.2 editing): the column of each target's reference image, or for FLUX.2 of a "
        "list of them (a local folder's metadata.jsonl names it in '<column>_file_name'; found there without this "
        "flag when it is the only one). Default: none (text-to-image data).",
    )
    instance_prompt: str | None = flag(
        None, "DreamBooth-style: use this prompt for every image (captions are ignored). Default: the captions."
    )
    resolution: tuple[int, ...] = flag(
        (1024,),
        "Training resolution in pixels (multiple of 16), or several, comma-separated (1024,2048): every image then "
        "trains at each of them every epoch, each global batch at one. Default: 1024, or 64 for the tiny default.",
        derive=lambda raw: (64,) if _is_embedded(raw) else (1024,),
        parse=_resolutions,
    )
    repeats: int = flag(
        1,
        "How many times each image appears per epoch (the data set is repeated); a folder in kohya's layout "
        "(sub-folders N_name) repeats each image N times, and this multiplies N.",
    )
    caption_dropout: float = flag(
        0.0,
        "Probability that a training image's caption is replaced by the empty caption in a step (it then trains "
        "unconditionally, for classifier-free guidance), as diffusers' FLUX.2 [klein] example; class images of "
        "--with_prior_preservation keep theirs.",
    )
    with_prior_preservation: bool = flag(
        False,
        "DreamBooth prior preservation: each step also trains on as many class images (--class_data_dir, captioned "
        "--class_prompt) as training images, adding --prior_loss_weight times their loss.",
    )
    class_data_dir: str | None = flag(
        None,
        "The folder of class images for --with_prior_preservation (read, never written); missing ones (up to "
        "--num_class_images) are generated with the base model into its subfolder generated/. Default: none.",
    )
    class_prompt: str | None = flag(
        None, "The prompt of the class images (--with_prior_preservation), e.g. 'a photo of a dog'. Default: none."
    )
    num_class_images: int = flag(
        100,
        "Class images for prior preservation: when --class_data_dir holds fewer, the rest are generated with "
        "--class_prompt.",
    )
    prior_loss_weight: float = flag(1.0, "The weight of the prior preservation loss.")
    center_crop: bool = flag(False, "Center crop the images to the resolution. Default: off (a random crop).")
    random_flip: bool = flag(False, "Randomly flip images horizontally.")
    aspect_buckets: bool = flag(
        False, "Group images into aspect-ratio buckets of about resolution^2 pixels instead of square crops."
    )
    max_sequence_length: int = flag(
        512,
        "Text-encoder tokens per prompt (<= 512; T5's for FLUX.1, Mistral's or Qwen3's for FLUX.2). Default: 512, or "
        "48 for the tiny default.",
        # the tiny default's: its bundled captions spelled out by the tiny tokenizer (35 tokens at most), whole
        derive=lambda raw: TINY_TEXT_TOKENS if _is_embedded(raw) else 512,
    )
    vae_encode_mode: str | None = flag(
        None,
        "The VAE latent of each image: 'sample' (a draw from its posterior, every step) or 'mode' (its mean). "
        "Default: diffusers' example's for the model family and data: FLUX.1 sample, FLUX.1 Kontext pairs and "
        "FLUX.2 mode. Reference images always use the mode.",
        choices=("sample", "mode"),
    )
    encodings_dir: str | None = flag(
        None,
        f"Where encoded latents and prompt embeddings are cached. Default: {DEFAULT_ENCODINGS_DIR} (--cache_dir when "
        "that is given: deprecated).",
        derive=lambda raw: raw["cache_dir"],
    )
    no_cache: bool = flag(
        False, "Encode every batch on the fly (keeps VAE and text encoders loaded; per-epoch random crops)."
    )

    @property
    def largest_resolution(self) -> int:
        return max(self.resolution)

    @property
    def samples_per_slot(self) -> int:
        """Samples each slot of a batch trains: its own, and with prior preservation a class image beside it."""
        return 2 if self.with_prior_preservation else 1

    def check(self) -> None:
        for res in self.resolution:
            if res % 16:
                raise UsageError(f"--resolution {res} must be a multiple of 16 (8x VAE, 2x2 patches)")
        if self.instance_data_dir is not None and not os.path.isdir(self.instance_data_dir):
            raise UsageError(
                f"--instance_data_dir {self.instance_data_dir}: no such folder (a hub data set goes to --dataset_name)"
            )
        if self.with_prior_preservation:
            needed = (("class_data_dir", self.class_data_dir, "the folder of class images"),
                      ("class_prompt", self.class_prompt, "the prompt of the class images"))  # fmt: skip
            for name, value, what in needed:
                if value is None:
                    raise UsageError(f"--with_prior_preservation needs --{name} ({what})")
            if os.path.exists(self.class_data_dir) and not os.path.isdir(self.class_data_dir):
                raise UsageError(f"--class_data_dir {self.class_data_dir} is a file, not a folder")
        name = self.dataset_name
        if name and not os.path.exists(name) and not is_hub_id(name):
            raise UsageError(f"--dataset_name {name}: no such folder (and not a hub id like owner/name)")
        if self.cond_image_column is not None and self.dataset_name is None:
            raise UsageError("--cond_image_column needs --dataset_name (the bundled data set has no reference images)")


@dataclass(frozen=True)
class TrainConfig:
    """Optimisation: batch, steps, optimizer, schedule, loss, precision (train_flux_cp.py, flux_cp.flow)."""

    config: str | None = flag(
        None,
        "A YAML (.yaml, .yml), TOML (.toml) or JSON (.json) file of flags by their names without '--' (flat, or in "
        "tables named after the sections: model, data, train, lora, ...); flags on the command line win. A run's "
        "OUTPUT_DIR/run_config.json is one: --config it with another --output_dir to repeat the run "
        "(docs/config_files.md). Default: none.",
        record=False,  # its flags are recorded, each under its own name
    )
    output_dir: str = flag(
        "flux-cp-output", "Where the trained model, checkpoints, metrics, validation images and logs are written."
    )
    overwrite_output_dir: bool = flag(
        False,
        "Replace an earlier run in --output_dir (its checkpoints, weights, metrics, validation images and logs are "
        "removed; other files stay). Without it, a folder holding another run is refused unless resumed.",
    )
    seed: int = flag(0, "A seed for reproducible training: data order, crops, noise, timesteps, initial LoRA weights.")
    train_batch_size: int = flag(
        1,
        "Samples per data-parallel rank per micro-step. Default: 1, or the demo's (4).",
        derive=lambda raw: _demo(raw).batch if _demo(raw) else 1,
    )
    max_train_steps: int | None = flag(
        None,
        "Optimizer steps; overrides --num_train_epochs. Default: --num_train_epochs epochs, or the demo's (200 for "
        "the bundled data set, 100 for its Kontext pairs).",
        derive=lambda raw: _demo(raw).steps if _demo(raw) else None,
    )
    num_train_epochs: int = flag(
        1, "Passes over the data set when --max_train_steps is not given. Default: 1.", derive=lambda raw: 1
    )
    gradient_accumulation_steps: int = flag(
        1, "Number of updates steps to accumulate before performing a backward/update pass."
    )
    gradient_checkpointing: str = flag(
        "none",
        "Recompute transformer blocks in the backward pass to save memory, at the cost of a slower step: 'auto' (the "
        "value of the flag given alone) checkpoints the fewest blocks whose planned peak fits the GPU's memory "
        "(--gpu_memory_gib, else the GPU's own; --plan shows the choice), 'all', 'none', or a number of blocks, taken "
        "from the end whose blocks keep the most for their backward (FLUX.1: the first blocks, FLUX.2: the last).",
        parse=_checkpointing,
        const="auto",
    )
    offload_blocks: str = flag(
        "0",
        "Keep the frozen weights of this many transformer blocks in pinned host memory and copy each to the GPU on a "
        "side stream ahead of its use, forward and backward: the same results with less GPU memory, for LoRA with "
        "DDP. 'auto' (the value of the flag given alone): the memory planner chooses the count, with "
        "--gradient_checkpointing auto the pair of both, whose planned peak fits the GPU's memory with the least "
        "modelled step time (--plan shows it); 0 or none: no offload. docs/offload.md says what it costs.",
        parse=_offload_blocks,
        const="auto",
    )
    learning_rate: float = flag(
        1e-4,
        "Initial learning rate (after the warmup). Default: 1e-4; 1.0 with --optimizer prodigy (a factor on the step "
        "size Prodigy estimates); with AdamW the demo's (1e-3; 2e-3 for the Kontext demo).",
        derive=lambda raw: 1.0 if raw["optimizer"] == "prodigy" else (_demo(raw).learning_rate if _demo(raw) else 1e-4),
    )
    scale_lr: bool = flag(False, "Multiply the LR by the global batch size.")
    lr_scheduler: str = flag("constant", "The learning rate schedule.", choices=LR_SCHEDULERS)
    lr_warmup_steps: int = flag(0, "Number of steps for the warmup in the lr scheduler.")
    lr_num_cycles: int = flag(1, "Number of hard resets of the lr in cosine_with_restarts scheduler.")
    lr_power: float = flag(1.0, "Power factor of the polynomial scheduler.")
    optimizer: str = flag(
        "adamw",
        "The optimizer: 'adamw' (torch's fused AdamW, or bitsandbytes' 8-bit one with --use_8bit_adam) or 'prodigy' "
        "(prodigyopt: it estimates its own step size; pip install -e .[optim]). Case does not matter.",
        choices=OPTIMIZERS,
        parse=str.lower,
    )
    use_8bit_adam: bool = flag(
        False,
        "AdamW with 8-bit moments from bitsandbytes (a quarter of AdamW's state memory; CUDA GPUs; pip install -e "
        ".[optim]). Applies to --optimizer adamw.",
    )
    adam_beta1: float = flag(0.9, "The beta1 parameter of AdamW and Prodigy.")
    adam_beta2: float = flag(0.999, "The beta2 parameter of AdamW and Prodigy.")
    adam_weight_decay: float = flag(
        1e-4, "Weight decay of the trained weights (decoupled as AdamW's; Prodigy: see --prodigy_decouple)."
    )
    adam_epsilon: float = flag(1e-8, "Epsilon value of AdamW and Prodigy.")
    prodigy_beta3: float | None = flag(
        None,
        "Prodigy: the decay of the running averages its step size is estimated from. Default: the square root of "
        "--adam_beta2.",
    )
    prodigy_decouple: bool = flag(
        True, "Prodigy: AdamW-style decoupled weight decay (true) or an L2 penalty on the gradient (false).",
        parse=boolean,
    )  # fmt: skip
    prodigy_use_bias_correction: bool = flag(True, "Prodigy: Adam's bias correction (true/false).", parse=boolean)
    prodigy_safeguard_warmup: bool = flag(
        True,
        "Prodigy: leave the LR out of the denominator of its step-size estimate, against problems during a warmup "
        "(true/false).",
        parse=boolean,
    )
    text_encoder_lr: float = flag(
        5e-6,
        "Learning rate of the text encoder's LoRA (--train_text_encoder), as diffusers' FLUX.1 LoRA example; with "
        "--optimizer prodigy --learning_rate is used for both (as there).",
    )
    adam_weight_decay_text_encoder: float = flag(
        1e-3, "Weight decay of the text encoder's LoRA (--train_text_encoder), as diffusers' example."
    )
    use_ema: bool = flag(
        False,
        "Keep an exponential moving average (EMA) of the trained weights (LoRA, or all weights with --full_finetune) "
        "and make it the run's output: the final weights and the validation images are the EMA's; checkpoints hold "
        "the raw weights and the EMA. The decay of the update at step s is min(--ema_decay, (1 + s) / (10 + s)), as "
        "diffusers' EMAModel.",
    )
    ema_decay: float = flag(0.9999, "Upper bound of the EMA's decay (--use_ema), as diffusers' EMAModel.")
    ema_update_interval: int = flag(
        1, "Update the EMA (--use_ema) after every this many optimizer steps (SimpleTuner's flag), to save time."
    )
    max_grad_norm: float = flag(1.0, "Max gradient norm (clipping; 0 turns it off).")
    mixed_precision: str | None = flag(
        None,
        "Precision of the frozen weights and the activations (trained weights stay fp32). Default: accelerate's "
        "config (bf16 in the GPU configs here).",
        choices=("no", "fp16", "bf16"),
    )
    allow_tf32: bool = flag(
        False, "Allow TF32 on Ampere and newer GPUs: faster matrix products of fp32 tensors, at lower precision."
    )
    weighting_scheme: str = flag(
        "none",
        "Timestep density and loss weighting, as in diffusers' examples: 'none' samples timesteps uniformly and "
        "weights the loss uniformly.",
        choices=WEIGHTING_SCHEMES,
    )
    logit_mean: float = flag(0.0, "Mean of the 'logit_normal' weighting scheme.")
    logit_std: float = flag(1.0, "Standard deviation of the 'logit_normal' weighting scheme.")
    mode_scale: float = flag(1.29, "Scale of the 'mode' weighting scheme.")
    guidance_scale: float = flag(
        3.5,
        "Guidance embedding value for guidance-distilled checkpoints (FLUX.1 [dev], FLUX.2 [dev]), in training and in "
        "validation images; FLUX.2 [klein] base models use it as classifier-free guidance in validation images.",
    )
    deterministic: bool = flag(False, "Deterministic kernels (slower).")
    profile_step: int | None = flag(
        None,
        "Profile this step (torch.profiler): a Chrome trace per rank and a summary of the GPU time by kernel kind, "
        "with how much of the communication overlapped compute, under OUTPUT_DIR/profile/. Default: no profile.",
    )
    seed_checkpoint: str | None = flag(
        None,
        "Initial trainable weights: written here when absent, read when present, so runs with different layouts "
        "start from identical parameters. Default: none (weights drawn from --seed).",
    )
    on_nonfinite: str = flag("stop", "What to do when the loss or gradient norm is NaN/inf.", choices=("stop", "skip"))
    compile: str = flag(
        "auto",
        "torch.compile each transformer block: 'on' (the flag given alone), 'off', or 'auto': on for a GPU run whose "
        "steps save more time than compiling takes by the planner's speed model (the log says why; --plan shows both), "
        "off on the CPU. A compile that fails at the first step falls back to eager blocks with one line.",
        parse=_on_off_auto,
        const="on",
    )
    recompute_attention: bool = flag(
        False,
        "With --gradient_checkpointing and --compile: recompute the attention (and its CP exchanges) in the backward "
        "instead of keeping its outputs. Saves memory (--plan shows how much) at the cost of a second attention "
        "forward per block.",
    )
    compile_mode: str | None = flag(
        None,
        "torch.compile mode of the blocks (implies --compile); reduce-overhead replays each block's forward and "
        "backward as CUDA graphs, communication included: the fastest on GPUs, most of all for short sequences. "
        "Default: torch.compile's own mode with --compile, else none.",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
    )

    def check(self) -> None:
        if self.compile == "off" and self.compile_mode:
            raise UsageError(
                f"--compile off with --compile_mode {self.compile_mode}: a compile mode compiles the blocks; drop one "
                "of the two"
            )


def cp_modes() -> tuple[str, ...]:
    """--cp_mode's choices: auto and every registered CP mode (`cp.MODES`)."""
    return ("auto", *MODES)


def _cp_mode_help() -> str:
    modes = ", ".join(f"{name} ({mode.summary})" if mode.summary else name for name, mode in MODES.items())
    ranked = sorted((m for m in MODES.values() if m.auto_rank is not None), key=lambda m: m.auto_rank)
    return (
        f"How attention exchanges keys and values in a CP group: {modes}; auto picks the first of "
        f"{', '.join(m.name for m in ranked)} that the model's heads and --cp_size allow."
    )


def _ulysses_modes() -> str:
    """The modes that take --ulysses_size."""
    return " or ".join(name for name, mode in MODES.items() if mode.takes_ulysses_size)


@dataclass(frozen=True)
class ParallelConfig:
    """The CP group and collectives (flux_cp.parallel, cp)."""

    cp_size: int = flag(1, "Ranks that share one sample's tokens.")
    cp_mode: str = flag("auto", _cp_mode_help, choices=cp_modes)
    ulysses_size: int | None = flag(
        None, lambda: f"Ulysses degree of the {_ulysses_modes()} mode. Default: chosen by --cp_mode auto."
    )
    collective_timeout: float = flag(
        600.0, "Seconds before a stuck collective aborts the run (a dead rank never hangs the others)."
    )

    def check(self) -> None:
        mode = MODES.get(self.cp_mode)  # None: auto
        if mode is not None and mode.takes_ulysses_size and self.ulysses_size is None:
            raise UsageError(
                f"--cp_mode {self.cp_mode} needs --ulysses_size (the Ulysses degree, a divisor of --cp_size)"
            )
        # run_config.json records the degree a mode runs itself (the whole group for Ulysses): read back, it is no
        # request of a degree
        own = mode is not None and not mode.takes_ulysses_size and self.ulysses_size == mode.degree(self.cp_size, None)
        if self.ulysses_size is not None and mode is not None and not mode.takes_ulysses_size and not own:
            raise UsageError(
                f"--ulysses_size is only used with --cp_mode {_ulysses_modes()} (got --cp_mode {self.cp_mode})"
            )
        if self.ulysses_size is not None and self.cp_size % self.ulysses_size:
            raise UsageError(f"--ulysses_size {self.ulysses_size} must divide --cp_size {self.cp_size}")


@dataclass(frozen=True)
class CPTuningConfig:
    """How CP runs, never what it computes (cp.Tuning): the attention kernels and how the exchanges are scheduled.
    Every setting gives the same results; they are for benchmarks and debugging."""

    cp_kernels: str | None = flag(
        None,
        "Comma-separated attention kernels in order of preference (the first that serves an input is used), from "
        f"{', '.join(sorted(KERNELS))}. Default: {','.join(DEFAULT_PREFERENCE['cuda'])} on CUDA, "
        f"{','.join(DEFAULT_PREFERENCE['cpu'])} on CPU.",
        parse=lambda text: ",".join(_comma_list(text)),  # kept as text: run_config.json and resumes compare it
    )
    cp_overlap: str = flag(
        "fill",
        "How a compiled block orders its CP exchanges against its compute: 'fill' (our scheduling pass puts ready "
        "compute beside each exchange), 'passes' (each exchange starts as early and is waited for as late as "
        "possible), 'compute' or 'scheduler' (Inductor's own, by its GPU runtime estimates) or 'none'.",
        choices=OVERLAPS,
    )
    cp_exchange_first: bool = flag(
        False,
        "After launching each CP exchange and after each wait for one, hold the compute stream ~0.5 us so that the "
        "exchange starts before the compute kernel behind it and runs beside it. Effect on a step not measured.",
    )
    cp_ulysses_chunks: int = flag(
        1,
        "Head chunks of the Ulysses attention, pipelined so that one chunk's exchange runs beside another's "
        "attention (reduced until the chunks' heads divide over the group). Gain on two GPUs not measured.",
    )

    @property
    def kernels(self) -> tuple[str, ...]:
        return _comma_list(self.cp_kernels or "")

    def tuning(self) -> Tuning:
        return Tuning(self.kernels, self.cp_overlap, self.cp_exchange_first, self.cp_ulysses_chunks)

    def check(self) -> None:
        if self.cp_kernels == "":
            raise UsageError(f"--cp_kernels '': no kernel named; choose from {', '.join(sorted(KERNELS))}")
        flags = {
            "kernels": f"--cp_kernels {self.cp_kernels!r}",
            "overlap": "--cp_overlap",
            "exchange_first": "--cp_exchange_first",
            "ulysses_chunks": "--cp_ulysses_chunks",
        }
        problem = refusal(self.kernels, self.cp_overlap, self.cp_exchange_first, self.cp_ulysses_chunks, flags)
        if problem:
            raise UsageError(problem)


@dataclass(frozen=True)
class CheckpointConfig:
    """Training checkpoints and resume (flux_cp.checkpoint)."""

    checkpointing_steps: int = flag(
        500, "Save a resumable checkpoint of the training state every X optimizer steps (and at the end)."
    )
    checkpoints_total_limit: int | None = flag(
        None, "Max number of checkpoints to store (the oldest are removed). Default: keep them all."
    )
    resume_from_checkpoint: str | None = flag(
        None,
        "'latest' (of --output_dir) or a checkpoint folder; a bare name (checkpoint-2) that is no folder here is one "
        "of --output_dir, as in diffusers' examples. Default: start from step 0.",
    )
    checkpoint_weights_only: bool = flag(
        False,
        "Checkpoints hold the trainable weights and the LR schedule but not AdamW's moments (a third of the size). "
        "Resuming from one restarts the moments from zero: training continues, but not exactly as uninterrupted.",
    )

    def check(self) -> None:
        resume = self.resume_from_checkpoint
        if resume not in (None, "latest") and not os.path.isdir(resume):
            raise UsageError(f"--resume_from_checkpoint {resume}: no such checkpoint folder")


@dataclass(frozen=True)
class ValidationConfig:
    """Validation images and logging (flux_cp.validation, flux_cp.metrics, trackers)."""

    validation_prompt: tuple[str, ...] | None = flag(
        None,
        "A prompt to render validation images of; repeatable. The embedded default also renders them before training "
        "(step 0). Default: none (no validation), or two captions of the bundled set for the demo.",
        repeat=True,
        derive=lambda raw: _demo(raw).prompts if _demo(raw) else None,
    )
    validation_image: tuple[str, ...] | None = flag(
        None,
        "Pair data: the reference image every --validation_prompt edits (FluxKontextPipeline, Flux2Pipeline, "
        "Flux2KleinPipeline); repeatable for FLUX.2, whose pipelines take several references (image=[...]). "
        "Default: none, or a reference of the bundled pairs for the Kontext demo.",
        repeat=True,
        derive=lambda raw: (str(_demo(raw).validation_image),) if _demo(raw) and _demo(raw).validation_image else None,
    )
    validation_steps: int | None = flag(
        None, "Render validation images every X optimizer steps. Default: only at the end of training."
    )
    num_validation_images: int = flag(2, "Number of images generated per --validation_prompt.")
    validation_resolution: int = flag(
        1024,
        "Size of the validation images in pixels. Default: --resolution (the largest).",
        derive=lambda raw: max(raw["resolution"]),
    )
    validation_inference_steps: int = flag(28, "Denoising steps of each validation image.")
    report_to: str = flag(
        "tensorboard", "The integration to report results and logs to.", choices=("tensorboard", "wandb", "all", "none")
    )
    logging_dir: str = flag("logs", "Tracker folder, relative to --output_dir.")

    @property
    def writes_logs(self) -> bool:
        """Whether a tracker writes files into --logging_dir: TensorBoard, and wandb (its wandb/ folder)."""
        return self.report_to != "none"

    def check(self) -> None:
        if self.validation_resolution % 16:
            raise UsageError(f"--validation_resolution {self.validation_resolution} must be a multiple of 16")
        for image in self.validation_image or ():
            if not os.path.isfile(image):
                raise UsageError(f"--validation_image {image}: no such file")
        if self.report_to == "wandb":
            import importlib.util

            if importlib.util.find_spec("wandb") is None:
                raise UsageError("--report_to wandb needs the wandb package (pip install wandb), or use tensorboard")


@dataclass(frozen=True)
class HubConfig:
    """Uploading the output folder to the Hugging Face Hub at the end (flux_cp.hub; the model card: flux_cp.card)."""

    push_to_hub: bool = flag(
        False, "Whether or not to push the model (LoRA or transformer, its card, validation images) to the Hub."
    )
    hub_model_id: str | None = flag(
        None, "The name of the repository to keep in sync with the local --output_dir. Default: the folder's name."
    )
    hub_token: str | None = flag(
        None,
        "The token to use to push to the Model Hub. Prefer `hf auth login` (or HF_TOKEN): a token on the command "
        "line shows in the process list and shell history. Never written to the run's files. Default: HF_TOKEN, "
        "else the stored login's.",
        secret=True,
    )


@dataclass(frozen=True)
class PlanConfig:
    """`--plan`: the memory planner instead of training (flux_cp.plan)."""

    plan: bool = flag(
        False,
        "Print the estimated per-GPU memory of this configuration, and the smallest CP size that fits, then exit "
        "(loads nothing heavy).",
    )
    gpu_memory_gib: float | None = flag(
        None,
        "For --plan and --gradient_checkpointing / --offload_blocks auto: memory per GPU in GiB (e.g. a per-process "
        "memory cap, or a smaller card's: 12, 16, 24). Default: the GPU's own, or 141 (an H200) for --plan without "
        "one.",
    )
    num_processes: int | None = flag(
        None,
        "For --plan: the processes (GPUs) to plan for, as accelerate launch's --num_processes; with 2 or more and "
        "LoRA, --plan also compares DDP with a quantized base against FSDP2 with a bf16 one. Default: the launched "
        "processes (WORLD_SIZE), else --cp_size.",
    )
    host_memory_gib: float | None = flag(
        None,
        "For --plan and --offload_blocks auto: host memory (CPU RAM) in GiB of one machine, of which the pinned homes "
        "of offloaded blocks may take nine tenths, shared by its processes. Default: this machine's available memory.",
    )
    gpu_class: str = flag(
        "auto",
        "For --plan and auto's choices: whose speed figures predict step times (flux_cp/speed_data/): 'auto' measures "
        "this GPU (cached), or without one takes the class of --gpu_memory_gib (up to 32 GiB a 24 GB card's, "
        "rtx4090; up to 100 an h100; else an h200); or name one.",
        choices=("auto", "h100", "h200", "rtx4090"),
    )


@dataclass(frozen=True)
class Config:
    """Every flag of a run, by section. Sections are frozen: a module gets the section(s) it needs."""

    model: ModelConfig = field(default_factory=ModelConfig)
    lora: LoraConfig = field(default_factory=LoraConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    cp_tuning: CPTuningConfig = field(default_factory=CPTuningConfig)
    checkpoints: CheckpointConfig = field(default_factory=CheckpointConfig)
    validation: ValidationConfig = field(default_factory=ValidationConfig)
    hub: HubConfig = field(default_factory=HubConfig)
    plan: PlanConfig = field(default_factory=PlanConfig)
    # How parse_config resolved the flags (not flags): the demo whose settings this run got; with the embedded
    # default, the flags given that turned a demo's settings off; and the checkpoint whose run's demo settings a
    # resume keeps. Fields, so that every copy (dataclasses.replace) keeps them.
    demo: Demo | None = field(default=None, metadata={"resolution": True})
    demo_off: tuple[str, ...] = field(default=(), metadata={"resolution": True})
    demo_from: str | None = field(default=None, metadata={"resolution": True})
    given: tuple[str, ...] = field(default=(), metadata={"resolution": True})  # the flags on the command line

    def sections(self) -> list[Any]:
        """The flag sections (model, lora, data, ...), in field order."""
        return [getattr(self, f.name) for f in dataclasses.fields(self) if not f.metadata.get("resolution")]

    def check(self) -> None:
        """Every check that needs only the flags; the first failure is a UsageError naming the flag. (What needs the
        launch, the model or the machine too is checked at the start of the run: flux_cp.trainer.)"""
        check_ranges(self.flat())
        for section in self.sections():
            check = getattr(section, "check", None)
            if check is not None:
                check()
        check_flags(self.model.base_precision, self.lora.full_finetune)
        if self.lora.network_weights is not None and self.train.seed_checkpoint is not None:
            raise UsageError(
                "--network_weights and --seed_checkpoint both set the initial LoRA weights: give one of the two"
            )
        adapters.check(self.lora, self.model.base_precision)
        if not self.plan.plan:  # the planner loads nothing and runs on any machine
            check_installed(self.model.base_precision)
        if self.hub.push_to_hub:  # what would fail the upload at the end whatever the run does
            hub.check_start(self.hub.hub_model_id, self.hub.hub_token, self.train.output_dir)
        if self.hub.hub_token and self.validation.report_to in ("wandb", "all"):
            # as diffusers' examples: wandb records the command line, and the token with it
            raise UsageError(
                "--hub_token with --report_to wandb would put the token in wandb's record of the command line: log "
                "in with `hf auth login` (or set HF_TOKEN) instead of --hub_token"
            )

    def flat(self) -> dict[str, Any]:
        """{flag name: value} of every flag but the secret ones (run_config.json, checkpoints' meta, trackers)."""
        return {
            f.name: getattr(section, f.name)
            for section in self.sections()
            for f in dataclasses.fields(section)
            if not f.metadata["secret"] and f.metadata["record"]
        }

    def demo_lines(self) -> list[str]:
        """What the log says about the demo settings: the ones this run got, or which flags turned them off (with
        the embedded default only; a named model never had them)."""
        demo, train = self.demo, self.train
        if demo is not None:
            images = f"validation images of {len(self.validation.validation_prompt or ())} prompts"
            if self.validation.validation_image:
                images += f" editing {', '.join(os.path.relpath(p) for p in self.validation.validation_image)}"
            settings = (
                f"{train.max_train_steps} steps at learning rate {train.learning_rate:g}, {train.train_batch_size} "
                f"samples per step, {images} before and after training"
            )
            if self.demo_from is not None:
                return [
                    f"{demo.name}'s settings, as the run of {self.demo_from} had them: {settings} (given flags win)"
                ]
            return [
                f"{demo.name}'s settings: {settings} (given flags win; "
                f"{', '.join('--' + f for f in DEMO_OFF_FLAGS[:2])} or another --dataset_name turn them off)"
            ]
        if self.demo_off:
            given = ", ".join("--" + f for f in self.demo_off)
            n = train.train_batch_size
            lr = f"learning rate {train.learning_rate:g}, {n} sample{'s' if n > 1 else ''} per step"
            epochs = train.num_train_epochs
            steps = train.max_train_steps
            steps = f"{steps} step{'s' * (steps > 1)}" if steps else f"{epochs} epoch{'s' * (epochs > 1)}"
            return [f"the demo's settings are off ({given} given): {steps}, {lr}, as for real runs"]
        return []


def non_default(cfg: Config) -> dict[str, Any]:
    """{flag: value} of every flag (the secret ones aside) whose value is not its default; a derived default is taken
    from the run's other values as parsing derives it (--lora_alpha against --rank, the demo's settings for a
    demo)."""
    raw = {**cfg.flat(), _DEMO: cfg.demo}
    out = {}
    for section in cfg.sections():
        for f in dataclasses.fields(section):
            if f.metadata["secret"]:
                continue
            value, derive = getattr(section, f.name), f.metadata["derive"]
            default = derive(raw) if derive else f.default
            if value != default:
                out[f.name] = value
    return out


# Argument-group titles of --help, in the order sections appear there.
_TITLES = {
    "model": "model",
    "data": "data",
    "train": "training",
    "lora": "LoRA / full fine-tuning",
    "parallel": "parallelism",
    "checkpoints": "checkpoints",
    "validation": "validation and logging",
    "hub": "Hugging Face Hub",
    "plan": "memory plan",
    "cp_tuning": "advanced: CP tuning",
}


def _sections() -> list[tuple[str, type]]:
    hints = typing.get_type_hints(Config)
    return [(name, hints[name]) for name in _TITLES]


def _scalar_type(annotation: Any) -> type:
    """int / float / str of an annotation such as `int | None` or `tuple[str, ...] | None`."""
    args = [a for a in typing.get_args(annotation) if a is not type(None)]
    if isinstance(annotation, types.UnionType) or typing.get_origin(annotation) is typing.Union:
        return _scalar_type(args[0])
    if typing.get_origin(annotation) is tuple:
        return args[0]
    return annotation


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Every flag's help ends with its default: its own "Default: ..." sentence (flags whose default is None or
    derived from other flags), else argparse's "(default: X)", "(default: off)" for a switch."""

    def _get_help_string(self, action: argparse.Action) -> str:
        text = action.help or ""
        if not action.option_strings or action.default is argparse.SUPPRESS or "Default:" in text:
            return text
        if isinstance(action, argparse._StoreTrueAction):
            return f"{text} (default: off)"
        return f"{text} (default: %(default)s)"


class _Parser(argparse.ArgumentParser):
    """argparse with one-line errors: an unknown flag gets the closest known one ("did you mean
    --learning_rate?"), and argparse's own errors (a bad choice or number) are a UsageError instead of the usage
    block, so that under `accelerate launch` one rank prints one line (flux_cp.runner)."""

    def parse_args(self, args=None, namespace=None):  # noqa: ANN001 - argparse's signature
        parsed, unknown = self.parse_known_args(args, namespace)
        if unknown:
            raise UsageError(self._unknown(unknown))
        return parsed

    def error(self, message: str):  # noqa: ANN201 - argparse's signature
        bad = re.match(r"argument (--\w+): invalid choice: '([^']*)'", message)
        choices = next((a.choices for a in self._actions if bad and bad.group(1) in a.option_strings), None)
        close = difflib.get_close_matches(bad.group(2), [str(c) for c in choices], n=1) if choices else []
        if close:
            raise UsageError(f"{message}: did you mean {close[0]}?")
        raise UsageError(f"{message} ({self.prog} --help lists every flag)")

    def closest(self, given: str) -> str | None:
        """The flag `given` (--learning-rate, -learning_rate, learning_rate) stands for, or the known flag closest to
        it (a misspelling), as `--name`; None when none is close."""
        known = [o for a in self._actions for o in a.option_strings if o.startswith("--")]
        name = "--" + given.lstrip("-").replace("-", "_")
        close = [name] if name in known else difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        return close[0] if close else None

    def _unknown(self, unknown: list[str]) -> str:
        flags = [u.split("=", 1)[0] for u in unknown if u.startswith("-") and len(u) > 1]
        if not flags:
            return (
                f"unexpected argument {unknown[0]!r}: every value follows its flag (e.g. --resolution 1024); "
                f"{self.prog} --help lists every flag"
            )
        parts = []
        for given in flags:
            close = self.closest(given)
            parts.append(f"{given}: did you mean {close}?" if close else given)
        more = "" if all("did you mean" in p for p in parts) else f" ({self.prog} --help lists every flag)"
        return f"unknown flag{'s' if len(parts) > 1 else ''} " + "; ".join(parts) + more


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="train_flux_cp.py",
        description="Fine-tune FLUX.1, FLUX.1 Kontext and FLUX.2 ([dev], [klein]) models (LoRA or full) with context "
        "parallelism. With no model and no data flags it trains a tiny FLUX.1 built locally on the bundled data set "
        "(the embedded default).",
        allow_abbrev=False,  # a misspelt flag is named (did you mean ...?), never taken for the flag it begins
        formatter_class=_HelpFormatter,
    )
    for name, section in _sections():
        group = p.add_argument_group(_TITLES[name])
        hints = typing.get_type_hints(section)
        for f in dataclasses.fields(section):
            m, kind = f.metadata, _scalar_type(hints[f.name])
            kw: dict[str, Any] = {"help": m["help"]() if callable(m["help"]) else m["help"]}
            if kind is bool and not m["parse"]:  # a switch; a boolean with `parse` takes a value (true/false)
                if f.default is not False:  # a switch turns something on; name it for that (e.g. --no_cache)
                    raise TypeError(f"{section.__name__}.{f.name}: boolean flags must default to False")
                kw["action"] = "store_true"
            else:
                # argparse also passes a string default through `type`: a parsed field shows its default as text.
                kw["type"] = m["parse"] or kind
                kw["default"] = None if m["derive"] else f.default
                if m["parse"] and isinstance(f.default, tuple) and not m["derive"]:
                    kw["default"] = ",".join(map(str, f.default))
                if m["choices"]:
                    kw["choices"] = m["choices"]() if callable(m["choices"]) else m["choices"]
                if m["const"] is not None:
                    kw["nargs"], kw["const"] = "?", m["const"]
                if m["repeat"]:
                    kw["action"] = "append"
            group.add_argument(f"--{f.name}", **kw)
    return p


def parse_config(argv: list[str] | None = None) -> Config:
    """Parse the flags once, resolve derived defaults, check them; the Config the whole run uses."""
    parser = build_parser()
    argv = sys.argv[1:] if argv is None else argv
    raw = dict(vars(parser.parse_args(argv)))
    given = given_flags(parser, argv)
    file_notes, from_file = _read_config_file(raw, parser, given) if raw["config"] is not None else ([], set())
    off = tuple(f for f in DEMO_OFF_FLAGS if raw[f] is not None)  # given: none of them has a default before derive
    if raw["instance_data_dir"] is not None:  # diffusers' DreamBooth name of a local --dataset_name
        if raw["dataset_name"] is not None:
            raise UsageError("--dataset_name and --instance_data_dir both name the training data: give one of them")
        raw["dataset_name"] = raw["instance_data_dir"]
    # a bare checkpoint name is a folder of --output_dir (as diffusers' examples read it), said below
    raw["resume_from_checkpoint"], resume_note = named_folder(raw["resume_from_checkpoint"], raw["output_dir"])
    raw[_DEMO] = _demo_of(raw)  # the embedded default on a bundled data set with no step count (the README's demos)
    resumed = _resumed_demo(raw)  # ... or a resume of such a run, which keeps its settings (a step count extends it)
    if resumed is not None:
        raw[_DEMO], demo_from, kept = resumed
        raw.update(kept)
    else:
        demo_from = None
    sections = {}
    for name, section in _sections():
        values = {}
        for f in dataclasses.fields(section):
            m, value = f.metadata, raw[f.name]
            if value is None and m["derive"]:
                value = raw[f.name] = m["derive"](raw)  # later derivations see it (validation <- resolution)
            elif isinstance(value, list):  # a repeated flag
                value = tuple(value)
            values[f.name] = value
        sections[name] = section(**values)
    off = off if _is_embedded(raw) and raw[_DEMO] is None else ()
    # empty paths refused, "~" expanded (said below)
    try:
        parsed = Config(**sections, demo=raw[_DEMO], demo_off=off, demo_from=demo_from, given=tuple(sorted(given)))
        config, notes = as_typed(parsed)
        config.check()
    except UsageError as e:
        flag = re.match(r"--(\w+)", str(e))
        if flag is None or flag.group(1) not in from_file:
            raise
        raise UsageError(f"{e} (--{flag.group(1)} is from --config {raw['config']})") from None
    if os.environ.get("RANK", "0") == "0":
        for warning in unused_flags(given, config.flat()) + _setting_warnings(config, given):
            print(f"warning: {warning}", file=sys.stderr)
        for note in file_notes + notes + ([resume_note] if resume_note else []):
            print(f"flux-cp: {note}", file=sys.stderr)
    return config


def _read_config_file(raw: dict, parser: _Parser, given: set[str]) -> tuple[list[str], set[str]]:
    """--config: the file's flags into `raw` where the command line did not give them (flux_cp.config_file); the
    flags it sets to other than their defaults (derived ones left out: run_config.json records every flag) added to
    `given`, for the warnings about flags without effect. Returns the lines to print and the flags taken from it."""
    fields = {name: {f.name: f for f in dataclasses.fields(section)} for name, section in _sections()}
    sections = {name: set(flags) for name, flags in fields.items()}
    path = os.path.expanduser(raw["config"])  # as every path flag ('~' left as typed after '=': flux_cp.path_flags)
    values, notes = config_file.flag_values(path, parser, sections, parser.closest)
    data = ("dataset_name", "instance_data_dir")
    if values.get("instance_data_dir") is not None and values.get("dataset_name") == values["instance_data_dir"]:
        del values["dataset_name"]  # run_config.json records --instance_data_dir as both
    if given & set(data):  # the command line names the data: the file's choice of either gives way
        values = {k: v for k, v in values.items() if k not in data}
    by_name = {name: f for flags in fields.values() for name, f in flags.items()}
    taken = {name for name in values if name not in given}
    for name in taken:
        value = values[name]
        raw[name] = value
        f = by_name[name]
        default = f.default
        if not f.metadata["derive"] and (tuple(value) if isinstance(value, list) else value) != default:
            given.add(name)
    return notes, taken


def _setting_warnings(config: Config, given: set[str]) -> list[str]:
    """Settings that run, but probably not as meant: the deprecated use of --cache_dir, and Prodigy's learning rate
    (as diffusers' examples warn)."""
    out = []
    data, train = config.data, config.train
    if "cache_dir" in given and "encodings_dir" not in given and not data.no_cache:
        out.append(
            f"--cache_dir {config.model.cache_dir} now holds downloaded models and hub data sets (as in diffusers' "
            "examples); the encodings also go there, as before, for this release only: pass --encodings_dir "
            f"{config.model.cache_dir} to keep them there (or name another folder)"
        )
    if train.optimizer == "prodigy" and train.learning_rate <= 0.1:
        out.append(
            f"--learning_rate {train.learning_rate:g} is low for --optimizer prodigy: its learning rate is a factor on "
            "the step size it estimates itself, and around 1.0 is usual"
        )
    return out


# A hub data set id: `name` or `owner/name` (letters, digits, '-', '_', '.'); anything else is a local path.
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*(/[A-Za-z0-9][\w.-]*)?")


def is_hub_id(name: str) -> bool:
    return _HUB_ID.fullmatch(name) is not None and ".." not in name
