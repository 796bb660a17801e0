"""The model card: `README.md` in the output folder, as diffusers' training examples write it (their
`save_model_card`: YAML front matter from huggingface_hub's ModelCardData with base_model, library_name, license,
instance_prompt, widget and tags, then a description with a <Gallery /> of the validation images), completed with
what a user of the weights needs: the training settings, the validation images, a diffusers snippet and where
the file goes in ComfyUI. Written atomically; the Hub shows it as the repository's page (`--push_to_hub`).

Unlike diffusers' `load_or_create_model_card`, nothing is fetched: the card is built from the run alone.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING

from flux_cp import files
from flux_cp.config.fields import is_hub_id
from flux_cp.families.base import default_family, known_model
from flux_cp.model import adapters
from flux_cp.model.optim import describe as describe_optimizer
from flux_cp.terminal import printable

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.families.base import Family

LORA_FILE = "pytorch_lora_weights.safetensors"


def _is_hub_id(name: str | None) -> bool:
    return bool(name) and not os.path.exists(name) and is_hub_id(name) and "/" in name


def _cell(value: object) -> str:
    """A table cell: one line, its pipes escaped (those `markdown` escaped already stay as they are)."""
    return re.sub(r"(?<!\\)\|", r"\\|", str(value).replace("\n", " "))


def _steps(output_dir: Path) -> int | None:
    """The last optimizer step in metrics.jsonl, when there is one."""
    try:
        lines = (output_dir / "metrics.jsonl").read_text().split("\n")
    except OSError:
        return None
    for line in reversed(lines):
        if line.strip():
            try:
                return int(json.loads(line)["step"])
            except (ValueError, KeyError, TypeError):
                return None
    return None


def reference_names(count: int) -> tuple[str, ...]:
    """The files beside the trained weights that a run's `count` reference images are copied to (its
    --validation_image, else its first training pair's references), which the snippet of a pair run edits."""
    return ("reference.png",) if count == 1 else tuple(f"reference-{i}.png" for i in range(1, count + 1))


