"""LoRA files for other tools: diffusers' keys with alphas, and the kohya / BFL layout.

- `diffusers` (default): `transformer.<module>.lora_A/lora_B.weight`, as `FluxPipeline.save_lora_weights`
  writes, plus `transformer.<module>.alpha` when `--lora_alpha` differs from `--rank`. diffusers and ComfyUI
  both read these keys (ComfyUI maps `transformer.<diffusers module>` for Flux and applies `alpha / rank`);
  without the alpha keys both would apply the LoRA at scale 1.
- `kohya`: `lora_unet_<BFL module>.lora_down/lora_up.weight` + `.alpha`, the layout of kohya's sd-scripts and
  of the original FLUX.1 checkpoints, which ComfyUI, Forge and most LoRA tools load, and diffusers converts.
  BFL fuses q/k/v (double blocks) and q/k/v/mlp (single blocks) into one linear: our separate LoRAs become
  one LoRA of the summed rank whose up matrix is block-diagonal, which is exactly the same weight update.
  `alpha / rank` is multiplied into the up matrices and `.alpha` equals each LoRA's rank (scale 1), since
  loaders differ in how they treat alphas (diffusers' converter ignores those of the final layer).
  diffusers' `load_lora_weights` converts this layout too, but drops LoRAs on the top-level modules
  (x_embedder, context_embedder, time_text_embed, proj_out, norm_out), and splits single-block linear1 with
  FLUX.1's sizes: for diffusers keep the `diffusers` format.
"""

from __future__ import annotations

import re

import torch

Tensor = torch.Tensor

FORMATS = ("diffusers", "kohya")

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


def convert(state: dict[str, Tensor], fmt: str, rank: int, alpha: float) -> dict[str, Tensor]:
    """A diffusers-format Flux LoRA state dict (keys `transformer.<module>.lora_A/B.weight`) in format `fmt`."""
    if fmt == "diffusers":
        return with_alphas(state, rank, alpha)
    if fmt == "kohya":
        return to_kohya(state, rank, alpha)
    raise ValueError(f"unknown LoRA format {fmt!r}; choose one of {', '.join(FORMATS)}")
