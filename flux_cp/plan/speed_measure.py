"""The speed model's figures measured on this GPU (flux_cp.plan.speed): what one block of each kind takes at the run's
token count, forward and backward, at each --base_precision asked for (quantized by flux_cp.model.precision as a run
quantizes it, LoRA added by flux_cp.model.loading as a run adds it), eager and compiled (torch.compile of the block, as
flux_cp.model.blocks compiles it); the attention kernel and the block's matrix products alone; host-to-GPU copies from
pinned memory (one block's bytes). The blocks are those of a transformer of the family's config with one block of
each kind and random weights (FLUX.1-dev's: 0.9 GiB in bf16).

From the timings: `matmul_tflops` and `attention_tflops` as measured; the elementwise work per mode as what a bf16
block takes beyond its matrix products and attention; each precision's dequantization as what its block takes beyond
the bf16 one, per quantized weight; the compile time as twice the first call's extra time over both kinds (a run
compiles each kind checkpointed and not). The step outside the blocks, the link between GPUs and what is not
measured (a precision whose package is missing, a mode not asked for) come from the GPU class's figures.

Cached on disk (FLUX_CP_HOME/speed/, else ~/.cache/flux_cp/speed/) by GPU name, torch version, shapes, precisions and
modes: a second --plan, or a run after it, reads the file and says so.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
import os
import re
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch

from flux_cp.families.builder import home
from flux_cp.plan import speed

GIB = 2**30
VERSION = 2  # of the cache's format and of what is measured: a change measures again (2: calls back to back)


def cache_dir() -> Path:
    return home() / "speed"


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"


@dataclasses.dataclass(frozen=True)
class Request:
    """What a plan needs measured: the family's blocks at this token count, these precisions and modes."""

    family: object  # flux_cp.families.Family
    config: dict  # the transformer's config
    tokens: int  # per sample on a rank (image + text)
    text_tokens: int
    batch: int
    precisions: tuple[str, ...]
    modes: tuple[str, ...]  # of speed.MODES
    lora_rank: int | None = 16
    lora_layers: tuple[str, ...] = ()

    def key(self, device: torch.device) -> dict:
        """What the timings depend on besides the precision and mode: one cache file per key."""
        return {
            "version": VERSION,
            "gpu": device_name(device),
            "torch": torch.__version__,
            "family": self.family.name,
            "config": self.config,
            "tokens": self.tokens,
            "text_tokens": self.text_tokens,
            "batch": self.batch,
            "lora_rank": self.lora_rank,
            "lora_layers": sorted(self.lora_layers),
        }

    def pairs(self) -> list[tuple[str, str]]:
        """(precision, mode) of every block timing it needs: bf16's too, which the others are measured against."""
        return [(p, m) for p in dict.fromkeys(("bf16", *self.precisions)) for m in self.modes]


def cached_path(request: Request, device: torch.device) -> Path:
    text = json.dumps(request.key(device), sort_keys=True, default=str)
    return cache_dir() / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


def _read(path: Path) -> dict | None:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError):
        return None  # none yet, or damaged: measured (again)
    return raw if isinstance(raw, dict) and "blocks" in raw else None


def _missing(raw: dict | None, request: Request) -> list[tuple[str, str]]:
    if raw is None:
        return request.pairs()
    return [(p, m) for p, m in request.pairs() if m not in raw["blocks"].get(p, {}) and p not in raw.get("skipped", {})]


def figures_for(
    request: Request,
    device: torch.device,
    base: speed.Figures,
    measure: Callable[..., dict] | None = None,
) -> speed.Figures:
    """This GPU's figures for `request`: from the cache, the timings it lacks measured and added to it. `base`: the
    figures for what is not measured. `measure`: the timing routine (`measure_blocks`; tests give a fake one)."""
    path = cached_path(request, device)
    raw = _read(path)
    missing = _missing(raw, request)
    if not missing:
        return derive(raw, base, f"measured on this GPU ({raw['gpu']}; cached: {path})")
    start = time.perf_counter()
    new = (measure or measure_blocks)(request, device, pairs=missing, known=raw)
    if raw is not None:  # what was measured before stays: the rates, and the other pairs' timings
        for p, by_mode in new["blocks"].items():
            raw["blocks"].setdefault(p, {}).update(by_mode)
        raw.setdefault("skipped", {}).update(new.get("skipped", {}))
        new = raw
    new["key"] = request.key(device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(new, indent=1, default=str) + "\n")
    os.replace(tmp, path)
    took = time.perf_counter() - start
    return derive(new, base, f"measured on this GPU ({new['gpu']}, in {took:.0f} s; cached: {path})")


