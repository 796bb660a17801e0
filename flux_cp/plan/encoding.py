"""The encoding phase's and the validation decode's memory on the accelerator, from the components' configs, and what
`--text_encoder_offload` and `--vae_tiling` resolve to (`auto`: from the GPU's memory, or --gpu_memory_gib).

The encoding phase holds one component at a time (flux_cp.placement), so its peak is the largest of: each text
encoder's weights (or, streamed, its largest layer) with its activations for TEXT_BATCH captions at
--max_sequence_length, and the VAE's weights with its activations encoding one image at the largest --resolution.
Validation images decode at --validation_resolution beside the transformer.

Activations are counted in tensors alive at once, in the components' dtype:
- a text encoder: the hidden states it keeps (every layer's for FLUX.2's stacked layers, the last for T5), the
  largest of one layer's attention (q, k, v, and with T5's eager attention its scores in the dtype and in fp32 for
  the softmax, plus the relative position bias kept through the forward) and MLP (three intermediate tensors), and a
  causal language model's logits over its vocabulary (the pipelines call the whole model);
- the VAE: VAE_ENCODE_UNITS / VAE_DECODE_UNITS tensors of its first block's channels at full resolution (counted on
  the CPU with FLUX.1's VAE config at 64-256 px: 5.0 and 6.1 such tensors at the peak, tests/test_encoding_memory.py);
  tiled (diffusers' `use_tiling`), one tile's worth plus the whole image's input or output with the tiles' overlap.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

from flux_cp.errors import UsageError
from flux_cp.families.components import component_folder
from flux_cp.families.encoders import TEXT_BATCH

if TYPE_CHECKING:
    from flux_cp.config.flags import Config
    from flux_cp.shape.run_shape import RunShape

logger = logging.getLogger("flux_cp")

GIB = 2**30
VAE_ENCODE_UNITS = 5.0
VAE_DECODE_UNITS = 6.5
MARGIN = 0.9  # of the GPU's memory a plan may use (as flux_cp.plan.memory)
CHOICES = ("auto", "on", "off")


@dataclass(frozen=True)
class TextEncoderShape:
    """What the memory of one text encoder's forward depends on."""

    label: str  # for people, e.g. "T5-XXL encoder"
    weight_bytes: int
    largest_layer_bytes: int  # what a streamed encoder holds on the accelerator at once
    hidden: int
    intermediate: int
    heads: int
    kept_hidden: int  # hidden states alive at the end: every layer's + the embeddings' with output_hidden_states
    eager_attention: bool  # attention scores materialized (T5's relative position bias)
    vocab_logits: int = 0  # a causal LM's vocabulary (its logits are computed for every token), else 0


@dataclass(frozen=True)
class VaeShape:
    weight_bytes: int
    first_channels: int  # block_out_channels[0]: the full-resolution stage's width
    tile: int  # diffusers' tile_sample_min_size (the config's sample_size), in pixels
    overlap: float = 0.25  # diffusers' tile_overlap_factor


def text_activation_bytes(t: TextEncoderShape, batch: int, tokens: int, dtype_bytes: int) -> int:
    """Activations of one forward of `batch` captions of `tokens` tokens (module doc)."""
    row = batch * tokens
    kept = t.kept_hidden * row * t.hidden * dtype_bytes
    scores = batch * t.heads * tokens * tokens
    attention = 4 * row * t.hidden * dtype_bytes + (scores * (dtype_bytes + 4) if t.eager_attention else 0)
    mlp = 3 * row * t.intermediate * dtype_bytes
    bias = scores * dtype_bytes if t.eager_attention else 0
    logits = row * t.vocab_logits * dtype_bytes
    return kept + max(attention, mlp) + bias + logits


def text_peak_bytes(t: TextEncoderShape, batch: int, tokens: int, dtype_bytes: int, streamed: bool) -> int:
    """The accelerator's bytes while this text encoder encodes: its weights (streamed: its largest layer, twice: one
    arriving while one runs) and its activations."""
    weights = 2 * t.largest_layer_bytes if streamed else t.weight_bytes
    return weights + text_activation_bytes(t, batch, tokens, dtype_bytes)


def vae_activation_bytes(v: VaeShape, width: int, height: int, dtype_bytes: int, decode: bool, tiled: bool) -> int:
    """Activations of the VAE encoding (or decoding) one `width x height` image (module doc)."""
    units = VAE_DECODE_UNITS if decode else VAE_ENCODE_UNITS
    if not tiled or (width <= v.tile and height <= v.tile):
        return int(units * v.first_channels * width * height * dtype_bytes)
    tile = int(units * v.first_channels * v.tile * v.tile * dtype_bytes)
    image = 3 * width * height * dtype_bytes
    return tile + int(2 * image / (1 - v.overlap) ** 2)  # the tiles decoded before they blend, and the image


