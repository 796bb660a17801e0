"""FLUX.1 LoRAs in kohya's / BFL's layout (`--lora_format kohya`): `lora_unet_<BFL module>.lora_down/lora_up.weight`
+ `.alpha`, the layout of kohya's sd-scripts and of the original FLUX.1 checkpoints, which ComfyUI, Forge and most
LoRA tools load, and diffusers converts. BFL fuses q/k/v (double blocks) and q/k/v/mlp (single blocks) into one
linear: our separate LoRAs become one LoRA of the summed rank whose up matrix is block-diagonal, which is exactly the
same weight update. `alpha / rank` is multiplied into the up matrices and `.alpha` equals each LoRA's rank (scale 1),
since loaders differ in how they treat alphas (diffusers' converter ignores those of the final layer).

diffusers' `load_lora_weights` converts this layout too, but drops LoRAs on the top-level modules (x_embedder,
context_embedder, time_text_embed, proj_out, norm_out), splits single-block linear1 with FLUX.1's sizes and knows
FLUX.1's 19 + 38 blocks only: `kohya_problem` names such LoRAs so that a run asking for this format refuses them at
start (`check_export`) instead of writing a file diffusers cannot read back. The file's metadata are the fields
kohya's sd-scripts writes for FLUX.1 LoRAs and kohya-format readers show (`ss_network_module`, `ss_network_dim`,
`ss_network_alpha`, `ss_base_model_version`, `ss_sd_model_name`, `modelspec.*`).
"""

from __future__ import annotations

import datetime
import os
import re

import torch

from flux_cp.errors import UsageError
from flux_cp.families.lora_format import Origin, lora_modules_of

Tensor = torch.Tensor

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
_BLOCK = re.compile(r"^(transformer_blocks|single_transformer_blocks)\.(\d+)\.(.+)$")


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
    modules = lora_modules_of(state)
    if any("magnitude" in lora for lora in modules.values()):  # refused at start (config.training.check_adapter)
        raise ValueError("the kohya layout holds no DoRA magnitudes; use --lora_format diffusers")
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


def _model_name(base_model: str) -> str:
    # kohya's sd-scripts names a local base model by its file or folder name, a hub id as it is
    return os.path.basename(os.path.normpath(base_model)) if os.path.exists(base_model) else base_model


def metadata(*, rank: int, alpha: float, origin: Origin | None, guidance: bool) -> dict[str, str]:
    """The safetensors header metadata of a kohya file (`guidance`: the transformer has a guidance embedding, FLUX.1
    [dev])."""
    out = {"format": "pt"}
    # the fields sd-scripts' train_network.py / flux_train_network.py write (library/sai_model_spec.py)
    out |= {
        "ss_network_module": "networks.lora_flux",
        "ss_network_dim": str(rank),
        "ss_network_alpha": str(alpha),
        "ss_base_model_version": "flux1",
    }
    if origin is not None:
        if origin.base_model:
            out["ss_sd_model_name"] = _model_name(origin.base_model)
        variant = "flux-1" if origin.pairs else ("flux-1-dev" if guidance else "flux-1-schnell")
        out |= {
            "modelspec.sai_model_spec": "1.0.1",
            "modelspec.architecture": f"{variant}/lora",
            "modelspec.implementation": "https://github.com/black-forest-labs/flux",
            "modelspec.title": origin.title,
            "modelspec.resolution": f"{origin.resolution}x{origin.resolution}",
            "modelspec.date": datetime.datetime.now().replace(microsecond=0).isoformat(),
        }
    return out


# --- reading a kohya file back (--network_weights) ----------------------------------------------------------------

_KOHYA_KEY = re.compile(r"^lora_unet_(.+)\.(lora_down\.weight|lora_up\.weight|alpha)$")
_KOHYA_BLOCK = re.compile(r"^(double|single)_blocks_(\d+)_(.+)$")


def _diffusers_slots(name: str) -> tuple[str, tuple[str, ...]]:
    """(diffusers prefix, the diffusers modules of its slots in row order) of the BFL module `name` (kohya's name
    without `lora_unet_`); one slot for an unfused linear. A ValueError for a name of no FLUX.1 layer."""
    m = _KOHYA_BLOCK.match(name)
    if m is None:
        glob = {v: k for k, v in _GLOBAL.items()}
        if name not in glob:
            raise ValueError(f"lora_unet_{name} names no FLUX.1 layer")
        return "", (glob[name],)
    kind, i, inner = m.groups()
    prefix = f"transformer_blocks.{i}." if kind == "double" else f"single_transformer_blocks.{i}."
    plain, fused = (_DOUBLE, _DOUBLE_FUSED) if kind == "double" else (_SINGLE, _SINGLE_FUSED)
    if inner in fused:
        return prefix, fused[inner]
    glob = {v: k for k, v in plain.items()}
    if inner not in glob:
        raise ValueError(f"lora_unet_{name} names no FLUX.1 layer")
    return prefix, (glob[inner],)


