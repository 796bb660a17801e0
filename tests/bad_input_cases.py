"""Every bad input tried: how to provoke it and the message it must get. Run by tests/test_bad_inputs.py;
tools/bad_inputs_table.py writes docs/bad_inputs.md from those test runs."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors.torch import save_file

from flux_cp.data.sources import BUNDLED_DATA
from flux_cp.outputs.roles import CHECKOUT


@dataclass
class Case:
    name: str
    what: str  # the bad input, as a user would describe it
    nproc: int
    args: Callable[[Path], list[str]]  # flags, given a scratch folder (set up there by the callable)
    expect: str  # substring of the error message
    env: dict = field(default_factory=dict)
    # Refused while the flags are parsed and checked, before anything loads: tested by calling the trainer's
    # entry point in the test process (one process, no launcher), which is where the time of launching goes.
    flags_only: bool = False


def _images(folder: Path, n: int = 3, captions: bool = True, column: str = "text") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    rows = []
    for i, src in enumerate(sorted(BUNDLED_DATA.glob("*.png"))[:n]):
        (folder / src.name).write_bytes(src.read_bytes())
        rows.append({"file_name": src.name, column: f"shape {i}"})
    if captions:
        (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _garbage_image(t: Path) -> list[str]:
    folder = _images(t / "data")
    (folder / "broken.png").write_bytes(b"this is not a PNG file")
    with open(folder / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "broken.png", "text": "broken"}) + "\n")
    return ["--dataset_name", str(folder)]


def _pairs(folder: Path, edit: Callable[[list[dict]], None] | None = None) -> Path:
    """Four pairs of the bundled pair set, with `edit` applied to their metadata rows."""
    pairs = BUNDLED_DATA.parent / "tiny_pairs"
    folder.mkdir(parents=True, exist_ok=True)
    rows = [json.loads(line) for line in (pairs / "metadata.jsonl").read_text().splitlines()[:4]]
    for row in rows:
        for key in ("file_name", "reference_file_name"):
            (folder / row[key]).write_bytes((pairs / row[key]).read_bytes())
    if edit:
        edit(rows)
    (folder / "metadata.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def _garbage_reference(t: Path) -> list[str]:
    folder = _pairs(t / "pairs")
    row = json.loads((folder / "metadata.jsonl").read_text().splitlines()[1])
    (folder / row["reference_file_name"]).write_bytes(b"this is not a PNG file")
    return ["--dataset_name", str(folder)]


def _other_run(folder: Path) -> Path:
    """An output folder of an earlier run: its manifest, metrics and loss curve."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / ".flux_cp_manifest.json").write_text(json.dumps({"format": 1, "entries": ["loss_curve.png"]}))
    (folder / "metrics.jsonl").write_text("")
    (folder / "loss_curve.png").write_bytes((BUNDLED_DATA / "01_black_square.png").read_bytes())
    return folder


def _more_class_images(t: Path) -> list[str]:
    """A checkpoint of a run with 3 class images, resumed with 5."""
    ckpt = _small_checkpoint(t / "out", 2)
    rows = [[f"generated/0000{k}-x.png", "d", "c"] for k in range(3)]
    meta = {"format": 1, "step": 2, "layout": "world 1", "args": {}, "run": {"prior": "abc", "prior_files": rows}}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ["--resume_from_checkpoint", "latest", "--with_prior_preservation", "--class_data_dir", str(t / "class"),
            "--class_prompt", "a shape", "--num_class_images", "5"]  # fmt: skip


def _corrupt_seed(t: Path) -> list[str]:
    t.mkdir(parents=True, exist_ok=True)
    (t / "seed.safetensors").write_bytes(b"\x00" * 64)
    return ["--seed_checkpoint", str(t / "seed.safetensors")]


def _foreign_seed(t: Path) -> list[str]:
    t.mkdir(parents=True, exist_ok=True)
    save_file({"some.other.weight": torch.zeros(2)}, t / "seed.safetensors")
    return ["--seed_checkpoint", str(t / "seed.safetensors")]


def _config_file(t: Path, text: str) -> list[str]:
    t.mkdir(parents=True, exist_ok=True)
    (t / "run.yaml").write_text(text)
    return ["--config", str(t / "run.yaml")]


def _lora_file(t: Path, rank: int) -> Path:
    """A LoRA file of the embedded default's layers (FLUX.1's default targets) at `rank`, as a run writes it."""
    from flux_cp.config.training import LoraConfig
    from flux_cp.families import FLUX1
    from flux_cp.families.flux1 import DEFAULT_TARGETS
    from flux_cp.families.flux1.tiny import tiny_transformer
    from flux_cp.model.loading import prepare_trainable
    from flux_cp.model.lora import save_lora

    t.mkdir(parents=True, exist_ok=True)
    lora = LoraConfig(rank=rank, lora_alpha=rank, lora_layers=DEFAULT_TARGETS)
    model = tiny_transformer()
    prepare_trainable(model, lora, seed=0)
    return save_lora(model, dict(model.state_dict()), str(t), lora, FLUX1)


def _kohya_images_beside(t: Path) -> list[str]:
    folder = _images(t / "data" / "10_sks shape", captions=False)
    (folder.parent / "stray.png").write_bytes((folder / "00_white_circle.png").read_bytes())
    return ["--dataset_name", str(folder.parent)]


def _not_a_checkpoint(t: Path) -> list[str]:
    (t / "checkpoint-7").mkdir(parents=True, exist_ok=True)
    return ["--resume_from_checkpoint", str(t / "checkpoint-7")]


def _foreign_checkpoint(t: Path) -> list[str]:
    ckpt = _small_checkpoint(t / "other", 2)  # another run's folder, beside the output folder
    meta = {"format": 1, "step": 2, "layout": "world 1 = dp 1 x cp 1", "run": {"rank": 4, "full_finetune": False}}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ["--resume_from_checkpoint", str(ckpt), "--rank", "8"]


def _earlier_run(t: Path) -> list[str]:
    ckpt = t / "out" / "checkpoint-2"
    ckpt.mkdir(parents=True, exist_ok=True)
    (ckpt / "meta.json").write_text("{}")
    (t / "out" / "metrics.jsonl").write_text("")
    return []


def _output_file(t: Path) -> list[str]:
    t.mkdir(parents=True, exist_ok=True)
    (t / "taken").write_text("x")
    return ["--output_dir", str(t / "taken")]


def _unwritable_output(t: Path) -> list[str]:
    return _output_file(t)[:1] + [str(t / "taken" / "sub")]


def _metadata_names_missing_image(t: Path) -> list[str]:
    folder = _images(t / "data")
    with open(folder / "metadata.jsonl", "a") as f:
        f.write(json.dumps({"file_name": "gone.png", "text": "a shape"}) + "\n")
    return ["--dataset_name", str(folder)]