def vae_peak_bytes(v: VaeShape, width: int, height: int, dtype_bytes: int, decode: bool, tiled: bool) -> int:
    return v.weight_bytes + vae_activation_bytes(v, width, height, dtype_bytes, decode, tiled)


# --- the choices ----------------------------------------------------------------------------------------------


def offload_choice(
    value: str, t: TextEncoderShape, batch: int, tokens: int, dtype_bytes: int, gpu_bytes: float | None
) -> tuple[bool, str]:
    """(streamed, why) for `--text_encoder_offload value`: auto streams a text encoder whose resident peak exceeds
    MARGIN of the GPU's memory (None: no GPU and no --gpu_memory_gib, nothing to fit: resident)."""
    resident = text_peak_bytes(t, batch, tokens, dtype_bytes, streamed=False)
    if value != "auto":
        return value == "on", f"--text_encoder_offload {value}"
    if gpu_bytes is None:
        return False, "auto: no GPU memory to fit"
    fits = resident <= MARGIN * gpu_bytes
    verdict = "fits" if fits else "does not fit"
    return not fits, f"auto: {gib(resident)} resident {verdict} in 90% of {gib(gpu_bytes)}"


def tiling_choice(
    value: str, v: VaeShape, width: int, height: int, dtype_bytes: int, decode: bool, budget_bytes: float | None
) -> tuple[bool, str]:
    """(tiled, why) for `--vae_tiling value` at this size: auto tiles when the untiled pass exceeds `budget_bytes`
    (what the accelerator has for it; None: nothing to fit, untiled)."""
    if value != "auto":
        return value == "on", f"--vae_tiling {value}"
    if budget_bytes is None:
        return False, "auto: no GPU memory to fit"
    whole = vae_peak_bytes(v, width, height, dtype_bytes, decode, tiled=False)
    fits = whole <= budget_bytes
    return not fits, f"auto: untiled {gib(whole)} {'fits' if fits else 'does not fit'} in {gib(max(budget_bytes, 0))}"


def gib(n: float) -> str:
    return f"{n / GIB:.1f} GiB"


# --- shapes of loaded components and of configs ----------------------------------------------------------------


def module_bytes(module) -> int:
    """Bytes of a module's parameters and buffers (tied ones once), on any device, the meta device included."""
    seen, total = set(), 0
    for t in [*module.parameters(), *module.buffers()]:
        if id(t) not in seen:
            seen.add(id(t))
            total += t.numel() * t.element_size()
    return total


def largest_layer_bytes(module) -> int:
    """Bytes of the module's largest repeated layer (an entry of its largest ModuleList) or of its largest leaf
    weight holder: what streaming holds of it at once."""
    import torch

    best = 0
    for m in module.modules():
        if isinstance(m, torch.nn.ModuleList):
            best = max([best, *(module_bytes(layer) for layer in m)])
        elif not list(m.children()):
            best = max(best, module_bytes(m))
    return best


def text_encoder_shape(module) -> TextEncoderShape:
    """The memory shape of a loaded (or meta) T5 encoder, Mistral 3 or Qwen3 model."""
    config = module.config
    text = getattr(config, "text_config", None) or config
    if getattr(config, "model_type", "") == "t5":
        return TextEncoderShape(
            f"T5 encoder ({config.num_layers} layers, d_model {config.d_model})",
            module_bytes(module),
            largest_layer_bytes(module),
            config.d_model,
            config.d_ff,
            config.num_heads,
            kept_hidden=2,
            eager_attention=True,
        )
    if getattr(config, "model_type", "") == "clip_text_model":
        return TextEncoderShape(
            f"CLIP text encoder ({config.num_hidden_layers} layers, hidden {config.hidden_size})",
            module_bytes(module),
            largest_layer_bytes(module),
            config.hidden_size,
            config.intermediate_size,
            config.num_attention_heads,
            kept_hidden=2,
            eager_attention=False,
        )
    name = {"mistral3": "Mistral 3", "qwen3": "Qwen3"}.get(config.model_type, config.model_type)
    return TextEncoderShape(
        f"{name} ({text.num_hidden_layers} layers, hidden {text.hidden_size})",
        module_bytes(module),
        largest_layer_bytes(module),
        text.hidden_size,
        text.intermediate_size,
        text.num_attention_heads,
        kept_hidden=text.num_hidden_layers + 1,
        eager_attention=False,
        vocab_logits=text.vocab_size,
    )


def vae_shape(vae, dtype_bytes: int | None = None) -> VaeShape:
    """The memory shape of a VAE; `dtype_bytes`: its weights counted in that size (default: as they are)."""
    config = vae.config
    weights = module_bytes(vae) if dtype_bytes is None else sum(p.numel() for p in vae.parameters()) * dtype_bytes
    return VaeShape(
        weights,
        config.block_out_channels[0],
        int(getattr(vae, "tile_sample_min_size", 0) or config.sample_size),
        float(getattr(vae, "tile_overlap_factor", 0.25)),
    )


