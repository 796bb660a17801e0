"""Command-line flags of `train_flux_cp.py`, named as in diffusers' Flux training examples where they
exist there, and the checks that need no model, data or GPU (they run before anything heavy)."""

from __future__ import annotations

import argparse
import os

from .errors import UsageError

DEFAULT_LORA_LAYERS = (
    "attn.to_k,attn.to_q,attn.to_v,attn.to_out.0,"
    "attn.add_k_proj,attn.add_q_proj,attn.add_v_proj,attn.to_add_out,"
    "ff.net.0.proj,ff.net.2,ff_context.net.0.proj,ff_context.net.2"
)
CP_MODES = ("auto", "ring", "ulysses", "hybrid")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        description="Fine-tune FLUX.1 (LoRA or full) with context parallelism. With no model and no data flags it "
        "trains a tiny Flux built locally on the bundled data set (the embedded default).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    g = p.add_argument_group("model")
    g.add_argument(
        "--pretrained_model_name_or_path",
        default=None,
        help="Diffusers-layout folder or hub id of FLUX.1. Default: a tiny Flux built locally.",
    )
    g.add_argument("--revision", default=None)
    g.add_argument("--variant", default=None, help="Weight file variant, e.g. fp16.")
    g.add_argument(
        "--transformer_init",
        choices=("pretrained", "random"),
        default="pretrained",
        help="'random': build the transformer from its config with seeded random weights (benchmarks and "
        "equivalence runs of FLUX.1-sized models without downloading them).",
    )

    g = p.add_argument_group("data")
    g.add_argument(
        "--dataset_name",
        default=None,
        help="Hub data set id, or a local folder of images with metadata.jsonl or a .txt caption beside "
        "each image. Default: the bundled data set.",
    )
    g.add_argument("--dataset_config_name", default=None)
    g.add_argument("--image_column", default="image")
    g.add_argument("--caption_column", default="text")
    g.add_argument(
        "--instance_prompt",
        default=None,
        help="DreamBooth-style: use this prompt for every image (captions are ignored).",
    )
    g.add_argument(
        "--resolution",
        type=int,
        default=None,
        help="Training resolution in pixels (multiple of 16). Default: 1024, or 64 for the tiny default.",
    )
    g.add_argument("--center_crop", action="store_true", help="Center crop (default: random crop).")
    g.add_argument("--random_flip", action="store_true")
    g.add_argument(
        "--aspect_buckets",
        action="store_true",
        help="Group images into aspect-ratio buckets of about resolution^2 pixels instead of square crops.",
    )
    g.add_argument(
        "--max_sequence_length",
        type=int,
        default=None,
        help="T5 tokens per prompt (<= 512). Default: 512, or 32 for the tiny default.",
    )
    g.add_argument(
        "--cache_dir",
        default=None,
        help="Where encoded latents and prompt embeddings are cached. Default: ~/.cache/flux_cp/encodings.",
    )
    g.add_argument(
        "--no_cache",
        action="store_true",
        help="Encode every batch on the fly (keeps VAE and text encoders loaded; per-epoch random crops).",
    )

    g = p.add_argument_group("training")
    g.add_argument("--output_dir", default="flux-cp-output")
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--train_batch_size", type=int, default=1, help="Samples per data-parallel rank per micro-step.")
    g.add_argument("--max_train_steps", type=int, default=None, help="Optimizer steps. Overrides --num_train_epochs.")
    g.add_argument("--num_train_epochs", type=int, default=1)
    g.add_argument("--gradient_accumulation_steps", type=int, default=1)
    g.add_argument("--gradient_checkpointing", action="store_true")
    g.add_argument("--learning_rate", type=float, default=1e-4)
    g.add_argument("--scale_lr", action="store_true", help="Multiply the LR by the global batch size.")
    g.add_argument(
        "--lr_scheduler",
        default="constant",
        choices=("linear", "cosine", "cosine_with_restarts", "polynomial", "constant", "constant_with_warmup"),
    )
    g.add_argument("--lr_warmup_steps", type=int, default=0)
    g.add_argument("--lr_num_cycles", type=int, default=1)
    g.add_argument("--lr_power", type=float, default=1.0)
    g.add_argument("--adam_beta1", type=float, default=0.9)
    g.add_argument("--adam_beta2", type=float, default=0.999)
    g.add_argument("--adam_weight_decay", type=float, default=1e-4)
    g.add_argument("--adam_epsilon", type=float, default=1e-8)
    g.add_argument("--max_grad_norm", type=float, default=1.0)
    g.add_argument(
        "--mixed_precision",
        choices=("no", "fp16", "bf16"),
        default=None,
        help="Default: accelerate's config (bf16 in the GPU configs here).",
    )
    g.add_argument("--allow_tf32", action="store_true")
    g.add_argument(
        "--weighting_scheme", default="none", choices=("sigma_sqrt", "logit_normal", "mode", "cosmap", "none")
    )
    g.add_argument("--logit_mean", type=float, default=0.0)
    g.add_argument("--logit_std", type=float, default=1.0)
    g.add_argument("--mode_scale", type=float, default=1.29)
    g.add_argument(
        "--guidance_scale",
        type=float,
        default=3.5,
        help="Guidance embedding value for guidance-distilled checkpoints (FLUX.1-dev); also used for "
        "validation images.",
    )
    g.add_argument("--deterministic", action="store_true", help="Deterministic kernels (slower).")
    g.add_argument(
        "--seed_checkpoint",
        default=None,
        help="Initial trainable weights: written here when absent, read when present, so runs with "
        "different layouts start from identical parameters.",
    )
    g.add_argument(
        "--on_nonfinite",
        choices=("stop", "skip"),
        default="stop",
        help="What to do when the loss or gradient norm is NaN/inf.",
    )
    g.add_argument("--compile", action="store_true", help="torch.compile each transformer block.")
    g.add_argument(
        "--compile_mode",
        choices=("default", "reduce-overhead", "max-autotune", "max-autotune-no-cudagraphs"),
        default=None,
        help="torch.compile mode of the blocks (implies --compile); reduce-overhead replays each block as a CUDA "
        "graph, communication included, which helps short sequences whose steps wait on the host.",
    )

    g = p.add_argument_group("LoRA / full fine-tuning")
    g.add_argument("--full_finetune", action="store_true", help="Train all transformer weights instead of LoRA.")
    g.add_argument("--rank", type=int, default=16, help="LoRA rank.")
    g.add_argument("--lora_alpha", type=int, default=None, help="Default: the rank.")
    g.add_argument("--lora_dropout", type=float, default=0.0)
    g.add_argument(
        "--lora_layers",
        default=DEFAULT_LORA_LAYERS,
        help="Comma-separated module name suffixes that get LoRA adapters.",
    )

    g = p.add_argument_group("parallelism")
    g.add_argument("--cp_size", type=int, default=1, help="Ranks that share one sample's tokens.")
    g.add_argument("--cp_mode", choices=CP_MODES, default="auto")
    g.add_argument("--ulysses_size", type=int, default=None, help="Ulysses degree of the hybrid mode.")
    g.add_argument(
        "--collective_timeout",
        type=float,
        default=600.0,
        help="Seconds before a stuck collective aborts the run (a dead rank never hangs the others).",
    )

    g = p.add_argument_group("checkpoints")
    g.add_argument("--checkpointing_steps", type=int, default=500)
    g.add_argument("--checkpoints_total_limit", type=int, default=None)
    g.add_argument("--resume_from_checkpoint", default=None, help="'latest' or a checkpoint folder.")

    g = p.add_argument_group("validation and logging")
    g.add_argument("--validation_prompt", action="append", default=None, help="Repeatable.")
    g.add_argument("--validation_steps", type=int, default=None, help="Default: only at the end of training.")
    g.add_argument("--num_validation_images", type=int, default=2)
    g.add_argument("--validation_resolution", type=int, default=None, help="Default: --resolution.")
    g.add_argument("--validation_inference_steps", type=int, default=28)
    g.add_argument("--report_to", default="tensorboard", choices=("tensorboard", "wandb", "all", "none"))
    g.add_argument("--logging_dir", default="logs", help="Tracker folder, relative to --output_dir.")
    g.add_argument(
        "--plan",
        action="store_true",
        help="Print the estimated per-GPU memory of this configuration, and the smallest CP size that "
        "fits, then exit (loads nothing heavy).",
    )
    g.add_argument("--gpu_memory_gib", type=float, default=None, help="For --plan: memory per GPU (default: read).")
    return p


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    args = build_parser().parse_args(argv)
    args.embedded_default = args.pretrained_model_name_or_path is None
    if args.resolution is None:
        args.resolution = 64 if args.embedded_default else 1024
    if args.max_sequence_length is None:
        args.max_sequence_length = 32 if args.embedded_default else 512
    if args.lora_alpha is None:
        args.lora_alpha = args.rank
    if args.validation_resolution is None:
        args.validation_resolution = args.resolution
    check_args(args)
    return args