def derive(raw: dict, base: speed.Figures, describe: str) -> speed.Figures:
    """The model's figures from a measurement (`measure_blocks`), `base`'s for what it did not measure."""
    mm, att = raw["matmul_tflops"], raw["attention_tflops"]
    kinds = raw["kinds"]  # kind -> {linear, attention, features, weights}
    times = raw["blocks"]  # precision -> mode -> kind -> {forward, backward, first}
    elementwise = dict(base.elementwise_ps)
    pass_ms = dict(base.pass_ms)
    dequant = {p: dict(by) for p, by in base.dequant_ms_per_gweight.items()}
    sources = dict(base.sources)
    compile_s = base.compile_s
    for how, by_kind in times.get("bf16", {}).items():
        rest = features = 0.0
        for kind, t in by_kind.items():
            k = kinds[kind]
            lin, a = k["linear"] / (mm * 1e12), k["attention"] / (att * 1e12)
            rest += (t["forward"] - lin - a) + (t["backward"] - lin - speed.ATTENTION_BACKWARD * a)
            features += 2 * k["features"]
        elementwise[how] = max(0.0, rest / features * 1e12)
        pass_ms[how] = 0.0  # folded into the elementwise work: one token count does not tell them apart
        sources[f"elementwise_ps.{how}"] = describe
        if how != "eager":
            extra = sum(max(0.0, t["first"] - t["forward"] - t["backward"]) for t in by_kind.values())
            if extra > 10:  # less: Inductor's cache held the graphs, and a first run compiles for longer
                compile_s = 2 * extra
                sources["compile_s"] = describe
    for precision, by_mode in times.items():
        if precision == "bf16":
            continue
        for how, by_kind in by_mode.items():
            plain = times.get("bf16", {}).get(how)
            if not plain:
                continue
            weights = sum(kinds[k]["weights"] for k in by_kind)
            f = sum(t["forward"] - plain[k]["forward"] for k, t in by_kind.items()) / weights * 1e12
            b = sum(t["backward"] - plain[k]["backward"] for k, t in by_kind.items()) / weights * 1e12
            dequant.setdefault(precision, {})[how] = (max(0.0, f), max(0.0, b))
            sources[f"dequant_ms_per_gweight.{precision}.{how}"] = describe
    for key in ("matmul_tflops", "attention_tflops", "h2d_gib_per_s"):
        sources[key] = describe
    h2d = raw.get("h2d_gib_per_s") or base.h2d_gib_per_s
    return dataclasses.replace(
        base,
        matmul_tflops=mm,
        attention_tflops=att,
        elementwise_ps=elementwise,
        pass_ms=pass_ms,
        dequant_ms_per_gweight=dequant,
        h2d_gib_per_s=h2d,
        compile_s=compile_s,
        gpu=raw["gpu"],
        describe=describe,
        sources=sources,
    )


# --- the timings ----------------------------------------------------------------------------------------------


class _Clock:
    """Seconds of GPU work between two marks (CUDA events), or of the host's clock on the CPU."""

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def mark(self):
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            return e
        return time.perf_counter()

    def seconds(self, a, b) -> float:
        if self.cuda:
            b.synchronize()
            return a.elapsed_time(b) / 1e3
        return b - a


