"""The trainer: one run of fine-tuning, phase by phase.

    setup -> load_data (encode once, cached) -> build_model (LoRA or full, CP, compile, FSDP/DDP) -> resume
    -> train: for each step `train_step`, then `after_step` (metrics, validation, checkpoint) -> finish

Each phase is a method that reads what the earlier ones set on the trainer. What is specific to a model family
(FLUX.1, FLUX.2) comes from `self.shape.family`; what benchmarks and tests replace is a method of its own (a seam):
`launched_world_size` and `make_layout` (the process group), `open_source` and `encode_share` (the data source and
who encodes it), `make_timer` (the clock) and `save_checkpoint`. The details of each phase live in flux_cp's modules.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from . import checkpoint, diskspace, distributed, faults, files, manifest, outdir, quiet, roles, validation
from .batches import Batches
from .blocks import attention_recomputed, more_blocks_than_there_are, step_begins
from .config import DEFAULT_ENCODINGS_DIR, Config
from .data import (
    BUNDLED_DATA,
    BatchSchedule,
    ImageSource,
    Repeats,
    batch_groups,
    cache_folder,
    check_epoch_size,
    check_pair_flags,
    check_reference_limit,
    open_source,
)
from .encode import (
    ClassGeometry,
    Geometry,
    LiveData,
    Repeated,
    TrainingData,
    component_fingerprints,
    component_folder,
    encode_dataset,
    encoder_fingerprints,
    model_fingerprint,
)
from .errors import NonFiniteError, UsageError
from .lora import lora_origin, save_lora
from .metrics import NO_FLOPS, MetricsLog, StepFlops, StepTimer, peak_flops, peak_memory_gib
from .model import (
    apply_seed_checkpoint,
    check_seed_checkpoint,
    full_state_dict,
    load_scheduler,
    load_transformer,
    pipeline_class,
    prepare_trainable,
    save_full,
)
from .offload import check_offload
from .optim import (
    Progress,
    apply_update,
    check_finite,
    check_optimizer,
    clip_grad_norm,
    make_lr_scheduler,
    make_optimizer,
)
from .outdir import finished, finished_line
from .parallel import Layout, cp_tuning, make_accelerator, make_layout, parallelize
from .plan import GIB, Checkpointing, checkpointing_for_run, unmeasured
from .precision import check_sharding, quantize_base
from .prior import ClassSamples, class_source, generate_class_images, generated_folder
from .prior import check_resume as check_prior_resume
from .profiling import profiled
from .resume import RESUMABLE_CHANGES, changed_settings, check_compatible, run_identity
from .resume import check_steps as check_resume_steps
from .shape import RunShape, build_shape, check_tokens, launched_world_size, resolved
from .terminal import escape_logs, printable

logger = logging.getLogger("flux_cp")


@dataclass
class StepResult:
    """A step as queued on the device: its loss, gradient norm and skip flag are 0-d tensors there until
    `after_step` reads them, once the next step is queued too, so the GPU never waits for the host between
    steps."""

    step: int
    epoch: int
    loss: torch.Tensor
    grad_norm: torch.Tensor
    skipped: torch.Tensor
    lr: float  # the schedule's LR after this step, as diffusers' examples log it
    tokens: int
    flops: StepFlops
    end: Any  # StepTimer.mark() after the step's update


class Trainer:
    """A run of `train_flux_cp.py`: build it from the parsed flags, then call the phases in order (`run` does)."""

    # setup: fixed for the whole run
    shape: RunShape
    tuning: Any  # cp.Tuning: the CP tuning this device and model run
    accelerator: Any
    layout: Layout
    device: torch.device
    weight_dtype: torch.dtype  # the frozen weights' and the inputs' dtype (mixed precision)
    sizes: diskspace.Sizes  # of one checkpoint and of the final model, from parameter counts
    # load_data: the encoded data, its batch order, and what validation needs of the encoders
    encoders: Any  # the VAE stays; the text encoders are freed once the data is cached
    noise_scheduler: Any
    source: ImageSource
    samples: TrainingData
    class_source: ImageSource | None  # prior preservation: the class images
    classes: ClassSamples | None  # ... and their encodings
    schedule: BatchSchedule
    global_batch: int  # samples per micro-step over all data-parallel ranks (their class images not counted)
    validation_embeds: dict[str, torch.Tensor] | None
    validation_reference: dict | None  # pairs: the pipeline's arguments for the --validation_image the prompts edit
    # build_model: the wrapped model and its optimizer, ready to step
    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    params: list[torch.nn.Parameter]  # trainable, after accelerate.prepare (sharded under FSDP2)
    offload: Any  # flux_cp.offload.BlockOffload, or None without --offload_blocks
    checkpointing: Checkpointing  # --gradient_checkpointing resolved: which blocks recompute
    max_steps: int
    run_identity: dict  # what a checkpoint must match to be resumed by this run
    components: dict[str, str]  # {component: fingerprint of its config and weights' content}
    # train: per-step machinery
    batches: Batches
    metrics: MetricsLog
    timer: StepTimer
    bar: Any
    peak: float | None  # bf16 FLOP/s that MFU and HFU are measured against (None: not on a GPU)
    fault: faults.Fault
    progress: Progress  # which steps since the start applied their update (--on_nonfinite skip)
    # finish
    hub_repo_id: str | None  # the Hub repository the outputs were pushed to (rank 0)
    done_before: Path | None = None  # resume: the last checkpoint of a run that had already finished

    def __init__(self, cfg: Config):
        self.cfg = cfg

    # --- seams: what benchmarks and tests replace ------------------------------------------------------------

    def launched_world_size(self) -> int:
        return launched_world_size()

    def make_layout(self, accelerator) -> Layout:
        """The layout and its CP context, in the mode and with the tuning decided in `setup`."""
        return make_layout(accelerator, self.shape, self.cfg.parallel.collective_timeout, self.tuning)

    def open_source(self) -> ImageSource:
        return open_source(self.cfg.data, self.shape.metadata, self.cfg.model.cache_dir)

    def encode_share(self) -> tuple[int, int]:
        """(this process's index, number of processes) among those that share the encoding of the data set."""
        return self.layout.rank, self.layout.world

    def make_timer(self) -> StepTimer:
        return StepTimer(self.device)

    # --- phases ----------------------------------------------------------------------------------------------

    def run(self) -> None:
        """Every phase in order, then the process group's teardown."""
        self.setup()
        self.load_data()
        self.build_model()
        start = self.resume()
        if self.done_before is None:
            self.train(start)
            self.finish()
        self.close()

    def setup(self) -> None:
        """Flag checks that need the launch size and the model folder, then accelerate, the dp x cp layout,
        logging and precision, and the output folder."""
        cfg = self.cfg
        quiet.install()  # third-party messages that say nothing to a user (flux_cp/quiet.py)
        # Everything that needs only the flags, the launch size and the model's config fails here, before any
        # process group. transformers' save_pretrained writes weights only on rank 0 once torch.distributed is up,
        # so the tiny default is built (by whichever process locks first) here too.
        self.shape = shape = build_shape(cfg, self.launched_world_size())
        self.cfg = cfg = resolved(cfg, shape.family, shape.pairs, shape.transformer_config)
        start_warnings = self.decide_against_model()
        check_optimizer(cfg.train, "cuda" if torch.cuda.is_available() else "cpu", shape.sharded)
        check_offload(cfg.train.offload_blocks, full_finetune=cfg.lora.full_finetune, sharded=shape.sharded)
        check_sharding(cfg.model.base_precision, shape.sharded)
        check_reference_limit(shape.family.max_references, shape.family.pairs_label, cfg.validation, shape.metadata,
                              shape.reference_column)  # fmt: skip
        check_tokens(shape, cfg.data, cfg.validation)
        check_pair_flags(cfg.data, cfg.validation, shape.pairs)
        self.accelerator = make_accelerator(cfg.parallel, cfg.train, cfg.validation, shape)
        self.layout = layout = self.make_layout(self.accelerator)
        logging.basicConfig(level=logging.INFO if layout.is_main else logging.WARNING, format="%(message)s")
        escape_logs(logger)  # values read from files (checkpoints, model folders, data) cannot act on the terminal
        if cfg.model.embedded_default:
            logger.info(
                f"flux-cp: embedded default - a tiny {'FLUX.1 Kontext' if shape.pairs else 'Flux'} built locally, "
                f"trained on {cfg.data.dataset_name or 'the bundled data set (data/tiny_shapes)'}; pass "
                "--pretrained_model_name_or_path and --dataset_name for real runs"
            )
        for line in cfg.demo_lines():
            logger.info(f"flux-cp: {line}")
        for warning in shape.family.output_warnings(cfg) if layout.is_main else ():
            logger.warning(warning)
        for warning in start_warnings if layout.is_main else ():
            logger.warning(f"warning: {warning}")
        logger.info(
            f"flux-cp: {layout.describe()}, {self.accelerator.distributed_type}, device {self.accelerator.device}"
        )
        if cfg.train.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        if cfg.train.allow_tf32 and torch.cuda.is_available():
            torch.backends.cuda.matmul.allow_tf32 = True
        self.device = self.accelerator.device
        self.weight_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(
            self.accelerator.mixed_precision, torch.float32
        )
        self.claim_output_dir()
        self.sizes = self.output_sizes()
        problem = None
        if layout.is_main:
            try:  # one checkpoint and the final model must fit; how many checkpoints fit is known once steps are
                diskspace.check_start(cfg.train.output_dir, self.sizes, saves=1, total_limit=None)
            except UsageError as e:
                problem = str(e)
        distributed.check_all_ranks(problem is None, problem or "")

    def decide_against_model(self) -> list[str]:
        """What depends on the model but needs none of it loaded, decided once before anything loads (the CP mode its
        heads allow is the run shape's): the CP tuning this device and model run, the prompt window against its
        tokenizer, the seed checkpoint's file. Returns the warnings for what is used otherwise than given."""
        cfg, shape = self.cfg, self.shape
        device_type = "cuda" if torch.cuda.is_available() else "cpu"  # accelerate's device (cpu=True without CUDA)
        self.tuning, warnings = cp_tuning(cfg, shape, device_type)
        shape.family.check(cfg)
        shape.family.check_text(cfg, shape.model_path)
        if cfg.train.seed_checkpoint is not None:
            check_seed_checkpoint(cfg.train.seed_checkpoint)
        return warnings

    def claim_output_dir(self) -> None:
        """The output folder becomes this run's (flux_cp.outdir), and how the run starts is decided (flux_cp.resume:
        a damaged or foreign checkpoint is found now, not after the models load); every rank learns the result."""
        cfg = self.cfg
        problem, claimed = None, None
        if self.layout.is_main:
            try:
                trackers = cfg.validation.report_to in ("tensorboard", "all")  # the ones writing into --logging_dir
                logs = cfg.validation.logging_dir if trackers else None
                classes = cfg.data.class_data_dir if cfg.data.with_prior_preservation else None
                data_flag = ("--instance_data_dir" if cfg.data.instance_data_dir else "--dataset_name"
                             if cfg.data.dataset_name else "the bundled data set")  # fmt: skip
                roles.check(cfg.train.output_dir, model=self.shape.model_path, data=cfg.data.dataset_name or
                            str(BUNDLED_DATA), data_flag=data_flag, bundled=BUNDLED_DATA.parent, class_dir=classes,
                            encodings=None if cfg.data.no_cache else self.encodings_dir, logs=logs)  # fmt: skip

                def accept(decision) -> None:  # a resume needing other class images: refused before generating
                    if decision.checkpoint is not None:
                        check_prior_resume(checkpoint.read_meta(decision.checkpoint), cfg.data, decision.checkpoint)

                claimed = outdir.claim(
                    cfg.train.output_dir, cfg.checkpoints.resume_from_checkpoint, cfg.train.overwrite_output_dir,
                    logging_dir=logs, max_train_steps=cfg.train.max_train_steps, accept=accept,
                    apart={"--pretrained_model_name_or_path": self.shape.model_path,
                           data_flag: cfg.data.dataset_name or str(BUNDLED_DATA),
                           "--class_data_dir": classes},
                )  # fmt: skip
                if not cfg.data.no_cache:
                    outdir.check_writable(Path(self.encodings_dir), "--encodings_dir")
            except UsageError as e:
                problem = str(e)
        distributed.check_all_ranks(problem is None, problem or "")
        self.verify_resume_checkpoint()
        if claimed and claimed.removed:
            logger.info(f"--overwrite_output_dir: removed the earlier run's outputs ({', '.join(claimed.removed)})")
        for note in claimed.notes if claimed else ():
            logger.info(note)

    def verify_resume_checkpoint(self) -> None:
        """The checkpoint this run resumes, checked against the checksums written with it, every rank a share of its
        shards (before any model loads: a damaged checkpoint is refused naming the file)."""
        ckpt = self.cfg.checkpoints
        path = checkpoint.resolve(ckpt.resume_from_checkpoint, self.cfg.train.output_dir)
        if path is not None:
            problem = checkpoint.verify_shared(path, checkpoint.read_meta(path), self.layout.rank, self.layout.world)
            distributed.check_all_ranks(problem is None, problem or "")

    @property
    def encodings_dir(self) -> str:
        return str(cache_folder(self.cfg.data) or os.path.expanduser(DEFAULT_ENCODINGS_DIR))

    def output_sizes(self) -> diskspace.Sizes:
        """Bytes of one checkpoint and of the final model, from the transformer's config (nothing loaded)."""
        cfg, shape = self.cfg, self.shape
        config = shape.transformer_config
        shape.family.check_export(config, cfg.lora)  # a kohya file diffusers could not read back: refused now
        return diskspace.run_sizes(cfg, shape.family, config, self.weight_dtype, self.layout.world)

    def load_data(self) -> None:
        """Encode the data set once (cached on disk, spread over all ranks), then free the text encoders."""
        cfg, layout, shape = self.cfg, self.layout, self.shape
        self.source = source = self.open_source()  # listing errors (captions, pairs) before any model loads
        check_epoch_size(len(source), len(shape.placements), cfg.data.repeats)
        if source.pairs:
            self.shape = shape = self.count_references(source)
            label = shape.family.pairs_label
            k = shape.reference_counts
            refs = ("their reference images" if k == (1,) else f"{k[0]} reference images each" if len(k) == 1
                    else f"{k[0]} to {k[-1]} reference images (a batch holds one count)")  # fmt: skip
            logger.info(f"{label} pairs: {len(source)} targets with {refs}, loss on the targets")
            warning = shape.family.pairs_warning(
                shape.model_path, pipeline_class(shape.model_path, cfg.model.revision, cfg.model.cache_dir)
            )
            if warning:
                logger.warning(warning)
        self.encoders = encoders = shape.family.load_encoders(
            cfg.model, shape.model_path, self.weight_dtype, self.device
        )
        # What the encodings (their cache keys) and a resume (the run identity) know the components by: content
        self.components = component_fingerprints(encoders, shape.model_path, cfg.model.revision, cfg.model.cache_dir)
        self.noise_scheduler = load_scheduler(cfg.model, shape.model_path)
        if layout.is_main:  # captions the prompt encoding cuts: said once, here
            prompts = {s.caption for s in source.samples} | set(cfg.validation.validation_prompt or ())
            if cfg.data.with_prior_preservation:
                prompts.add(cfg.data.class_prompt)
            for line in encoders.truncation_warnings(sorted(prompts), cfg.data.max_sequence_length):
                logger.warning(line)
        geometry = Geometry(list(shape.buckets), [list(p) for p in shape.placements])
        self.validation_embeds = self.validation_reference = None
        if cfg.validation.validation_prompt:
            prompts = list(cfg.validation.validation_prompt)
            self.validation_embeds = shape.family.validation_embeds(encoders, prompts, shape.text_tokens)
            if cfg.validation.validation_image:  # one image as it always was, several as a list (FLUX.2)
                images = [validation.reference_image(p, cfg.validation.validation_resolution)
                          for p in cfg.validation.validation_image]  # fmt: skip
                image = images[0] if len(images) == 1 else images
                self.validation_reference = shape.family.reference_inputs(image, encoders, self.device)
        self.class_source = self.classes = None
        if cfg.data.with_prior_preservation:  # the class images, generated with the base model where missing
            self.generate_class_images()
            self.class_source = class_source(Path(cfg.data.class_data_dir), cfg.data.class_prompt,
                                             cfg.data.num_class_images)  # fmt: skip
            logger.info(f"prior preservation: {len(self.class_source)} class images of '{cfg.data.class_prompt}'")
        captions = ("",) if cfg.data.caption_dropout > 0 else ()  # the empty caption, encoded once
        if cfg.data.no_cache:
            samples = LiveData(source, encoders, geometry, cfg.data, cfg.train.seed)
            if self.class_source is not None:
                used = sorted(set(samples.buckets))
                live = LiveData(self.class_source, encoders, ClassGeometry(geometry.buckets, used), cfg.data,
                                cfg.train.seed)  # fmt: skip
                self.classes = ClassSamples(live, len(self.class_source), used)
        else:
            cache = Path(self.encodings_dir)
            fingerprints = encoder_fingerprints(self.components, encoders)
            samples = encode_dataset(source, encoders, geometry, cfg.data, cfg.train.seed, cache, fingerprints,
                                     *self.encode_share(), captions=captions)  # fmt: skip
            computed = samples.computed
            if self.class_source is not None:  # in every bucket the training images use (a batch is one bucket)
                used = sorted(set(samples.buckets))
                encoded = encode_dataset(self.class_source, encoders, ClassGeometry(geometry.buckets, used), cfg.data,
                                         cfg.train.seed, cache, fingerprints, *self.encode_share(),
                                         flips=False)  # fmt: skip
                self.classes = ClassSamples(encoded, len(self.class_source), used)
                computed += encoded.computed
            logger.info(f"encodings: {len(source)} samples, {computed} newly computed, cache {cache}")
            encoders.free_text_encoders()
        self.samples = Repeated(samples, cfg.data.repeats) if cfg.data.repeats > 1 else samples
        self.global_batch = cfg.train.train_batch_size * layout.dp
        counts = [source.reference_count(t % len(source)) for t in range(len(samples.buckets))]
        groups = Repeats(batch_groups(samples.buckets, counts), cfg.data.repeats)  # each copy in its sample's group
        self.schedule = BatchSchedule(groups, self.global_batch, cfg.train.seed)
        if len(set(counts)) > 1 and (unfilled := self.schedule.unfilled()):
            n = sum(unfilled.values())
            logger.warning(
                f"{n} of {len(groups)} samples {'is' if n == 1 else 'are'} never trained on: a global batch holds one "
                f"aspect bucket and one number of reference images, and theirs have fewer samples than a global batch "
                f"({self.global_batch}); lower --train_batch_size, or give those rows as many references as others"
            )

    def count_references(self, source: ImageSource) -> RunShape:
        """The run shape with the reference counts of the opened data set (a hub data set's are known only now), its
        limit and token counts checked again (the same on every rank)."""
        cfg, shape = self.cfg, self.shape
        try:
            family = shape.family
            check_reference_limit(family.max_references, family.pairs_label, cfg.validation, source=source)
            shape = shape.with_reference_counts(tuple(source.reference_counts()))
            check_tokens(shape, cfg.data, cfg.validation)
        except UsageError as e:
            raise UsageError(str(e), agreed=True) from None
        return shape

    def generate_class_images(self) -> None:
        """Prior preservation: the class images `--class_data_dir` lacks, rendered with the base model under CP
        before the training data is encoded (flux_cp.prior)."""
        made = generate_class_images(self.cfg, self.shape, self.layout, self.encoders, self.noise_scheduler.config,
                                     self.weight_dtype, self.device, self.accelerator.autocast)  # fmt: skip
        if made:
            logger.info(f"generated {made} class images in {generated_folder(Path(self.cfg.data.class_data_dir))}")

    def build_model(self) -> None:
        """The transformer (its frozen base quantized with --base_precision, LoRA or full, the seed checkpoint), made
        to run on the layout by `parallelize` (CP, checkpointing and compile, block offload, the optimizer, FSDP2 or
        DDP), and the LR schedule."""
        cfg, layout, train, shape = self.cfg, self.layout, self.cfg.train, self.shape
        precision = cfg.model.base_precision
        # On the CPU first when blocks are offloaded or the base is quantized: the whole bf16 model need not fit the
        # GPU (quantize_base and offload_blocks move it there, a layer or a block at a time).
        staged = train.offload_blocks != "0" or precision != "bf16"
        transformer = load_transformer(cfg.model, shape.model_path, shape.family.transformer_class(),
                                       self.weight_dtype, torch.device("cpu") if staged else self.device,
                                       train.seed)  # fmt: skip
        pretrained = cfg.model.transformer_init == "pretrained"  # random weights: its config and the seed are all
        folder = component_folder(shape.model_path, "transformer", cfg.model.revision, cfg.model.cache_dir)
        self.components["transformer"] = model_fingerprint(transformer, folder if pretrained else None)
        if precision != "bf16":  # before LoRA: peft wraps each quantized linear in its LoRA layer
            logger.info(quantize_base(transformer, precision, device=self.device).describe())
        prepare_trainable(transformer, cfg.lora, train.seed)
        if train.seed_checkpoint:
            how = apply_seed_checkpoint(transformer, train.seed_checkpoint, layout.is_main)
            logger.info(f"seed checkpoint {how}: {train.seed_checkpoint}")
        steps_per_epoch = self.schedule.batches_per_epoch // train.gradient_accumulation_steps
        if steps_per_epoch == 0 and train.max_train_steps is None:
            raise UsageError(
                f"one epoch has {self.schedule.batches_per_epoch} batches, fewer than "
                f"--gradient_accumulation_steps {train.gradient_accumulation_steps}: set --max_train_steps",
                agreed=True,  # every rank counts the same batches
            )
        self.max_steps = max_steps = train.max_train_steps or train.num_train_epochs * steps_per_epoch
        self.checkpointing = self.plan_checkpointing()
        ready = parallelize(transformer, shape, layout, cfg, checkpointing=self.checkpointing, device=self.device,
                            accelerator=self.accelerator,
                            make_optimizer=lambda params: make_optimizer(train, params, self.global_batch))  # fmt: skip
        self.model, self.optimizer, self.offload = ready.model, ready.optimizer, ready.offload
        self.lr_scheduler = make_lr_scheduler(train, ready.base_optimizer, max_steps)
        # After prepare: FSDP2 replaces the parameters with sharded ones (the optimizer is remapped by accelerate;
        # a list taken before would clip and measure gradients that no longer exist).
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        samples_per_step = self.global_batch * train.gradient_accumulation_steps
        buckets = list(shape.buckets) if cfg.data.aspect_buckets else None
        classes = self.class_source.identity() if self.class_source is not None else None
        self.run_identity = run_identity(cfg, samples_per_step, self.source.identity(), buckets, classes,
                                                    self.components)  # fmt: skip
        every = cfg.checkpoints.checkpointing_steps
        if layout.is_main:
            saves = max_steps // every + (1 if max_steps % every else 0)
            warning = diskspace.check_start(
                train.output_dir, self.sizes, saves, cfg.checkpoints.checkpoints_total_limit
            )
            if warning:
                logger.warning(f"warning: {warning}")

    def plan_checkpointing(self) -> Checkpointing:
        """--gradient_checkpointing resolved (auto: the fewest blocks whose planned peak fits this GPU, or
        --gpu_memory_gib), logged; run_config.json records it."""
        cfg, shape = self.cfg, self.shape
        gpu = cfg.plan.gpu_memory_gib
        if gpu is None and self.device.type == "cuda":
            gpu = torch.cuda.get_device_properties(self.device).total_memory / GIB
        ckpt = checkpointing_for_run(cfg, shape, gpu)
        value = cfg.train.gradient_checkpointing
        if value != "none":  # asked for: say what it resolved to
            logger.info(ckpt.describe(value))
        if note := more_blocks_than_there_are(value, ckpt.total):
            logger.warning(f"warning: {note}")
        if note := unmeasured(shape.family):
            logger.info(f"flux-cp: {note}")
        if not ckpt.fits:
            logger.warning(
                f"warning: the planned peak ({ckpt.planned_gib:.1f} GiB) exceeds 90% of {ckpt.gpu_gib:.1f} GiB even "
                "with every block checkpointed: expect out-of-memory; use --cp_size (train_flux_cp.py --plan)"
            )
        return ckpt

    def resume(self) -> int:
        """The step to start after: a compatible checkpoint's, restored on any layout, or 0. A run already finished
        (its last checkpoint at the last step, its outputs written) sets `done_before` and loads nothing."""
        ckpt, output_dir = self.cfg.checkpoints, self.cfg.train.output_dir
        self.done_before = finished(ckpt.resume_from_checkpoint, output_dir, self.max_steps, claimed=True)
        if self.done_before is not None:
            logger.info(f"flux-cp: {finished_line(self.done_before, self.max_steps)}")
            return self.max_steps
        try:  # every rank reads the same checkpoint and holds the same run identity: one rank prints a refusal
            path = checkpoint.resolve(ckpt.resume_from_checkpoint, output_dir)
            meta = checkpoint.read_meta(path) if path is not None else None
            if meta is not None:
                check_compatible(meta, self.run_identity, path)
                check_resume_steps(meta["step"], self.max_steps, path, "--max_train_steps, or --num_train_epochs")
        except UsageError as e:
            raise UsageError(str(e), agreed=True) from None
        if path is None:
            if ckpt.resume_from_checkpoint == "latest":
                logger.info(f"no checkpoint in {output_dir} yet: starting from step 0")
            return 0
        with_optimizer = meta.get("optimizer_state", True)
        applied = checkpoint.load(path, self.model, self.optimizer, self.lr_scheduler, with_optimizer)
        logger.info(f"resumed from {path} at step {meta['step']} (written with {printable(meta['layout'])})")
        changed = changed_settings(meta.get("args", {}), self.cfg.flat(), RESUMABLE_CHANGES)
        for change in changed or applied:
            logger.info(f"resume: {change} (applied from step {meta['step'] + 1})")
        if not with_optimizer:
            logger.warning(
                f"warning: {path} has no optimizer state (--checkpoint_weights_only): AdamW's moments start from "
                "zero, so the next steps differ from an uninterrupted run"
            )
        return meta["step"]

    def train(self, start_step: int) -> None:
        """Every step after `start_step`, each queued on the device before the previous one is read."""
        self.start_loop(start_step)
        queued = None  # the previous step, read once this one is queued behind it
        for step in range(start_step + 1, self.max_steps + 1):
            profile = step == self.cfg.train.profile_step
            with profiled(profile, self.cfg.train.output_dir, self.layout.rank, self.layout.is_main):
                result = self.train_step(step)
            if queued is not None:
                self.after_step(queued)
            queued = result
            if self.uses_model_after(step):
                self.after_step(result)
                queued = None

    def start_loop(self, start_step: int) -> None:
        """Record the run's settings, open the metrics and trackers, and build the batch source."""
        cfg, layout, device, shape = self.cfg, self.layout, self.device, self.shape
        if layout.is_main:
            chosen = {"layout": layout.describe(), "cp_mode": shape.cp_mode, "ulysses_size": shape.ulysses_size,
                      "cp_ulysses_chunks": self.tuning.ulysses_chunks,
                      "checkpointed_blocks": len(self.checkpointing.blocks),
                      "planned_peak_gib": round(self.checkpointing.planned_gib, 2)}  # fmt: skip
            manifest.record(cfg.train.output_dir, "run_config.json")
            files.write_json(Path(cfg.train.output_dir) / "run_config.json", {**cfg.flat(), **chosen})
        if self.accelerator.log_with:
            flat = {**cfg.flat(), "resolution": ",".join(map(str, cfg.data.resolution))}  # trackers take scalars
            hparams = {k: v for k, v in flat.items() if isinstance(v, (int, float, str, bool))}
            self.accelerator.init_trackers("flux-cp", config=hparams)
        self.metrics = MetricsLog(cfg.train.output_dir, start_step, layout.is_main)
        self.progress = Progress(start_step)
        if device.type == "cuda":  # peak memory of training, not of loading and initialisation
            torch.cuda.reset_peak_memory_stats(device)
        from tqdm.auto import tqdm

        self.bar = tqdm(range(self.max_steps), initial=start_step, desc="steps", disable=not layout.is_main,
                        dynamic_ncols=True)  # fmt: skip
        guidance = bool(shape.transformer_config.get("guidance_embeds"))
        self.batches = Batches(self.samples, self.schedule, layout, cfg.data, cfg.train, self.noise_scheduler,
                               shape.family, shape.family.normalizer(self.encoders.vae), guidance, device,
                               self.weight_dtype, self.classes)  # fmt: skip
        peak = peak_flops(device)
        self.peak = peak and peak[0]
        if peak:
            logger.info(f"MFU and HFU against {peak[1]}")
        self.timer = self.make_timer()
        self.fault = faults.from_env(layout.rank)
        if cfg.model.embedded_default and self.validation_embeds is not None and start_step == 0:
            self.validate(0)  # the tiny model before training, to set beside the images at the end
            self.timer.restart()
        self.model.train()

    def train_step(self, step: int) -> StepResult:
        """One optimizer step queued on the device: forward/backward over the accumulated micro-batches, clip,
        update. Nothing in it waits for the GPU."""
        cfg, accelerator, model, family = self.cfg, self.accelerator, self.model, self.shape.family
        accum = cfg.train.gradient_accumulation_steps
        loss_sum = torch.zeros((), device=self.device, dtype=torch.float64)
        tokens, flops = 0, NO_FLOPS
        recomputed = len(self.checkpointing.blocks) / self.checkpointing.total  # share of the blocks
        samples = self.global_batch * cfg.data.samples_per_slot  # with their class images (prior preservation)
        for micro in range(accum):
            mb = self.batches.micro((step - 1) * accum + micro)
            tokens += samples * (mb.image_tokens + mb.text_tokens)
            flops += family.step_flops(self.shape.transformer_config, mb.image_tokens, mb.text_tokens, samples,
                                       not cfg.lora.full_finetune, recomputed,
                                       recomputed if attention_recomputed(cfg.train) else 0.0)  # fmt: skip
            step_begins(cfg.train.compile_mode)
            with accelerator.accumulate(model):
                loss = self.fault.maybe_corrupt(step, mb.loss(model(**mb.inputs)[0]))
                accelerator.backward(loss)
                loss_sum += loss.detach().double()
                upcoming = (step - 1) * accum + micro + 1
                if upcoming < self.max_steps * accum:  # the host builds it while the GPU runs this backward
                    self.batches.prefetch(upcoming)
                if accelerator.sync_gradients:
                    grad_norm = clip_grad_norm(accelerator, self.params, cfg.train.max_grad_norm)
        self.fault.maybe_fail(step)
        step_loss = accelerator.reduce(loss_sum / accum, reduction="mean")
        skipped = apply_update(self.optimizer, self.lr_scheduler, step_loss, grad_norm)
        lr = self.lr_scheduler.get_last_lr()[0]
        return StepResult(step, mb.epoch, step_loss, grad_norm, skipped, lr, tokens, flops, self.timer.mark())

    def due_after(self, step: int) -> tuple[bool, bool]:
        """Whether validation images and whether a checkpoint are due after `step`."""
        every = self.cfg.validation.validation_steps
        validating = bool(self.validation_embeds is not None and every and step % every == 0)
        return validating, step % self.cfg.checkpoints.checkpointing_steps == 0

    def uses_model_after(self, step: int) -> bool:
        """Whether what follows `step` needs the model as that step left it (validation images, a checkpoint, the
        outputs of the last step) or an idle GPU (the next step is profiled): then the next step is queued only
        after `after_step` of this one."""
        return any(self.due_after(step)) or step >= self.max_steps or step + 1 == self.cfg.train.profile_step

    def after_step(self, result: StepResult) -> None:
        """Read the step's loss (stopping on a non-finite one, --on_nonfinite), write its metrics row and send it to
        the trackers, update the progress bar; validation images when due, a checkpoint when due."""
        cfg, layout, step = self.cfg, self.layout, result.step
        loss, grad_norm, skipped = torch.stack([result.loss.double(), result.grad_norm.double(),
                                                result.skipped.double()]).tolist()  # fmt: skip
        dt = self.timer.seconds(result.end)
        check_finite(loss, grad_norm, cfg.train.on_nonfinite, step)
        self.progress.note(step, bool(skipped))
        row = {
            "step": step, "epoch": result.epoch, "loss": loss, "lr": result.lr, "grad_norm": grad_norm,
            "s_per_step": dt, "tokens_per_s": result.tokens / dt,
            "tokens_per_s_per_gpu": result.tokens / dt / layout.world, "peak_mem_gib": peak_memory_gib(self.device),
            "skipped": bool(skipped),
        }  # fmt: skip
        if self.peak:  # model FLOPs (no recomputation) and executed FLOPs per GPU-second, against the GPU's peak
            row["mfu"] = result.flops.model / dt / layout.world / self.peak
            row["hfu"] = result.flops.executed / dt / layout.world / self.peak
        self.metrics.write(row)
        if self.accelerator.log_with:
            self.accelerator.log({k: v for k, v in row.items() if k != "step"}, step=step)
        self.bar.update(1)
        self.bar.set_postfix(
            loss=f"{loss:.4f}", lr=f"{row['lr']:.2e}", s_step=f"{dt:.2f}", tok_s=f"{row['tokens_per_s']:.0f}",
            **({"mfu": f"{row['mfu']:.0%}"} if self.peak else {}),
        )  # fmt: skip
        if step < self.max_steps:  # the last step's outputs are written by `finish`, the model first
            validating, saving = self.due_after(step)
            if validating:
                self.validate(step)
            if saving and skipped:  # the weights of a skipped step gave a non-finite loss: no checkpoint of them
                logger.warning(f"step {step} was skipped: no checkpoint of it (the last one is kept)")
            elif saving:
                self.save_checkpoint(step)
            if self.uses_model_after(step):  # keep what ran here out of the next step's time
                self.timer.restart()

    def save_checkpoint(self, step: int) -> None:
        cfg, layout = self.cfg, self.layout
        demo = cfg.demo.name if cfg.demo else None  # a resume of a demo run keeps its settings (flux_cp.config)
        meta = {"run": self.run_identity, "layout": layout.describe(), "args": cfg.flat(), "demo": demo}
        diskspace.check_checkpoint(cfg.train.output_dir, step, self.sizes.checkpoint, layout.is_main)
        saved = checkpoint.save(
            cfg.train.output_dir, step, self.model, self.optimizer, self.lr_scheduler, meta, layout.is_main,
            cfg.checkpoints.checkpoints_total_limit, self.fault,
            optimizer_state=not cfg.checkpoints.checkpoint_weights_only,
        )  # fmt: skip
        logger.info(f"saved {saved}")

    def validate(self, step: int) -> None:
        """Validation images with the current weights (CP across each group), saved and sent to the trackers."""
        cfg = self.cfg
        self.fault.during_validation(step)
        images = validation.generate(
            self.accelerator.unwrap_model(self.model), self.encoders, self.noise_scheduler.config,
            self.validation_embeds, self.layout, cfg.validation, cfg.train.guidance_scale, cfg.train.seed,
            self.accelerator.autocast, self.shape.family, self.validation_reference,
        )  # fmt: skip
        if self.layout.is_main:
            path = validation.save_and_log(images, step, cfg.validation, cfg.train.output_dir, self.accelerator)
            logger.info(f"validation images: {path}")

    def finish(self) -> None:
        """The outputs of the last step, most valuable first: the trained weights in diffusers' format (LoRA file or
        transformer folder), then the final checkpoint, then what is optional (validation images, the loss curve)."""
        cfg, output_dir, layout, step = self.cfg, self.cfg.train.output_dir, self.layout, self.max_steps
        self.bar.close()
        self.metrics.close()
        # A run that did not train (its last steps skipped) keeps the folder's earlier outputs: every rank decides
        # alike from the reduced losses; the main rank names the checkpoints in its message.
        found = [s for s, _ in checkpoint.list_checkpoints(output_dir)] if layout.is_main else []
        failure = self.progress.failure(found, output_dir)
        if failure:
            raise NonFiniteError(failure)
        state = full_state_dict(self.model, trainable_only=not cfg.lora.full_finetune)  # every rank: FSDP gathers
        bad = layout.is_main and any(not torch.isfinite(v).all() for v in state.values())
        if distributed.any_rank(bad):
            raise NonFiniteError(
                f"the trained weights hold NaN or inf: no final model or checkpoint was written, and {output_dir} "
                "keeps its earlier outputs. Resume from the last checkpoint with a lower --learning_rate"
            )
        problem = None
        if layout.is_main:
            inner = self.accelerator.unwrap_model(self.model)
            try:
                prev = checkpoint.list_checkpoints(output_dir)
                kept = f"{prev[-1][1]} is the last good checkpoint" if prev else "no checkpoint was written"
                diskspace.check_write(output_dir, self.sizes.model, f"the final {self.sizes.model_name}", kept,
                                      resumable=bool(prev))  # fmt: skip
                if cfg.lora.full_finetune:
                    out = outdir.write_final(output_dir, "transformer",
                                             lambda d: save_full(inner, state, str(d), self.weight_dtype))  # fmt: skip
                else:
                    origin = lora_origin(cfg, kontext=self.shape.pairs)
                    out = outdir.write_final(output_dir, "pytorch_lora_weights.safetensors",
                                             lambda d: save_lora(inner, state, str(d), cfg.lora, self.shape.family,
                                                                       origin))  # fmt: skip
                logger.info(f"wrote {out}")
            except UsageError as e:
                problem = str(e)
        state.clear()  # the gathered full weights: free them before the checkpoint is written
        distributed.check_all_ranks(problem is None, problem or "")
        self.save_checkpoint(step)
        if self.validation_embeds is not None:
            self.validate(step)
        if layout.is_main:
            from .metrics import plot_loss_curve

            manifest.record(output_dir, "loss_curve.png")
            plot_loss_curve(Path(output_dir) / "metrics.jsonl", Path(output_dir) / "loss_curve.png")
        hub_url = self.publish()
        if layout.is_main:
            self.summarize(hub_url)
        self.accelerator.wait_for_everyone()

    def summarize(self, hub_url: str | None) -> None:
        """The run's last lines (rank 0): every output written, the loss's change, and how to load the weights."""
        from .summary import summary

        cfg, family = self.cfg, self.shape.family
        urls = []
        if cfg.validation.report_to in ("wandb", "all"):
            try:  # the run's page; none when wandb runs offline
                urls = [u for u in [self.accelerator.get_tracker("wandb").run.url] if u]
            except Exception:  # noqa: BLE001 - a missing link must not fail a finished run
                urls = []
        text = summary(
            cfg, steps=self.max_steps, pipeline=family.pipeline_class_name(self.shape.pairs), kontext=self.shape.pairs,
            hub_url=hub_url, repo_id=self.hub_repo_id, tracker_urls=tuple(urls),
            transformer_class=family.transformer_class_name,
        )  # fmt: skip
        logger.info(text)

    def publish(self) -> str | None:
        """The model card (README.md in the output folder, as diffusers' examples write it) and, with --push_to_hub,
        the upload of the run's final outputs (flux_cp.hub.PUBLISHED: checkpoints, logs and the rest stay local). A
        failed upload is one line; the outputs stay in the folder. Returns the repository's URL when pushed (rank
        0)."""
        from . import hub
        from .card import write_model_card

        cfg, problem, url = self.cfg, None, None
        self.hub_repo_id = None
        if self.layout.is_main:
            output_dir = cfg.train.output_dir
            name, note = outdir.card_name(output_dir)  # a card the user wrote or edited is kept
            if note:
                logger.warning(f"warning: {note}")

            def card(repo_id: str | None = None) -> Path | None:
                self.hub_repo_id = repo_id
                if name is None:
                    return None
                manifest.record(output_dir, name)
                path = write_model_card(
                    cfg.train.output_dir, cfg, kontext=self.shape.pairs, steps=self.max_steps,
                    layout=self.layout.describe(), cp_mode=self.shape.cp_mode, repo_id=repo_id,
                    pipeline=self.shape.family.pipeline_class_name(self.shape.pairs), family=self.shape.family,
                    filename=name,
                )  # fmt: skip
                manifest.note_written(output_dir, name)
                return path

            try:
                if cfg.hub.push_to_hub:
                    url = hub.push_to_hub(cfg.train.output_dir, cfg.hub.hub_model_id, hub.token(cfg.hub.hub_token),
                                          on_repo=card)  # fmt: skip
                    logger.info(f"pushed {cfg.train.output_dir} to {url}")
                else:
                    card()
            except UsageError as e:
                problem = str(e)
        distributed.check_all_ranks(problem is None, problem or "")
        return url

    def close(self) -> None:
        """Free what holds the process group while it is up, then end accelerate's trackers. The wrapped model's
        gradient reducer holds the group: freed after the group was destroyed, its teardown can deadlock gloo (a
        worker thread waits for the GIL the destructor holds)."""
        for name in ("model", "optimizer", "lr_scheduler", "params", "batches", "metrics", "bar"):
            self.__dict__.pop(name, None)
        self.accelerator.free_memory()
        self.accelerator.end_training()
