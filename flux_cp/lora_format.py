"""LoRA files for other tools: diffusers' keys with alphas, and the kohya / BFL layout.

- `diffusers` (default): `transformer.<module>.lora_A/lora_B.weight`, as `FluxPipeline.save_lora_weights`
  writes, plus `transformer.<module>.alpha` when `--lora_alpha` differs from `--rank`. diffusers and ComfyUI
  both read these keys (ComfyUI maps `transformer.<diffusers module>` for Flux and applies `alpha / rank`);
  without the alpha keys both would apply the LoRA at scale 1. FLUX.2's LoRA loader (`Flux2Pipeline`) refuses
  alpha keys, and ComfyUI reads no other alpha: a FLUX.2 file carries `alpha / rank` multiplied into lora_B
  (`alpha_keys=False`), the same weight update at scale 1, with adapter metadata of `lora_alpha` = rank.
- `kohya`: `lora_unet_<BFL module>.lora_down/lora_up.weight` + `.alpha`, the layout of kohya's sd-scripts and
  of the original FLUX.1 checkpoints, which ComfyUI, Forge and most LoRA tools load, and diffusers converts.
  BFL fuses q/k/v (double blocks) and q/k/v/mlp (single blocks) into one linear: our separate LoRAs become
  one LoRA of the summed rank whose up matrix is block-diagonal, which is exactly the same weight update.
  `alpha / rank` is multiplied into the up matrices and `.alpha` equals each LoRA's rank (scale 1), since
  loaders differ in how they treat alphas (diffusers' converter ignores those of the final layer).
  diffusers' `load_lora_weights` converts this layout too, but drops LoRAs on the top-level modules
  (x_embedder, context_embedder, time_text_embed, proj_out, norm_out), splits single-block linear1 with
  FLUX.1's sizes and knows FLUX.1's 19 + 38 blocks only: `kohya_problem` names such LoRAs so that a run asking
  for this format refuses them at start (`check_export`) instead of writing a file diffusers cannot read back.

Metadata (the safetensors header, `metadata()`): the diffusers file carries diffusers' adapter metadata (the
peft LoraConfig, under `lora_adapter_metadata` with the `transformer.` prefix, as `FluxPipeline.save_lora_weights`
writes it given `transformer_lora_adapter_metadata`), from which `load_lora_weights` builds the adapter (rank,
alpha, targets) instead of guessing them from the keys, and the base model. diffusers refuses a file with both
adapter metadata and alpha keys ("Both `network_alphas` and `metadata` cannot be specified"), and ComfyUI reads
alphas only from the keys: a LoRA whose alpha differs from its rank keeps its alpha keys and goes without the
adapter metadata (diffusers then derives rank, alpha and targets from the keys); a FLUX.2 one has the scale in
its weights and keeps the metadata. The kohya file carries the fields kohya's sd-scripts writes for FLUX.1 LoRAs
and kohya-format readers show (`ss_network_module`, `ss_network_dim`, `ss_network_alpha`,
`ss_base_model_version`, `ss_sd_model_name`, `modelspec.*`).
"""

from __future__ import annotations

import datetime
import json
import os
import re
from dataclasses import dataclass

import torch

from .config import LORA_FORMATS as FORMATS

Tensor = torch.Tensor

# diffusers.loaders.lora_base.LORA_ADAPTER_METADATA_KEY: where load_lora_weights looks for the adapter's config.
LORA_ADAPTER_METADATA_KEY = "lora_adapter_metadata"