def from_kohya(
    state: dict[str, Tensor], linears: dict[str, tuple[int, int]], trained: set[str], rank: int
) -> tuple[dict[str, tuple[Tensor, Tensor]], dict[str, float]]:
    """The LoRAs of a kohya / BFL-layout FLUX.1 file `state` as diffusers modules: ({module: (lora_A, lora_B)},
    {module: the file's scale alpha / rank there}), for a transformer whose linear layers are `linears` ({diffusers
    module: (out, in)}) and of which the run trains `trained` at `rank`. A fused linear (q/k/v; a single block's
    q/k/v/mlp) holds either one LoRA shared by its slots (kohya's sd-scripts: every slot gets its down matrix and its
    rows of the up matrix) or, as `to_kohya` writes, one LoRA per slot (a block-diagonal up matrix, `rank` columns a
    slot). Slots whose rows are zero and that the run does not train are left out; any other is returned, for the
    caller to compare with what the run trains. A ValueError names what cannot be read."""
    parts: dict[str, dict[str, Tensor]] = {}
    for key, value in state.items():
        m = _KOHYA_KEY.match(key)
        if m is None:
            raise ValueError(f"{key!r} is not a LoRA weight of kohya's layout (lora_unet_<layer>.lora_down/lora_up)")
        parts.setdefault(m.group(1), {})[m.group(2)] = value
    modules: dict[str, tuple[Tensor, Tensor]] = {}
    scales: dict[str, float] = {}
    for name, p in sorted(parts.items()):
        if "lora_down.weight" not in p or "lora_up.weight" not in p:
            raise ValueError(f"lora_unet_{name} lacks its lora_down or lora_up weight")
        down, up = p["lora_down.weight"], p["lora_up.weight"]
        r = down.shape[0]
        scale = float(p["alpha"]) / r if "alpha" in p else 1.0  # no alpha: kohya's default, alpha = rank
        prefix, slots = _diffusers_slots(name)
        full = [prefix + s for s in slots]
        if full == ["norm_out.linear"]:
            up = _swap_scale_shift(up)  # its own inverse: BFL's [shift, scale] back to diffusers' [scale, shift]
        if len(full) == 1:
            modules[full[0]], scales[full[0]] = (down, up), scale
            continue
        missing = [f for f in full if f not in linears]
        if missing:
            raise ValueError(f"lora_unet_{name}: this model has no {', '.join(missing)}")
        dims = [linears[f][0] for f in full]
        if sum(dims) != up.shape[0]:
            raise ValueError(
                f"lora_unet_{name} has {up.shape[0]} output rows; this model's {'+'.join(full)} have {sum(dims)}"
            )
        rows = list(up.split(dims, dim=0))
        present = [j for j, f in enumerate(full) if f in trained]
        if r == rank or not present:  # one LoRA shared by the slots (kohya's sd-scripts)
            for j, f in enumerate(full):
                if j in present or rows[j].any():
                    modules[f], scales[f] = (down, rows[j].contiguous()), scale
            continue
        if r != len(present) * rank:
            raise ValueError(
                f"lora_unet_{name} has rank {r}: neither --rank {rank} (one LoRA for {'/'.join(slots)}, as kohya "
                f"trains) nor {len(present)} x {rank} (one for each of them, as flux-cp writes)"
            )
        for k, j in enumerate(present):  # one LoRA per slot: slot j's columns, its rows; nothing beside them
            cols = slice(k * rank, (k + 1) * rank)
            beside = torch.cat([rows[j][:, : cols.start], rows[j][:, cols.stop :]], dim=1)
            if beside.any():
                raise ValueError(f"lora_unet_{name}: its up matrix is not one LoRA per layer of {'/'.join(slots)}")
            modules[full[j]], scales[full[j]] = (down[cols].contiguous(), rows[j][:, cols].contiguous()), scale
        others = [full[j] for j in range(len(full)) if j not in present and rows[j].any()]
        if others:
            raise ValueError(f"lora_unet_{name} holds a LoRA on {', '.join(others)}, which this run does not train")
    return modules, scales
