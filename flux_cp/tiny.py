"""A tiny FLUX.1 built locally: same diffusers layout and component classes as
black-forest-labs/FLUX.1-dev (transformer with guidance embedding, VAE, CLIP + T5 encoders with their
tokenizers, flow-matching scheduler), random weights, tokenizers made from a byte/character vocabulary.
No downloads. Used as the embedded default of `train_flux_cp.py` and by the tests. The Kontext variant has
the same components saved as a `FluxKontextPipeline` (FLUX.1 Kontext [dev] is FLUX.1-dev's transformer
architecture, fed reference-image tokens after the target's).
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import string
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

# Bump when the recipe below changes, so cached copies are rebuilt.
TINY_VERSION = 1

TRANSFORMER_CONFIG = dict(
    patch_size=1,
    in_channels=16,  # 4 latent channels x 2x2 packing
    num_layers=2,
    num_single_layers=2,
    attention_head_dim=16,
    num_attention_heads=4,
    joint_attention_dim=32,
    pooled_projection_dim=32,
    guidance_embeds=True,
    axes_dims_rope=(4, 6, 6),
)


# FLUX.1-dev's transformer config (black-forest-labs/FLUX.1-dev, transformer/config.json).
FLUX1_DEV_TRANSFORMER = dict(
    patch_size=1,
    in_channels=64,
    num_layers=19,
    num_single_layers=38,
    attention_head_dim=128,
    num_attention_heads=24,
    joint_attention_dim=4096,
    pooled_projection_dim=768,
    guidance_embeds=True,
    axes_dims_rope=(16, 56, 56),
)


def tiny_transformer(seed: int = 0, **overrides):
    """A randomly initialised tiny `FluxTransformer2DModel` (fp32)."""
    from diffusers import FluxTransformer2DModel

    config = {**TRANSFORMER_CONFIG, **overrides}
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = FluxTransformer2DModel(**config)
        # diffusers zero-initialises nothing here, but make the output layer non-trivial anyway so that
        # tests see gradients flow through every block.
        torch.nn.init.normal_(model.proj_out.weight, std=0.02)
    return model


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2/CLIP byte-to-printable-character table."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, [chr(c) for c in cs]))


def _clip_tokenizer():
    from transformers import CLIPTokenizer

    chars = list(_bytes_to_unicode().values())
    vocab = {c: i for i, c in enumerate(chars)}
    vocab.update({c + "</w>": len(chars) + i for i, c in enumerate(chars)})
    vocab["<|startoftext|>"] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=77)


def _t5_tokenizer():
    from transformers import T5TokenizerFast

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    for c in string.ascii_letters + string.digits + string.punctuation:
        pieces += [(c, -3.0), ("\u2581" + c, -3.5)]
    return T5TokenizerFast(vocab=pieces, extra_ids=0, model_max_length=512)


def build_tiny_pipeline(
    seed: int = 0,
    clip_dim: int = 32,
    t5_dim: int = 32,
    latent_channels: int | None = None,
    transformer: bool = True,
    kontext: bool = False,
):
    """All components of a tiny FluxPipeline (FluxKontextPipeline with `kontext`), fp32, on CPU. The dims let
    the encoders feed a transformer of another size (the flux1-dev-shapes preset); `transformer=False` leaves
    the transformer out."""
    from diffusers import AutoencoderKL, FlowMatchEulerDiscreteScheduler, FluxKontextPipeline, FluxPipeline
    from transformers import CLIPTextConfig, CLIPTextModel, T5Config, T5EncoderModel

    tokenizer, tokenizer_2 = _clip_tokenizer(), _t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(
            CLIPTextConfig(
                vocab_size=len(tokenizer),
                hidden_size=clip_dim,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=4,
                max_position_embeddings=77,
                projection_dim=clip_dim,
                bos_token_id=tokenizer.bos_token_id,
                eos_token_id=tokenizer.eos_token_id,
                pad_token_id=tokenizer.pad_token_id,
            )
        )
        text_encoder_2 = T5EncoderModel(
            T5Config(
                vocab_size=len(tokenizer_2),
                d_model=t5_dim,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_heads=4,
                relative_attention_num_buckets=8,
                pad_token_id=tokenizer_2.pad_token_id,
                eos_token_id=tokenizer_2.eos_token_id,
                decoder_start_token_id=0,
            )
        )
        # 4 blocks: the same 8x spatial compression as FLUX.1's VAE, so --resolution means the same.
        vae = AutoencoderKL(
            in_channels=3,
            out_channels=3,
            down_block_types=("DownEncoderBlock2D",) * 4,
            up_block_types=("UpDecoderBlock2D",) * 4,
            block_out_channels=(8, 16, 16, 16),
            layers_per_block=1,
            latent_channels=latent_channels or TRANSFORMER_CONFIG["in_channels"] // 4,
            norm_num_groups=4,
            sample_size=128,
            scaling_factor=0.3611,
            shift_factor=0.1159,
            use_quant_conv=False,
            use_post_quant_conv=False,
        )
    transformer = tiny_transformer(seed) if transformer else None
    scheduler = FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )
    return (FluxKontextPipeline if kontext else FluxPipeline)(
        scheduler=scheduler,
        vae=vae,
        text_encoder=text_encoder,
        tokenizer=tokenizer,
        text_encoder_2=text_encoder_2,
        tokenizer_2=tokenizer_2,
        transformer=transformer,
    )


def home() -> Path:
    """Where the tiny models are built: FLUX_CP_HOME, else ~/.cache/flux_cp."""
    return Path(os.environ.get("FLUX_CP_HOME") or os.path.join(os.path.expanduser("~"), ".cache", "flux_cp"))


def default_cache_dir(kontext: bool = False) -> Path:
    return home() / f"tiny-flux{'-kontext' if kontext else ''}-v{TINY_VERSION}"


# Written into every folder build_once makes: which recipe built it. A folder holding it is one this module built
# (reused when the recipe matches); a folder without it is the user's and is never written.
MARKER = ".flux_cp_tiny.json"


@dataclass(frozen=True)
class Recipe:
    """What a built folder holds: the recipe's `name` (with its version), the pipeline class model_index.json
    names and the transformer config it carries (to recognise a copy built before the marker existed)."""

    name: str
    pipeline: str
    transformer: dict


def _json(path: Path) -> object:
    try:
        return json.loads(path.read_text()) if path.is_file() and not path.is_symlink() else None
    except (OSError, ValueError):
        return None


def _plain(value: object) -> object:
    return list(value) if isinstance(value, tuple) else value


def _is_built(path: Path, recipe: Recipe) -> bool:
    """`path` holds the model `recipe` builds: written by build_once (its marker), or by a version before the
    marker (model_index.json and the transformer's config are the recipe's)."""
    if not (path / "model_index.json").is_file():
        return False
    marker = _json(path / MARKER)
    if marker is not None:
        return isinstance(marker, dict) and marker.get("recipe") == recipe.name
    index, config = _json(path / "model_index.json"), _json(path / "transformer" / "config.json")
    return (isinstance(index, dict) and index.get("_class_name") == recipe.pipeline and isinstance(config, dict)
            and all(config.get(k) == _plain(v) for k, v in recipe.transformer.items()))  # fmt: skip


def _check_target(path: Path, recipe: Recipe) -> bool:
    """Whether `path` holds the model already (True), or is new or empty (False, to build); any other folder is
    refused with a UsageError: the builder writes only into a new or empty folder, or one it built before."""
    from .errors import UsageError

    if _is_built(path, recipe):
        return True
    if not os.path.lexists(path):
        return False
    if path.is_symlink() or not path.is_dir():
        raise UsageError(f"--out {path} is {'a link' if path.is_symlink() else 'a file'}: choose a new or empty folder")
    names = sorted(p.name for p in path.iterdir())
    if not names:
        return False
    marker = _json(path / MARKER)
    if isinstance(marker, dict) and (path / "model_index.json").is_file():
        raise UsageError(f"--out {path} holds the model of another recipe ({marker.get('recipe')}, not "
                         f"{recipe.name}): choose another --out")  # fmt: skip
    shown = ", ".join(names[:3]) + (f" and {len(names) - 3} more" if len(names) > 3 else "")
    raise UsageError(f"--out {path} holds files this builder did not write ({shown}): it writes only into a new or "
                     "empty folder, or one it built before; choose another --out")  # fmt: skip


def build_once(path: Path, write: Callable[[Path], None], recipe: Recipe) -> Path:
    """The model folder `path`, written by `write(folder)` unless it holds the model of `recipe` already. Only a
    new or empty folder is written (any other is refused: `_check_target`). Safe when several processes call it at
    once (every rank of a launch does): one builds under a file lock while the others wait and then find the
    finished folder. The build goes to a temporary sibling, which is renamed into place once complete (with the
    marker naming the recipe), so a crash mid-build leaves no half-written folder."""
    path = Path(path)
    if _check_target(path, recipe):
        return path
    path.parent.mkdir(parents=True, exist_ok=True)
    # Opened without following a link (a link named like the lock must not redirect the open) and not truncated.
    lock_path = path.parent / f".{path.name}.lock"
    try:
        fd = os.open(lock_path, os.O_WRONLY | os.O_CREAT | os.O_NOFOLLOW, 0o666)
    except OSError as e:
        from .errors import UsageError

        raise UsageError(
            f"cannot open {lock_path} ({e.strerror or e}): remove it (a link?), or set FLUX_CP_HOME"
        ) from None
    with open(fd, "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _check_target(path, recipe):
            return path
        tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent))
        try:
            write(tmp)
            (tmp / MARKER).write_text(json.dumps({"written_by": "flux_cp.tiny", "recipe": recipe.name}) + "\n")
            from .files import apply_umask

            apply_umask(tmp)
            os.rename(tmp, path)  # replaces an empty folder; a folder filled meanwhile makes it fail
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return path


def ensure_tiny_pipeline(path: str | os.PathLike | None = None, kontext: bool = False) -> Path:
    """Return a folder holding the tiny pipeline (or its Kontext variant) in diffusers layout, building it once."""
    path = Path(path) if path else default_cache_dir(kontext)
    recipe = Recipe(f"tiny-flux1{'-kontext' if kontext else ''}-v{TINY_VERSION}",
                    "FluxKontextPipeline" if kontext else "FluxPipeline", TRANSFORMER_CONFIG)  # fmt: skip
    return build_once(path, lambda tmp: build_tiny_pipeline(kontext=kontext).save_pretrained(tmp), recipe)


def write_flux1_dev_shapes(path: str | os.PathLike, kontext: bool = False) -> Path:
    """A pipeline folder whose transformer/config.json is FLUX.1-dev's (no transformer weights: train with
    `--transformer_init random`), with tiny VAE and text encoders of the matching output sizes (16 latent
    channels, CLIP 768, T5 4096). For benchmarks and equivalence runs at FLUX.1 size without downloads.
    `kontext`: the same folder as a FluxKontextPipeline (FLUX.1 Kontext [dev] has FLUX.1-dev's transformer
    config). Written like the tiny folder (`build_once`): only into a new or empty folder, or one built before."""
    recipe = Recipe(f"flux1-dev-shapes{'-kontext' if kontext else ''}-v{TINY_VERSION}",
                    "FluxKontextPipeline" if kontext else "FluxPipeline", FLUX1_DEV_TRANSFORMER)  # fmt: skip
    return build_once(Path(path), lambda tmp: _write_flux1_dev_shapes(tmp, kontext), recipe)


def _write_flux1_dev_shapes(path: Path, kontext: bool) -> None:
    from diffusers import FluxTransformer2DModel

    from .files import write_json

    pipe = build_tiny_pipeline(clip_dim=768, t5_dim=4096, latent_channels=16, transformer=False)
    for name in ("vae", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2", "scheduler"):
        getattr(pipe, name).save_pretrained(path / name)
    with torch.device("meta"):
        meta = FluxTransformer2DModel(**FLUX1_DEV_TRANSFORMER)
    meta.save_config(path / "transformer")
    index = {
        "_class_name": "FluxKontextPipeline" if kontext else "FluxPipeline",
        "_diffusers_version": __import__("diffusers").__version__,
    }
    for name, obj in [
        ("scheduler", pipe.scheduler),
        ("text_encoder", pipe.text_encoder),
        ("text_encoder_2", pipe.text_encoder_2),
        ("tokenizer", pipe.tokenizer),
        ("tokenizer_2", pipe.tokenizer_2),
        ("vae", pipe.vae),
        ("transformer", meta),
    ]:
        lib = "diffusers" if type(obj).__module__.startswith("diffusers") else "transformers"
        index[name] = [lib, type(obj).__name__]
    write_json(path / "model_index.json", index)


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(description="Build a local Flux pipeline folder (no downloads).")
    p.add_argument(
        "--preset", choices=("tiny", "flux1-dev-shapes", "flux2-dev-shapes", "flux2-klein-shapes"), default="tiny"
    )
    p.add_argument("--out", required=True)
    p.add_argument(
        "--family",
        choices=("flux1", "flux1-kontext", "flux2", "flux2-klein"),
        help="The model family of the folder: FluxPipeline (default), FluxKontextPipeline, Flux2Pipeline or "
        "Flux2KleinPipeline. The flux2 shapes presets imply theirs.",
    )
    p.add_argument("--kontext", action="store_true", help="Save it as a FluxKontextPipeline (FLUX.1 Kontext).")
    a = p.parse_args(argv)
    from .errors import UsageError

    try:
        print(_build(p, a))
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


def _build(p, a) -> Path:
    family = a.family or ("flux1-kontext" if a.kontext else "flux1")
    if a.kontext and family != "flux1-kontext":
        p.error(f"--kontext is --family flux1-kontext; it does not combine with --family {family}")
    if a.preset.startswith("flux2-"):
        implied = "flux2-klein" if a.preset == "flux2-klein-shapes" else "flux2"
        if (a.family or implied) != implied or a.kontext:
            p.error(
                f"--preset {a.preset} builds a {implied} folder; drop --family/--kontext or pass --family {implied}"
            )
        from .tiny_flux2 import write_flux2_shapes

        return write_flux2_shapes(a.out, klein=implied == "flux2-klein")
    if family.startswith("flux2"):
        if a.preset != "tiny":
            shapes = {"flux2": "flux2-dev-shapes", "flux2-klein": "flux2-klein-shapes"}[family]
            p.error(f"--preset {a.preset} is FLUX.1's; for --family {family} use --preset {shapes}")
        from .tiny_flux2 import ensure_tiny_flux2_pipeline

        return ensure_tiny_flux2_pipeline(a.out, klein=family == "flux2-klein")
    if a.preset == "tiny":
        return ensure_tiny_pipeline(a.out, kontext=family == "flux1-kontext")
    return write_flux1_dev_shapes(a.out, kontext=family == "flux1-kontext")


if __name__ == "__main__":
    raise SystemExit(main())
