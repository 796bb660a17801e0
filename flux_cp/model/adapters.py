"""The adapter a run trains on `--lora_layers` (`--adapter`), each through peft: LoRA, DoRA
(`LoraConfig(use_dora=True)`: LoRA plus a trained magnitude per output feature) or LoKr (`LoKrConfig`: the update is
a Kronecker product of two small factors). What each needs of the other flags, how its file is written and loaded.

Exact under CP as LoRA is: every one is a function of its weights alone (DoRA's norm of the adapted weight per output
feature, LoKr's Kronecker product) applied to each token on its own, so every rank of a CP group computes the same
weight update and its gradients sum over the ranks' tokens as LoRA's do (tests/test_train_adapters.py). Under FSDP2
peft's layers read the base weight inside the block's forward, where FSDP2 has gathered it (tests/test_adapters.py).

Files, `--lora_format diffusers` (the only layout that holds them):
- DoRA: diffusers' LoRA keys plus `transformer.<module>.lora_magnitude_vector` (what `get_peft_model_state_dict`
  gives), which `load_lora_weights` reads as DoRA (diffusers' `get_peft_kwargs`: use_dora from those keys, or from the
  adapter metadata). ComfyUI, kohya and LyCORIS call DoRA's magnitude `dora_scale` and ComfyUI divides by the norm of
  the base weight per output feature where peft divides by that of the adapted weight: no file of theirs holds
  peft's DoRA, so `--lora_format kohya` is refused, and ComfyUI would leave the magnitudes out of this file.
- LoKr: `transformer.<module>.lokr_w1` and `lokr_w2` (or `lokr_w2_a` / `lokr_w2_b` where peft factors w2 at
  `--rank`), peft's scale alpha / rank multiplied into `lokr_w1` (the product is linear in each factor), no alpha
  keys: diffusers' LoKr loader (`transformer.load_lora_adapter`; FLUX.2's `load_lora_weights` too) reads such a file
  at scale 1, and so does ComfyUI, which maps these diffusers module names (`transformer.<module>`, q/k/v as rows of
  BFL's fused linear) and applies `kron(w1, w2)` at scale 1 to a LoKr without alpha keys. FLUX.1's
  `load_lora_weights` reads LoRA keys only: the model card's snippet loads a LoKr with `load_lora_adapter`. The
  kohya / BFL layout fuses q, k and v into one linear, whose update separate Kronecker products of the three are
  not: `--lora_format kohya` is refused.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from flux_cp.config.fields import ADAPTER_LABELS

if TYPE_CHECKING:
    from flux_cp.config.training import LoraConfig

Tensor = torch.Tensor

LABELS = ADAPTER_LABELS
# Name parts of the trainable parameters peft adds, by adapter (DoRA's magnitude is `lora_magnitude_vector`).
PARAMETER_PARTS = ("lora_", "lokr_")


def label(adapter: str) -> str:
    """The adapter's name for people: LoRA, DoRA, LoKr."""
    return LABELS[adapter]


def peft_config(adapter: str, rank: int, alpha: float, dropout: float, targets: list[str]):
    """peft's config of `adapter` on the modules `targets` (peft's suffix rule). LoRA's and DoRA's B start at zero
    and A Gaussian (as diffusers' examples: `init_lora_weights="gaussian"`); LoKr's w1 starts at zero (peft's
    default), so every adapter starts as the base model."""
    if adapter == "lokr":
        from peft import LoKrConfig  # peft at first use (its import takes seconds)

        return LoKrConfig(r=rank, alpha=alpha, target_modules=targets)
    from peft import LoraConfig as PeftLoraConfig

    return PeftLoraConfig(
        r=rank,
        lora_alpha=alpha,
        lora_dropout=dropout,
        init_lora_weights="gaussian",
        target_modules=targets,
        use_dora=adapter == "dora",
    )


def is_adapter_parameter(name: str) -> bool:
    """Whether the parameter `name` is one that peft added for an adapter (LoRA's, DoRA's or LoKr's)."""
    return any(part in name for part in PARAMETER_PARTS)


def lokr_weights(state: dict[str, Tensor], rank: int, alpha: float) -> dict[str, Tensor]:
    """peft's LoKr state dict (`get_peft_model_state_dict`'s keys with the `transformer.` prefix) as the file holds
    it (see the module doc): peft's scale alpha / rank multiplied into each `lokr_w1`."""
    scale = alpha / rank
    out = {}
    for key, value in state.items():
        if key.endswith((".lokr_w1_a", ".lokr_w1_b", ".lokr_t2")):  # not in peft's config written here
            raise ValueError(f"{key}: only LoKr with a whole w1 and a whole or factored w2 is written")
        out[key] = value * scale if key.endswith(".lokr_w1") else value
    return out


def load_line(adapter: str, source: str, weight_name: str) -> str:
    """The snippet's line that loads the file `weight_name` of `source` (Python that names a folder or Hub
    repository: a variable of the snippet, or a literal) into `pipe`."""
    if adapter == "lokr":  # FLUX.1's load_lora_weights reads LoRA keys only; the model's loader reads LoKr
        return f'pipe.transformer.load_lora_adapter({source}, weight_name={weight_name!r}, prefix="transformer")'
    return f"pipe.load_lora_weights({source}, weight_name={weight_name!r})"