def _caption_not_utf8(t: Path) -> list[str]:
    folder = _images(t / "data", captions=False)
    for p in folder.glob("*.png"):
        p.with_suffix(".txt").write_text("shape")
    next(iter(sorted(folder.glob("*.txt")))).write_bytes("caf\u00e9".encode("latin-1"))
    return ["--dataset_name", str(folder)]


def _null_caption(t: Path) -> list[str]:
    folder = _images(t / "data")
    rows = (folder / "metadata.jsonl").read_text().splitlines()
    rows[1] = json.dumps({"file_name": json.loads(rows[1])["file_name"], "text": None})
    (folder / "metadata.jsonl").write_text("\n".join(rows) + "\n")
    return ["--dataset_name", str(folder)]


def _model_folder(t: Path) -> Path:
    """A model folder's layout (its transformer is not read before the refusal)."""
    (t / "model" / "transformer").mkdir(parents=True, exist_ok=True)
    (t / "model" / "transformer" / "config.json").write_text('{"_class_name": "FluxTransformer2DModel"}')
    (t / "model" / "model_index.json").write_text('{"_class_name": "FluxPipeline"}')
    return t / "model"


def _model_of_escaped_classes(t: Path) -> list[str]:
    """A model folder whose model_index.json names a class holding terminal escapes (ESC [ 2 J clears a screen)."""
    folder = t / "evil"
    (folder / "transformer").mkdir(parents=True, exist_ok=True)
    (folder / "transformer" / "config.json").write_text('{"_class_name": "OtherTransformer"}')
    (folder / "model_index.json").write_text(json.dumps({"_class_name": "\x1b[2J\x1b[31mEvilPipeline"}))
    return ["--pretrained_model_name_or_path", str(folder)]


def _edited_model(t: Path, component: str, edits: dict) -> list[str]:
    """A copy of the tiny FLUX.1 folder with `edits` made to a component's config.json."""
    import shutil

    from flux_cp.families import FLUX1

    folder = Path(shutil.copytree(FLUX1.embedded_default(pairs=False), t / "edited"))
    config = json.loads((folder / component / "config.json").read_text())
    (folder / component / "config.json").write_text(json.dumps({**config, **edits}))
    return ["--pretrained_model_name_or_path", str(folder)]


def _listed_model_index(t: Path) -> Path:
    folder = _model_folder(t)
    (folder / "model_index.json").write_text("[1, 2]")
    return folder


def _truncated_weights(t: Path) -> list[str]:
    args = _edited_model(t, "transformer", {})
    weights = Path(args[1]) / "transformer" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    return args


def _output_dir_is_the_model(t: Path) -> list[str]:
    model = str(_model_folder(t))
    return [
        "--pretrained_model_name_or_path",
        model,
        "--output_dir",
        model,
        "--overwrite_output_dir",
        "--full_finetune",
    ]


def _output_dir_inside_the_data(t: Path) -> list[str]:
    folder = _images(t / "data")
    return ["--dataset_name", str(folder), "--output_dir", str(folder / "out")]


def _finished_run_without_checkpoints(t: Path) -> list[str]:
    out = t / "out"
    out.mkdir(parents=True, exist_ok=True)
    (out / "run_config.json").write_text(json.dumps({"output_dir": str(out), "cp_size": 1,
                                                     "resume_from_checkpoint": None}))  # fmt: skip
    (out / "metrics.jsonl").write_text(json.dumps({"step": 1, "loss": 1.0}) + "\n")
    (out / "pytorch_lora_weights.safetensors").write_bytes(b"x")
    return ["--resume_from_checkpoint", "latest"]


def _checkpoint(folder: Path, step: int) -> Path:
    path = folder / f"checkpoint-{step}"
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": 1, "step": step, "layout": "world 1 = dp 1 x cp 1", "run": {}, "args": {}}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


def _demo_checkpoint_of_odd_types(t: Path) -> list[str]:
    """A checkpoint of the demo whose meta.json holds a learning rate that is no number (a resumed demo keeps it)."""
    from flux_cp.config.demo import DEMO

    ckpt = _checkpoint(t / "out", 2)
    meta = json.loads((ckpt / "meta.json").read_text())
    (ckpt / "meta.json").write_text(json.dumps({**meta, "demo": DEMO.name, "args": {"learning_rate": "fast"}}))
    return ["--resume_from_checkpoint", "latest"]


def _flux2(t: Path, template: str | None = None) -> list[str]:
    """The tiny FLUX.2 [dev] folder (built once), or a copy of it whose tokenizer has `template` as chat template."""
    import shutil

    from flux_cp.families import FLUX2

    folder = Path(FLUX2.embedded_default(pairs=False))
    if template is not None:
        folder = Path(shutil.copytree(folder, t / "crafted"))
        (folder / "tokenizer" / "chat_template.jinja").write_text(template)
    return ["--pretrained_model_name_or_path", str(folder), "--resolution", "64"]


def _small_checkpoint(folder: Path, step: int) -> Path:
    """A real checkpoint-`step` of a small model (its DCP files and checksums) in `folder`."""
    from diffusers.optimization import get_scheduler

    from flux_cp.outputs import checkpoint

    model = torch.nn.Linear(4, 4)
    opt = torch.optim.AdamW(model.parameters())
    model(torch.ones(1, 4)).sum().backward()
    opt.step()
    sched = get_scheduler("constant", optimizer=opt)
    return checkpoint.save(str(folder), step, model, opt, sched, {"run": {}, "layout": "world 1 = dp 1 x cp 1"},
                           True, None)  # fmt: skip


def _truncated_metadata(t: Path) -> list[str]:
    """A real checkpoint-2 in the output folder (refused before any model loads), whose DCP metadata lost its end."""
    ckpt = _small_checkpoint(t / "out", 2)
    metadata = ckpt / "state" / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[:40])
    return ["--resume_from_checkpoint", "latest"]


def _checkpoint_of_another_run(t: Path) -> list[str]:
    _finished_run_without_checkpoints(t)
    return ["--resume_from_checkpoint", str(_checkpoint(t / "other", 2))]


def _checkpoint_beyond_the_steps(t: Path) -> list[str]:
    return ["--resume_from_checkpoint", str(_checkpoint(t / "out", 4))]


def _checkpoint_with_flags(t: Path, flags: list[str]) -> Path:
    """A checkpoint-2 in the output folder whose meta.json is that of a run of the embedded default with `flags` (its
    run identity and flags; the state is a small model's, never loaded: the resume is refused before)."""
    from flux_cp.config.parser import parse_config
    from flux_cp.families import FLUX1
    from flux_cp.outputs.resume import run_identity
    from flux_cp.shape.build import resolved

    ckpt = _small_checkpoint(t / "out", 2)
    cfg = resolved(parse_config([*flags, "--max_train_steps", "2"]), FLUX1, False, None)
    samples = cfg.train.train_batch_size * cfg.train.gradient_accumulation_steps
    run = run_identity(cfg, samples, "", None)
    meta = {"format": 1, "step": 2, "layout": "world 1 = dp 1 x cp 1", "args": cfg.flat(), "run": run}
    (ckpt / "meta.json").write_text(json.dumps(meta))
    return ckpt