# diffusers module -> BFL module (a module of a fused BFL linear is one of its slots, below).
_DOUBLE = {
    "attn.to_out.0": "img_attn_proj",
    "attn.to_add_out": "txt_attn_proj",
    "ff.net.0.proj": "img_mlp_0",
    "ff.net.2": "img_mlp_2",
    "ff_context.net.0.proj": "txt_mlp_0",
    "ff_context.net.2": "txt_mlp_2",
    "norm1.linear": "img_mod_lin",
    "norm1_context.linear": "txt_mod_lin",
}
_DOUBLE_FUSED = {
    "img_attn_qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "txt_attn_qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
}
_SINGLE = {"proj_out": "linear2", "norm.linear": "modulation_lin"}
_SINGLE_FUSED = {"linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp")}
_GLOBAL = {
    "x_embedder": "img_in",
    "context_embedder": "txt_in",
    "time_text_embed.timestep_embedder.linear_1": "time_in_in_layer",
    "time_text_embed.timestep_embedder.linear_2": "time_in_out_layer",
    "time_text_embed.text_embedder.linear_1": "vector_in_in_layer",
    "time_text_embed.text_embedder.linear_2": "vector_in_out_layer",
    "time_text_embed.guidance_embedder.linear_1": "guidance_in_in_layer",
    "time_text_embed.guidance_embedder.linear_2": "guidance_in_out_layer",
    "proj_out": "final_layer_linear",
    "norm_out.linear": "final_layer_adaLN_modulation_1",
}
_KEY = re.compile(r"^transformer\.(.+)\.lora_([AB])\.weight$")
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


def _modules(state: dict[str, Tensor]) -> dict[str, dict[str, Tensor]]:
    """{diffusers module: {"A": lora_A, "B": lora_B}} of a diffusers-format Flux LoRA state dict."""
    out: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        m = _KEY.match(key)
        if not m:
            raise ValueError(f"not a diffusers Flux LoRA key: {key!r} (expected transformer.<module>.lora_A/B.weight)")
        out.setdefault(m.group(1), {})[m.group(2)] = value
    return out