def check_args(args: argparse.Namespace) -> None:
    """Checks that need only the flags (and the world size, when launched)."""
    if args.resolution % 16:
        raise UsageError(f"--resolution {args.resolution} must be a multiple of 16 (8x VAE, 2x2 patches)")
    if args.validation_resolution % 16:
        raise UsageError(f"--validation_resolution {args.validation_resolution} must be a multiple of 16")
    if not 1 <= args.max_sequence_length <= 512:
        raise UsageError(f"--max_sequence_length must be between 1 and 512, got {args.max_sequence_length}")
    for name in (
        "train_batch_size",
        "gradient_accumulation_steps",
        "cp_size",
        "checkpointing_steps",
        "num_train_epochs",
        "rank",
    ):
        if getattr(args, name) < 1:
            raise UsageError(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.max_train_steps is not None and args.max_train_steps < 1:
        raise UsageError(f"--max_train_steps must be at least 1, got {args.max_train_steps}")
    if args.cp_mode == "hybrid" and args.ulysses_size is None:
        raise UsageError("--cp_mode hybrid needs --ulysses_size (the Ulysses degree, a divisor of --cp_size)")
    if args.ulysses_size is not None and args.cp_mode not in ("hybrid", "auto"):
        raise UsageError(f"--ulysses_size is only used with --cp_mode hybrid (got --cp_mode {args.cp_mode})")
    if args.ulysses_size is not None and (args.ulysses_size < 1 or args.cp_size % args.ulysses_size):
        raise UsageError(f"--ulysses_size {args.ulysses_size} must divide --cp_size {args.cp_size}")
    if args.dataset_name and os.path.sep in args.dataset_name and not os.path.exists(args.dataset_name):
        raise UsageError(f"--dataset_name {args.dataset_name}: no such folder")
    if args.resume_from_checkpoint not in (None, "latest") and not os.path.isdir(args.resume_from_checkpoint):
        raise UsageError(f"--resume_from_checkpoint {args.resume_from_checkpoint}: no such checkpoint folder")
    if args.report_to == "wandb":
        import importlib.util

        if importlib.util.find_spec("wandb") is None:
            raise UsageError("--report_to wandb needs the wandb package (pip install wandb), or use tensorboard")
    if args.collective_timeout <= 0:
        raise UsageError("--collective_timeout must be positive (seconds)")
