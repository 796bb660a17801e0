"""diffusers' FLUX.2 LoRA example (examples/dreambooth/train_dreambooth_lora_flux2.py) at its small-memory settings,
on one GPU capped to a smaller card's memory: the FLUX.2 peer row of the small-GPU table.

    python -m benchmarks.bench_diffusers_flux2 --out RESULTS/diffusers_flux2.json --gpu_memory_gib 24

The settings its README_flux2.md names for small memory: `--bnb_quantization_config_path` with a 4-bit NF4
`BitsAndBytesConfig`, `--offload`, `--cache_latents`, `--gradient_checkpointing`, `--use_8bit_adam`; bf16 mixed
precision, 1024 px, batch 1, `--guidance_scale 1` (its README's command), LoRA on the example's default modules (the
attention projections and every single block's fused input and output projections, this project's FLUX.2 default
too) with rank and alpha 16 instead of its default 4, as this project's rows use.

What runs is the example's own sequence, line for line where the step is concerned (commit 58eb52c0 of diffusers,
the lines cited in `one`): `Flux2Transformer2DModel.from_pretrained(..., quantization_config=BitsAndBytesConfig(
load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=bf16), torch_dtype=bf16)`,
`prepare_model_for_kbit_training(use_gradient_checkpointing=False)`, the transformer moved to the GPU (never
offloaded), `enable_gradient_checkpointing`, LoRA through `add_adapter`, bitsandbytes' AdamW8bit, the constant
scheduler, `accelerator.prepare`, then per step: the cached latents patchified and normalized with the VAE's
batch-norm statistics, noise, SD3 timestep density, sigmas, the transformer, the weighted flow-matching loss,
`accelerator.backward`, `clip_grad_norm_`, the optimizer and scheduler steps and `loss.item()`. With `--cache_latents`
and one instance prompt the VAE and the text encoder are not part of the step (`--offload` moves them to the CPU
after encoding): the latents (1 x 32 x 128 x 128 for 1024 px) and the prompt embeddings (512 tokens of Mistral Small
3.1's 15360 stacked features) are random tensors of their shapes and dtype, on the GPU as the example keeps them.
The weights: FLUX.2 [dev]-shaped, seeded random (N(0, 1/fan_in) matrices), drawn shard by shard where
`from_pretrained` reads the checkpoint (its file reader is replaced; the quantization while loading is diffusers'
and bitsandbytes' own). Each cap runs in a process of its own, capped with `torch.cuda.set_per_process_memory_fraction`
before anything is allocated (as benchmarks/capped.py caps the trainer). Per row: the peak while loading, the peak
over the timed steps, the median step time. `--smoke`: a tiny transformer on the CPU (no quantization, AdamW: the CPU
path of the script only).
"""

from __future__ import annotations

import argparse
import json
import shlex
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from benchmarks import schema
from benchmarks.steps import timed

GIB = 2**30
SHARD_BYTES = 5 * 10**9  # diffusers' default max_shard_size
DIFFUSERS_COMMIT = "58eb52c0"  # the example's lines cited below
# The example's command for these settings (its README's FLUX.2 [dev] command with the small-memory options).
EXAMPLE_FLAGS = (
    "--pretrained_model_name_or_path black-forest-labs/FLUX.2-dev --instance_data_dir DATA --output_dir OUT "
    "--mixed_precision bf16 --bnb_quantization_config_path nf4.json --offload --cache_latents "
    "--gradient_checkpointing --use_8bit_adam --optimizer adamW --instance_prompt PROMPT --resolution 1024 "
    "--train_batch_size 1 --guidance_scale 1 --rank 16 --lora_alpha 16 --learning_rate 1e-4 "
    "--lr_scheduler constant --max_train_steps 500 --seed 0"
)
NF4_JSON = {"load_in_4bit": True, "bnb_4bit_quant_type": "nf4"}  # nf4.json
COLUMNS = {
    "name": "run",
    "cap_gib": "cap GiB",
    "resolution": "px",
    "load_peak_gib": "load peak GiB",
    "step_peak_gib": "step peak GiB",
    "s_per_step": "s/step",
    "loss_step1": "loss at step 1",
    "error": "error",
}