def dtype_size(dtype) -> int:
    import torch

    return torch.empty((), dtype=dtype).element_size()


# --- the plan of a run --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class EncodingPlan:
    """The encoding phase's and the validation decode's planned peaks, and the choices behind them."""

    encoding_bytes: int
    encoding_what: str  # the component that sets the encoding peak
    decode_bytes: int | None  # validation decode's activations and the VAE (None: no validation prompts)
    streamed: dict[str, bool]  # text encoder -> streamed
    tiled_encode: bool
    tiled_decode: bool
    reasons: dict[str, str]  # what each choice rests on

    def lines(self) -> list[str]:
        out = [f"encoding phase: {gib(self.encoding_bytes)} ({self.encoding_what})"]
        if self.decode_bytes is not None:
            out.append(
                f"validation decode: {gib(self.decode_bytes)} (VAE, {'tiled' if self.tiled_decode else 'whole'};"
                " beside the transformer's weights)"
            )
        return out


def encoding_plan(
    texts: dict[str, TextEncoderShape],
    vae: VaeShape,
    *,
    dtype_bytes: int,
    tokens: int,
    resolution: int,
    validation_resolution: int | None,
    offload: str,
    tiling: str,
    gpu_bytes: float | None,
    decode_budget: float | None,
    batch: int,
    trained: tuple[str, ...] = (),
) -> EncodingPlan:
    """The plan of an encoding phase (module doc): `texts` {name: shape} in the order they run, `tokens` per caption,
    square images of `resolution` (the largest) and `validation_resolution` (None: no validation images), the flags'
    values, the GPU's bytes (None: nothing to fit) and what validation's decode may use beside the transformer.
    `trained`: the text encoders trained (--train_text_encoder), never streamed: they run whole every step."""
    streamed, reasons, peaks = {}, {}, []
    for name, t in texts.items():
        if name in trained:
            streamed[name], reasons[name] = False, "--train_text_encoder trains it whole on the accelerator"
        else:
            streamed[name], reasons[name] = offload_choice(offload, t, batch, tokens, dtype_bytes, gpu_bytes)
        peak = text_peak_bytes(t, batch, tokens, dtype_bytes, streamed[name])
        how = ", streamed from host memory" if streamed[name] else ""
        peaks.append((peak, f"{t.label}{how}, {batch} captions x {tokens} tokens"))
    budget = MARGIN * gpu_bytes if gpu_bytes is not None else None
    tiled_encode, reasons["vae encode"] = tiling_choice(tiling, vae, resolution, resolution, dtype_bytes, False, budget)
    peaks.append(
        (
            vae_peak_bytes(vae, resolution, resolution, dtype_bytes, False, tiled_encode),
            f"VAE encoding {resolution} px{', tiled' if tiled_encode else ''}",
        )
    )
    decode, tiled_decode = None, False
    if validation_resolution is not None:
        r = validation_resolution
        tiled_decode, reasons["vae decode"] = tiling_choice(tiling, vae, r, r, dtype_bytes, True, decode_budget)
        decode = vae_peak_bytes(vae, r, r, dtype_bytes, True, tiled_decode)
    peak, what = max(peaks, key=lambda p: p[0])
    return EncodingPlan(peak, what, decode, streamed, tiled_encode, tiled_decode, reasons)


# --- a run's plan: from the loaded encoders (the trainer) or from the configs alone (--plan) ----------------------


def gpu_bytes_of(cfg: Config, device=None) -> float | None:
    """The memory to fit: --gpu_memory_gib, else the GPU's own, else None (the CPU: nothing to fit)."""
    import torch

    if cfg.plan.gpu_memory_gib is not None:
        return cfg.plan.gpu_memory_gib * GIB
    if torch.cuda.is_available() and (device is None or torch.device(device).type == "cuda"):
        return float(torch.cuda.get_device_properties(device or 0).total_memory)
    return None


def decode_budget(gpu_bytes: float | None, training_fixed: float) -> float | None:
    """What validation's decode may use: MARGIN of the GPU less `training_fixed`, the training's weights, gradients
    and optimizer state (the planner's `Estimate.fixed`), which stay on the accelerator while validation renders."""
    return None if gpu_bytes is None else MARGIN * gpu_bytes - training_fixed


