#!/usr/bin/env python
"""Fine-tune FLUX.1, FLUX.1 Kontext and FLUX.2 ([dev], [klein]) models (LoRA or full) with context parallelism
under `accelerate launch`.

    accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py \
        --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev --dataset_name DATA \
        --resolution 2048 --cp_size 2 --rank 16 --mixed_precision bf16 --gradient_checkpointing

With no model and data flags it trains a tiny FLUX.1 built locally on the bundled data set (the demo).
The phases live in flux_cp/trainer.py, their details in flux_cp's modules; flags arrive as typed sections
(flux_cp/config.py). The model family (FLUX.1, FLUX.1 Kontext, FLUX.2 [dev] or [klein]) is recognised from the
model folder's model_index.json.
"""

from __future__ import annotations

import os
import sys

from flux_cp import quiet

quiet.install()  # before the imports below: libraries they import (torchao) speak while being imported

from flux_cp import environment, runner  # noqa: E402
from flux_cp.config import parse_config  # noqa: E402
from flux_cp.outdir import finished, finished_line  # noqa: E402
from flux_cp.trainer import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    cfg = parse_config(argv)  # every flag checked before anything loads
    environment.check_environment(cfg.validation.report_to)  # FLUX_CP_* values, a wandb login
    if cfg.plan.plan:  # the memory planner instead of a run
        from flux_cp.plan import print_plan

        print_plan(cfg)
        return 0
    steps, output_dir = cfg.train.max_train_steps, cfg.train.output_dir
    done = finished(cfg.checkpoints.resume_from_checkpoint, output_dir, steps)
    if done is not None and not cfg.train.overwrite_output_dir:  # a finished run resumed: nothing loads or is written
        if os.environ.get("RANK", "0") == "0":
            print(f"flux-cp: {finished_line(done, steps)}", file=sys.stderr)
        return 0
    trainer = Trainer(cfg)
    trainer.setup()  # the run shape (model family, pairs, buckets, dp x cp), accelerate, the output folder
    trainer.load_data()  # encode every image and caption once (cached), then free the text encoders
    trainer.build_model()  # LoRA or full, CP attention, checkpointing and compile, FSDP2 or DDP, AdamW
    start = trainer.resume()  # the checkpoint's step on any dp x cp layout, or 0 (a finished run: nothing to do)
    if trainer.done_before is None:
        trainer.train(start)  # each step queued on the device; metrics, validation images and checkpoints when due
        trainer.finish()  # the LoRA file or transformer folder, the final checkpoint, images, the loss curve
    trainer.close()
    return 0


if __name__ == "__main__":
    sys.exit(runner.run(main))