def example_targets(num_single_layers: int) -> list[str]:
    """The example's default LoRA targets (train_dreambooth_lora_flux2.py:1297-1300; 48 single blocks there)."""
    return ["to_k", "to_q", "to_v", "to_out.0"] + [
        "to_qkv_mlp_proj",
        *[f"single_transformer_blocks.{i}.attn.to_out" for i in range(num_single_layers)],
    ]


def transformer_config(smoke: bool) -> dict:
    from benchmarks.bench_diffusers_cp import FULL_TRANSFORMER, SMOKE_TRANSFORMER

    return dict(SMOKE_TRANSFORMER["flux2"] if smoke else FULL_TRANSFORMER["flux2"])


def write_model_dir(root: Path, config: dict) -> dict[str, list[str]]:
    """A model folder as from_pretrained reads it (transformer/config.json, a shard index, empty shard files),
    sharded as diffusers shards a checkpoint; returns each shard's keys."""
    import torch
    from diffusers import Flux2Transformer2DModel

    with torch.device("meta"):
        model = Flux2Transformer2DModel(**config).to(torch.bfloat16)
    folder = root / "transformer"
    folder.mkdir(parents=True, exist_ok=True)
    model.save_config(folder)
    shards: list[list[str]] = [[]]
    size = total = 0
    for key, t in model.state_dict().items():
        nbytes = t.numel() * t.element_size()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append(key)
        size += nbytes
        total += nbytes
    names = [f"diffusion_pytorch_model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    for name in names:
        (folder / name).touch()
    weight_map = {key: name for name, keys in zip(names, shards) for key in keys}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / "diffusion_pytorch_model.safetensors.index.json").write_text(json.dumps(index))
    return {name: keys for name, keys in zip(names, shards)}


def random_reader(shards: dict[str, list[str]], shapes: dict, seed: int, device):
    """A stand-in for diffusers' checkpoint reader (`model_loading_utils.load_state_dict`): a shard's tensors drawn
    (seeded per shard; N(0, 1/fan_in) matrices, unit norm weights, zero biases), on the CPU as a file's would be."""
    import torch

    def load_state_dict(checkpoint_file, disable_mmap=False, map_location="cpu"):
        if isinstance(checkpoint_file, dict):
            return checkpoint_file
        name = Path(checkpoint_file).name
        g = torch.Generator(device=device).manual_seed(seed + sorted(shards).index(name))
        out = {}
        for key in shards[name]:
            shape = shapes[key]
            if len(shape) == 2:
                t = torch.randn(shape, generator=g, device=device, dtype=torch.bfloat16).mul_(shape[1] ** -0.5)
            else:
                t = torch.full(shape, 1.0 if "norm" in key and key.endswith("weight") else 0.0, dtype=torch.bfloat16)
            out[key] = t.to("cpu")
        return out

    return load_state_dict


@contextmanager
def random_checkpoint(config: dict, seed: int, device) -> Iterator[Path]:
    """A model folder whose weights `from_pretrained` draws instead of reading (diffusers' reader replaced inside
    the block only)."""
    import torch
    from diffusers import Flux2Transformer2DModel
    from diffusers.models import model_loading_utils

    root = Path(tempfile.mkdtemp(prefix="flux2_shapes_"))
    shards = write_model_dir(root, config)
    with torch.device("meta"):
        shapes = {k: tuple(v.shape) for k, v in Flux2Transformer2DModel(**config).state_dict().items()}
    original = model_loading_utils.load_state_dict
    model_loading_utils.load_state_dict = random_reader(shards, shapes, seed, device)
    try:
        yield root
    finally:
        model_loading_utils.load_state_dict = original
        shutil.rmtree(root, ignore_errors=True)


