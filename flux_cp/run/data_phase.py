"""A run's training data, made ready once before the transformer loads: the data set opened and checked, the model
family's encoders loaded, the class images of prior preservation (rendered with the base model where missing), every
image and caption encoded once (cached on disk, the work spread over all ranks) and the text encoders freed, the
validation prompts' encodings, and the order of the global batches (flux_cp.data.schedule.BatchSchedule)."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flux_cp.data.buckets import ClassGeometry, Geometry
from flux_cp.data.encode import (
    ClassSamples,
    LiveData,
    Repeated,
    TrainingData,
    component_fingerprints,
    encode_dataset,
    encoder_fingerprints,
    tokenizer_fingerprints,
)
from flux_cp.data.prior import class_source, generated_folder
from flux_cp.data.schedule import BatchSchedule, Repeats, batch_groups, check_epoch_size
from flux_cp.data.sources import ImageSource, check_reference_limit, encodings_folder
from flux_cp.errors import UsageError
from flux_cp.families.components import pipeline_class
from flux_cp.model.loading import load_scheduler
from flux_cp.outputs import validation
from flux_cp.outputs.metrics import peak_memory_gib
from flux_cp.outputs.validation import Previews
from flux_cp.plan import encoding as encoding_memory
from flux_cp.plan import memory as plan
from flux_cp.run.class_images import generate_class_images
from flux_cp.shape.run_shape import RunShape, check_tokens

if TYPE_CHECKING:
    import torch

    from flux_cp.config.flags import Config
    from flux_cp.layout import Layout

logger = logging.getLogger("flux_cp")


@dataclass
class RunData:
    shape: RunShape  # with the opened data set's reference counts (a hub data set's are known only then)
    source: ImageSource
    encoders: Any  # the VAE stays; the text encoders are freed once the data is cached
    components: dict[str, str]  # {component: fingerprint of its config and weights' content}
    noise_scheduler: Any
    samples: TrainingData
    class_source: ImageSource | None  # prior preservation: the class images ...
    classes: ClassSamples | None  # ... and their encodings
    schedule: BatchSchedule
    global_batch: int  # samples per micro-step over all data-parallel ranks (their class images not counted)
    previews: Previews | None  # what validation images need (None: no --validation_prompt)


def load(
    cfg: Config,
    shape: RunShape,
    layout: Layout,
    device: torch.device,
    dtype: torch.dtype,
    autocast,
    open_source: Callable[[], ImageSource],
    encode_share: Callable[[], tuple[int, int]],
    check: Callable[[ImageSource, dict[str, str]], None] | None = None,
) -> RunData:
    """The run's data (see the module doc). `open_source`, `encode_share`: the trainer's seams (which data set, and
    this process's share of the encoding among how many). `check(source, components)`: called once the data set
    and the encoders' fingerprints are known, before any class image is rendered or any image encoded (a resume
    on another data set or model is refused there)."""
    source = open_source()  # listing errors (captions, pairs) before any model loads
    copies = source.copies()  # kohya's N_name folders: each image's own repeats
    images = (sum(copies), "images with their folders' repeats") if copies else (len(source), "images")
    check_epoch_size(images[0], len(shape.placements), cfg.data.repeats, images[1])
    if source.kohya is not None:
        logger.info(f"flux-cp: {source.kohya.describe(cfg.data.repeats)}")
    for warning in source.warnings if layout.is_main else ():
        logger.warning(f"warning: {warning}")
    if source.pairs:
        shape = _count_references(cfg, shape, source)
        k = shape.reference_counts
        refs = f"{k[0]} to {k[-1]} reference images (a batch holds one count)"
        if len(k) == 1:
            refs = "their reference images" if k == (1,) else f"{k[0]} reference images each"
        logger.info(f"{shape.family.pairs_label} pairs: {len(source)} targets with {refs}, loss on the targets")
        warning = shape.family.pairs_warning(
            shape.model_path, pipeline_class(shape.model_path, cfg.model.revision, cfg.model.cache_dir)
        )
        if warning:
            logger.warning(warning)
    encoders = shape.family.load_encoders(cfg.model, shape.model_path, dtype, device)
    fixed = plan.run_estimate(cfg, shape)(None).fixed  # what stays on the GPU beside validation's decode
    trained = encoding_memory.trained_text_encoders(cfg, shape.family)  # stays whole: it trains every step
    encoding_memory.configure(cfg, encoders, device, fixed, trained)  # streamed text encoders, VAE tiling (logged)
    # What the encodings (their cache keys) and a resume (the run identity) know the components by: content
    components = component_fingerprints(encoders, shape.model_path, cfg.model.revision, cfg.model.cache_dir)
    if check is not None:
        check(source, components)
    noise_scheduler = load_scheduler(cfg.model, shape.model_path)
    if layout.is_main:  # captions the prompt encoding cuts: said once, here
        prompts = {s.caption for s in source.samples} | set(cfg.validation.validation_prompt or ())
        if cfg.data.with_prior_preservation:
            prompts.add(cfg.data.class_prompt)
        for line in encoders.truncation_warnings(sorted(prompts), cfg.data.max_sequence_length):
            logger.warning(line)
    previews = _previews(cfg, shape, encoders, noise_scheduler, device)
    classes = None
    if cfg.data.with_prior_preservation:  # the class images, generated with the base model where missing
        made = generate_class_images(
            cfg, shape, layout, encoders, noise_scheduler.config, dtype, device, autocast, components
        )
        if made:
            logger.info(f"generated {made} class images in {generated_folder(Path(cfg.data.class_data_dir))}")
        classes = class_source(Path(cfg.data.class_data_dir), cfg.data.class_prompt, cfg.data.num_class_images)
        logger.info(f"prior preservation: {len(classes)} class images of '{cfg.data.class_prompt}'")
    samples, encoded_classes = _encoded(cfg, shape, source, classes, encoders, components, encode_share)
    global_batch = cfg.train.train_batch_size * layout.dp
    counts = [source.reference_count(t % len(source)) for t in range(len(samples.buckets))]
    # each sample's own copies, at each of its placements (encoded sample t is image t mod the images)
    copies = [copies[t % len(source)] for t in range(len(samples.buckets))] if copies else None
    groups = Repeats(batch_groups(samples.buckets, counts), cfg.data.repeats, copies)  # each copy in its sample's group
    schedule = BatchSchedule(groups, global_batch, cfg.train.seed)
    if len(set(counts)) > 1 and (unfilled := schedule.unfilled()):
        n = sum(unfilled.values())
        logger.warning(
            f"{n} of {len(groups)} samples {'is' if n == 1 else 'are'} never trained on: a global batch holds one "
            f"aspect bucket and one number of reference images, and theirs have fewer samples than a global batch "
            f"({global_batch}); lower --train_batch_size, or give those rows as many references as others"
        )
    repeated = Repeated(samples, cfg.data.repeats, copies) if cfg.data.repeats > 1 or copies else samples
    if device.type == "cuda":  # beside the plan logged at the start of the phase
        logger.info(f"encoding phase: measured peak {peak_memory_gib(device):.1f} GiB")
    return RunData(
        shape,
        source,
        encoders,
        components,
        noise_scheduler,
        repeated,
        classes,
        encoded_classes,
        schedule,
        global_batch,
        previews,
    )


def _count_references(cfg: Config, shape: RunShape, source: ImageSource) -> RunShape:
    """The run shape with the reference counts of the opened data set (a hub data set's are known only now), its
    limit and token counts checked again (the same on every rank)."""
    try:
        family = shape.family
        check_reference_limit(family.max_references, family.pairs_label, cfg.validation, source=source)
        shape = shape.with_reference_counts(tuple(source.reference_counts()))
        check_tokens(shape, cfg.data, cfg.validation)
    except UsageError as e:
        raise UsageError(str(e), agreed=True) from None
    return shape


def _previews(cfg: Config, shape: RunShape, encoders, noise_scheduler, device: torch.device) -> Previews | None:
    """The validation prompts' encodings (before the text encoders are freed) and the reference they edit."""
    v = cfg.validation
    if not v.validation_prompt:
        return None
    embeds = shape.family.validation_embeds(encoders, list(v.validation_prompt), shape.text_tokens)
    reference = None
    if v.validation_image:  # one image as it always was, several as a list (FLUX.2)
        images = [validation.reference_image(p, v.validation_resolution) for p in v.validation_image]
        reference = shape.family.reference_inputs(images[0] if len(images) == 1 else images, encoders, device)
    return Previews(encoders, noise_scheduler.config, embeds, reference)


def _encoded(
    cfg: Config,
    shape: RunShape,
    source: ImageSource,
    classes: ImageSource | None,
    encoders,
    components: dict[str, str],
    encode_share,
) -> tuple[TrainingData, ClassSamples | None]:
    """The training samples and the class images, encoded: live with --no_cache, else once into the cache (then the
    text encoders are freed). Class images are placed in every bucket the training images use (a batch is one
    bucket)."""
    data, seed = cfg.data, cfg.train.seed
    geometry = Geometry(list(shape.buckets), [list(p) for p in shape.placements])
    captions = ("",) if data.caption_dropout > 0 else ()  # the empty caption, encoded once
    if data.no_cache:
        samples = LiveData(source, encoders, geometry, data, seed)
        if classes is None:
            return samples, None
        used = sorted(set(samples.buckets))
        live = LiveData(classes, encoders, ClassGeometry(geometry.buckets, used), data, seed)
        return samples, ClassSamples(live, len(classes), used)
    cache = Path(encodings_folder(data))
    model = cfg.model
    tokenizers = tokenizer_fingerprints(encoders, shape.model_path, model.revision, model.cache_dir)
    fingerprints = encoder_fingerprints(components, encoders, tokenizers, model.variant)
    samples = encode_dataset(
        source, encoders, geometry, data, seed, cache, fingerprints, *encode_share(), captions=captions
    )
    computed, texts, encoded = samples.computed, samples.computed_texts, None
    if classes is not None:
        used = sorted(set(samples.buckets))
        placed = ClassGeometry(geometry.buckets, used)
        class_data = encode_dataset(
            classes, encoders, placed, data, seed, cache, fingerprints, *encode_share(), flips=False
        )
        encoded = ClassSamples(class_data, len(classes), used)
        computed, texts = computed + class_data.computed, texts + class_data.computed_texts
    latents = computed - texts
    logger.info(
        f"encodings: {len(source)} samples; newly computed: {latents} image latent{'s' * (latents != 1)} (one per "
        f"image, size and flip), {texts} caption embedding{'s' * (texts != 1)} (one per distinct caption); the rest "
        f"read from the cache {cache}"
    )
    trained = encoding_memory.trained_text_encoders(cfg, shape.family)
    encoders.free_text_encoders(keep=trained)  # the one trained stays (flux_cp.model.text_encoder)
    encoders.placement.release()  # the accelerator is the transformer's from here (validation borrows the VAE)
    return samples, encoded