def with_alphas(state: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """The diffusers-format state dict, with `<module>.alpha` keys when `alpha != rank` (see the module doc)."""
    if alpha == rank:
        return dict(state)
    out = dict(state)
    for module in _modules(state):
        out[f"transformer.{module}.alpha"] = torch.tensor(float(alpha))
    return out


def with_scale(state: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """The diffusers-format state dict with the scale `alpha / rank` multiplied into every lora_B, for loaders that
    take no alpha keys (FLUX.2: see the module doc): the same weight update at scale 1."""
    if alpha == rank:
        return dict(state)
    scale = alpha / rank
    return {k: v * scale if k.endswith(".lora_B.weight") else v for k, v in state.items()}


def _swap_scale_shift(up: Tensor) -> Tensor:
    # diffusers' norm_out.linear emits [scale, shift]; BFL's final adaLN emits [shift, scale].
    scale, shift = up.chunk(2, dim=0)
    return torch.cat([shift, scale], dim=0)


def _fused(parts: list[dict[str, Tensor] | None], out_dims: list[int], scale: float) -> dict[str, Tensor]:
    """One LoRA for a fused linear from the LoRAs of its slots (None: slot without LoRA)."""
    present = [p for p in parts if p is not None]
    down = torch.cat([p["A"] for p in present], dim=0)
    up = down.new_zeros(sum(out_dims), down.shape[0])
    row = col = 0
    for p, dim in zip(parts, out_dims):
        if p is not None:
            r = p["A"].shape[0]
            up[row : row + dim, col : col + r] = p["B"]
            col += r
        row += dim
    return {"lora_down.weight": down, "lora_up.weight": up * scale, "alpha": torch.tensor(float(down.shape[0]))}


def to_kohya(state: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """Convert a diffusers-format Flux LoRA (peft `lora_alpha=alpha`, `r=rank`) to the kohya / BFL layout."""
    scale = alpha / rank
    modules = _modules(state)
    blocks: dict[tuple[str, int], dict[str, dict[str, Tensor]]] = {}
    out: dict[str, Tensor] = {}

    def put(name: str, tensors: dict[str, Tensor]) -> None:
        for suffix, t in tensors.items():
            out[f"lora_unet_{name}.{suffix}"] = t.contiguous()

    def single(lora: dict[str, Tensor], swap: bool = False) -> dict[str, Tensor]:
        up = (_swap_scale_shift(lora["B"]) if swap else lora["B"]) * scale
        return {"lora_down.weight": lora["A"], "lora_up.weight": up, "alpha": torch.tensor(float(lora["A"].shape[0]))}

    for module, lora in modules.items():
        m = _BLOCK.match(module)
        if m:
            blocks.setdefault((m.group(1), int(m.group(2))), {})[m.group(3)] = lora
        elif module in _GLOBAL:
            put(_GLOBAL[module], single(lora, swap=module == "norm_out.linear"))
        else:
            raise ValueError(f"the kohya layout has no place for a LoRA on {module!r}; use --lora_format diffusers")
    for (kind, i), inner in sorted(blocks.items()):
        prefix = f"double_blocks_{i}_" if kind == "transformer_blocks" else f"single_blocks_{i}_"
        plain, fused = (_DOUBLE, _DOUBLE_FUSED) if kind == "transformer_blocks" else (_SINGLE, _SINGLE_FUSED)
        used = set()
        for name, slots in fused.items():
            parts = [inner.get(s) for s in slots]
            if not any(parts):
                continue
            # q/k/v each output `hidden` features; a single block's mlp part 4 x hidden (Flux's mlp ratio).
            qkv = [inner[s]["B"].shape[0] for s in slots[:3] if s in inner]
            hidden = qkv[0] if qkv else inner["proj_mlp"]["B"].shape[0] // 4
            dims = [inner[s]["B"].shape[0] if s in inner else hidden * (4 if s == "proj_mlp" else 1) for s in slots]
            put(prefix + name, _fused(parts, dims, scale))
            used.update(s for s in slots if s in inner)
        for module, lora in inner.items():
            if module in used:
                continue
            if module not in plain:
                raise ValueError(
                    f"the kohya layout has no place for a LoRA on {kind}.{i}.{module}; use --lora_format diffusers"
                )
            put(prefix + plain[module], single(lora))
    return out


def convert(state: dict[str, Tensor], fmt: str, rank: int, alpha: float, alpha_keys: bool = True) -> dict[str, Tensor]:
    """A diffusers-format Flux LoRA state dict (keys `transformer.<module>.lora_A/B.weight`) in format `fmt`.
    `alpha_keys=False` (FLUX.2): the diffusers format carries `alpha / rank` in lora_B instead of alpha keys."""
    if fmt == "diffusers":
        return with_alphas(state, rank, alpha) if alpha_keys else with_scale(state, rank, alpha)
    if fmt == "kohya":
        return to_kohya(state, rank, alpha)
    raise ValueError(f"unknown LoRA format {fmt!r}; choose one of {', '.join(FORMATS)}")


# --- what ComfyUI skips in FLUX.2 files ------------------------------------------------------------------------

# FLUX.2 layers whose diffusers names ComfyUI's Flux LoRA mapping (comfy/utils.py `flux_to_diffusers`, which ComfyUI
# applies to FLUX.2 too) does not list: it logs their LoRAs "lora key not loaded" and leaves them out. Every other
# linear layer of Flux2Transformer2DModel it maps (tests/test_lora_format.py checks this list against its rules).
FLUX2_COMFYUI_UNMAPPED = (
    "time_guidance_embed.timestep_embedder.linear_1", "time_guidance_embed.timestep_embedder.linear_2",
    "time_guidance_embed.guidance_embedder.linear_1", "time_guidance_embed.guidance_embedder.linear_2",
    "double_stream_modulation_img.linear", "double_stream_modulation_txt.linear", "single_stream_modulation.linear",
)  # fmt: skip


def comfyui_skips(targets: list[str] | tuple[str, ...]) -> list[str]:
    """The layers of FLUX2_COMFYUI_UNMAPPED that the LoRA targets `targets` (peft's suffix rule) put LoRAs on."""
    return [n for n in FLUX2_COMFYUI_UNMAPPED if any(n == t or n.endswith("." + t) for t in targets)]


# --- what diffusers' kohya loader reads back -------------------------------------------------------------------

# diffusers' `_convert_kohya_flux_lora_to_diffusers` (0.42.1) walks FLUX.1's 19 double and 38 single blocks and
# splits a single block's linear1 into q/k/v/mlp with FLUX.1's sizes; it names the top-level layers without the
# `transformer.` prefix, so `load_lora_weights` drops them without a word.
_DIFFUSERS_KOHYA_BLOCKS = {"transformer_blocks": 19, "single_transformer_blocks": 38}
_FLUX1_HIDDEN = 3072


def _pattern(module: str) -> str:
    return re.sub(r"^(transformer_blocks|single_transformer_blocks)\.\d+\.", r"\1.*.", module)


def _listed(modules: list[str]) -> str:
    patterns = sorted(dict.fromkeys(_pattern(m) for m in modules))
    return ", ".join(patterns[:6]) + (f" and {len(patterns) - 6} more" if len(patterns) > 6 else "")


def kohya_problem(modules: list[str], config: dict) -> str | None:
    """Why diffusers could not read back a kohya file holding LoRAs on `modules` (diffusers names) of a Flux
    transformer with `config`, or None when it can."""
    top, beyond, fused, homeless = [], [], [], []
    hidden = config["num_attention_heads"] * config["attention_head_dim"]
    for module in modules:
        m = _BLOCK.match(module)
        if m is None:
            (top if module in _GLOBAL else homeless).append(module)
            continue
        kind, i, inner = m.group(1), int(m.group(2)), m.group(3)
        plain, slots = (_DOUBLE, _DOUBLE_FUSED) if kind == "transformer_blocks" else (_SINGLE, _SINGLE_FUSED)
        if inner not in plain and not any(inner in s for s in slots.values()):
            homeless.append(module)
        elif i >= _DIFFUSERS_KOHYA_BLOCKS[kind]:
            beyond.append(module)
        elif kind == "single_transformer_blocks" and inner not in plain and hidden != _FLUX1_HIDDEN:
            fused.append(module)
    if homeless:
        return f"the kohya layout has no place for LoRAs on {_listed(homeless)}"
    if top:
        return (
            f"diffusers' kohya loader drops LoRAs on top-level layers ({_listed(top)}), so it would not read back "
            "those of this file"
        )
    if beyond:
        return f"diffusers' kohya loader knows FLUX.1's 19 double and 38 single blocks only, not {_listed(beyond)}"
    if fused:
        return (
            f"diffusers' kohya loader splits a single block's fused linear1 with FLUX.1's sizes (3 x {_FLUX1_HIDDEN} + "
            f"{4 * _FLUX1_HIDDEN}), not this model's (3 x {hidden} + {4 * hidden}), so it could not read back the "
            f"LoRAs on {_listed(fused)}"
        )
    return None


def lora_modules(config: dict, targets: list[str]) -> list[str]:
    """The linear layers of a Flux transformer with `config` that peft gives LoRAs for `targets` (module-name
    suffixes, peft's rule for a list), found on the meta device (nothing allocated)."""
    from diffusers import FluxTransformer2DModel

    with torch.device("meta"):
        model = FluxTransformer2DModel.from_config(config)
    return [
        name
        for name, module in model.named_modules()
        if isinstance(module, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
    ]


def check_export(config: dict, lora) -> None:
    """At start (flags and the transformer's config only): a UsageError when `--lora_format kohya` would write a
    file diffusers cannot read back completely. `lora` is the run's LoraConfig."""
    from .errors import UsageError

    if lora.full_finetune or lora.lora_format != "kohya":
        return
    problem = kohya_problem(lora_modules(config, list(lora.lora_layers)), config)
    if problem:
        # The same flags and config on every rank: every rank raises it alike.
        raise UsageError(
            f"--lora_format kohya: {problem}; use --lora_format diffusers (ComfyUI loads it too), or leave those "
            "layers out of --lora_layers",
            agreed=True,
        )


# --- metadata ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Origin:
    """Where a LoRA comes from, for its file's metadata."""

    base_model: str | None  # --pretrained_model_name_or_path (hub id or folder); None: the embedded tiny Flux
    title: str  # the run's name (its output folder's)
    resolution: int
    kontext: bool = False  # trained on FLUX.1 Kontext pairs


# The LoraConfig fields diffusers needs to rebuild the adapter. diffusers passes the metadata to LoraConfig(**...),
# and a peft release that lacks one of the fields a newer one writes would refuse the file: keep to these.
_ADAPTER_FIELDS = ("r", "lora_alpha", "target_modules", "lora_dropout", "init_lora_weights", "bias", "use_dora",
                   "use_rslora", "rank_pattern", "alpha_pattern", "base_model_name_or_path")  # fmt: skip


def adapter_metadata(peft_config: dict, base_model: str | None) -> dict:
    """diffusers' adapter metadata from a peft LoraConfig's `to_dict()`, with the base model."""
    out = {k: peft_config[k] for k in _ADAPTER_FIELDS if k in peft_config}
    out["base_model_name_or_path"] = base_model
    return {k: sorted(v) if isinstance(v, set) else v for k, v in out.items()}


def _model_name(base_model: str) -> str:
    # kohya's sd-scripts names a local base model by its file or folder name, a hub id as it is
    return os.path.basename(os.path.normpath(base_model)) if os.path.exists(base_model) else base_model


def metadata(
    fmt: str,
    *,
    rank: int,
    alpha: float,
    adapter: dict | None,
    origin: Origin | None,
    guidance: bool,
    alpha_keys: bool = True,
) -> dict[str, str]:
    """The safetensors header metadata of a LoRA file in format `fmt` (see the module doc). `adapter`: diffusers'
    adapter metadata (`adapter_metadata`); `guidance`: the transformer has a guidance embedding (FLUX.1 [dev]);
    `alpha_keys`: as `convert`'s (False: the scale is in lora_B, and the adapter's alpha is its rank)."""
    out = {"format": "pt"}  # what diffusers' save_lora_weights writes
    if fmt == "diffusers":
        if adapter is not None and not alpha_keys:
            adapter = {**adapter, "lora_alpha": rank}
        if adapter is not None and (alpha == rank or not alpha_keys):  # (alpha keys otherwise: see the module doc)
            packed = {f"transformer.{k}": v for k, v in adapter.items()}
            out[LORA_ADAPTER_METADATA_KEY] = json.dumps(packed, indent=2, sort_keys=True)
        if origin is not None and origin.base_model:
            out["base_model"] = origin.base_model
        return out
    # kohya: the fields sd-scripts' train_network.py / flux_train_network.py write (library/sai_model_spec.py)
    out.update({"ss_network_module": "networks.lora_flux", "ss_network_dim": str(rank), "ss_network_alpha": str(alpha),
                "ss_base_model_version": "flux1"})  # fmt: skip
    if origin is not None:
        if origin.base_model:
            out["ss_sd_model_name"] = _model_name(origin.base_model)
        variant = "flux-1" if origin.kontext else ("flux-1-dev" if guidance else "flux-1-schnell")
        out.update({
            "modelspec.sai_model_spec": "1.0.1",
            "modelspec.architecture": f"{variant}/lora",
            "modelspec.implementation": "https://github.com/black-forest-labs/flux",
            "modelspec.title": origin.title,
            "modelspec.resolution": f"{origin.resolution}x{origin.resolution}",
            "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
        })  # fmt: skip
    return out