def start_line(lora: LoraConfig) -> str | None:
    """What the log says at the start of a DoRA or LoKr run (None for LoRA and full fine-tuning)."""
    if lora.full_finetune or lora.adapter == "lora":
        return None
    how = {"dora": "LoRA plus a trained magnitude per output feature", "lokr": "a Kronecker product of two factors"}
    loads = (
        "pipe.transformer.load_lora_adapter and ComfyUI load it"
        if lora.adapter == "lokr"
        else "load_lora_weights loads it; ComfyUI would leave its magnitudes out"
    )
    return (
        f"--adapter {lora.adapter}: peft's {label(lora.adapter)} ({how[lora.adapter]}) on --lora_layers, rank "
        f"{lora.rank}, alpha {lora.lora_alpha}; the file is in diffusers' format ({loads})"
    )


def description(adapter: str) -> str | None:
    """What the model card says of a DoRA or LoKr (None for LoRA)."""
    if adapter == "dora":
        return (
            "DoRA: LoRA plus a trained magnitude per output feature (peft's `use_dora`); diffusers' "
            "`load_lora_weights` reads its `lora_magnitude_vector` keys as DoRA"
        )
    if adapter == "lokr":
        return (
            "LoKr: each update the Kronecker product of two small factors (peft's `LoKrConfig`), written with "
            "diffusers' module names (`transformer.<layer>.lokr_w1/lokr_w2`) at scale 1; loaded with the transformer's "
            "`load_lora_adapter`"
        )
    return None


def comfyui(adapter: str, mapping: str) -> str | None:
    """The model card's ComfyUI text for a DoRA or LoKr file (`mapping`: for which models ComfyUI maps diffusers'
    names); None for LoRA (the card's own)."""
    if adapter == "dora":
        return (
            "ComfyUI applies a DoRA magnitude only as LyCORIS' `dora_scale`, normalised by the base weight where peft "
            "normalises by the adapted weight: it would load this file's LoRA part without its magnitudes "
            '("lora key not loaded" for `lora_magnitude_vector`). Use it with diffusers.'
        )
    if adapter == "lokr":
        return (
            "Copy the file into `ComfyUI/models/loras/` and apply it with a *LoraLoaderModelOnly* node: ComfyUI's LoKr "
            f"loader reads its `lokr_w1` / `lokr_w2` keys under diffusers' module names, which it maps for {mapping}."
        )
    return None


# --- memory, for the planner (flux_cp.plan.memory)
# ----------------------------------------------------------------------

_LAYERS: dict[tuple, tuple[tuple[tuple[int, int], ...], ...]] = {}


def adapted_layers(family, config: dict, targets: list[str]) -> tuple[tuple[tuple[int, int], ...], ...]:
    """(in, out) features of the linears peft adapts for `targets` (its suffix rule) in a transformer of `family`
    with `config`: one tuple per block, in the order the blocks run, then one of those outside the blocks. Built on
    the meta device (nothing allocated)."""
    import json

    key = (family.name, json.dumps(config, sort_keys=True), tuple(targets))
    if key not in _LAYERS:
        with torch.device("meta"):
            model = family.transformer_class().from_config(config)
        adapted = {
            id(m): (m.in_features, m.out_features)
            for name, m in model.named_modules()
            if isinstance(m, torch.nn.Linear) and any(name == t or name.endswith("." + t) for t in targets)
        }
        blocks = [
            tuple(adapted.pop(id(m)) for m in block.modules() if id(m) in adapted) for _, block in family.blocks(model)
        ]
        _LAYERS[key] = (*blocks, tuple(adapted.values()))
    return _LAYERS[key]


def kept_bytes(adapter: str, layers: tuple[tuple[int, int], ...], weight_bytes: int) -> int:
    """Bytes a block (or the layers outside the blocks) with these adapted `layers` keeps for its backward beyond
    LoRA's, independent of the tokens: peft's LoKr layer builds its whole update weight and multiplies the input by
    it, which autograd keeps in the compute dtype (`weight_bytes`; tests/test_adapters.py counts it on CPU)."""
    return sum(i * o for i, o in layers) * weight_bytes if adapter == "lokr" else 0


def transient_bytes(adapter: str, layers: tuple[tuple[int, int], ...], weight_bytes: int) -> int:
    """Bytes one adapted layer of `layers` (the largest) holds for a moment in its forward, by peft's code: DoRA builds
    an fp32 identity of its input width (and its copy in the compute dtype) to take B @ A, then the adapted weight
    for its norm; LoKr its fp32 Kronecker product."""
    if adapter == "dora":
        cast = weight_bytes if weight_bytes < 4 else 0
        return max((i * i * (4 + cast) + 2 * i * o * weight_bytes for i, o in layers), default=0)
    if adapter == "lokr":
        return max((i * o * 4 for i, o in layers), default=0)
    return 0