def snippet(
    cfg: Config,
    pairs: bool,
    source: str,
    base: str | None,
    family: Family,
    *,
    hub: bool = False,
    references: tuple[str, ...] | None = None,
    image_folder: str | None = None,
) -> str:
    """Python that loads the trained weights into diffusers' `pipeline` for `base` (None: the embedded default's tiny
    model) and renders an image at the trained size, on the GPU when there is one, else on the CPU, without the
    libraries' notices (their progress bars stay). `source`: the output folder (named by its absolute path, so that
    the lines run wherever they are pasted; the image goes into it) or, with `hub`, its Hub repository (the image goes
    to `<repository name>.png`, or into `image_folder`: a pushed run's local output folder). `pairs`: the pipeline
    edits the reference images `references` (their names in the folder or repository; default one `reference.png`).
    `family`: the model family trained: its pipeline, its transformer class (a full fine-tune's `transformer/` loads
    with it), its embedded default. Every value from the run (paths, hub ids, the prompt) is a Python literal (repr),
    so no folder or prompt can add code to it."""
    pipeline, transformer_class = family.pipeline_class_name(pairs), family.transformer_class_name
    prompt = (cfg.validation.validation_prompt or (cfg.data.instance_prompt,))[0] or "a photo"
    references = (references if references is not None else reference_names(1)) if pairs else ()
    if base and os.path.isdir(base):  # a local model folder: by its absolute path too
        base = os.path.abspath(base)
    tiny_import, tiny = family.embedded_snippet(pairs) if not base else ("", "")
    base_expr = repr(base) if base else tiny
    # --transformer_init random: a LoRA belongs to the random transformer it trained on, rebuilt as the run built it
    random_base = cfg.model.transformer_init == "random" and not cfg.lora.full_finetune
    model = cfg.model  # where the run found the base: its files there, not a second download
    extra = config_extra = ""  # the loading arguments beside the base (a config has no variant)
    for name, value in (("revision", model.revision), ("variant", model.variant), ("cache_dir", model.cache_dir)):
        if base and value:
            value = os.path.abspath(value) if name == "cache_dir" else value
            extra += f", {name}={value!r}"
            config_extra += f", {name}={value!r}" if name != "variant" else ""
    load_base = base_expr + extra
    full = cfg.lora.full_finetune
    lines = [
        "import logging",
        "",
        "logging.disable(logging.WARNING)  # the libraries' notices (progress bars stay)",
        "",
        "import torch",
        f"from diffusers import {pipeline}" + (f", {transformer_class}" if full or random_base else ""),
    ]
    if references:
        lines.append("from diffusers.utils import load_image")
        if hub:
            lines.append("from huggingface_hub import hf_hub_download")
    if not base:
        lines.append(tiny_import)
    if random_base:
        lines.append(
            "from flux_cp.random_weights import build_random, name_seed  # the random base the LoRA trained on"
        )
    lines.append("")
    if hub:
        where, saved = "repo", repr(f"{source.split('/')[-1]}.png")
        if image_folder is not None:
            saved = repr(os.path.join(os.path.abspath(image_folder), "image.png"))
        lines.append(f"repo = {source!r}  # the trained weights on the Hugging Face Hub")
    else:
        where, saved = "folder", 'f"{folder}/image.png"'
        lines.append(f"folder = {os.path.abspath(source)!r}  # the run's output folder (moved? its new path here)")
    lines += [
        'device = "cuda" if torch.cuda.is_available() else "cpu"',
        'dtype = torch.bfloat16 if device == "cuda" else torch.float32',
    ]
    if full:
        lines.append(
            f'transformer = {transformer_class}.from_pretrained({where}, subfolder="transformer", dtype=dtype)'
        )
        lines.append(f"pipe = {pipeline}.from_pretrained({load_base}, transformer=transformer, dtype=dtype)")
    elif random_base:
        lines += [
            f"base = {base_expr}",
            f'config = dict({transformer_class}.load_config(base, subfolder="transformer"{config_extra}))',
            f"transformer = build_random({transformer_class}, config, dtype, torch.device(device), "
            f'name_seed("transformer", {cfg.train.seed}))',
            f"pipe = {pipeline}.from_pretrained(base{extra}, transformer=transformer, dtype=dtype)",
            adapters.load_line(cfg.lora.adapter, where, LORA_FILE),
        ]
    else:
        lines.append(f"pipe = {pipeline}.from_pretrained({load_base}, dtype=dtype)")
        checkpoint = "" if hub else '  # a checkpoint\'s: f"{folder}/checkpoint-N"'
        lines.append(adapters.load_line(cfg.lora.adapter, where, LORA_FILE) + checkpoint)  # LoKr: its own loader
    lines.append("pipe.to(device)")
    size = cfg.data.largest_resolution  # the size it was trained at (the pipelines' own default is 1024)
    args = f"prompt={prompt!r}, height={size}, width={size}"
    args += f", num_inference_steps={cfg.validation.validation_inference_steps}"
    args += f", guidance_scale={cfg.train.guidance_scale:g}"
    if references:
        loads = [
            f"load_image(hf_hub_download(repo, {n!r}))" if hub else f'load_image(f"{{folder}}/{n}")' for n in references
        ]
        lines.append(f"reference = {loads[0]}" if len(loads) == 1 else f"reference = [{', '.join(loads)}]")
        extra, why = family.snippet_call(pairs, size)
        lines[-1] += why
        args += extra
        lines.append(f"image = pipe(image=reference, {args}).images[0]")
    else:
        lines.append(f"image = pipe({args}).images[0]")
    lines.append(f"image.save({saved})")
    return "\n".join(lines)


# --base_precision, said for people
_STORED = {
    "fp8": "float8 (torchao, one byte per weight)",
    "int8": "int8 (torchao, one byte per weight)",
    "nf4": "4-bit NormalFloat (bitsandbytes, as QLoRA)",
}


