"""kohya-ss sd-scripts' FLUX.1 LoRA step (flux_train_network.py) at its documented small-GPU settings, on one GPU
capped to a smaller card's memory: the peer rows of the small-GPU table beside diffusers' QLoRA recipe.

    python -m benchmarks.bench_kohya --sd_scripts PATH --out RESULTS/kohya.json [--settings NAME,...]

PATH is a checkout of https://github.com/kohya-ss/sd-scripts (not part of this repository; its commit is recorded
with the results). Its Python dependencies beyond this project's (transformers 4.x, diffusers 0.32, toml,
voluptuous, imagesize, bitsandbytes for AdamW8bit) go in a folder given by --kohya_site, put first on the path of
the processes that import kohya's code (benchmarks/carry.sh prepares it).

What runs is kohya's own code, in the order its training loop calls it, with only the files replaced: its
`FluxNetworkTrainer.load_target_model` (with `--fp8_base` the whole transformer in float8_e4m3fn, which autocast upcasts
per layer; `enable_block_swap` for `--blocks_to_swap N`) on a FLUX.1-dev-shaped `library.flux_models.Flux` whose weights
are drawn at random (seeded, N(0, 1/fan_in)) where `flux_utils.load_flow_model` would read them (with `--fp8_base` as
from an fp8 checkpoint, see `random_flow_model`), and kohya's dummy CLIP-L standing in for the text encoders and
autoencoder (their outputs are cached, so the step does not call them); `networks.lora_flux.create_network` and
`apply_to` (LoRA dim 16 on its default modules), gradient checkpointing, `train_util.get_optimizer` (AdamW8bit) and
`get_scheduler_fix`, the fp8 / dtype casts and `prepare_unet_with_accelerator` of `train_network.NetworkTrainer.train`,
then per step what its loop runs: `process_batch` (flow-matching noise, `get_noise_pred_and_target`, the loss),
`accelerator.backward`, the LoRA's gradient norms, `clip_grad_norm_`, the optimizer and scheduler steps, the norm
logging and `loss.item()`. A batch is what its data loader yields with `--cache_latents --cache_text_encoder_outputs`:
one 1024 px latent and 512 T5 tokens' outputs (random, float32 as its caches hold them). Each setting runs in a process
of its own, capped with `torch.cuda.set_per_process_memory_fraction` before anything is allocated (as
benchmarks/capped.py caps the trainer). Per row: the peak while loading, the peak over the timed steps, the median step
time after --warmup steps, and the kohya command line the row stands for. `--tiny`: a tiny Flux on the CPU (AdamW
instead of AdamW8bit, 2 blocks swapped where a setting swaps), to check the script.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

from benchmarks import schema
from benchmarks.steps import timed

GIB = 2**30
# The flags every setting shares: kohya's documented FLUX.1 LoRA command (docs/flux_train_network.md, section 4)
# with the dimension and optimizer of its low-memory table (6.1), bf16 like this project's rows, 1024 px, batch 1,
# LoRA on the transformer only (the text encoders' outputs cached).
COMMON = shlex.split(
    "--network_module networks.lora_flux --network_dim 16 --network_alpha 1 --network_train_unet_only "
    "--learning_rate 1e-4 --optimizer_type AdamW8bit --lr_scheduler constant --sdpa --mixed_precision bf16 "
    "--gradient_checkpointing --guidance_scale 1.0 --timestep_sampling flux_shift --model_prediction_type raw "
    "--cache_text_encoder_outputs --cache_latents --train_batch_size 1 --resolution 1024,1024 "
    "--t5xxl_max_token_length 512 --seed 0"
)
# The files a user's command names; here placeholders (nothing is read from them).
FILES = shlex.split(
    "--pretrained_model_name_or_path flux1-dev.safetensors --clip_l clip_l.safetensors "
    "--t5xxl t5xxl_fp16.safetensors --ae ae.safetensors --train_data_dir DATA --output_dir OUT"
)
# name: (GPU memory cap in GiB, the setting's own flags). Its 24 GB setting (--fp8_base, the basic settings), bf16
# with 8 blocks swapped at 24 GiB, and its 12 GB setting (--fp8_base with 16 blocks swapped and 8-bit AdamW).
SETTINGS = {
    "kohya_fp8_24gib": (24.0, ["--fp8_base"]),
    "kohya_bf16_swap8_24gib": (24.0, ["--blocks_to_swap", "8"]),
    "kohya_fp8_swap16_12gib": (12.0, ["--fp8_base", "--blocks_to_swap", "16"]),
}
# --tiny: what changes for the tiny Flux on the CPU (bitsandbytes' 8-bit AdamW needs a GPU; 2 of its blocks swapped).
TINY = {"--optimizer_type": "AdamW", "--resolution": "64,64", "--t5xxl_max_token_length": "8", "--blocks_to_swap": "2"}
COLUMNS = {
    "name": "run",
    "flags": "kohya flags",
    "cap_gib": "cap GiB",
    "resolution": "px",
    "lora_modules": "LoRA modules",
    "load_peak_gib": "load peak GiB",
    "step_peak_gib": "step peak GiB",
    "s_per_step": "s/step",
    "loss_step1": "loss at step 1",
    "error": "error",
}


def kohya_flags(setting: list[str], tiny: bool) -> list[str]:
    """The command-line flags kohya's parser gets for a setting (later flags win, as argparse reads them)."""
    flags = [*FILES, *COMMON, *setting]
    if tiny:
        for name, value in TINY.items():
            if name in flags:
                flags[flags.index(name) + 1] = value
    return flags