def one(cap: float | None, resolution: int, rank: int, steps: int, warmup: int, smoke: bool) -> dict:
    """One cap, in this process: the example's setup and training step on random data (see the module's doc)."""
    import inspect

    import torch
    import torch.nn as nn
    from accelerate import Accelerator
    from accelerate.utils import set_seed
    from diffusers import AutoencoderKLFlux2, FlowMatchEulerDiscreteScheduler, Flux2Pipeline, Flux2Transformer2DModel
    from diffusers.optimization import get_scheduler
    from diffusers.training_utils import compute_density_for_timestep_sampling, compute_loss_weighting_for_sd3
    from peft import LoraConfig

    from flux_cp.families.builder import SCHEDULER_CONFIG

    gpu = not smoke
    row: dict = {"cap_gib": cap, "resolution": resolution}
    if gpu and cap:
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    accelerator = Accelerator(mixed_precision="bf16", cpu=smoke)
    set_seed(0)
    weight_dtype = torch.bfloat16
    config = transformer_config(smoke)

    # train_dreambooth_lora_flux2.py:1202-1231: scheduler, the VAE's batch-norm statistics (a VAE's running
    # statistics as initialised: mean 0, variance 1), the quantized transformer.
    noise_scheduler_copy = FlowMatchEulerDiscreteScheduler(**SCHEDULER_CONFIG)
    eps = inspect.signature(AutoencoderKLFlux2.__init__).parameters["batch_norm_eps"].default
    bn = nn.BatchNorm2d(config["in_channels"], eps=eps, affine=False, track_running_stats=True)
    latents_bn_mean = bn.running_mean.view(1, -1, 1, 1).to(accelerator.device)
    latents_bn_std = torch.sqrt(bn.running_var.view(1, -1, 1, 1) + eps).to(accelerator.device)
    quantization_config = None
    if gpu:
        from diffusers import BitsAndBytesConfig
        from peft import prepare_model_for_kbit_training

        config_kwargs = dict(NF4_JSON)
        if "load_in_4bit" in config_kwargs and config_kwargs["load_in_4bit"]:
            config_kwargs["bnb_4bit_compute_dtype"] = weight_dtype
        quantization_config = BitsAndBytesConfig(**config_kwargs)
    with random_checkpoint(config, 0, accelerator.device) as root:
        transformer = Flux2Transformer2DModel.from_pretrained(
            str(root), subfolder="transformer", quantization_config=quantization_config, torch_dtype=weight_dtype
        )
    if quantization_config is not None:
        transformer = prepare_model_for_kbit_training(transformer, use_gradient_checkpointing=False)
    # :1239-1310: frozen base, on the GPU (the transformer is never offloaded), checkpointing, LoRA.
    transformer.requires_grad_(False)
    transformer_to_kwargs = {"device": accelerator.device}
    if quantization_config is None:
        transformer_to_kwargs["dtype"] = weight_dtype
    transformer.to(**transformer_to_kwargs)
    transformer.enable_gradient_checkpointing()
    target_modules = example_targets(config["num_single_layers"])
    transformer_lora_config = LoraConfig(
        r=rank, lora_alpha=rank, lora_dropout=0.0, init_lora_weights="gaussian", target_modules=target_modules
    )
    transformer.add_adapter(transformer_lora_config)
    # :1425-1460: the optimizer (8-bit AdamW with --use_8bit_adam, the example's Adam defaults); :1725-1732,
    # its scheduler; :1735, accelerate.
    transformer_lora_parameters = list(filter(lambda p: p.requires_grad, transformer.parameters()))
    params_to_optimize = [{"params": transformer_lora_parameters, "lr": 1e-4}]
    if gpu:
        import bitsandbytes as bnb

        optimizer_class = bnb.optim.AdamW8bit
    else:
        optimizer_class = torch.optim.AdamW
    optimizer = optimizer_class(params_to_optimize, betas=(0.9, 0.999), weight_decay=1e-04, eps=1e-08)
    lr_scheduler = get_scheduler("constant", optimizer=optimizer, num_warmup_steps=500, num_training_steps=500)
    transformer, optimizer, lr_scheduler = accelerator.prepare(transformer, optimizer, lr_scheduler)
    row["lora_params"] = sum(p.numel() for p in transformer_lora_parameters)
    if gpu:
        row["load_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)

    # The caches (:1641-1700 with --cache_latents; the instance prompt's embeddings, :1580-1636): on the GPU.
    g = torch.Generator().manual_seed(resolution)
    side = resolution // 8
    text_tokens = 32 if smoke else 512
    instance_latents = torch.randn(1, config["in_channels"] // 4, side, side, generator=g).to(
        accelerator.device, weight_dtype
    )
    static_prompt_embeds = torch.randn(1, text_tokens, config["joint_attention_dim"], generator=g)
    static_prompt_embeds = static_prompt_embeds.to(accelerator.device, weight_dtype)
    static_text_ids = Flux2Pipeline._prepare_text_ids(static_prompt_embeds).to(accelerator.device)

    def get_sigmas(timesteps, n_dim=4, dtype=torch.float32):  # :1810-1818
        sigmas = noise_scheduler_copy.sigmas.to(device=accelerator.device, dtype=dtype)
        schedule_timesteps = noise_scheduler_copy.timesteps.to(accelerator.device)
        timesteps = timesteps.to(accelerator.device)
        step_indices = [(schedule_timesteps == t).nonzero().item() for t in timesteps]

        sigma = sigmas[step_indices].flatten()
        while len(sigma.shape) < n_dim:
            sigma = sigma.unsqueeze(-1)
        return sigma

    losses = []

    def step() -> None:  # :1820-1932, without prior preservation, one prompt
        with accelerator.accumulate([transformer]):
            prompt_embeds = static_prompt_embeds.repeat_interleave(1, dim=0)
            text_ids = static_text_ids.repeat_interleave(1, dim=0)
            model_input = torch.cat([instance_latents], dim=0)

            model_input = Flux2Pipeline._patchify_latents(model_input)
            model_input = (model_input - latents_bn_mean) / latents_bn_std

            model_input_ids = Flux2Pipeline._prepare_latent_ids(model_input).to(device=model_input.device)
            noise = torch.randn_like(model_input)
            bsz = model_input.shape[0]

            u = compute_density_for_timestep_sampling(
                weighting_scheme="none", batch_size=bsz, logit_mean=0.0, logit_std=1.0, mode_scale=1.29
            )
            indices = (u * noise_scheduler_copy.config.num_train_timesteps).long()
            timesteps = noise_scheduler_copy.timesteps[indices].to(device=model_input.device)

            sigmas = get_sigmas(timesteps, n_dim=model_input.ndim, dtype=model_input.dtype)
            noisy_model_input = (1.0 - sigmas) * model_input + sigmas * noise

            packed_noisy_model_input = Flux2Pipeline._pack_latents(noisy_model_input)

            guidance = torch.full([1], 1.0, device=accelerator.device)
            guidance = guidance.expand(model_input.shape[0])

            model_pred = transformer(
                hidden_states=packed_noisy_model_input,
                timestep=timesteps / 1000,
                guidance=guidance,
                encoder_hidden_states=prompt_embeds,
                txt_ids=text_ids,
                img_ids=model_input_ids,
                return_dict=False,
            )[0]
            model_pred = model_pred[:, : packed_noisy_model_input.size(1) :]

            model_pred = Flux2Pipeline._unpack_latents_with_ids(model_pred, model_input_ids)

            weighting = compute_loss_weighting_for_sd3(weighting_scheme="none", sigmas=sigmas)

            target = noise - model_input

            loss = torch.mean(
                (weighting.float() * (model_pred.float() - target.float()) ** 2).reshape(target.shape[0], -1),
                1,
            )
            loss = loss.mean()

            accelerator.backward(loss)
            if accelerator.sync_gradients:
                params_to_clip = transformer.parameters()
                accelerator.clip_grad_norm_(params_to_clip, 1.0)

            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad()
        losses.append(loss.detach().item())  # :1978, the step's log

    row |= timed(step, warmup, steps, gpu)
    row["loss_step1"] = round(losses[0], 6)
    row["losses"] = [round(x, 6) for x in losses]
    return row


def run_one(spec: dict, timeout: float) -> dict:
    """`one(**spec)` in a fresh process (its own GPU memory cap); its row, or the error it ended with."""
    cmd = [sys.executable, "-m", "benchmarks.bench_diffusers_flux2", "--out", "-", "--one", json.dumps(spec)]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, cwd=schema.ROOT, timeout=timeout)
        stdout, stderr, code = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:  # the child is killed
        stdout, stderr = (x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        stderr, code = stderr + f"\ntimed out after {timeout:g} s", None
    found = [ln[4:] for ln in stdout.splitlines() if ln.startswith("ROW ")]
    if found:
        return json.loads(found[-1])
    last = [ln for ln in stderr.splitlines() if ln.strip()]
    return {
        "cap_gib": spec["cap"],
        "resolution": spec["resolution"],
        "error": (last[-1] if last else f"exit {code}")[:300],
        "log_tail": last[-30:],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", required=True, help="result file (JSON, benchmarks/schema.py)")
    p.add_argument("--gpu_memory_gib", type=float, nargs="+", default=[24.0])
    p.add_argument("--resolution", type=int, default=1024)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=4, help="timed steps per cap")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--timeout", type=float, default=300, help="seconds per cap")
    p.add_argument("--smoke", action="store_true", help="a tiny transformer on the CPU: checks the script only")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row's arguments as JSON, run in this process
    args = p.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one(**json.loads(args.one))), flush=True)
        return
    if args.smoke:
        args.gpu_memory_gib, args.resolution, args.steps, args.warmup = [0.0], 64, 2, 1
    command = schema.command_line(argv, module="benchmarks.bench_diffusers_flux2")
    rows = []
    for cap in args.gpu_memory_gib:
        spec = dict(
            cap=cap or None,
            resolution=args.resolution,
            rank=args.rank,
            steps=args.steps,
            warmup=args.warmup,
            smoke=args.smoke,
        )
        row = run_one(spec, args.timeout)
        row_argv = [
            "--gpu_memory_gib",
            f"{cap:g}",
            "--resolution",
            str(args.resolution),
            "--steps",
            str(args.steps),
            "--warmup",
            str(args.warmup),
            *(["--smoke"] if args.smoke else []),
        ]
        row.update(
            name=f"diffusers_flux2_nf4_{args.resolution}_{cap:g}gib",
            example_command=f"accelerate launch train_dreambooth_lora_flux2.py {EXAMPLE_FLAGS}",
            command=shlex.join(["python", "-m", "benchmarks.bench_diffusers_flux2", "--out", "OUT", *row_argv]),
        )
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "log_tail")}), flush=True)
        rows.append(row)
    settings = {
        "peer": f"diffusers examples/dreambooth/train_dreambooth_lora_flux2.py (commit {DIFFUSERS_COMMIT})",
        "settings": "nf4 base (BitsAndBytesConfig), --offload, --cache_latents, gradient checkpointing, 8-bit AdamW",
        "nf4.json": json.dumps(NF4_JSON),
        "model": "tiny" if args.smoke else "FLUX.2 [dev]-shaped Flux2Transformer2DModel, seeded random weights",
        "lora": f"r{args.rank} (alpha {args.rank}) on the example's default modules",
        "data": "cached latents and prompt embeddings (random), 512 text tokens, one sample",
        "autocast": "bf16 (accelerate)",
        "timed": f"median of {args.steps} steps after {args.warmup}",
    }
    schema.write(args.out, schema.result("diffusers_flux2", rows, command=command, settings=settings, columns=COLUMNS))


if __name__ == "__main__":
    main()