def plan_for(
    cfg: Config,
    texts: dict[str, TextEncoderShape],
    vae: VaeShape,
    dtype_bytes: int,
    gpu_bytes: float | None,
    training_fixed: float,
    trained: tuple[str, ...] = (),
) -> EncodingPlan:
    """The encoding plan of a run of these flags (`training_fixed`: the training's weights, gradients and optimizer
    state, which validation's decode shares the GPU with; `trained`: the text encoders it trains)."""
    v = cfg.validation
    return encoding_plan(
        texts,
        vae,
        dtype_bytes=dtype_bytes,
        tokens=cfg.data.max_sequence_length,
        resolution=cfg.data.largest_resolution,
        validation_resolution=v.validation_resolution if v.validation_prompt else None,
        offload=cfg.model.text_encoder_offload,
        tiling=cfg.model.vae_tiling,
        gpu_bytes=gpu_bytes,
        decode_budget=decode_budget(gpu_bytes, training_fixed),
        batch=TEXT_BATCH,
        trained=trained,
    )


def trained_text_encoders(cfg: Config, family) -> tuple[str, ...]:
    """The text encoders a run trains (--train_text_encoder: the family's)."""
    trained = family.trained_text_encoder if cfg.lora.train_text_encoder else None
    return trained[:1] if trained else ()


def configure(cfg: Config, encoders, device, training_fixed: float, trained: tuple[str, ...] = ()) -> EncodingPlan:
    """Apply the plan to loaded encoders (`Encoders`): stream the text encoders it streams (never one
    in `trained`, which trains whole on the accelerator), set the VAE's tiling for encoding and for decoding, keep
    every component on the accelerator for --no_cache; log the choices and warn when the encoding phase's planned peak
    exceeds the GPU."""
    gpu = gpu_bytes_of(cfg, device)
    texts = {name: text_encoder_shape(m) for name, m in encoders.text_encoders.items()}
    plan = plan_for(cfg, texts, vae_shape(encoders.vae), dtype_size(encoders.dtype), gpu, training_fixed, trained)
    for name, streamed in plan.streamed.items():
        if streamed:
            encoders.placement.stream(name)
        logger.info(
            f"{name}: {'streamed from host memory' if streamed else 'whole on the accelerator when in use'} "
            f"({plan.reasons[name]})"
        )
    encoders.tiled_encode, encoders.tiled_decode = plan.tiled_encode, plan.tiled_decode
    tiling = [f"encoding {'tiled' if plan.tiled_encode else 'whole'} ({plan.reasons['vae encode']})"]
    if "vae decode" in plan.reasons:
        tiling.append(f"validation decode {'tiled' if plan.tiled_decode else 'whole'} ({plan.reasons['vae decode']})")
    logger.info("VAE: " + "; ".join(tiling))
    logger.info(plan.lines()[0].replace("encoding phase: ", "encoding phase: planned peak ", 1))
    if cfg.data.no_cache:  # every batch is encoded beside the training transformer: the components stay there
        encoders.placement.keep_resident()
    elif gpu is not None and plan.encoding_bytes > MARGIN * gpu:
        logger.warning(
            f"warning: the encoding phase's planned peak ({gib(plan.encoding_bytes)}, {plan.encoding_what}) "
            f"exceeds 90% of {gib(gpu)}: expect out-of-memory; use --text_encoder_offload on, --vae_tiling "
            "on, or a lower --max_sequence_length"
        )
    return plan


def plan_from_configs(
    cfg: Config, shape: RunShape, gpu_bytes: float | None, training_fixed: float
) -> EncodingPlan | None:
    """The plan from the components' configs alone, built on the meta device (--plan: no weights read); None when a
    component's config is not on this machine (a hub model not downloaded)."""
    import torch
    from accelerate import init_empty_weights
    from huggingface_hub.errors import StrictDataclassError

    from flux_cp.families.components import cause

    model = cfg.model
    dtype = torch.float32 if cfg.train.mixed_precision == "no" else torch.bfloat16
    built = {}
    for name, cls in shape.family.encoder_classes().items():
        folder = component_folder(shape.model_path, name, model.revision, model.cache_dir)
        if folder is None or not (folder / "config.json").is_file():
            return None
        try:
            with init_empty_weights():
                if hasattr(cls, "config_class"):
                    m = cls._from_config(cls.config_class.from_pretrained(folder), dtype=dtype)
                else:  # the VAE's weights are counted in `dtype` (diffusers warns about a cast)
                    m = cls.from_config(dict(cls.load_config(folder)))
        except (
            OSError,
            ValueError,
            RuntimeError,
            TypeError,
            IndexError,
            KeyError,
            ZeroDivisionError,
            StrictDataclassError,
        ) as e:
            raise UsageError(f"{folder}/config.json: {cls.__name__} cannot be built from it ({cause(e)})") from None
        built[name] = m
    vae = built.pop("vae")
    texts = {name: text_encoder_shape(m) for name, m in built.items()}
    return plan_for(
        cfg,
        texts,
        vae_shape(vae, dtype_size(dtype)),
        dtype_size(dtype),
        gpu_bytes,
        training_fixed,
        trained_text_encoders(cfg, shape.family),
    )