def run_notes(cfg: Config, base: str) -> list[str]:
    """What the trained weights rest on and what they are, where it is not the plain case (a pretrained bf16 base, the
    raw trained weights), one sentence each for people: a random-initialised base, a quantized frozen base, the EMA
    as the output, a text encoder's LoRA. The model card and the summary say them; the log said them at the start.
    `base`: the base model as the text names it."""
    full, train = cfg.lora.full_finetune, cfg.train
    trained = "fine-tuned transformer" if full else "LoRA"
    notes = []
    if cfg.model.transformer_init == "random":
        notes.append(
            f"The transformer was random-initialised from the config of {base} (--transformer_init random, seed "
            f"{train.seed}): the model's pretrained weights were not used, so the {trained} belongs to that random "
            "base, not to the pretrained model."
            + ("" if full else " The snippet below rebuilds that base and loads the LoRA into it.")
        )
    precision = cfg.model.base_precision
    if precision != "bf16" and not full:
        notes.append(
            f"The frozen base was stored in {_STORED.get(precision, precision)} while the LoRA trained "
            f"(--base_precision {precision}): it learned against those weights, and on the bf16 model it meets "
            "slightly different ones."
        )
    if train.use_ema:
        every = "step" if train.ema_update_interval == 1 else f"{train.ema_update_interval} steps"
        notes.append(
            f"The {'weights are' if full else 'LoRA is'} the exponential moving average of the trained weights "
            f"(--use_ema: decay up to {train.ema_decay:g}, updated every {every}), "
            "as are the validation images; the checkpoints hold the raw weights beside it."
        )
    if cfg.lora.train_text_encoder:
        notes.append(
            f"A LoRA of the CLIP text encoder trained beside the transformer's (--train_text_encoder, learning rate "
            f"{train.text_encoder_lr:g}): the LoRA file holds it under text_encoder.* keys, and the pipeline's "
            "load_lora_weights loads both."
        )
    return notes


# Flags the card shows in rows of their own or in its snippet, and flags that say where a run's files are (local paths,
# the upload, the planner: kept off a card that is published, as run_config.json is)
_SHOWN = {
    "pretrained_model_name_or_path",
    "dataset_name",
    "instance_data_dir",
    "resolution",
    "aspect_buckets",
    "max_train_steps",
    "num_train_epochs",
    "train_batch_size",
    "gradient_accumulation_steps",
    "learning_rate",
    "lr_scheduler",
    "lr_warmup_steps",
    "optimizer",
    "use_8bit_adam",
    "adam_beta1",
    "adam_beta2",
    "adam_weight_decay",
    "adam_epsilon",
    "prodigy_beta3",
    "prodigy_decouple",
    "prodigy_use_bias_correction",
    "prodigy_safeguard_warmup",
    "full_finetune",
    "rank",
    "lora_alpha",
    "lora_dropout",
    "lora_layers",
    "mixed_precision",
    "cp_size",
    "cp_mode",
    "seed",
    "repeats",
    "caption_dropout",
    "with_prior_preservation",
    "class_prompt",
    "num_class_images",
    "prior_loss_weight",
    "lora_format",
    "instance_prompt",
    "validation_prompt",
    "num_validation_images",
    "transformer_init",
    "base_precision",
    "use_ema",
    "ema_decay",
    "ema_update_interval",
    "train_text_encoder",
    "text_encoder_lr",
}
_LOCAL = {
    "cache_dir",
    "class_data_dir",
    "encodings_dir",
    "output_dir",
    "logging_dir",
    "seed_checkpoint",
    "resume_from_checkpoint",
    "validation_image",
    "overwrite_output_dir",
    "report_to",
    "push_to_hub",
    "hub_model_id",
    "plan",
    "gpu_memory_gib",
    "num_processes",
}


def other_settings(cfg: Config, family: Family, pairs: bool) -> list[str]:
    """`--flag value` of every other flag whose value is not its default (config.non_default), as a command line
    would give it (the family's own default --vae_encode_mode is no change)."""
    from flux_cp.config.flags import non_default

    out = []
    for name, value in non_default(cfg).items():
        if name in _SHOWN or name in _LOCAL:
            continue
        if name == "vae_encode_mode" and value == family.default_vae_encode_mode(pairs):
            continue
        if value is True:
            out.append(f"--{name}")
        else:
            text = ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
            out.append(f"--{name} {text}")
    return out


