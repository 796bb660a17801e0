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

from . import files
from .config import is_hub_id
from .families import FLUX1, known_model
from .optim import describe as describe_optimizer
from .terminal import printable

if TYPE_CHECKING:
    from .config import Config
    from .families import Family

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


def snippet(
    cfg: Config, kontext: bool, source: str, base: str | None, pipeline: str | None = None,
    transformer_class: str = "FluxTransformer2DModel",
) -> str:  # fmt: skip
    """Python that loads the trained weights (from `source`: the output folder or its Hub repository) into diffusers'
    `pipeline` for `base` (None: the embedded default's tiny model) and renders an image at the trained size, on the
    GPU when there is one, else on the CPU. `kontext`: the pipeline takes a reference image. `transformer_class`: the
    class a full fine-tune's `transformer/` loads with. Every value from the run (paths, hub ids, the prompt) is a
    Python literal (repr), so no folder or prompt can add code to it."""
    pipeline = pipeline or ("FluxKontextPipeline" if kontext else "FluxPipeline")
    prompt = (cfg.validation.validation_prompt or (cfg.data.instance_prompt,))[0] or "a photo"
    load_base = repr(base) if base else f"ensure_tiny_pipeline({'kontext=True' if kontext else ''})"
    lines = ["import torch"]
    if cfg.lora.full_finetune:
        lines.append(f"from diffusers import {pipeline}, {transformer_class}")
    else:
        lines.append(f"from diffusers import {pipeline}")
    if kontext:
        lines.append("from diffusers.utils import load_image")
    if not base:
        lines.append("from flux_cp.tiny import ensure_tiny_pipeline  # the tiny Flux this demo trained")
    lines += [
        "",
        'device = "cuda" if torch.cuda.is_available() else "cpu"',
        'dtype = torch.bfloat16 if device == "cuda" else torch.float32',
    ]
    if cfg.lora.full_finetune:
        lines.append(
            f'transformer = {transformer_class}.from_pretrained({source!r}, subfolder="transformer", dtype=dtype)'
        )
        lines.append(f"pipe = {pipeline}.from_pretrained({load_base}, transformer=transformer, dtype=dtype)")
    else:
        lines.append(f"pipe = {pipeline}.from_pretrained({load_base}, dtype=dtype)")
        lines.append(f"pipe.load_lora_weights({source!r}, weight_name={LORA_FILE!r})")
    lines.append("pipe.to(device)")
    size = cfg.data.largest_resolution  # the size it was trained at (the pipelines' own default is 1024)
    args = f"{prompt!r}, height={size}, width={size}, num_inference_steps={cfg.validation.validation_inference_steps}"
    args += f", guidance_scale={cfg.train.guidance_scale:g}"
    if kontext:
        if pipeline == "FluxKontextPipeline":  # it renders max_area pixels (default 1024^2), whatever height and width
            args += f", max_area={size * size}"
        lines.append(f'image = pipe(image=load_image("reference.png"), prompt={args}).images[0]')
    else:
        lines.append(f"image = pipe({args}).images[0]")
    lines.append('image.save("image.png")')
    return "\n".join(lines)


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
    layout = (
        "kohya's / BFL's key names (`lora_unet_...`)"
        if cfg.lora.lora_format == "kohya"
        else "diffusers' key names (`transformer.<layer>.lora_A/lora_B`), which ComfyUI maps for "
        + family.comfyui_mapping
    )
    text = (
        f"Copy `{LORA_FILE}` (rename it as you like) into `ComfyUI/models/loras/` and apply it with a "
        f"*LoraLoaderModelOnly* node to the {base_name} model. The file holds LoRAs of the transformer only (none for "
        f"the text encoders), in {layout}."
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
    kontext: bool = False,
    steps: int | None = None,
    layout: str | None = None,
    cp_mode: str | None = None,
    repo_id: str | None = None,
    pipeline: str | None = None,
    family: Family | None = None,
    filename: str = "README.md",
) -> Path:
    """Write `<output_dir>/README.md` for the run `cfg` and return its path. `kontext`: trained on FLUX.1 Kontext
    pairs. `steps`: optimizer steps trained (default: the last step of metrics.jsonl). `layout`, `cp_mode`: the
    process layout and the CP mode the run used (Layout.describe(), the chosen mode). `repo_id`: the Hub
    repository the folder goes to (the snippet loads from it; default: the output folder). `pipeline`: diffusers'
    pipeline class of the snippet (the family's; default: FluxKontextPipeline for `kontext`, else FluxPipeline).
    `family`: the model family trained (default FLUX.1); `kontext` then means its reference-image pairs. `filename`:
    the card's name, when README.md is the user's (flux_cp.outdir.card_name)."""
    from huggingface_hub import ModelCardData  # huggingface_hub's cards at first use

    out = Path(output_dir)
    base = cfg.model.pretrained_model_name_or_path
    known = known_model(base)
    hub_base = base if _is_hub_id(base) else None
    family = family or FLUX1
    label = family.pairs_label if kontext else family.label
    base_name = known.model_id.split("/")[-1] if known else markdown(base or family.label)
    full = cfg.lora.full_finetune
    kind = "full fine-tune" if full else "LoRA"
    name = repo_id or out.resolve().name
    source = repo_id or str(output_dir)
    steps = steps if steps is not None else _steps(out)
    grids = sorted((out / "validation").glob("step-*.png"))
    prompts = list(cfg.validation.validation_prompt or ())

    widget = []
    if grids:
        caption = "; ".join(prompts) if prompts else " "
        widget.append({"text": caption, "output": {"url": grids[-1].relative_to(out).as_posix()}})
    tags = ["text-to-image", "diffusers-training", "diffusers", *(["lora", "template:sd-lora"] if not full else []),
            *family.card_tags_for(kontext), "flux-cp"]  # fmt: skip
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
        f"[{markdown(base)}](https://huggingface.co/{base})" if hub_base else (code_span(base) if base else "a tiny "
        "Flux built locally (flux-cp's embedded default, for the demo)")
    )  # fmt: skip
    lora = cfg.lora
    what = "a transformer fine-tuned from" if full else f"LoRA weights (rank {lora.rank}, alpha {lora.lora_alpha}) for"
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
    if cfg.data.instance_prompt:
        trigger = f"You should use {code_span(cfg.data.instance_prompt)} to trigger the image generation."
        body += ["## Trigger words", "", trigger, ""]
    body += ["## Training settings", "", "| setting | value |", "|---|---|"]
    cp = f"--cp_size {cfg.parallel.cp_size}, mode {cp_mode or cfg.parallel.cp_mode}"
    cp = cp if cfg.parallel.cp_size > 1 else "off (--cp_size 1)"
    rows = [
        ("base model", markdown(base) if base else "embedded tiny Flux"),
        ("data", (markdown(cfg.data.dataset_name) if cfg.data.dataset_name else "the bundled data set")
                 + (f" ({family.pairs_label} pairs)" if kontext else "")),
        ("resolution", f"{', '.join(map(str, cfg.data.resolution))} px"
                       + (" (aspect buckets)" if cfg.data.aspect_buckets else "")),
        ("optimizer steps", steps if steps is not None else "not recorded"),
        ("batch", f"{cfg.train.train_batch_size} per data-parallel rank, gradient accumulation "
                  f"{cfg.train.gradient_accumulation_steps}"),
        ("learning rate", f"{cfg.train.learning_rate:g} ({cfg.train.lr_scheduler}, {cfg.train.lr_warmup_steps} warmup "
                          "steps)"),
        ("optimizer", describe_optimizer(cfg.train)),
        ("training", "full fine-tuning" if full else f"LoRA rank {cfg.lora.rank}, alpha {cfg.lora.lora_alpha}, "
                     f"dropout {cfg.lora.lora_dropout:g}, layers {markdown(', '.join(cfg.lora.lora_layers))}"),
        ("mixed precision", cfg.train.mixed_precision or "accelerate's config"),
        ("context parallelism", cp + (f"; {layout}" if layout else "")),
        ("seed", cfg.train.seed),
    ]  # fmt: skip
    options = cfg.data
    if options.repeats > 1:
        rows.append(("repeats", f"{options.repeats} (each image per epoch)"))
    if options.caption_dropout:
        rows.append(("caption dropout", f"{options.caption_dropout:g}"))
    if options.with_prior_preservation:
        prior = f"class prompt '{markdown(options.class_prompt)}', {options.num_class_images} class images"
        rows.append(("prior preservation", f"{prior}, prior loss weight {options.prior_loss_weight:g}"))
    if not full:
        rows.append(("LoRA file", f"`{LORA_FILE}`, {cfg.lora.lora_format} format"))
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
        snippet(cfg, kontext, source, base, pipeline, family.transformer_class_name),
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
        body += ["## License", "", f"Please adhere to the licensing terms of the base model, {known.model_id}: "
                 f"[{known.license_name or known.license}]({link}).", ""]  # fmt: skip
    text = f"---\n{data.to_yaml()}\n---\n\n" + "\n".join(body).replace("\n\n\n", "\n\n")
    # Whatever else reached the text: its control characters escaped too (the front matter's YAML and the snippet's
    # Python literals escape theirs already, so this changes nothing there)
    text = printable(text, keep="\n")
    path = out / filename
    files.write_text(path, text)
    return path