def _batch_cut_into_micro_steps(t: Path) -> list[str]:
    """A checkpoint of the same run at --train_batch_size 2, resumed at batch 1 with 2 accumulated micro-steps (the
    same global batch, other draws)."""
    _checkpoint_with_flags(t, ["--train_batch_size", "2"])
    return ["--resume_from_checkpoint", "latest", "--train_batch_size", "1", "--gradient_accumulation_steps", "2"]


def _another_seed(t: Path) -> list[str]:
    _checkpoint_with_flags(t, ["--seed", "5"])
    return ["--resume_from_checkpoint", "latest"]


def _flux1(t: Path) -> str:
    """The tiny FLUX.1 folder (built once)."""
    from flux_cp.families import FLUX1

    return FLUX1.embedded_default(pairs=False)


def _lock_is_a_link(t: Path) -> list[str]:
    (t / "out").mkdir(parents=True, exist_ok=True)
    (t / "victim.txt").write_text("a file the lock must not truncate")
    (t / "out" / ".flux_cp.lock").symlink_to(t / "victim.txt")
    return []


def _dangling_link(t: Path) -> list[str]:
    folder = _images(t / "data")
    (folder / "not_fetched.png").symlink_to(t / "annex" / "objects" / "missing")
    return ["--dataset_name", str(folder), "--instance_prompt", "a shape"]


def _not_an_object(t: Path) -> list[str]:
    folder = _images(t / "data")
    with open(folder / "metadata.jsonl", "a") as f:
        f.write("42\n")
    return ["--dataset_name", str(folder)]


def _reference_outside(t: Path) -> list[str]:
    def outside(rows: list[dict]) -> None:
        rows[1]["reference_file_name"] = "../" + rows[1]["reference_file_name"]

    folder = _pairs(t / "pairs", outside)
    (t / json.loads((folder / "metadata.jsonl").read_text().splitlines()[1])["reference_file_name"][3:]).write_bytes(
        (folder / json.loads((folder / "metadata.jsonl").read_text().splitlines()[0])["file_name"]).read_bytes()
    )
    return ["--dataset_name", str(folder)]


def _reference_list(t: Path, *extra) -> list[str]:
    """Pairs whose second row lists its reference and then `extra` as its references (FLUX.2's layout)."""

    def listed(rows: list[dict]) -> None:
        rows[1]["reference_file_name"] = [rows[1]["reference_file_name"], *extra]

    return ["--dataset_name", str(_pairs(t / "pairs", listed))]


def _two_validation_images(t: Path) -> list[str]:
    folder = _pairs(t / "pairs")
    images = [str(folder / name) for name in ("00_blue_circle.png", "01_green_square.png")]
    return ["--dataset_name", str(folder), "--validation_prompt", "red", "--validation_image", images[0],
            "--validation_image", images[1]]  # fmt: skip