def markdown(text: object) -> str:
    """`text` as literal Markdown text on one line, for a value from the run's flags and files (folder names, prompts,
    data set names) put inside a sentence or a table cell: every character that inline Markdown or HTML reads as
    markup is escaped, and every control character written as its escape (`\\x1b`: `cat README.md` runs none)."""
    out = printable(" ".join(str(text).splitlines()))
    return "".join("\\" + c if c in _MARKUP else c for c in out)


_MARKUP = set("\\`*_[]<>|&~$")  # inline markup: emphasis, code, links and images, HTML and entities, tables


def code_span(text: object) -> str:
    """`text` as an inline code span, whatever backticks it holds (Markdown shows code spans literally), its control
    characters escaped."""
    out = printable(" ".join(str(text).splitlines()))
    fence = "`" * (max((len(r) for r in re.findall(r"`+", out)), default=0) + 1)
    pad = " " if out.startswith("`") or out.endswith("`") or not out.strip() else ""
    return f"{fence}{pad}{out}{pad}{fence}"


def _comfyui(cfg: Config, base_name: str, family: Family) -> str | None:
    """The card's ComfyUI section (None: ComfyUI does not know the family)."""
    if family.comfyui_mapping is None:
        return None
    if cfg.lora.full_finetune:
        return family.comfyui_transformer
    if cfg.lora.adapter != "lora":  # DoRA, LoKr: what ComfyUI makes of their keys
        return adapters.comfyui(cfg.lora.adapter, family.comfyui_mapping)
    layout = (
        "kohya's / BFL's key names (`lora_unet_...`)"
        if cfg.lora.lora_format == "kohya"
        else "diffusers' key names (`transformer.<layer>.lora_A/lora_B`), which ComfyUI maps for "
        + family.comfyui_mapping
    )
    if cfg.model.transformer_init == "random":
        return None  # the LoRA belongs to a random transformer, not to the model a ComfyUI user has
    held = (
        "LoRAs of the transformer and, under text_encoder.* keys, of the CLIP text encoder (LoraLoaderModelOnly "
        "applies the transformer's)"
        if cfg.lora.train_text_encoder
        else "LoRAs of the transformer only (none for the text encoders)"
    )
    text = (
        f"Copy `{LORA_FILE}` (rename it as you like) into `ComfyUI/models/loras/` and apply it with a "
        f"*LoraLoaderModelOnly* node to the {base_name} model. The file holds {held}, in {layout}."
    )
    skipped = family.comfyui_skips(cfg.lora.lora_layers or ())
    if skipped:
        text += (
            f' ComfyUI maps no diffusers name for {", ".join(skipped)}: it leaves their LoRAs out ("lora key not '
            'loaded").'
        )
    return text


