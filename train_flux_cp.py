#!/usr/bin/env python
"""Fine-tune FLUX.1, FLUX.1 Kontext and FLUX.2 ([dev], [klein]) models (LoRA or full) with context parallelism
under `accelerate launch`.

    accelerate launch --config_file accelerate_configs/fsdp2_cp2.yaml train_flux_cp.py \
        --pretrained_model_name_or_path black-forest-labs/FLUX.1-dev --dataset_name DATA \
        --resolution 2048 --cp_size 2 --rank 16 --mixed_precision bf16 --gradient_checkpointing

With no model and data flags it trains a tiny FLUX.1 built locally on the bundled data set (the demo). The model
family (FLUX.1, FLUX.1 Kontext, FLUX.2 [dev] or [klein]) is recognised from the model folder's model_index.json.

The recipe: the flags are parsed into typed sections and checked before anything loads (flux_cp/config/flags.py), then
`Trainer.run` (flux_cp/run/trainer.py) runs the phases in order, each one's details in flux_cp's modules:
    setup        the run shape (model family, pairs, buckets, dp x cp, the CP mode), accelerate, the output folder
    load_data    every image and caption encoded once (cached), then the text encoders freed
    build_model  LoRA or full (on a quantized base with --base_precision), then parallelize: CP attention,
                 checkpointing and compile, block offload, the optimizer, FSDP2 or DDP
    resume       the checkpoint's step on any dp x cp layout, or 0 (a finished run: nothing loads or is written)
    train        each step queued on the device; metrics, validation images and checkpoints when due
    finish       the LoRA file or transformer folder, the final checkpoint, images, the loss curve, the model card
"""

from __future__ import annotations

import sys

from flux_cp import quiet

quiet.install()  # before the imports below: libraries they import (torchao) speak while being imported

from flux_cp import bars  # noqa: E402
from flux_cp.config.parser import parse_config  # noqa: E402
from flux_cp.plan.report import print_plan  # noqa: E402
from flux_cp.run import environment, runner  # noqa: E402
from flux_cp.run.trainer import Trainer  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    bars.plain_output()  # a log file gets lines, not the libraries' progress bars (the tiny model's build writes one)
    cfg = parse_config(argv)  # every flag checked before anything loads
    environment.check_environment(cfg.validation.report_to)  # FLUX_CP_* values, a wandb login
    if cfg.plan.plan:  # the memory planner instead of a run
        print_plan(cfg, sys.argv[1:] if argv is None else argv)  # its recommended command repeats the flags
        return 0
    Trainer(cfg).run()
    return 0


if __name__ == "__main__":
    sys.exit(runner.run(main))