def _median(xs: Sequence[float]) -> float:
    xs = sorted(xs)
    return xs[len(xs) // 2]


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def h2d_gib_per_s(device: torch.device, nbytes: int, repeats: int = 5) -> float | None:
    """Host-to-GPU copies of `nbytes` from page-locked memory (offload's homes are), None without a GPU."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device=device)
    clock, times = _Clock(device), []
    for _ in range(repeats + 1):
        a = clock.mark()
        dst.copy_(src, non_blocking=True)
        times.append(clock.seconds(a, clock.mark()))
    return nbytes / _median(times[1:]) / GIB


def _back_to_back(device: torch.device, work: Callable[[], None], repeats: int) -> float:
    """Seconds of one `work()` on the GPU (median of `repeats`), the calls queued back to back as a run queues its
    kernels: the host's launch time hides behind the GPU's work instead of adding to it (the first call warms up)."""
    work()
    _sync(device)
    clock = _Clock(device)
    marks = [clock.mark()]
    for _ in range(repeats):
        work()
        marks.append(clock.mark())
    _sync(device)
    return _median([clock.seconds(a, b) for a, b in zip(marks, marks[1:])])


def matmul_tflops(device: torch.device, tokens: int, hidden: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """bf16 matrix products of a block's shapes: tokens x D -> 4D and back."""
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    w1 = torch.randn(hidden, 4 * hidden, device=device, dtype=dtype)
    w2 = torch.randn(4 * hidden, hidden, device=device, dtype=dtype)
    seconds = _back_to_back(device, lambda: (x @ w1) @ w2, repeats)
    return 2 * 2 * tokens * hidden * 4 * hidden / seconds / 1e12


def attention_tflops(
    device: torch.device, batch: int, heads: int, tokens: int, head_dim: int, dtype: torch.dtype, repeats: int = 5
) -> float:
    """The attention op the blocks call (cp's, one rank): its forward and backward, against 3.5x the forward's
    FLOPs (flux_cp.plan.speed.ATTENTION_BACKWARD)."""
    import cp.ring  # noqa: F401 - registers torch.ops.cp

    q, k, v = (
        torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    grad = torch.randn(batch, heads, tokens, head_dim, device=device, dtype=dtype)

    def work() -> None:
        out, _ = torch.ops.cp.ring_attention(q, k, v, head_dim**-0.5, "", "", False)
        out.backward(grad)

    seconds = _back_to_back(device, work, repeats)
    flops = 4 * batch * tokens * tokens * heads * head_dim
    return (1 + speed.ATTENTION_BACKWARD) * flops / seconds / 1e12


def one_block_targets(family, layers: tuple[str, ...]) -> tuple[str, ...]:
    """The run's --lora_layers as they fall on a transformer of one block of each kind: a target named for a block
    (FLUX.2's `single_transformer_blocks.7.attn.to_out`, one per block) names that kind's first block, which
    stands for every block of its kind."""
    lists = "|".join(re.escape(name) for _, name, _ in family.block_lists)
    return tuple(dict.fromkeys(re.sub(rf"(^|\.)({lists})\.\d+\.", r"\1\2.0.", t) for t in layers))


def _one_of_each(request: Request, precision: str, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """The family's transformer with one block of each kind, random weights, the base at `precision` and LoRA
    added, with the CP attention processors (one rank), as a run prepares them."""
    import cp
    from flux_cp.config.training import LoraConfig
    from flux_cp.model.loading import prepare_trainable
    from flux_cp.model.precision import quantize_base
    from flux_cp.random_weights import build_random

    family = request.family
    small = {**request.config, **{key: 1 for _, _, key in family.block_lists}}
    model = build_random(family.transformer_class(), small, dtype, device, seed=0)
    quantize_base(model, precision, device=device, parts=family.quantized_parts)
    if request.lora_rank is not None:
        layers = one_block_targets(family, request.lora_layers) or family.lora_targets(False, small)
        lora = LoraConfig(rank=request.lora_rank, lora_alpha=request.lora_rank, lora_layers=layers)
        prepare_trainable(model, lora, seed=0)
    cp.apply_context_parallel(model, cp.CPContext(None))
    return model.train()


def _inputs(request: Request, device: torch.device, dtype: torch.dtype) -> dict:
    family, config, b = request.family, request.config, request.batch
    text = min(request.text_tokens, request.tokens)
    side = math.isqrt(request.tokens - text)
    ids = family.image_ids(2 * side, 2 * side, device=device)  # FLUX.1 takes the VAE latent's size, FLUX.2 its own
    if ids.shape[0] != side * side:
        ids = family.image_ids(side, side, device=device)
    embeds = {"prompt_embeds": torch.randn(b, text, config["joint_attention_dim"], device=device, dtype=dtype)}
    if config.get("pooled_projection_dim"):
        embeds["pooled_prompt_embeds"] = torch.randn(b, config["pooled_projection_dim"], device=device, dtype=dtype)
    hidden = torch.randn(b, side * side, config["in_channels"], device=device, dtype=dtype)
    guidance = torch.full((b,), 3.5, device=device) if config.get("guidance_embeds") else None
    return family.transformer_inputs(
        hidden, ids, embeds, family.text_ids(text, device=device), torch.full((b,), 0.5, device=device), guidance
    )


def _block_calls(
    model: torch.nn.Module, family, inputs: dict, autocast
) -> list[tuple[str, torch.nn.Module, tuple, dict]]:
    """(kind, block, args, kwargs) of every block, their inputs as the model's forward passes them."""
    calls: list = []
    handles = []
    for kind, block in family.blocks(model):

        def hook(module, args, kwargs, kind=kind):
            keep = lambda t: t.detach().clone() if isinstance(t, torch.Tensor) else t  # noqa: E731
            calls.append((kind, module, tuple(keep(a) for a in args), {k: keep(v) for k, v in kwargs.items()}))

        handles.append(block.register_forward_pre_hook(hook, with_kwargs=True))
    with torch.no_grad(), autocast():
        model(**inputs)
    for h in handles:
        h.remove()
    return calls


def _time_block(
    block, args: tuple, kwargs: dict, hidden: int, device: torch.device, autocast, repeats: int, graphs: bool
) -> dict:
    """Forward and backward seconds of one block (medians), and the first call's (compiling, when compiled). The
    activations in (batch x tokens x hidden) get gradients, as inside a LoRA run. The timed calls are queued back
    to back, each backward freeing its forward's activations before the next forward, as a run's host launches
    ahead of the GPU: the launch time then hides behind the GPU's work instead of adding to each call's."""
    from flux_cp.model.blocks import step_begins

    def grad(t):
        return isinstance(t, torch.Tensor) and t.dim() == 3 and t.shape[-1] == hidden and t.is_floating_point()

    a = tuple(t.detach().requires_grad_() if grad(t) else t for t in args)
    k = {n: (t.detach().requires_grad_() if grad(t) else t) for n, t in kwargs.items()}
    clock = _Clock(device)

    def once() -> tuple:
        if graphs:
            step_begins("reduce-overhead")
        m0 = clock.mark()
        with autocast():
            out = block(*a, **k)
        m1 = clock.mark()
        outs = [
            t
            for t in (out if isinstance(out, (tuple, list)) else (out,))
            if isinstance(t, torch.Tensor) and t.requires_grad
        ]
        torch.autograd.backward(outs, [torch.ones_like(t) for t in outs])
        m2 = clock.mark()
        for t in (*a, *k.values()):
            if isinstance(t, torch.Tensor):
                t.grad = None
        return m0, m1, m2

    _sync(device)
    t0 = time.perf_counter()
    once()
    _sync(device)
    first = time.perf_counter() - t0
    once()  # the second call may still record CUDA graphs
    _sync(device)
    marks = [once() for _ in range(repeats)]
    _sync(device)
    forward = [clock.seconds(m0, m1) for m0, m1, _ in marks]
    backward = [clock.seconds(m1, m2) for _, m1, m2 in marks]
    return {"forward": _median(forward), "backward": _median(backward), "first": first}


def measure_blocks(
    request: Request,
    device: torch.device,
    pairs: Sequence[tuple[str, str]] | None = None,
    known: dict | None = None,
    repeats: int = 5,
) -> dict:
    """The timings behind the figures (`derive`): every kind of block at each (precision, mode) of `pairs` (default:
    the request's), and the rates, unless `known` (an earlier measurement of the same shapes) has them."""
    from flux_cp.extras import PACKAGES, version
    from flux_cp.model.blocks import transformer_blocks
    from flux_cp.plan import memory as plan
    from flux_cp.plan.speed import mode as _mode  # noqa: F401 - the modes' names

    family, config = request.family, request.config
    dtype = torch.bfloat16
    hidden = family.hidden_size(config)
    blocks, _ = plan.step_blocks(
        family,
        config,
        tokens=request.tokens,
        text_tokens=request.text_tokens,
        batch=request.batch,
        cp=1,
        precision="fp8",
    )
    kinds = {}
    for b in blocks:  # per block kind: what the model counts for one block
        kinds.setdefault(
            b.kind, {"linear": b.linear, "attention": b.attention, "features": b.features, "weights": b.weights}
        )
    heads, head_dim = config["num_attention_heads"], config["attention_head_dim"]
    raw = {"gpu": device_name(device), "kinds": kinds, "blocks": {}, "skipped": {}}
    if known is not None:
        raw.update({k: known[k] for k in ("matmul_tflops", "attention_tflops", "h2d_gib_per_s")})
    else:
        plain, _ = plan.step_blocks(
            family,
            config,
            tokens=request.tokens,
            text_tokens=request.text_tokens,
            batch=request.batch,
            cp=1,
            precision="bf16",
        )
        raw["matmul_tflops"] = matmul_tflops(device, request.batch * request.tokens, hidden, dtype)
        raw["attention_tflops"] = attention_tflops(device, request.batch, heads, request.tokens, head_dim, dtype)
        raw["h2d_gib_per_s"] = h2d_gib_per_s(device, max(b.nbytes for b in plain))
    if device.type == "cuda":
        autocast = lambda: torch.autocast("cuda", dtype=dtype)  # noqa: E731
    else:
        autocast = lambda: torch.autocast("cpu", dtype=dtype)  # noqa: E731
    inputs = _inputs(request, device, dtype)
    todo = request.pairs() if pairs is None else list(pairs)
    for precision in dict.fromkeys(p for p, _ in todo):
        package = PACKAGES.get(precision)
        if package and version(package[0]) is None:
            raw["skipped"][precision] = f"{package[0]} is not installed"
            continue
        for how in [m for p, m in todo if p == precision]:
            model = _one_of_each(request, precision, device, dtype)
            calls = _block_calls(model, family, inputs, autocast)
            if how != "eager":
                from cp import Tuning
                from cp.schedule import inductor_options

                options = inductor_options("reduce-overhead" if how == "graphs" else None, Tuning(), 1)
                for block in transformer_blocks(model):
                    block.compile(options=options)
            by_kind = {}
            for kind, block, args, kwargs in calls:
                by_kind[kind] = _time_block(block, args, kwargs, hidden, device, autocast, repeats, how == "graphs")
            raw["blocks"].setdefault(precision, {})[how] = by_kind
            del model, calls
            if how != "eager":
                torch._dynamo.reset()
            if device.type == "cuda":
                torch.cuda.empty_cache()
    return raw


# --- which figures a plan uses ----------------------------------------------------------------------------------


def class_name(gpu_class: str, device: torch.device, gpu_gib: float | None) -> str:
    """The GPU class whose figures stand for what is not measured: the one named (--gpu_class), else this GPU's by
    its name, else the class of `gpu_gib` (without one, --plan's default: an H200's 141 GiB)."""
    if gpu_class not in ("auto", "measure"):
        return gpu_class
    if device.type == "cuda":
        found = speed.class_of_gpu(device_name(device))
        if found:
            return found
    if gpu_gib is None and device.type == "cuda":
        gpu_gib = torch.cuda.get_device_properties(device).total_memory / GIB
    return speed.class_for_memory(gpu_gib or 141.0)


def times_this_gpu(gpu_class: str, device: torch.device) -> bool:
    """Whether a plan on `device` times its blocks: with --gpu_class measure on a CUDA GPU, and with auto on one whose
    class has no file measured on it or fitted to its steps (a GPU of no class, or a class sourced from datasheets).
    A class file predicts whole steps better than blocks timed alone: on an H100 its figures came within 11% of every
    measured step, where blocks timed at a run's start came out 28% and 37% slow and the same block timed twice in
    one sitting differed by up to 1.7x (docs/small_gpus.md, "The speed model")."""
    if device.type != "cuda" or gpu_class not in ("auto", "measure"):
        return False
    if gpu_class == "measure":
        return True
    found = speed.class_of_gpu(device_name(device))
    return found is None or speed.class_status(found) == "sourced"


def choose(
    cfg,
    shape,
    device: torch.device,
    gpu_gib: float | None,
    wanted: Sequence[tuple[Sequence[str], Sequence[str]]],
    measure: bool = True,
) -> speed.Figures:
    """The figures a plan (or a run's auto choices) uses: the GPU class's (named by --gpu_class, else this GPU's,
    else that of `gpu_gib`), or, where `times_this_gpu` says so (and `measure`), this GPU's measured for the run's
    blocks at each (precisions, modes) of `wanted` (cached), the class's for what is not measured."""
    base = speed.load_class(class_name(cfg.plan.gpu_class, device, gpu_gib))
    if not measure or not times_this_gpu(cfg.plan.gpu_class, device):
        return base
    cp = shape.cp
    lora = None if cfg.lora.full_finetune else cfg.lora.rank
    figures = base
    for precisions, modes in wanted:  # one cache file: each request adds its timings to the earlier ones
        request = Request(
            shape.family,
            dict(shape.transformer_config),
            tokens=-(-shape.largest_sequence // cp),
            text_tokens=-(-shape.text_tokens // cp),
            batch=cfg.train.train_batch_size * cfg.data.samples_per_slot,
            precisions=tuple(precisions),
            modes=tuple(modes),
            lora_rank=lora,
            lora_layers=tuple(cfg.lora.lora_layers or ()),
        )
        figures = figures_for(request, device, base)
    return figures


def agreed(make: Callable[[], speed.Figures], is_main: bool) -> speed.Figures:
    """The figures every rank of a launch plans with: made by the main process and sent to the others (each
    measuring its own could differ by a few percent and choose other blocks to checkpoint)."""
    import torch.distributed as dist

    figures = make() if is_main else None
    if dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        box = [figures]
        dist.broadcast_object_list(box, src=0)
        figures = box[0]
    return figures