def write_model_card(
    output_dir: str | os.PathLike,
    cfg: Config,
    *,
    pairs: bool = False,
    steps: int | None = None,
    layout: str | None = None,
    cp_mode: str | None = None,
    repo_id: str | None = None,
    family: Family | None = None,
    filename: str = "README.md",
    references: tuple[str, ...] | None = None,
) -> Path:
    """Write `<output_dir>/README.md` for the run `cfg` and return its path. `pairs`: trained on the family's image
    pairs. `steps`: optimizer steps trained (default: the last step of metrics.jsonl). `layout`, `cp_mode`: the
    process layout and the CP mode the run used (Layout.describe(), the chosen mode). `repo_id`: the Hub
    repository the folder goes to (the snippet loads from it; default: the output folder). `family`: the model family
    trained (default: the first registered, the embedded default's); its pipeline loads the weights. `filename`:
    the card's name, when README.md is the user's (flux_cp.outputs.outdir.card_name). `references`: the reference images
    beside the weights that the snippet of a pair run edits (`snippet`)."""
    from huggingface_hub import ModelCardData  # huggingface_hub's cards at first use

    out = Path(output_dir)
    base = cfg.model.pretrained_model_name_or_path
    known = known_model(base)
    random_init = cfg.model.transformer_init == "random"
    hub_base = base if _is_hub_id(base) and not random_init else None  # not trained on that model's weights
    family = family or default_family()
    label = family.pairs_label if pairs else family.label
    base_name = known.model_id.split("/")[-1] if known else markdown(base or family.label)
    full = cfg.lora.full_finetune
    adapter = adapters.label(cfg.lora.adapter)  # LoRA, DoRA or LoKr
    kind = "full fine-tune" if full else adapter
    name = repo_id or out.resolve().name
    source, hub = repo_id or str(output_dir), bool(repo_id)
    steps = steps if steps is not None else _steps(out)
    grids = sorted((out / "validation").glob("step-*.png"))
    prompts = list(cfg.validation.validation_prompt or ())

    widget = []
    if grids:
        caption = "; ".join(prompts) if prompts else " "
        widget.append({"text": caption, "output": {"url": grids[-1].relative_to(out).as_posix()}})
    tags = [
        "text-to-image",
        "diffusers-training",
        "diffusers",
        *(["lora", "template:sd-lora"] if not full else []),
        *([cfg.lora.adapter] if cfg.lora.adapter != "lora" else []),
        *family.card_tags_for(pairs),
        "flux-cp",
    ]
    data = ModelCardData(
        base_model=hub_base,
        library_name="diffusers",
        license=known.license if known else None,
        license_name=known.license_name if known else None,
        license_link=known.license_link if known else None,
        tags=tags,
        instance_prompt=cfg.data.instance_prompt,
        widget=widget or None,
    )

    base_text = (
        f"[{markdown(base)}](https://huggingface.co/{base})"
        if hub_base
        else (code_span(base) if base else "a tiny Flux built locally (flux-cp's embedded default, for the demo)")
    )
    lora = cfg.lora
    what = (
        "a transformer fine-tuned from"
        if full
        else f"{adapter} weights (rank {lora.rank}, alpha {lora.lora_alpha}) for"
    )
    if random_init:
        what = (
            "a transformer trained from random weights with the config of"
            if full
            else f"{adapter} weights (rank {lora.rank}, alpha {lora.lora_alpha}) for a random-initialised transformer "
            "with the config of"
        )
    body = [
        f"# {label} {kind} - {markdown(name)}",
        "",
        "<Gallery />",
        "",
        "## Model description",
        "",
        f"These are {markdown(name)} {what} {base_text}, trained with flux-cp (diffusers' {family.label} training "
        "recipe with context parallelism: each sample's tokens split over GPUs, with the loss and gradients of "
        "training without it).",
        "",
    ]
    for note in run_notes(cfg, base_text):
        body += [note, ""]
    if cfg.data.instance_prompt:
        trigger = f"You should use {code_span(cfg.data.instance_prompt)} to trigger the image generation."
        body += ["## Trigger words", "", trigger, ""]
    body += ["## Training settings", "", "| setting | value |", "|---|---|"]
    cp = f"--cp_size {cfg.parallel.cp_size}, mode {cp_mode or cfg.parallel.cp_mode}"
    cp = cp if cfg.parallel.cp_size > 1 else "off (--cp_size 1)"
    precision, train = cfg.model.base_precision, cfg.train
    init = f"random-initialised from its config (--transformer_init random, seed {train.seed})"
    data_set = markdown(cfg.data.dataset_name) if cfg.data.dataset_name else "the bundled data set"
    sizes = ", ".join(map(str, cfg.data.resolution))
    per_rank = f"{train.train_batch_size} per data-parallel rank"
    schedule = f"{train.lr_scheduler}, {train.lr_warmup_steps} warmup steps"
    training = "full fine-tuning"
    if not full:
        training = f"{adapter} rank {lora.rank}, alpha {lora.lora_alpha}, dropout {lora.lora_dropout:g}"
        training += f", layers {markdown(', '.join(lora.lora_layers))}"
    rows = [
        ("base model", markdown(base) if base else "embedded tiny Flux"),
        ("base weights", init if random_init else "pretrained"),
        ("data", data_set + (f" ({family.pairs_label} pairs)" if pairs else "")),
        ("resolution", f"{sizes} px" + (" (aspect buckets)" if cfg.data.aspect_buckets else "")),
        ("optimizer steps", steps if steps is not None else "not recorded"),
        ("batch", f"{per_rank}, gradient accumulation {train.gradient_accumulation_steps}"),
        ("learning rate", f"{train.learning_rate:g} ({schedule})"),
        ("optimizer", describe_optimizer(train)),
        ("training", training),
        ("mixed precision", train.mixed_precision or "accelerate's config"),
        ("context parallelism", cp + (f"; {layout}" if layout else "")),
        ("seed", train.seed),
    ]
    options = cfg.data
    if options.repeats > 1:
        rows.append(("repeats", f"{options.repeats} (each image per epoch)"))
    if options.caption_dropout:
        rows.append(("caption dropout", f"{options.caption_dropout:g}"))
    if options.with_prior_preservation:
        prior = f"class prompt '{markdown(options.class_prompt)}', {options.num_class_images} class images"
        rows.append(("prior preservation", f"{prior}, prior loss weight {options.prior_loss_weight:g}"))
    if not full:
        rows.append(
            (
                "base precision",
                "bf16 (as loaded)" if precision == "bf16" else f"{precision}: {_STORED.get(precision, precision)}",
            )
        )
    if cfg.train.use_ema:
        rows.append(
            ("EMA", f"the output (decay up to {cfg.train.ema_decay:g}, every {cfg.train.ema_update_interval} steps)")
        )
    if lora.train_text_encoder:
        rows.append(("text encoder", f"CLIP LoRA, learning rate {cfg.train.text_encoder_lr:g}"))
    others = other_settings(cfg, family, pairs)
    if others:
        rows.append(("other settings", markdown(", ".join(others))))
    if not full:
        rows.append(("LoRA file", f"`{LORA_FILE}`, {cfg.lora.lora_format} format"))
        if adapters.description(cfg.lora.adapter):
            rows.append(("adapter", adapters.description(cfg.lora.adapter)))
    body += [f"| {_cell(k)} | {_cell(v)} |" for k, v in rows] + [""]
    if grids:
        body += ["## Validation images", ""]
        if prompts:
            rows_text = "; ".join(f"{i + 1}. {markdown(p)}" for i, p in enumerate(prompts))
            body += [f"One row per prompt ({cfg.validation.num_validation_images} images each): {rows_text}", ""]
        for grid in grids:
            step = int(grid.stem.split("-")[-1])
            label = "before training" if step == 0 else f"step {step}"
            body += [f"![{label}]({grid.relative_to(out).as_posix()})", ""]
    body += [
        "## Use it with the [🧨 diffusers library](https://github.com/huggingface/diffusers)",
        "",
        "```py",
        snippet(cfg, pairs, source, base, family, hub=hub, references=references),
        "```",
        "",
        "For more details, including weighting, merging and fusing LoRAs, check the [documentation on loading LoRAs "
        "in diffusers](https://huggingface.co/docs/diffusers/main/en/using-diffusers/loading_adapters)."
        if not full
        else "",
        "",
    ]
    comfyui = _comfyui(cfg, base_name, family)
    if comfyui:
        body += ["## Use it in ComfyUI", "", comfyui, ""]
    if known is not None:
        link = known.license_link or f"https://huggingface.co/{known.model_id}"
        body += [
            "## License",
            "",
            f"Please adhere to the licensing terms of the base model, {known.model_id}: "
            f"[{known.license_name or known.license}]({link}).",
            "",
        ]
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body).replace("\n\n\n", "\n\n")
    # Whatever else reached the text: its control characters escaped too (the front matter's YAML and the snippet's
    # Python literals escape theirs already, so this changes nothing there)
    text = printable(text, keep="\n")
    path = out / filename
    files.write_text(path, text)
    return path