def kohya_command(flags: list[str]) -> str:
    """The command a kohya user runs for these flags (from the sd-scripts checkout)."""
    return shlex.join(["accelerate", "launch", "--num_cpu_threads_per_process", "1", "flux_train_network.py", *flags])


def sd_scripts_commit(path: Path) -> str | None:
    """The checkout's commit: the COMMIT file benchmarks/carry.sh writes into an exported tree, or git's."""
    marker = path / "COMMIT"
    if marker.is_file():
        return marker.read_text().strip()
    if not (path / ".git").exists():  # not its own repository (git would answer for an enclosing one)
        return None
    try:
        done = subprocess.run(["git", "-C", str(path), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def tiny_params(flux_models):
    """A FLUX.1-shaped Flux small enough for the CPU (head dim 16, 4 double and 6 single blocks)."""
    from dataclasses import replace

    return replace(
        flux_models.configs["dev"].params,
        in_channels=16,
        vec_in_dim=8,
        context_in_dim=16,
        hidden_size=32,
        num_heads=2,
        depth=4,
        depth_single_blocks=6,
        axes_dim=[4, 6, 6],
    )


def random_flow_model(flux_models, params, seed: int, draw_device):
    """A stand-in for `flux_utils.load_flow_model`: the Flux built on the meta device in the loaded dtype, as kohya
    builds it, its weights then drawn instead of read (N(0, 1/fan_in) matrices, unit RMSNorm scales, zero biases),
    on `draw_device` for speed and kept on the CPU, where kohya loads them. kohya asks for the file's own dtype
    (`dtype` None) with --fp8_base: then the weights come as an fp8 checkpoint's, float8_e4m3fn, which kohya takes
    as they are (its documented way around casting a bf16 file on the CPU, minutes for 12B weights); every weight
    is in the dtype its cast would give, so the step is the same."""
    import torch

    def load_flow_model(ckpt_path, dtype, device, disable_mmap=False, model_type="flux"):
        dtype = dtype or torch.float8_e4m3fn
        with torch.device("meta"):
            model = flux_models.Flux(params).to(dtype)
        model = model.to_empty(device=device)
        g = torch.Generator(device=draw_device).manual_seed(seed)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if p.ndim == 2:
                    draw = torch.randn(p.shape, generator=g, device=draw_device).mul_(p.shape[1] ** -0.5)
                else:
                    draw = torch.full(p.shape, 1.0 if name.endswith(".scale") else 0.0, device=draw_device)
                p.copy_(draw.to(dtype))
        return False, model  # (is_schnell, model)

    return load_flow_model


def one(sd_scripts: str, name: str, cap: float | None, flags: list[str], steps: int, warmup: int, tiny: bool) -> dict:
    """One setting, in this process: kohya's setup and training loop on random data (see the module's doc)."""
    import importlib
    import types

    import torch

    sys.path.insert(0, sd_scripts)
    gpu = torch.cuda.is_available() and not tiny
    row: dict = {"cap_gib": cap}
    if gpu and cap:
        total = torch.cuda.get_device_properties(0).total_memory / GIB
        torch.cuda.set_per_process_memory_fraction(min(1.0, cap / total), 0)
    import flux_train_network
    from accelerate.utils import set_seed
    from library import flux_models, flux_utils, train_util

    parser = flux_train_network.setup_parser()
    args = parser.parse_args(flags)
    train_util.verify_training_args(args)
    train_util.prepare_dataset_args(args, True)
    set_seed(args.seed)
    trainer = flux_train_network.FluxNetworkTrainer()
    # The dataset group's checks that assert_extra_args makes: 1024 px is a multiple of its bucket step, and cached
    # text encoder outputs need no caption augmentation (none is used).
    datasets = types.SimpleNamespace(
        verify_bucket_reso_steps=lambda step: None, is_text_encoder_output_cacheable=lambda: True
    )
    trainer.assert_extra_args(args, datasets, None)
    accelerator = train_util.prepare_accelerator(args)
    weight_dtype, _ = train_util.prepare_dtype(args)
    vae_dtype = weight_dtype
    params = tiny_params(flux_models) if tiny else flux_models.configs["dev"].params
    flux_utils.load_flow_model = random_flow_model(flux_models, params, args.seed, accelerator.device)
    flux_utils.load_clip_l = flux_utils.load_t5xxl = lambda *a, **k: flux_utils.dummy_clip_l()
    flux_utils.load_ae = lambda *a, **k: flux_utils.dummy_clip_l()
    _, text_encoders, vae, unet = trainer.load_target_model(args, weight_dtype, accelerator)

    # train_network.NetworkTrainer.train, from "prepare network" to the start of the epoch, for this configuration.
    network_module = importlib.import_module(args.network_module)
    net_kwargs = dict(arg.split("=", 1) for arg in args.network_args or [])
    net_kwargs.setdefault("dropout", args.network_dropout)
    network = network_module.create_network(
        1.0,
        args.network_dim,
        args.network_alpha,
        vae,
        text_encoders,
        unet,
        neuron_dropout=args.network_dropout,
        **net_kwargs,
    )
    if hasattr(network, "prepare_network"):
        network.prepare_network(args)
    trainer.post_process_network(args, accelerator, network, text_encoders, unet)
    train_unet = not args.network_train_text_encoder_only
    train_text_encoder = trainer.is_train_text_encoder(args)
    network.apply_to(text_encoders, unet, train_text_encoder, train_unet)
    if args.gradient_checkpointing:
        unet.enable_gradient_checkpointing(cpu_offload=args.cpu_offload_checkpointing)
        network.enable_gradient_checkpointing()
    trainable_params, _ = network.prepare_optimizer_params_with_multiple_te_lrs(
        args.text_encoder_lr, args.unet_lr, args.learning_rate
    )
    _, _, optimizer = train_util.get_optimizer(args, trainable_params)
    lr_scheduler = train_util.get_scheduler_fix(args, optimizer, accelerator.num_processes)
    unet_weight_dtype = weight_dtype
    if args.fp8_base or args.fp8_base_unet:
        unet_weight_dtype = torch.float8_e4m3fn
        unet.to(dtype=unet_weight_dtype)
    unet.requires_grad_(False)
    if trainer.cast_unet(args):
        unet.to(dtype=unet_weight_dtype)
    for t_enc in text_encoders:
        t_enc.requires_grad_(False)
    unet = trainer.prepare_unet_with_accelerator(args, accelerator, unet)
    network, optimizer, lr_scheduler = accelerator.prepare(network, optimizer, lr_scheduler)
    training_model = network
    if args.gradient_checkpointing:
        unet.train()
        for t_enc in text_encoders:
            t_enc.train()
    else:
        unet.eval()
    accelerator.unwrap_model(network).prepare_grad_etc(text_encoders, unet)
    noise_scheduler = trainer.get_noise_scheduler(args, accelerator.device)
    text_encoding_strategy = trainer.get_text_encoding_strategy(args)
    unwrapped = accelerator.unwrap_model(network)
    on_step_start_for_network = getattr(unwrapped, "on_step_start", lambda *a, **k: None)
    unwrapped.on_epoch_start(text_encoders, unet)
    row["base_dtype"] = str(next(accelerator.unwrap_model(unet).double_blocks.parameters()).dtype)
    row["swapped_blocks"] = accelerator.unwrap_model(unet).blocks_to_swap or 0
    row["lora_modules"] = len(unwrapped.unet_loras)
    row["lora_params"] = sum(p.numel() for p in unwrapped.parameters() if p.requires_grad)
    if gpu:
        row["load_peak_gib"] = round(torch.cuda.max_memory_allocated() / GIB, 2)

    # What the data loader yields with cached latents and text encoder outputs (float32, as the caches hold them).
    side = args.resolution[0] // 8
    text = args.t5xxl_max_token_length
    g = torch.Generator().manual_seed(args.seed)
    cached = {
        "latents": torch.randn(1, params.in_channels // 4, side, side, generator=g),
        "text_encoder_outputs_list": [
            torch.randn(1, params.vec_in_dim, generator=g),  # CLIP-L pooled
            torch.randn(1, text, params.context_in_dim, generator=g),  # T5-XXL
            torch.zeros(1, text, 3),  # txt_ids
            torch.ones(1, text, dtype=torch.int64),  # T5 attention mask
        ],
        "loss_weights": torch.ones(1),
    }
    device = accelerator.device
    losses = []

    def step() -> None:
        batch = {
            "latents": cached["latents"].to(device),
            "text_encoder_outputs_list": [t.to(device) for t in cached["text_encoder_outputs_list"]],
            "loss_weights": cached["loss_weights"].to(device),
        }
        # train_network.py's loop body (the lines from `with accelerator.accumulate` to `loss.detach().item()`).
        with accelerator.accumulate(training_model):
            on_step_start_for_network(text_encoders, unet)
            trainer.on_step_start(args, accelerator, network, text_encoders, unet, batch, weight_dtype, is_train=True)
            loss = trainer.process_batch(
                batch,
                text_encoders,
                unet,
                network,
                vae,
                noise_scheduler,
                vae_dtype,
                weight_dtype,
                accelerator,
                args,
                text_encoding_strategy,
                None,
                is_train=True,
                train_text_encoder=train_text_encoder,
                train_unet=train_unet,
            )
            accelerator.backward(loss)
            if accelerator.sync_gradients:
                trainer.all_reduce_network(accelerator, network)
                if args.max_grad_norm != 0.0:
                    params_to_clip = accelerator.unwrap_model(network).get_trainable_params()
                    accelerator.clip_grad_norm_(params_to_clip, args.max_grad_norm)
                if hasattr(network, "update_grad_norms"):
                    network.update_grad_norms()
                if hasattr(network, "update_norms"):
                    network.update_norms()
            optimizer.step()
            lr_scheduler.step()
            optimizer.zero_grad(set_to_none=True)
        if hasattr(network, "weight_norms"):
            for norms in (network.weight_norms(), network.grad_norms(), network.combined_weight_norms()):
                if norms is not None:
                    norms.mean().item()
        losses.append(loss.detach().item())

    row |= timed(step, warmup, steps, gpu)
    row["loss_step1"] = round(losses[0], 6)
    row["losses"] = [round(x, 6) for x in losses]
    row["software"] = {
        n: getattr(sys.modules.get(n), "__version__", None)
        for n in ("torch", "accelerate", "transformers", "diffusers", "bitsandbytes")
    }
    return row


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sd_scripts", required=True, help="a checkout of kohya-ss/sd-scripts")
    p.add_argument("--kohya_site", default=None, help="a folder of kohya's dependencies, first on its processes' path")
    p.add_argument("--out", required=True, help="result file (JSON, benchmarks/schema.py)")
    p.add_argument("--settings", default=",".join(SETTINGS), help=f"comma-separated, of {', '.join(SETTINGS)}")
    p.add_argument("--steps", type=int, default=5, help="timed steps per setting")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--timeout", type=float, default=300, help="seconds per setting")
    p.add_argument("--tiny", action="store_true", help="a tiny Flux on the CPU: checks the script only")
    p.add_argument("--one", help=argparse.SUPPRESS)  # a row's arguments as JSON, run in this process
    args = p.parse_args(argv)
    if args.one:
        print("ROW " + json.dumps(one(**json.loads(args.one))), flush=True)
        return
    sd_scripts = Path(args.sd_scripts).resolve()
    if not (sd_scripts / "flux_train_network.py").is_file():
        raise SystemExit(f"error: {sd_scripts} is not a kohya-ss/sd-scripts checkout (no flux_train_network.py)")
    names = [n for n in args.settings.split(",") if n]
    unknown = [n for n in names if n not in SETTINGS]
    if unknown:
        raise SystemExit(f"error: unknown setting {', '.join(unknown)}; choose from {', '.join(SETTINGS)}")
    if args.tiny:
        args.steps, args.warmup = 2, 1
    env = dict(os.environ)
    path = [str(sd_scripts), *([str(Path(args.kohya_site).resolve())] if args.kohya_site else [])]
    env["PYTHONPATH"] = os.pathsep.join([*path, str(schema.ROOT), *filter(None, [env.get("PYTHONPATH")])])
    command = schema.command_line(argv, module="benchmarks.bench_kohya")
    rows = []
    for name in names:
        cap, setting = SETTINGS[name]
        flags = kohya_flags(setting, args.tiny)
        spec = dict(
            sd_scripts=str(sd_scripts),
            name=name,
            cap=None if args.tiny else cap,
            flags=flags,
            steps=args.steps,
            warmup=args.warmup,
            tiny=args.tiny,
        )
        row = run_one(spec, env, args.timeout)
        row_argv = ["--settings", name, "--steps", str(args.steps), "--warmup", str(args.warmup)]
        row.update(
            name=name,
            flags=shlex.join(setting),
            resolution=int(flags[flags.index("--resolution") + 1].split(",")[0]),
            kohya_command=kohya_command(flags),
            command=shlex.join(
                [
                    "python",
                    "-m",
                    "benchmarks.bench_kohya",
                    "--sd_scripts",
                    "SD_SCRIPTS",
                    "--out",
                    "OUT",
                    *row_argv,
                    *(["--tiny"] if args.tiny else []),
                ]
            ),
        )
        print(json.dumps({k: v for k, v in row.items() if k not in ("losses", "log_tail")}), flush=True)
        rows.append(row)
        settings = {
            "peer": "kohya-ss/sd-scripts flux_train_network.py (its Flux, LoRA network, fp8 and block swap)",
            "sd_scripts_commit": sd_scripts_commit(sd_scripts),
            "SD_SCRIPTS": "the sd-scripts checkout",
            "model": "tiny Flux" if args.tiny else "FLUX.1-dev-shaped Flux, seeded random weights N(0, 1/fan_in)",
            "data": "cached latents and text encoder outputs: one sample, 512 T5 tokens (random)",
            "common_flags": shlex.join(COMMON),
            "timed": f"median of {args.steps} steps after {args.warmup}",
            "cap": "torch.cuda.set_per_process_memory_fraction before anything is allocated",
        }
        schema.write(args.out, schema.result("kohya", rows, command=command, settings=settings, columns=COLUMNS))


def run_one(spec: dict, env: dict, timeout: float) -> dict:
    """`one(**spec)` in a fresh process (its own GPU memory cap and allocator); its row, or the error it ended with."""
    cmd = [
        sys.executable,
        "-m",
        "benchmarks.bench_kohya",
        "--sd_scripts",
        spec["sd_scripts"],
        "--out",
        "-",
        "--one",
        json.dumps(spec),
    ]
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=schema.ROOT, timeout=timeout)
        stdout, stderr, code = r.stdout, r.stderr, r.returncode
    except subprocess.TimeoutExpired as e:  # the child is killed
        stdout, stderr = (x.decode() if isinstance(x, bytes) else (x or "") for x in (e.stdout, e.stderr))
        stderr, code = stderr + f"\ntimed out after {timeout:g} s", None
    found = [ln[4:] for ln in stdout.splitlines() if ln.startswith("ROW ")]
    if found:
        return json.loads(found[-1])
    last = [ln for ln in stderr.splitlines() if ln.strip()]
    return {"cap_gib": spec["cap"], "error": (last[-1] if last else f"exit {code}")[:300], "log_tail": last[-30:]}


if __name__ == "__main__":
    main()
