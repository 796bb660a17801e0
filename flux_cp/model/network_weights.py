"""`--network_weights FILE` (kohya's name): a run whose LoRA starts from an existing LoRA file instead of seeded
random weights; the optimizer and the LR schedule start fresh at step 0 (`--resume_from_checkpoint` continues a
flux-cp checkpoint instead).

The file is in diffusers' layout (`transformer.<module>.lora_A/lora_B.weight`, as flux-cp, diffusers' examples and
ai-toolkit write it) or, for FLUX.1, in kohya's / BFL's (`lora_unet_<layer>.lora_down/lora_up.weight`,
flux_cp/families/flux1/kohya.py). It must hold LoRAs on exactly the layers this run trains (`--lora_layers`), of
`--rank`, at the run's scale `--lora_alpha / --rank` (its alpha keys or adapter metadata; a file without them has
scale 1, as diffusers reads it; flux-cp's kohya and FLUX.2 files carry the scale in lora_B, so alpha = rank there):
anything else is refused at start, naming what differs, before any model loads. Its weights are then copied into the
peft adapters as they are (bit for bit), before DDP or FSDP2 wraps the model, on every rank alike. A text encoder's
LoRA in the file is not used. The file's content is part of the run identity (flux_cp.outputs.resume), so a resume uses
the same file.
"""

from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass

import torch

from flux_cp.errors import UsageError
from flux_cp.families.base import Family, of_model

Tensor = torch.Tensor
_DIFFUSERS = re.compile(r"^transformer\.(.+)\.(lora_A\.weight|lora_B\.weight|alpha)$")
_TEXT_ENCODER = ("text_encoder.", "text_encoder_2.", "lora_te")  # diffusers' and kohya's text-encoder prefixes
_BLOCK = re.compile(r"^[a-z_]+\.\d+\.")  # a block's prefix (transformer_blocks.3.): what --lora_layers leaves out


@dataclass(frozen=True)
class LoraFile:
    """A LoRA file read as diffusers modules: {module: (lora_A, lora_B)} and the file's scale (alpha / rank) on
    each, its layout, and whether it holds a text encoder's LoRA (not used)."""

    path: str
    layout: str
    modules: dict[str, tuple[Tensor, Tensor]]
    scales: dict[str, float]
    text_encoder: bool


def fingerprint(path: str) -> str:
    """The file's content, as the run identity records it."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()[:16]


def _flag(path: str) -> str:
    return f"--network_weights {path}"


def _load(path: str) -> tuple[dict[str, Tensor], dict[str, str]]:
    from safetensors import safe_open

    try:
        with safe_open(path, "pt") as f:
            return {k: f.get_tensor(k) for k in f.keys()}, dict(f.metadata() or {})
    except FileNotFoundError:
        raise UsageError(f"{_flag(path)}: no such file") from None
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for every kind of damage
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise UsageError(f"{_flag(path)} cannot be read as a .safetensors LoRA file: {first}") from None


def _adapter_scale(metadata: dict[str, str]) -> float | None:
    """alpha / r of diffusers' adapter metadata (None: none in the file)."""
    text = metadata.get("lora_adapter_metadata")
    if not text:
        return None
    try:
        adapter = json.loads(text)
        r, alpha = adapter.get("transformer.r"), adapter.get("transformer.lora_alpha")
    except (ValueError, AttributeError):
        return None
    if adapter.get("transformer.rank_pattern") or adapter.get("transformer.alpha_pattern"):
        raise UsageError("per-layer rank or alpha patterns (rank_pattern, alpha_pattern) are not read")
    return alpha / r if r and alpha else None


