"""What a run writes besides its metrics: checkpoints when due, validation images when due, and at the end the
trained weights (a LoRA file or a transformer folder), the final checkpoint, the last validation images, the loss
curve, the model card, the upload to the Hub and the summary the run ends with. The trainer holds one `Outputs` from
the start of its training loop and calls it; every rank makes the same calls (the collectives of a gather, a
checkpoint and validation images need them all)."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from flux_cp import checkpoint_folders, distributed, files, hub, manifest
from flux_cp.errors import NonFiniteError, UsageError
from flux_cp.model.loading import full_state_dict, save_full
from flux_cp.model.lora import lora_origin, save_lora
from flux_cp.outputs import checkpoint, outdir, validation
from flux_cp.outputs.card import LORA_FILE, reference_names, write_model_card
from flux_cp.outputs.metrics import plot_loss_curve
from flux_cp.outputs.summary import summary
from flux_cp.plan import diskspace

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.layout import Layout
    from flux_cp.run.faults import Fault
    from flux_cp.shape.run_shape import RunShape

logger = logging.getLogger("flux_cp")


def base_weights(cfg: Config) -> str:
    """What the transformer trained on, for run_config.json: its pretrained weights, or random ones (and how)."""
    if cfg.model.transformer_init == "random":
        return f"random-initialised from the config (seed {cfg.train.seed}), not the pretrained weights"
    return "pretrained"


@dataclass
class Outputs:
    """The outputs of the run `cfg` of this shape and layout, from the model, optimizer and schedule as trained.
    `save`: the trainer's checkpoint seam (flux_cp.run.trainer.Trainer.save_checkpoint, which benchmarks replace),
    called for the final checkpoint too."""

    cfg: Config
    shape: RunShape
    layout: Layout
    accelerator: Any
    model: torch.nn.Module
    optimizer: Any
    lr_scheduler: Any
    sizes: diskspace.Sizes
    weight_dtype: torch.dtype
    run_identity: dict
    fault: Fault
    steps: int  # the run's last step
    previews: validation.Previews | None  # None: no --validation_prompt
    save: Callable[[int], None] | None = None
    hub_repo_id: str | None = None  # the Hub repository the outputs were pushed to (rank 0)
    state_model: torch.nn.Module | None = None  # what checkpoints hold of the weights (default: `model`)
    text: Any = None  # flux_cp.model.text_encoder.TrainedTextEncoder (--train_text_encoder)
    ema: Any = None  # flux_cp.model.ema.EMA (--use_ema): the final weights and validation images are its
    source: Any = None  # flux_cp.data.sources.ImageSource, the training data: a pair run's references for the card
    references: tuple[str, ...] = ()  # the reference images written beside the weights (`write_references`)

    def averaged(self):
        """The EMA in the weights (--use_ema) for what the block writes or renders, the raw weights after it."""
        return self.ema.applied() if self.ema is not None else contextlib.nullcontext()

    def record_settings(self, tuning, checkpointing) -> None:
        """run_config.json: every flag as the run resolved it, and what the run chose (the layout, the CP mode and
        tuning, the checkpointed and offloaded blocks, the planned peak and pinned host memory, the base weights)."""
        if not self.layout.is_main:
            return
        shape, output_dir = self.shape, self.cfg.train.output_dir
        chosen = {
            "layout": self.layout.describe(),
            "cp_mode": shape.cp_mode,
            "ulysses_size": shape.ulysses_size,
            "cp_ulysses_chunks": tuning.ulysses_chunks,
            "checkpointed_blocks": len(checkpointing.blocks),
            "planned_peak_gib": round(checkpointing.planned_gib, 2),
            "offloaded_blocks": checkpointing.offloaded,
            "pinned_host_gib": round(checkpointing.host_gib, 2),
            "base_weights": base_weights(self.cfg),
        }
        manifest.record(output_dir, "run_config.json")
        files.write_json(Path(output_dir) / "run_config.json", {**self.cfg.flat(), **chosen})

    def checkpoint(self, step: int) -> None:
        """checkpoint-`step` (flux_cp.outputs.checkpoint), once the disk is known to hold it."""
        cfg, layout = self.cfg, self.layout
        demo = cfg.demo.name if cfg.demo else None  # a resume of a demo run keeps its settings (flux_cp.config.flags)
        meta = {"run": self.run_identity, "layout": layout.describe(), "args": cfg.flat(), "demo": demo}
        diskspace.check_checkpoint(cfg.train.output_dir, step, self.sizes.checkpoint, layout.is_main)
        write_files = None
        if not cfg.lora.full_finetune:  # the step's LoRA file inside it, gathered as the final one (every rank)
            state, text = self.trained_weights()

            def write_files(folder: Path) -> Path:
                return self.save_lora_file(folder, state, text)

        saved = checkpoint.save(
            cfg.train.output_dir,
            step,
            self.state_model or self.model,
            self.optimizer,
            self.lr_scheduler,
            meta,
            layout.is_main,
            cfg.checkpoints.checkpoints_total_limit,
            self.fault,
            optimizer_state=not cfg.checkpoints.checkpoint_weights_only,
            extra=self.extra_state(),
            write_files=write_files,
        )
        logger.info(f"saved {saved}")

    def extra_state(self) -> dict | None:
        """What checkpoints hold beside the weights and the optimizer: the EMA's shadow (--use_ema)."""
        return {"ema": self.ema.state_dict()} if self.ema is not None else None

    def validate(self, step: int) -> None:
        """Validation images with the current weights (their EMA with --use_ema; the trained text encoder's
        encodings of the prompts with --train_text_encoder), CP across each group, saved and sent to the trackers."""
        cfg, p = self.cfg, self.previews
        self.fault.during_validation(step)
        with self.averaged():
            embeds = dict(p.embeds)
            if self.text is not None:
                dtype = embeds[self.text.entry].dtype
                embeds.update(self.text.pipeline_inputs(list(cfg.validation.validation_prompt), dtype))
            images = validation.generate(
                self.accelerator.unwrap_model(self.model),
                p.encoders,
                p.scheduler_config,
                embeds,
                self.layout,
                cfg.validation,
                cfg.train.guidance_scale,
                cfg.train.seed,
                self.accelerator.autocast,
                self.shape.family,
                p.reference,
            )
        if self.layout.is_main:
            path = validation.save_and_log(images, step, cfg.validation, cfg.train.output_dir, self.accelerator)
            logger.info(f"validation images: {path}")

    def finish(self, progress) -> None:
        """The outputs of the last step, most valuable first: the trained weights in diffusers' format (LoRA file or
        transformer folder), then the final checkpoint, then what is optional (validation images, the loss curve),
        then the model card, the upload and the summary. `progress`: which steps applied their update
        (flux_cp.model.optim.Progress): a run that did not train keeps the folder's earlier outputs."""
        output_dir, layout = self.cfg.train.output_dir, self.layout
        # Every rank decides alike from the reduced losses; the main rank names the checkpoints in its message.
        found = [s for s, _ in checkpoint_folders.list_checkpoints(output_dir)] if layout.is_main else []
        failure = progress.failure(found, output_dir)
        if failure:
            raise NonFiniteError(failure)
        self.write_weights()
        (self.save or self.checkpoint)(self.steps)
        if self.previews is not None:
            self.validate(self.steps)
        if layout.is_main:
            manifest.record(output_dir, "loss_curve.png")
            plot_loss_curve(Path(output_dir) / "metrics.jsonl", Path(output_dir) / "loss_curve.png")
            self.write_references()
        hub_url = self.publish()
        if layout.is_main:
            self.summarize(hub_url)
        self.accelerator.wait_for_everyone()

    def write_weights(self) -> None:
        """The trained weights in diffusers' format: the LoRA file (`--lora_format`) or the transformer folder, written
        into place by the main rank once the disk is known to hold them (every rank gathers them under FSDP2)."""
        cfg, output_dir, layout = self.cfg, self.cfg.train.output_dir, self.layout
        state, text = self.trained_weights()
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
                prev = checkpoint_folders.list_checkpoints(output_dir)
                kept = f"{prev[-1][1]} is the last good checkpoint" if prev else "no checkpoint was written"
                diskspace.check_write(
                    output_dir, self.sizes.model, f"the final {self.sizes.model_name}", kept, resumable=bool(prev)
                )
                if cfg.lora.full_finetune:
                    out = outdir.write_final(
                        output_dir, "transformer", lambda d: save_full(inner, state, str(d), self.weight_dtype)
                    )
                else:
                    out = outdir.write_final(output_dir, LORA_FILE, lambda d: self.save_lora_file(d, state, text))
                logger.info(f"wrote {out}")
            except UsageError as e:
                problem = str(e)
        state.clear()  # the gathered full weights: free them before the checkpoint is written
        distributed.check_all_ranks(problem is None, problem or "")

    def trained_weights(self) -> tuple[dict[str, torch.Tensor], tuple | None]:
        """The weights the run's output holds (the EMA's with --use_ema): the trainable ones as CPU tensors, complete
        on the main rank (every rank calls it: FSDP2 gathers), and the trained text encoder's LoRA weights with its
        adapter config (--train_text_encoder, else None)."""
        with self.averaged():  # every rank: FSDP gathers. Copies: on the CPU the state holds the parameters themselves
            state = full_state_dict(self.model, trainable_only=not self.cfg.lora.full_finetune)
            if self.ema is not None:
                state = {k: v.clone() for k, v in state.items()}
            text = (self.text.lora_weights(), self.text.adapter_config()) if self.text is not None else None
        return state, text

    def save_lora_file(self, folder: str | os.PathLike, state: dict[str, torch.Tensor], text: tuple | None) -> Path:
        """The LoRA file of `trained_weights` in `folder` (the main rank): the output's, and each checkpoint's."""
        cfg, family = self.cfg, self.shape.family
        inner = self.accelerator.unwrap_model(self.model)
        origin = lora_origin(cfg, pairs=self.shape.pairs)
        return save_lora(inner, state, str(folder), cfg.lora, family, origin, text)

    def write_references(self) -> None:
        """A pair run's reference images beside its weights (the main rank), for the lines of the model card and the
        summary to edit (`reference_images`), as PNG (`flux_cp.outputs.card.reference_names`). A file of that name the
        run did not write is the user's: kept, and the lines edit it."""
        if not self.shape.pairs:
            return
        out = Path(self.cfg.train.output_dir)
        try:  # an image that cannot be read or written now costs the lines their reference, not the run its end
            images = self.reference_images()
            names = reference_names(len(images)) if images else ()
            listed = manifest.read(out) or []
            for name, image in zip(names, images):
                path = out / name
                if os.path.lexists(path) and name not in listed:
                    logger.warning(
                        f"warning: {path} was not written by flux-cp: kept, and the model card's lines edit it"
                    )
                    continue
                manifest.record(out, name)
                files.write_with(path, lambda tmp, image=image: image.save(tmp, format="PNG"))
        except (OSError, UsageError) as e:
            logger.warning(f"warning: the reference images were not copied beside the weights ({e})")
            return
        self.references = names

    def reference_images(self) -> list:
        """The images a pair run's lines edit: its --validation_image(s), else its first training sample's references,
        each cut as validation cuts it (`--validation_resolution` square, at least 64 px: FLUX.2's pipelines take no
        smaller image); at most 99 (the names the Hub upload takes: flux_cp.hub.PUBLISHED)."""
        v, source = self.cfg.validation, self.source
        size = max(v.validation_resolution, 64)
        if v.validation_image:
            return [validation.reference_image(p, size) for p in v.validation_image[:99]]
        if source is None or not len(source):
            return []
        loaded = (source.load(0, reference=True, ref_index=j) for j in range(min(source.reference_count(0), 99)))
        return [validation.square(image, size) for image in loaded]

    def publish(self) -> str | None:
        """The model card (README.md in the output folder, as diffusers' examples write it) and, with --push_to_hub,
        the upload of the run's final outputs (flux_cp.hub.PUBLISHED: checkpoints, logs and the rest stay local). A
        failed upload is one line; the outputs stay in the folder. Returns the repository's URL when pushed (rank
        0)."""
        cfg, shape, problem, url = self.cfg, self.shape, None, None
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
                    cfg.train.output_dir,
                    cfg,
                    pairs=shape.pairs,
                    steps=self.steps,
                    layout=self.layout.describe(),
                    cp_mode=shape.cp_mode,
                    repo_id=repo_id,
                    family=shape.family,
                    filename=name,
                    references=self.references,
                )
                manifest.note_written(output_dir, name)
                return path

            try:
                if cfg.hub.push_to_hub:
                    url = hub.push_to_hub(
                        cfg.train.output_dir, cfg.hub.hub_model_id, hub.token(cfg.hub.hub_token), on_repo=card
                    )
                    logger.info(f"pushed {cfg.train.output_dir} to {url}")
                else:
                    card()
            except UsageError as e:
                problem = str(e)
        distributed.check_all_ranks(problem is None, problem or "")
        return url

    def summarize(self, hub_url: str | None) -> None:
        """The run's last lines (rank 0): every output written, the loss's change, and how to load the weights."""
        cfg, family, pairs = self.cfg, self.shape.family, self.shape.pairs
        urls = []
        if cfg.validation.report_to in ("wandb", "all"):
            try:  # the run's page; none when wandb runs offline
                urls = [u for u in [self.accelerator.get_tracker("wandb").run.url] if u]
            except Exception:  # noqa: BLE001 - a missing link must not fail a finished run
                urls = []
        text = summary(
            cfg,
            steps=self.steps,
            pairs=pairs,
            hub_url=hub_url,
            repo_id=self.hub_repo_id,
            tracker_urls=tuple(urls),
            family=family,
            references=self.references,
        )
        logger.info(text)
