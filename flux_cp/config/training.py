"""The sections of the flags that say what a run trains: the model, its adapters (or full fine-tuning), the data and
the optimisation; and the checks of these flags that span sections. (The other sections and `Config`, every section
together: flux_cp.config.flags.)"""

from __future__ import annotations

import os
from dataclasses import dataclass

from flux_cp.config.demo import TINY_TEXT_TOKENS, demo_in, is_embedded
from flux_cp.config.fields import (
    ADAPTER_LABELS,
    ADAPTERS,
    DEFAULT_ENCODINGS_DIR,
    LORA_FORMATS,
    LR_SCHEDULERS,
    OPTIMIZERS,
    PRECISION_BITS,
    PRECISIONS,
    WEIGHTING_SCHEMES,
    boolean,
    comma_list,
    flag,
    is_hub_id,
    parse_checkpointing,
    parse_offload_blocks,
    parse_on_off_auto,
    parse_resolutions,
)
from flux_cp.errors import UsageError


@dataclass(frozen=True)
class ModelConfig:
    """Which FLUX model to load (flux_cp.model.loading; the family is read from the model folder)."""

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
    """LoRA adapters or full fine-tuning (flux_cp.model.lora, flux_cp.model.loading). `rank` is the LoRA rank (the
    process rank is `Layout.rank`)."""

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
        parse=comma_list,
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
    """Images, captions and their encodings (flux_cp.data.sources, flux_cp.data.encode)."""

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
        derive=lambda raw: (64,) if is_embedded(raw) else (1024,),
        parse=parse_resolutions,
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
        derive=lambda raw: TINY_TEXT_TOKENS if is_embedded(raw) else 512,
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
            needed = (
                ("class_data_dir", self.class_data_dir, "the folder of class images"),
                ("class_prompt", self.class_prompt, "the prompt of the class images"),
            )
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
    """Optimisation: batch, steps, optimizer, schedule, loss, precision (train_flux_cp.py, flux_cp.data.flow)."""

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
        derive=lambda raw: demo_in(raw).batch if demo_in(raw) else 1,
    )
    max_train_steps: int | None = flag(
        None,
        "Optimizer steps; overrides --num_train_epochs. Default: --num_train_epochs epochs, or the demo's (200 for "
        "the bundled data set, 100 for its Kontext pairs).",
        derive=lambda raw: demo_in(raw).steps if demo_in(raw) else None,
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
        parse=parse_checkpointing,
        const="auto",
    )
    offload_blocks: str = flag(
        "0",
        "Keep the frozen weights of this many transformer blocks in pinned host memory and copy each to the GPU on a "
        "side stream ahead of its use, forward and backward: the same results with less GPU memory, for LoRA with "
        "DDP. 'auto' (the value of the flag given alone): the memory planner chooses the count, with "
        "--gradient_checkpointing auto the pair of both, whose planned peak fits the GPU's memory with the least "
        "modelled step time (--plan shows it); 0 or none: no offload. docs/offload.md says what it costs.",
        parse=parse_offload_blocks,
        const="auto",
    )
    learning_rate: float = flag(
        1e-4,
        "Initial learning rate (after the warmup). Default: 1e-4; 1.0 with --optimizer prodigy (a factor on the step "
        "size Prodigy estimates); with AdamW the demo's (1e-3; 2e-3 for the Kontext demo).",
        derive=lambda raw: (
            1.0 if raw["optimizer"] == "prodigy" else (demo.learning_rate if (demo := demo_in(raw)) else 1e-4)
        ),
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
        True,
        "Prodigy: AdamW-style decoupled weight decay (true) or an L2 penalty on the gradient (false).",
        parse=boolean,
    )
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
        parse=parse_on_off_auto,
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


def check_adapter(lora: LoraConfig, base_precision: str) -> None:
    """At start, the flags only: a UsageError for what `--adapter` cannot be combined with."""
    adapter = lora.adapter
    if adapter == "lora":
        return
    name, what = f"--adapter {adapter}", ADAPTER_LABELS[adapter]
    if lora.full_finetune:
        raise UsageError(
            f"{name} trains {what} adapters; --full_finetune trains every weight and no adapter: drop one of the two"
        )
    if lora.network_weights is not None:
        raise UsageError(
            f"{name} with --network_weights: a LoRA file holds no {what} weights (a {what} adapter would start half "
            "from the file and half at random); use --adapter lora or drop --network_weights"
        )
    if lora.train_text_encoder:
        raise UsageError(
            f"{name} with --train_text_encoder: the text encoder's adapter is a LoRA only (as in diffusers' examples); "
            "use --adapter lora or drop --train_text_encoder"
        )
    if lora.lora_format != "diffusers":
        why = (
            "kohya's, LyCORIS' and ComfyUI's DoRA (dora_scale) divides by the base weight's norm, peft's by the "
            "adapted weight's, so no kohya file holds this DoRA"
            if adapter == "dora"
            else "the kohya / BFL layout fuses q, k and v into one linear, whose update separate Kronecker products of "
            "the three are not"
        )
        loads = (
            "load_lora_weights loads it" if adapter == "dora" else "ComfyUI and diffusers' load_lora_adapter load it"
        )
        raise UsageError(f"{name} with --lora_format {lora.lora_format}: {why}; keep --lora_format diffusers ({loads})")
    if adapter == "lokr" and lora.lora_dropout:
        raise UsageError(
            f"--lora_dropout {lora.lora_dropout:g} with --adapter lokr: peft's LoKr drops no inputs (its dropouts "
            "are of ranks and whole modules); drop --lora_dropout"
        )
    if adapter == "lokr" and base_precision == "nf4":
        raise UsageError(
            "--adapter lokr with --base_precision nf4: peft's LoKr layer shapes its update like the base weight, "
            "which bitsandbytes stores packed; use --base_precision int8 or fp8"
        )


def check_base_precision(precision: str, full_finetune: bool) -> None:
    """The flags alone: a quantized base holds frozen weights, which full fine-tuning would train."""
    if precision != "bf16" and full_finetune:
        raise UsageError(
            f"--base_precision {precision} stores the frozen base weights in {PRECISION_BITS[precision]} bits for "
            "LoRA; "
            "--full_finetune trains every weight, which needs them in full precision: drop --base_precision (or "
            "--full_finetune to train a LoRA)"
        )