def _diffusers(state: dict[str, Tensor], metadata: dict[str, str], path: str) -> tuple[dict, dict]:
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        m = _DIFFUSERS.match(key)
        if m is None:
            raise UsageError(
                f"{_flag(path)} holds {key!r}, which is not a LoRA weight of diffusers' layout "
                "(transformer.<layer>.lora_A/lora_B.weight; DoRA and LoKr files are not read)"
            )
        parts.setdefault(m.group(1), {})[m.group(2)] = value
    try:
        default = _adapter_scale(metadata) or 1.0  # neither alpha keys nor metadata: scale 1, as diffusers reads it
    except UsageError as e:
        raise UsageError(f"{_flag(path)}: {e}") from None
    modules, scales = {}, {}
    for module, p in parts.items():
        if "lora_A.weight" not in p or "lora_B.weight" not in p:
            raise UsageError(f"{_flag(path)}: transformer.{module} lacks its lora_A or lora_B weight")
        modules[module] = (p["lora_A.weight"], p["lora_B.weight"])
        rank = p["lora_A.weight"].shape[0]
        scales[module] = float(p["alpha"]) / rank if "alpha" in p else default
    return modules, scales


def read(path: str, family: Family, linears: dict[str, tuple[int, int]], trained: set[str], rank: int) -> LoraFile:
    """The LoRA file at `path` as diffusers modules (a UsageError naming what cannot be read): diffusers' layout, or
    kohya's where `family` reads it (`Family.lora_layouts`, `read_lora_layout`); `linears`, `trained`, `rank`: the
    model's linear layers ({module: (out, in)}), those the run trains, and its rank (what a kohya file's fused layers
    are split by)."""
    state, metadata = _load(path)
    text = {k for k in state if k.startswith(_TEXT_ENCODER)}
    state = {k: v for k, v in state.items() if k not in text}
    kohya = any(k.startswith("lora_unet_") for k in state)
    if not state:
        raise UsageError(f"{_flag(path)} holds no transformer LoRA weights")
    if kohya:
        if "kohya" not in family.lora_layouts:
            raise UsageError(
                f"{_flag(path)} is in kohya's layout (lora_unet_...), which {family.label} does not read: give this "
                "model a LoRA file in diffusers' layout (transformer.<layer>.lora_A/lora_B.weight)"
            )
        try:
            modules, scales = family.read_lora_layout("kohya", state, linears, trained, rank)
        except ValueError as e:
            raise UsageError(f"{_flag(path)}: {e}") from None
    else:
        modules, scales = _diffusers(state, metadata, path)
    return LoraFile(path, "kohya" if kohya else "diffusers", modules, scales, bool(text))


def _layers(names: list[str]) -> str:
    """Names of layers as --lora_layers takes them (each block's prefix left out), comma-separated."""
    return ",".join(sorted({_BLOCK.sub("", n) for n in names}))


def _some(names: set[str]) -> str:
    listed = sorted(names)
    return ", ".join(listed[:3]) + (f" and {len(listed) - 3} more" if len(listed) > 3 else "")


def check(lora_file: LoraFile, linears: dict[str, tuple[int, int]], trained: set[str], rank: int, alpha: float) -> None:
    """The file's LoRAs against the run's: the same layers, `rank`, shapes and scale `alpha / rank`; a UsageError
    naming the first difference and the flags that would match the file."""
    flag, modules = _flag(lora_file.path), lora_file.modules
    extra, missing = set(modules) - trained, trained - set(modules)
    if extra or missing:
        parts = []
        if extra:
            parts.append(f"LoRAs on {len(extra)} layers this run does not train ({_some(extra)})")
        if missing:
            parts.append(f"none on {len(missing)} layers it trains ({_some(missing)})")
        raise UsageError(
            f"{flag} holds {' and '.join(parts)}: give --lora_layers {_layers(list(modules))} as the file has them"
        )
    ranks = sorted({a.shape[0] for a, _ in modules.values()})
    if ranks != [rank]:
        if len(ranks) > 1:
            raise UsageError(f"{flag} holds LoRAs of ranks {', '.join(map(str, ranks))}: a run trains one --rank")
        file_alpha = next(iter(lora_file.scales.values())) * ranks[0]
        raise UsageError(
            f"{flag} holds LoRAs of rank {ranks[0]}, this run's --rank is {rank}: pass --rank {ranks[0]} --lora_alpha "
            f"{file_alpha:g} as the file has them"
        )
    for module, (a, b) in sorted(modules.items()):
        out, into = linears[module]
        if a.shape != (rank, into) or b.shape != (out, rank):
            raise UsageError(
                f"{flag}: {module} holds lora_A {list(a.shape)} and lora_B {list(b.shape)}; this model's layer takes "
                f"[{rank}, {into}] and [{out}, {rank}] (a LoRA of another model)"
            )
    scales = sorted(set(lora_file.scales.values()))
    if len(scales) > 1:
        raise UsageError(f"{flag}: its layers have different alphas (scales {', '.join(f'{s:g}' for s in scales)})")
    if not math.isclose(scales[0], alpha / rank, rel_tol=1e-6):
        raise UsageError(
            f"{flag} applies its LoRA at alpha {scales[0] * rank:g} for rank {rank} (scale {scales[0]:g}), this run at "
            f"--lora_alpha {alpha:g} (scale {alpha / rank:g}): pass --lora_alpha {scales[0] * rank:g}"
        )