CASES = [
    Case(
        "cp_size_not_dividing_world",
        "--cp_size 3 with 2 launched processes",
        2,
        lambda t: ["--cp_size", "3"],
        "--cp_size 3 does not divide the 2 launched processes: choose --cp_size from [1, 2]",
    ),
    Case(
        "image_tokens_not_divisible",
        "a resolution whose image tokens do not split over the CP group",
        2,
        lambda t: ["--cp_size", "2", "--resolution", "48"],
        "--resolution 48 gives 9 image tokens, not divisible by --cp_size 2: use 32 or 64",
    ),
    Case(
        "text_tokens_not_divisible",
        "a text length that does not split over the CP group",
        2,
        lambda t: ["--cp_size", "2", "--max_sequence_length", "31"],
        "--max_sequence_length 31 (text tokens) is not divisible by --cp_size 2: use 30",
    ),
    Case(
        "unknown_cp_mode",
        "an unknown CP mode",
        1,
        lambda t: ["--cp_mode", "sideways"],
        "argument --cp_mode: invalid choice: 'sideways'",
        flags_only=True,
    ),
    Case(
        "kohya_file_diffusers_cannot_read",
        "--lora_format kohya for LoRAs diffusers could not read back from that layout",
        1,
        lambda t: ["--lora_format", "kohya", "--lora_layers", "attn.to_q,x_embedder"],
        "--lora_format kohya: diffusers' kohya loader drops LoRAs on top-level layers (x_embedder)",
    ),
    Case(
        "dora_in_kohya_format",
        "--adapter dora with --lora_format kohya (no kohya file holds peft's DoRA)",
        1,
        lambda t: ["--adapter", "dora", "--lora_format", "kohya"],
        "--adapter dora with --lora_format kohya: kohya's, LyCORIS' and ComfyUI's DoRA (dora_scale) divides by the "
        "base weight's norm",
        flags_only=True,
    ),
    Case(
        "lokr_in_kohya_format",
        "--adapter lokr with --lora_format kohya (q, k and v are one linear there)",
        1,
        lambda t: ["--adapter", "lokr", "--lora_format", "kohya"],
        "--adapter lokr with --lora_format kohya: the kohya / BFL layout fuses q, k and v into one linear",
        flags_only=True,
    ),
    Case(
        "adapter_with_full_finetune",
        "--adapter lokr with --full_finetune",
        1,
        lambda t: ["--adapter", "lokr", "--full_finetune"],
        "--adapter lokr trains LoKr adapters; --full_finetune trains every weight and no adapter",
        flags_only=True,
    ),
    Case(
        "adapter_with_network_weights",
        "--adapter dora with --network_weights (a LoRA file holds no DoRA weights)",
        1,
        lambda t: ["--adapter", "dora", "--network_weights", str(_lora_file(t / "lora", 4))],
        "--adapter dora with --network_weights: a LoRA file holds no DoRA weights",
        flags_only=True,
    ),
    Case(
        "adapter_with_text_encoder",
        "--adapter dora with --train_text_encoder (CLIP's adapter is a LoRA)",
        1,
        lambda t: ["--adapter", "dora", "--train_text_encoder"],
        "--adapter dora with --train_text_encoder: the text encoder's adapter is a LoRA only",
        flags_only=True,
    ),
    Case(
        "lokr_with_lora_dropout",
        "--lora_dropout with --adapter lokr (peft's LoKr has no input dropout)",
        1,
        lambda t: ["--adapter", "lokr", "--lora_dropout", "0.1"],
        "--lora_dropout 0.1 with --adapter lokr: peft's LoKr drops no inputs",
        flags_only=True,
    ),
    Case(
        "lokr_on_nf4",
        "--adapter lokr on a 4-bit base (--base_precision nf4)",
        1,
        lambda t: ["--adapter", "lokr", "--base_precision", "nf4"],
        "--adapter lokr with --base_precision nf4: peft's LoKr layer shapes its update like the base weight",
        flags_only=True,
    ),
    Case(
        "misspelt_flag",
        "a misspelt flag",
        1,
        lambda t: ["--learnig_rate", "1e-4"],
        "unknown flag --learnig_rate: did you mean --learning_rate?",
        flags_only=True,
    ),
    Case(
        "quantized_base_full_finetune",
        "--full_finetune with a quantized base (--base_precision)",
        1,
        lambda t: ["--full_finetune", "--base_precision", "int8"],
        "--base_precision int8 stores the frozen base weights in 8 bits for LoRA; --full_finetune trains every weight",
        flags_only=True,
    ),
    Case(
        "hybrid_without_ulysses_size",
        "--cp_mode hybrid without --ulysses_size",
        1,
        lambda t: ["--cp_mode", "hybrid"],
        "--cp_mode hybrid needs --ulysses_size",
        flags_only=True,
    ),
    Case(
        "offload_with_full_finetune",
        "--offload_blocks with --full_finetune",
        1,
        lambda t: ["--full_finetune", "--offload_blocks", "4"],
        "--offload_blocks moves frozen weights, and --full_finetune trains every weight: drop --offload_blocks",
        flags_only=True,
    ),
    Case(
        "auto_fits_nothing",
        "--gradient_checkpointing and --offload_blocks auto where nothing fits the GPU's memory",
        1,
        lambda t: ["--gradient_checkpointing", "--offload_blocks", "--gpu_memory_gib", "0.001"],
        "does not fit 90% of 1.0 MiB at --base_precision bf16 (planned ",
    ),
    Case(
        "revision_of_a_local_folder",
        "--revision with a local model folder (diffusers ignores it there: another version than asked for)",
        1,
        lambda t: ["--pretrained_model_name_or_path", _flux1(t), "--revision", "v2"],
        "with the local model folder",
        flags_only=True,
    ),
    Case(
        "profile_step_past_the_last_step",
        "--profile_step 5 in a run of 2 steps (no step would be profiled)",
        1,
        lambda t: ["--profile_step", "5"],
        "--profile_step 5 is past the last step of this run (--max_train_steps 2): no step would be profiled",
        flags_only=True,
    ),
    Case(
        "ema_never_updated",
        "--use_ema --ema_update_interval 5 in a run of 2 steps (the output would be the initial weights)",
        1,
        lambda t: ["--use_ema", "--ema_update_interval", "5"],
        "--ema_update_interval 5 > --max_train_steps 2: the EMA, the run's output with --use_ema, would never be "
        "updated and would stay the initial weights",
        flags_only=True,
    ),
    Case(
        "offload_blocks_beyond_the_model",
        "--offload_blocks 99 on a model of 4 blocks",
        1,
        lambda t: ["--offload_blocks", "99"],
        "--offload_blocks 99: the transformer has 4 blocks; give at most 4",
    ),
    Case(
        "checkpointing_beyond_the_model",
        "--gradient_checkpointing 99 on a model of 4 blocks (the same rule as --offload_blocks)",
        1,
        lambda t: ["--gradient_checkpointing", "99"],
        "--gradient_checkpointing 99: the transformer has 4 blocks; give at most 4, or 'all'",
    ),
    Case(
        "plan_offload_blocks_beyond_the_model",
        "--plan --offload_blocks 99 on a model of 4 blocks (as the run refuses it, before a plan of '4 of 4 blocks')",
        1,
        lambda t: ["--plan", "--offload_blocks", "99"],
        "--offload_blocks 99: the transformer has 4 blocks; give at most 4",
        flags_only=True,
    ),
    Case(
        "plan_cp_size_not_dividing_num_processes",
        "--plan --num_processes 3 --cp_size 2 (the advice names --plan's own flag)",
        1,
        lambda t: ["--plan", "--num_processes", "3", "--cp_size", "2"],
        "--cp_size 2 does not divide --num_processes 3: choose --cp_size from [1, 3], or plan for a multiple of 2 "
        "processes (--num_processes)",
        flags_only=True,
    ),
    Case(
        "compile_not_a_value",
        "--compile sometimes",
        1,
        lambda t: ["--compile", "sometimes"],
        "--compile: 'sometimes': give on, off or auto",
        flags_only=True,
    ),
    Case(
        "compile_off_with_a_compile_mode",
        "--compile off with --compile_mode reduce-overhead",
        1,
        lambda t: ["--compile", "off", "--compile_mode", "reduce-overhead"],
        "--compile off with --compile_mode reduce-overhead: a compile mode compiles the blocks; drop one of the two",
        flags_only=True,
    ),
    Case(
        "host_memory_not_positive",
        "--host_memory_gib 0",
        1,
        lambda t: ["--plan", "--host_memory_gib", "0"],
        "--host_memory_gib 0 is out of range: it must be > 0",
        flags_only=True,
    ),
    Case(
        "offload_blocks_not_a_number",
        "--offload_blocks half",
        1,
        lambda t: ["--offload_blocks", "half"],
        "--offload_blocks: 'half': give auto, none or a number of blocks",
        flags_only=True,
    ),
    Case(
        "ulysses_heads_not_divisible",
        "Ulysses over 3 ranks with a 4-head model",
        3,
        lambda t: ["--cp_size", "3", "--cp_mode", "ulysses", "--resolution", "48", "--max_sequence_length", "30"],
        "4 attention heads are not divisible by the Ulysses size 3",
    ),
    Case(
        "ulysses_chunks_beyond_the_heads",
        "--cp_ulysses_chunks larger than the model's attention heads",
        2,
        lambda t: ["--cp_size", "2", "--cp_ulysses_chunks", "8"],
        "--cp_ulysses_chunks 8: the model has 4 attention heads and a chunk holds at least one; use at most 4",
    ),
    Case(
        "ulysses_chunks_absurd",
        "--cp_ulysses_chunks 1000000000 (each attention call once counted it down to what the heads allow)",
        1,
        lambda t: ["--cp_size", "1", "--cp_ulysses_chunks", "1000000000"],
        "--cp_ulysses_chunks 1000000000 is out of range: it must be >= 1 and <= 1024",
        flags_only=True,
    ),
    Case(
        "repeats_absurd",
        "--repeats 1000000000 (a list of every copy exhausted memory after encoding)",
        1,
        lambda t: ["--repeats", "1000000000"],
        "--repeats 1000000000 is out of range: it must be >= 1 and <= 100000",
        flags_only=True,
    ),
    Case(
        "cp_kernels_of_another_device",
        "--cp_kernels naming only kernels of another device (cudnn on a CPU; cpu_flash on a GPU)",
        1,
        lambda t: ["--cp_kernels", "cpu_flash" if torch.cuda.is_available() else "cudnn"],
        "none of these attention kernels runs on",
    ),
    Case(
        "overlap_scheduler_without_a_gpu",
        "--compile --cp_overlap scheduler on CPUs (Inductor's overlap scheduler needs a CUDA GPU and triton)",
        2,
        lambda t: ["--cp_size", "2", "--compile", "--cp_overlap", "scheduler"],
        "--cp_overlap scheduler is Inductor's overlap scheduler, which needs",
    ),
    Case(
        "flux2_window_the_template_fills",
        "FLUX.2 [dev] with --max_sequence_length 128: its system message fills the window (captions all encode alike)",
        1,
        lambda t: _flux2(t) + ["--max_sequence_length", "128"],
        "--max_sequence_length 128: FLUX.2 [dev]'s chat template takes 172 tokens before the caption",
    ),
    Case(
        "flux2_crafted_chat_template",
        "a FLUX.2 tokenizer whose chat template reaches for Python internals",
        1,
        lambda t: _flux2(t, "{{ ''.__class__.__mro__[1].__subclasses__() }}") + ["--max_sequence_length", "256"],
        "chat_template.jinja) cannot be rendered (SecurityError: access to attribute '__class__'",
    ),
    Case(
        "flux2_train_text_encoder",
        "--train_text_encoder with FLUX.2 (Mistral / Qwen3 text encoders, which diffusers' examples do not train)",
        1,
        lambda t: _flux2(t) + ["--train_text_encoder", "--max_sequence_length", "256"],
        "--train_text_encoder trains FLUX.1's CLIP; FLUX.2 [dev]'s text encoder is not trained",
    ),
    Case(
        "train_text_encoder_full_finetune",
        "--train_text_encoder with --full_finetune",
        1,
        lambda t: ["--train_text_encoder", "--full_finetune"],
        "--train_text_encoder trains a CLIP LoRA written into the LoRA file; --full_finetune writes a transformer",
        flags_only=True,
    ),
    Case(
        "train_text_encoder_kohya",
        "--train_text_encoder with --lora_format kohya",
        1,
        lambda t: ["--train_text_encoder", "--lora_format", "kohya"],
        "--train_text_encoder with --lora_format kohya: the kohya layout written here holds the transformer's LoRA",
        flags_only=True,
    ),
    Case(
        "ema_decay_one",
        "--use_ema --ema_decay 1 (the average would never move)",
        1,
        lambda t: ["--use_ema", "--ema_decay", "1"],
        "--ema_decay 1 is out of range: it must be > 0 and < 1",
        flags_only=True,
    ),
    Case(
        "ema_update_interval_zero",
        "--use_ema --ema_update_interval 0",
        1,
        lambda t: ["--use_ema", "--ema_update_interval", "0"],
        "--ema_update_interval 0 is out of range: it must be >= 1",
        flags_only=True,
    ),
    Case(
        "model_class_with_terminal_escapes",
        "a model_index.json whose class name holds terminal escape sequences",
        1,
        _model_of_escaped_classes,
        "is a \\x1b[2J\\x1b[31mEvilPipeline with a OtherTransformer; flux-cp trains",
    ),
    Case(
        "output_dir_empty",
        '--output_dir "" (it was the current folder)',
        1,
        lambda t: ["--output_dir", ""],
        "--output_dir is empty: give a path, or leave the flag out for its default",
        flags_only=True,
    ),
    Case(
        "resolution_not_multiple_of_16",
        "--resolution 100",
        1,
        lambda t: ["--resolution", "100"],
        "--resolution 100 must be a multiple of 16",
        flags_only=True,
    ),
    Case(
        "missing_data_folder",
        "a data folder that does not exist",
        1,
        lambda t: ["--dataset_name", str(t / "no" / "such" / "folder")],
        "no such folder",
        flags_only=True,
    ),
    Case(
        "images_without_captions",
        "images with no metadata.jsonl, no .txt and no --instance_prompt",
        1,
        lambda t: ["--dataset_name", str(_images(t / "data", captions=False))],
        "have no caption",
    ),
    Case(
        "missing_caption_column",
        "metadata.jsonl without the --caption_column",
        1,
        lambda t: ["--dataset_name", str(_images(t / "data", column="caption"))],
        "has no caption column 'text'",
    ),
    Case("unreadable_image", "a file named .png that is not an image", 1, _garbage_image, "cannot read image"),
    Case(
        "empty_data_folder",
        "an empty data folder",
        1,
        lambda t: (t / "empty").mkdir(parents=True) or ["--dataset_name", str(t / "empty")],
        "no images",
    ),
    Case(
        "batch_larger_than_data",
        "a global batch larger than the data set",
        1,
        lambda t: ["--train_batch_size", "100"],
        "no global batch can be formed",
    ),
    Case(
        "missing_resume_folder",
        "--resume_from_checkpoint of a folder that does not exist",
        1,
        lambda t: ["--resume_from_checkpoint", str(t / "nope")],
        "no such checkpoint folder",
        flags_only=True,
    ),
    Case(
        "missing_bare_checkpoint_name",
        "--resume_from_checkpoint checkpoint-9, a bare name that is a folder neither here nor in --output_dir",
        1,
        lambda t: ["--resume_from_checkpoint", "checkpoint-9"],
        "--resume_from_checkpoint checkpoint-9: no such checkpoint folder (tried ",
        flags_only=True,
    ),
    Case(
        "resume_with_another_seed",
        "a checkpoint of --seed 5 resumed with the default seed (every draw is keyed by it)",
        1,
        _another_seed,
        "comes from an incompatible run (seed: checkpoint 5, now 0)",
    ),
    Case(
        "resume_with_another_cut_of_the_global_batch",
        "a checkpoint of --train_batch_size 2 resumed with --train_batch_size 1 --gradient_accumulation_steps 2",
        1,
        _batch_cut_into_micro_steps,
        "(micro-steps per optimizer step (--gradient_accumulation_steps): checkpoint 1, now 2). The samples, noise "
        "and timesteps of a step are drawn per micro-step, so another global batch or another cut of it into "
        "micro-steps trains on other draws. To continue it as it was, resume with --train_batch_size 2 "
        "--gradient_accumulation_steps 1 --cp_size 1 on 1 process",
    ),
    Case(
        "resume_folder_not_a_checkpoint",
        "--resume_from_checkpoint of a folder without meta.json",
        1,
        _not_a_checkpoint,
        "is not a complete checkpoint (no meta.json)",
    ),
    Case(
        "resume_checkpoint_damaged",
        "--resume_from_checkpoint latest whose state/.metadata was truncated",
        1,
        _truncated_metadata,
        "checkpoint-2: state/.metadata is damaged (40 bytes, ",
    ),
    Case(
        "resume_incompatible_run",
        "resuming a checkpoint written with another LoRA rank",
        1,
        _foreign_checkpoint,
        "comes from an incompatible run",
    ),
    Case(
        "corrupt_seed_checkpoint",
        "a --seed_checkpoint file that is not safetensors",
        1,
        _corrupt_seed,
        "cannot be read",
    ),
    Case(
        "seed_checkpoint_is_a_folder",
        "--seed_checkpoint naming a folder",
        1,
        lambda t: (t / "seeds").mkdir(parents=True) or ["--seed_checkpoint", str(t / "seeds")],
        "is a folder: name a file in it",
    ),
    Case(
        "foreign_seed_checkpoint",
        "a --seed_checkpoint written for other weights",
        1,
        _foreign_seed,
        "was written for other trainable weights",
    ),
    Case(
        "config_file_unknown_key",
        "a misspelt flag in a --config file",
        1,
        lambda t: _config_file(t, "learnig_rate: 1e-4\n"),
        "run.yaml: unknown flag 'learnig_rate': did you mean learning_rate?",
        flags_only=True,
    ),
    Case(
        "config_file_bad_choice",
        "a value of a --config file that is not one of the flag's choices",
        1,
        lambda t: _config_file(t, "train:\n  lr_scheduler: cosin\n"),
        'run.yaml: lr_scheduler is "cosin", not one of linear, cosine, cosine_with_restarts, polynomial, constant, '
        "constant_with_warmup: did you mean cosine?",
        flags_only=True,
    ),
    Case(
        "network_weights_other_rank",
        "--network_weights naming a LoRA file of another rank than --rank",
        1,
        lambda t: ["--network_weights", str(_lora_file(t / "lora", 4)), "--rank", "8"],
        "holds LoRAs of rank 4, this run's --rank is 8: pass --rank 4 --lora_alpha 4 as the file has them",
    ),
    Case(
        "network_weights_full_finetune",
        "--network_weights with --full_finetune",
        1,
        lambda t: ["--network_weights", str(_lora_file(t / "lora", 4)), "--full_finetune"],
        "--network_weights starts a LoRA from a LoRA file; --full_finetune trains every weight and no LoRA",
        flags_only=True,
    ),
    Case(
        "kohya_layout_images_beside_the_folders",
        "a data folder in kohya's layout (N_name sub-folders) with images beside the sub-folders",
        1,
        _kohya_images_beside,
        "image(s) beside them (e.g. stray.png), which kohya does not read: move them into a sub-folder",
    ),
    Case(
        "unknown_lora_layers",
        "--lora_layers naming no module",
        1,
        lambda t: ["--lora_layers", "attn.to_zz"],
        "--lora_layers ['attn.to_zz'] match no module",
    ),
    Case(
        "missing_model",
        "a model folder that does not exist",
        1,
        lambda t: ["--pretrained_model_name_or_path", str(t / "no_model")],
        "cannot load transformer from --pretrained_model_name_or_path",
    ),
    Case(
        "non_positive_timeout",
        "--collective_timeout 0",
        1,
        lambda t: ["--collective_timeout", "0"],
        "--collective_timeout 0 is out of range: it must be > 0",
        flags_only=True,
    ),
    Case(
        "earlier_run_in_output_dir",
        "an output folder holding another run, without --resume_from_checkpoint or --overwrite_output_dir",
        1,
        _earlier_run,
        "holds an earlier run (checkpoint-2, metrics.jsonl): pass --resume_from_checkpoint latest to continue it, "
        "--overwrite_output_dir to replace it",
    ),
    Case(
        "overwrite_and_resume_latest",
        "--overwrite_output_dir with --resume_from_checkpoint latest",
        1,
        lambda t: _earlier_run(t) + ["--overwrite_output_dir", "--resume_from_checkpoint", "latest"],
        "--overwrite_output_dir would delete the checkpoint --resume_from_checkpoint latest resumes from",
    ),
    Case("output_dir_is_a_file", "--output_dir naming a file", 1, _output_file, "is a file, not a folder"),
    Case("output_dir_unwritable", "--output_dir that cannot be created", 1, _unwritable_output, "cannot be written"),
    Case(
        "disk_too_small",
        "an output disk smaller than one checkpoint and the final model (FLUX_CP_DISK_BYTES=100000)",
        1,
        lambda t: [],
        "KiB free, but this run needs",
        env={"FLUX_CP_DISK_BYTES": "100000"},
    ),
    Case(
        "hub_id_not_reachable",
        "a hub data set id that cannot be loaded (offline)",
        1,
        lambda t: ["--dataset_name", "someone/no-such-dataset"],
        "--dataset_name someone/no-such-dataset is not a local folder, and datasets cannot load it from the hub",
    ),
    Case(
        "metadata_names_a_missing_image",
        "a metadata.jsonl line whose file_name is not in the folder",
        1,
        _metadata_names_missing_image,
        "metadata.jsonl line 4: file_name 'gone.png' does not exist in",
    ),
    Case("caption_not_utf8", "a .txt caption in Latin-1", 1, _caption_not_utf8, "is not UTF-8 text (byte 0xe9"),
    Case("null_caption", "a metadata.jsonl caption that is null", 1, _null_caption, "'text' is null, not a string"),
    Case(
        "learning_rate_zero",
        "--learning_rate 0 (the LoRA would never change)",
        1,
        lambda t: ["--learning_rate", "0"],
        "--learning_rate 0 is out of range: it must be > 0",
        flags_only=True,
    ),
    Case(
        "lora_alpha_zero",
        "--lora_alpha 0 (LoRA's output scaled by 0)",
        1,
        lambda t: ["--lora_alpha", "0"],
        "--lora_alpha 0 is out of range: it must be > 0",
        flags_only=True,
    ),
    Case(
        "lora_dropout_one",
        "--lora_dropout 1 (every LoRA input dropped)",
        1,
        lambda t: ["--lora_dropout", "1"],
        "--lora_dropout 1 is out of range",
        flags_only=True,
    ),
    Case(
        "adam_beta_out_of_range",
        "--adam_beta2 1.5 (torch.optim would raise)",
        1,
        lambda t: ["--adam_beta2", "1.5"],
        "--adam_beta2 1.5 is out of range: it must be >= 0 and < 1",
        flags_only=True,
    ),
    Case(
        "kontext_row_without_reference",
        "FLUX.1 Kontext pairs: a metadata.jsonl row without its reference image",
        1,
        lambda t: ["--dataset_name", str(_pairs(t / "pairs", lambda rows: rows[2].pop("reference_file_name")))],
        "line 3 (02_black_triangle_edited.png) has no reference image 'reference_file_name'",
    ),
    Case(
        "kontext_unreadable_reference",
        "FLUX.1 Kontext pairs: a reference image that is not an image",
        1,
        _garbage_reference,
        "cannot read reference image",
    ),
    Case(
        "kontext_unknown_reference_column",
        "FLUX.1 Kontext pairs: --cond_image_column naming a column the data does not have",
        1,
        lambda t: ["--dataset_name", str(_pairs(t / "pairs")), "--cond_image_column", "source"],
        "--cond_image_column source: no row of",
    ),
    Case(
        "validation_image_without_pairs",
        "--validation_image (a Kontext reference) for data without reference images",
        1,
        lambda t: [
            "--validation_image",
            str(_images(t / "data", n=1) / "00_white_circle.png"),
            "--validation_prompt",
            "red",
        ],  # fmt: skip
        "--validation_image is the reference image FLUX.1 Kontext validation edits",
        flags_only=True,
    ),
    Case(
        "output_dir_is_the_model_folder",
        "--output_dir naming the model folder, with --overwrite_output_dir --full_finetune",
        1,
        _output_dir_is_the_model,
        "is the folder of --pretrained_model_name_or_path",
    ),
    Case(
        "output_dir_inside_the_data_folder",
        "--output_dir inside the data folder (the next run would train on its validation images)",
        1,
        _output_dir_inside_the_data,
        "is inside --dataset_name",
    ),
    Case(
        "resume_latest_in_a_finished_run_without_checkpoints",
        "--resume_from_checkpoint latest in a folder whose run finished and whose checkpoints were deleted",
        1,
        _finished_run_without_checkpoints,
        "but no checkpoint to resume: starting it again from step 0 would replace it",
    ),
    Case(
        "resume_another_runs_checkpoint_into_a_used_folder",
        "--resume_from_checkpoint of another folder's checkpoint, with an --output_dir holding a run",
        1,
        _checkpoint_of_another_run,
        "resuming it there would mix two runs in one folder",
    ),
    Case(
        "resume_beyond_max_train_steps",
        "resuming checkpoint-4 with --max_train_steps 2",
        1,
        _checkpoint_beyond_the_steps,
        "is at step 4, beyond the 2 steps of this run (--max_train_steps)",
    ),
    Case(
        "lock_file_is_a_link",
        "a .flux_cp.lock in the output folder that is a symbolic link to another file",
        1,
        _lock_is_a_link,
        ".flux_cp.lock cannot be opened",
    ),
    Case(
        "dangling_image_link",
        "an image that is a symbolic link to a file not fetched (git-annex, DVC)",
        1,
        _dangling_link,
        "not_fetched.png is a symbolic link to",
    ),
    Case(
        "metadata_line_not_an_object",
        "a metadata.jsonl line that is a number, not an object",
        1,
        _not_an_object,
        "metadata.jsonl line 4 is a JSON int, not an object",
    ),
    Case(
        "kontext_reference_outside_the_folder",
        "FLUX.1 Kontext pairs: a reference image named outside the folder (../)",
        1,
        _reference_outside,
        "line 2: reference_file_name '../",
    ),
    Case(
        "reference_list_empty",
        "pairs: a metadata.jsonl row whose reference list is empty",
        1,
        lambda t: ["--dataset_name", str(_pairs(t / "pairs", lambda rows: rows[1].update(reference_file_name=[])))],
        "line 2: reference_file_name is an empty list: name one or more images",
    ),
    Case(
        "reference_list_not_a_string",
        "pairs: a reference list holding a number",
        1,
        lambda t: _reference_list(t, 3),
        "line 2: reference_file_name[1] is 3, not a path relative to",
    ),
    Case(
        "reference_list_outside_the_folder",
        "pairs: a reference list naming an image outside the folder (../)",
        1,
        lambda t: _reference_list(t, "../01_green_square.png"),
        "line 2: reference_file_name[1] '../01_green_square.png' must be a path inside",
    ),
    Case(
        "kontext_several_references",
        "FLUX.1 Kontext pairs: a row listing two reference images (FLUX.2 takes several)",
        1,
        lambda t: _reference_list(t, "02_white_triangle.png"),
        "line 2 (reference_file_name) names 2 reference images, but FLUX.1 Kontext takes one per target",
    ),
    Case(
        "kontext_several_validation_images",
        "FLUX.1 Kontext: --validation_image given twice",
        1,
        _two_validation_images,
        "--validation_image is given 2 times, but FLUX.1 Kontext edits one reference image",
    ),
    Case(
        "wandb_without_login",
        "--report_to wandb without a wandb login (no WANDB_API_KEY, no netrc entry)",
        1,
        lambda t: ["--report_to", "wandb"],
        "--report_to wandb: no wandb login found",
        env={
            "WANDB_API_KEY": "",
            "WANDB_MODE": "",
            "NETRC": "/nonexistent/netrc",
            "WANDB_CONFIG_DIR": "/nonexistent",
            "WANDB_DIR": "/nonexistent",
        },  # fmt: skip
        flags_only=True,
    ),
    Case(
        "push_to_hub_offline",
        "--push_to_hub with HF_HUB_OFFLINE=1 (the upload at the end could not happen)",
        1,
        lambda t: ["--push_to_hub"],
        "--push_to_hub with HF_HUB_OFFLINE set: the upload at the end could not reach the Hub",
        env={"HF_HUB_OFFLINE": "1", "HF_TOKEN": "x"},
        flags_only=True,
    ),
    Case(
        "flux_cp_home_is_a_file",
        "FLUX_CP_HOME naming a file",
        1,
        lambda t: [],
        "FLUX_CP_HOME=/dev/null names a file, not a folder",
        env={"FLUX_CP_HOME": "/dev/null"},
        flags_only=True,
    ),
    Case(
        "disk_bytes_not_a_whole_number",
        "FLUX_CP_DISK_BYTES=1e9",
        1,
        lambda t: [],
        "FLUX_CP_DISK_BYTES='1e9' is not a whole number of bytes",
        env={"FLUX_CP_DISK_BYTES": "1e9"},
        flags_only=True,
    ),
    Case(
        "fault_of_unknown_kind",
        "FLUX_CP_FAULT with an unknown kind",
        1,
        lambda t: [],
        "FLUX_CP_FAULT='rank=0,step=2,kind=explode': kind must be one of raise, exit",
        env={"FLUX_CP_FAULT": "rank=0,step=2,kind=explode"},
        flags_only=True,
    ),
    Case(
        "fault_with_a_bad_step",
        "FLUX_CP_FAULT with a step that is not a number",
        1,
        lambda t: [],
        "FLUX_CP_FAULT='rank=0,step=two,kind=raise': step must be a whole number >= 1",
        env={"FLUX_CP_FAULT": "rank=0,step=two,kind=raise"},
        flags_only=True,
    ),
    Case(
        "dataset_and_instance_data_dir",
        "--dataset_name and --instance_data_dir both given",
        1,
        lambda t: ["--dataset_name", str(_images(t / "a")), "--instance_data_dir", str(_images(t / "b"))],
        "--dataset_name and --instance_data_dir both name the training data: give one of them",
        flags_only=True,
    ),
    Case(
        "instance_data_dir_missing",
        "--instance_data_dir naming no folder",
        1,
        lambda t: ["--instance_data_dir", str(t / "photos")],
        "no such folder (a hub data set goes to --dataset_name)",
        flags_only=True,
    ),
    Case(
        "prior_without_class_prompt",
        "--with_prior_preservation without --class_prompt",
        1,
        lambda t: ["--with_prior_preservation", "--class_data_dir", str(t / "class")],
        "--with_prior_preservation needs --class_prompt (the prompt of the class images)",
        flags_only=True,
    ),
    Case(
        "caption_dropout_above_one",
        "a caption dropout that is no probability",
        1,
        lambda t: ["--caption_dropout", "1.5"],
        "--caption_dropout 1.5 is out of range: it must be >= 0 and <= 1 (a probability)",
        flags_only=True,
    ),
    Case(
        "prior_preservation_with_pairs",
        "--with_prior_preservation on FLUX.1 Kontext pairs",
        1,
        lambda t: [
            "--dataset_name",
            str(_pairs(t / "pairs")),
            "--with_prior_preservation",
            "--class_data_dir",
            str(t / "class"),
            "--class_prompt",
            "a circle",
        ],  # fmt: skip
        "pair data (a reference image per target) has no class images to pair them with",
    ),
    Case(
        "class_data_dir_inside_output_dir",
        "--class_data_dir inside --output_dir",
        1,
        lambda t: [
            "--with_prior_preservation",
            "--class_data_dir",
            str(_images(t / "out" / "class")),
            "--class_prompt",
            "a shape",
        ],  # fmt: skip
        "is inside --output_dir",
    ),
    Case(
        "class_data_dir_is_the_new_output_dir",
        "--class_data_dir and --output_dir the same folder, before it exists",
        1,
        lambda t: [
            "--with_prior_preservation",
            "--class_data_dir",
            str(t / "x"),
            "--class_prompt",
            "a shape",
            "--output_dir",
            str(t / "x"),
        ],
        "--class_data_dir {t}/x is --output_dir {t}/x: the class images need a folder of their own",
    ),
    Case(
        "output_dir_in_flux_cp_s_own_files",
        "--output_dir inside the flux-cp checkout's own code",
        1,
        lambda t: ["--output_dir", str(CHECKOUT / "cp" / "run")],
        "is inside {checkout}/cp, one of flux-cp's own files",
    ),
    Case(
        "output_dir_in_pip_s_cache",
        "--output_dir inside pip's cache",
        1,
        lambda t: ["--output_dir", str(t / "pip" / "run")],
        "--output_dir {t}/pip/run is inside pip's cache",
        env={"PIP_CACHE_DIR": "{t}/pip"},
    ),
    Case(
        "output_dir_inside_another_model",
        "--output_dir inside a model folder other than the one trained (by its model_index.json)",
        1,
        lambda t: ["--output_dir", str(_model_folder(t) / "lora")],
        "is inside a model folder",
    ),
    Case(
        "negative_attention_heads",
        "a transformer config with num_attention_heads -4",
        1,
        lambda t: _edited_model(t, "transformer", {"num_attention_heads": -4}),
        "edited/transformer/config.json: num_attention_heads is -4; it must be an integer from 1 to 240",
    ),
    Case(
        "zero_attention_head_dim",
        "a transformer config with attention_head_dim 0",
        1,
        lambda t: _edited_model(t, "transformer", {"attention_head_dim": 0}),
        "edited/transformer/config.json: attention_head_dim is 0; it must be an integer from 1",
    ),
    Case(
        "negative_vae_channels",
        "a VAE config with latent_channels -4",
        1,
        lambda t: _edited_model(t, "vae", {"latent_channels": -4}),
        "edited/vae/config.json: latent_channels is -4; it must be an integer from 1",
    ),
    Case(
        "truncated_transformer_weights",
        "a transformer weight file cut short (an interrupted download)",
        1,
        _truncated_weights,
        "diffusion_pytorch_model.safetensors is not a whole safetensors file",
    ),
    Case(
        "demo_checkpoint_of_odd_types",
        "a resumed demo run whose checkpoint's meta.json holds a learning rate that is no number",
        1,
        _demo_checkpoint_of_odd_types,
        "meta.json's args.learning_rate is 'fast', not a value of --learning_rate",
        flags_only=True,
    ),
    Case(
        "model_index_not_an_object",
        "a model folder whose model_index.json is a JSON list",
        1,
        lambda t: ["--pretrained_model_name_or_path", str(_listed_model_index(t))],
        "its model_index.json is a JSON list, not an object of settings",
    ),
    Case(
        "text_encoder_config_of_a_wrong_type",
        "a text encoder config.json with a setting of the wrong type (hidden_act 5)",
        1,
        lambda t: _edited_model(t, "text_encoder", {"hidden_act": 5}),
        "cannot load text_encoder from --pretrained_model_name_or_path",
    ),
    Case(
        "class_data_dir_is_instance_data_dir",
        "--class_data_dir naming the training images' folder",
        1,
        lambda t: [
            "--instance_data_dir",
            str(_images(t / "dog")),
            "--with_prior_preservation",
            "--class_data_dir",
            str(t / "dog"),
            "--class_prompt",
            "a dog",
        ],  # fmt: skip
        "is --instance_data_dir",
    ),
    Case(
        "class_data_dir_is_the_bundled_data",
        "--class_data_dir naming the bundled data set (generated images would go into it)",
        1,
        lambda t: ["--with_prior_preservation", "--class_data_dir", str(BUNDLED_DATA), "--class_prompt", "a shape"],
        "is the bundled data set",
    ),
    Case(
        "class_data_dir_is_another_runs_output",
        "--class_data_dir naming another run's output folder",
        1,
        lambda t: [
            "--with_prior_preservation",
            "--class_data_dir",
            str(_other_run(t / "earlier")),
            "--class_prompt",
            "a shape",
        ],  # fmt: skip
        "is the output folder of another run",
    ),
    Case(
        "resume_with_more_class_images",
        "a resume asking for more class images than its checkpoint trained with",
        1,
        _more_class_images,
        "was trained with 3 class images, and this run asks for --num_class_images 5: resume with --num_class_images 3",
    ),
    Case(
        "logging_dir_names_a_run_output",
        "--logging_dir naming one of the run's own outputs (run_config.json)",
        1,
        lambda t: ["--report_to", "tensorboard", "--logging_dir", "run_config.json"],
        "--logging_dir run_config.json names run_config.json, one of the run's own outputs",
    ),
    Case(
        "logging_dir_is_encodings_dir",
        "--logging_dir naming the encoding cache",
        1,
        lambda t: ["--report_to", "tensorboard", "--logging_dir", str(t / "cache")],
        "is --encodings_dir",
    ),
    Case(
        "encodings_dir_inside_logging_dir",
        "--encodings_dir inside the tracker folder (removed with it)",
        1,
        lambda t: ["--report_to", "tensorboard", "--encodings_dir", str(t / "out" / "logs" / "cache")],
        "--logging_dir logs holds --encodings_dir",
    ),
    Case(
        "disk_full_while_saving",
        "the disk fills up while a checkpoint is written (ENOSPC injected)",
        2,
        lambda t: ["--cp_size", "2", "--max_train_steps", "4", "--checkpointing_steps", "2"],
        "No space left on device",
        env={"FLUX_CP_FAULT": "rank=0,step=4,kind=enospc_in_save"},
    ),
]