def model_layers(
    model: torch.nn.Module, targets: list[str] | None = None
) -> tuple[dict[str, tuple[int, int]], set[str]]:
    """({module: (out, in)} of the model's linear layers, the modules trained): those with a peft LoRA layer, or,
    for a model without adapters (on the meta device, at start), those `targets` name (peft's suffix rule)."""
    linears, trained = {}, set()
    for name, m in model.named_modules():
        if hasattr(m, "lora_A") and hasattr(m, "base_layer"):  # peft's LoRA layer around the linear
            linears[name] = (m.out_features, m.in_features)
            trained.add(name)
        elif isinstance(m, torch.nn.Linear) and not re.search(r"(^|\.)(base_layer|lora_A|lora_B)(\.|$)", name):
            linears[name] = (m.out_features, m.in_features)
            if targets is not None and any(name == t or name.endswith("." + t) for t in targets):
                trained.add(name)
    return linears, trained


def check_start(lora, family, transformer_config: dict) -> LoraFile:
    """At start, with the model's config only (its layers built on the meta device): the file read and checked
    against the run's LoRA (`lora`: its LoraConfig). Every rank reads the same file: every rank raises alike."""
    cls = family.transformer_class()
    with torch.device("meta"):
        model = cls.from_config(transformer_config)
    linears, trained = model_layers(model, list(lora.lora_layers))
    try:
        lora_file = read(lora.network_weights, family, linears, trained, lora.rank)
        check(lora_file, linears, trained, lora.rank, lora.lora_alpha)
    except UsageError as e:
        raise UsageError(str(e), agreed=True) from None
    return lora_file


def apply(transformer: torch.nn.Module, lora) -> str:
    """Copy the file's LoRA into the transformer's peft adapters (before any wrapping); the line to log."""
    linears, trained = model_layers(transformer)
    lora_file = read(lora.network_weights, of_model(transformer), linears, trained, lora.rank)
    check(lora_file, linears, trained, lora.rank, lora.lora_alpha)
    trainable = {n for n, p in transformer.named_parameters() if p.requires_grad}
    filled = set()
    with torch.no_grad():
        for module, (a, b) in lora_file.modules.items():
            layer = transformer.get_submodule(module)
            for which, value in (("lora_A", a), ("lora_B", b)):
                adapters = getattr(layer, which)
                if len(adapters) != 1:
                    raise UsageError(f"{_flag(lora_file.path)}: {module} has {len(adapters)} adapters, not one")
                ((adapter, linear),) = adapters.items()
                linear.weight.copy_(value.to(linear.weight.device, linear.weight.dtype))
                filled.add(f"{module}.{which}.{adapter}.weight")
    left = trainable - filled
    if left:
        raise UsageError(
            f"{_flag(lora_file.path)}: this run's adapters have weights a LoRA file does not hold ({_some(left)}): "
            "--network_weights starts LoRA adapters only"
        )
    a = next(iter(lora_file.scales.values())) * lora.rank
    text = "; its text encoder's LoRA is not used" if lora_file.text_encoder else ""
    return (
        f"LoRA weights from {lora_file.path} ({lora_file.layout} layout, {len(lora_file.modules)} layers, rank "
        f"{lora.rank}, alpha {a:g}): training starts from them at step 0, with a new optimizer and LR schedule{text}"
    )
