"""Block offload (`--offload_blocks`, flux_cp/model/offload.py) on a CUDA GPU:
`python -m pytest -q tests/gpu/test_offload_gpu.py`.

A FLUX.1-shaped transformer (FLUX.1-dev's widths, 3 double and 6 single blocks, bf16, LoRA on the default layers)
with its 6 single blocks offloaded to two slots:

- trains bit for bit as without offload (losses and LoRA weights over three steps of two micro-steps), eager with
  some blocks checkpointed, compiled, and compiled with CUDA graphs (--compile_mode reduce-overhead), with
  deterministic algorithms and the attention kernel whose backward is deterministic;
- lowers the peak GPU memory of a step by the plan's saved bytes, never holds the offloaded weights on the GPU all
  at once while it sets up from a model on the CPU, keeps them in page-locked memory, and copies per micro-step what
  the plan says;
- with a quantized base (fp8, int8, nf4), set up as the trainer does (each linear quantized on the GPU and sent back
  to the CPU, then the blocks placed), never holds the whole quantized model on the GPU and trains bit for bit as the
  base quantized and kept on the GPU.
"""

from __future__ import annotations

import gc
import os

import pytest
import torch

import cp
from cp import Tuning
from flux_cp.config.training import LoraConfig
from flux_cp.families.flux1 import DEFAULT_TARGETS
from flux_cp.model.blocks import prepare_blocks, step_begins
from flux_cp.model.loading import prepare_trainable
from flux_cp.model.offload import offload_blocks

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]

# cuBLAS is deterministic only with a fixed workspace; read when its first handle is made.
os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

BLOCKS = dict(num_layers=3, num_single_layers=6)
OFFLOADED = 6  # the single blocks (the more numerous kind goes first), two slots: four blocks' weights saved
CHECKPOINTED = range(2, 5)  # a double and two single blocks, offloaded and resident ones among them
LATENT, TEXT = 64, 128  # 1024 image tokens and 128 text tokens
# The attention kernel whose backward is deterministic (matrix products): two runs can then agree bit for bit, and
# any difference is the offload's. The other kernels' backwards may accumulate in varying order.
TUNING = Tuning(kernels=("math",))


@pytest.fixture(autouse=True)
def deterministic():
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)  # as --deterministic does
    yield
    torch.use_deterministic_algorithms(before)
    torch._dynamo.reset()
    gc.collect()
    torch.cuda.empty_cache()


def _model():
    """The transformer on the GPU with LoRA, as the trainer prepares it (fp32 adapters, every one acting)."""
    from diffusers import FluxTransformer2DModel

    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER

    device = torch.device("cuda", torch.cuda.current_device())
    with torch.device(device), torch.random.fork_rng(devices=[device]):
        torch.manual_seed(0)
        model = FluxTransformer2DModel(**{**FLUX1_DEV_TRANSFORMER, **BLOCKS}).to(torch.bfloat16)
    prepare_trainable(model, LoraConfig(rank=16, lora_alpha=16, lora_layers=DEFAULT_TARGETS), seed=0)
    with torch.no_grad(), torch.random.fork_rng(devices=[device]):
        torch.manual_seed(1)
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(std=0.01)
    cp.apply_context_parallel(model, cp.CPContext(None, tuning=TUNING))
    return model


def _batches(n: int) -> list[dict]:
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    g = torch.Generator(device="cuda").manual_seed(7)
    out = []
    for _ in range(n):
        latents = torch.randn(1, 16, LATENT, LATENT, device="cuda", generator=g)
        out.append(dict(
            hidden_states=pack_latents(latents).bfloat16(),
            encoder_hidden_states=torch.randn(1, TEXT, 4096, device="cuda", generator=g).bfloat16(),
            pooled_projections=torch.randn(1, 768, device="cuda", generator=g).bfloat16(),
            timestep=torch.rand(1, device="cuda", generator=g),
            guidance=torch.full((1,), 3.5, device="cuda"),
            img_ids=image_ids(LATENT, LATENT, device="cuda"),
            txt_ids=text_ids(TEXT, device="cuda"),
            target=torch.randn(1, (LATENT // 2) ** 2, 64, device="cuda", generator=g),
        ))  # fmt: skip
    return out


def _train(model, batches: list[dict], compile_mode: str | None = None, steps: int = 3, accumulation: int = 2,
           offload=None) -> tuple[list[torch.Tensor], list[int]]:  # fmt: skip
    """Losses and final LoRA weights (on the CPU), and the bytes the offload copied in each micro-step."""
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-3)
    losses, copied = [], []
    for step in range(steps):
        for micro in range(accumulation):
            batch = dict(batches[(step * accumulation + micro) % len(batches)])
            target = batch.pop("target")
            before = offload.copied_bytes if offload else 0
            step_begins(compile_mode)
            with torch.autocast("cuda", dtype=torch.bfloat16):
                pred = model(**batch).sample
            loss = (pred.float() - target).square().mean() / accumulation
            loss.backward()
            losses.append(loss.detach().clone())
            if offload:
                copied.append(offload.copied_bytes - before)
        opt.step()
        opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return [t.cpu() for t in losses] + [p.detach().cpu() for p in params], copied


def _prepared(compile_mode: str | None, offloaded: bool):
    """The model with its blocks prepared as the trainer does (checkpointing, compile), then offloaded from the CPU."""
    model = _model()
    compiled = compile_mode is not None
    prepare_blocks(model, checkpointed=CHECKPOINTED, recompute_attention=False, compile=compiled,
                   compile_mode=None if compile_mode == "default" else compile_mode, cp=1, tuning=TUNING)  # fmt: skip
    if not offloaded:
        return model, None
    model.cpu()
    torch.cuda.empty_cache()
    return model, offload_blocks(model, OFFLOADED, "cuda")


@pytest.mark.parametrize("compile_mode", [None, "default", "reduce-overhead"])
def test_offloaded_training_equals_training_without_offload(compile_mode):
    batches = _batches(2)
    mode = None if compile_mode in (None, "default") else compile_mode
    results = []
    for offloaded in (False, True):
        model, off = _prepared(compile_mode, offloaded)
        got, copied = _train(model, batches, mode, offload=off)
        results.append(got)
        if off is not None:
            assert copied == [off.plan.moved_bytes] * len(copied) and off.plan.moved_bytes > 0
            off.check()
        del model, off
        gc.collect()
        torch.cuda.empty_cache()
    losses = results[0][:6]
    assert len(set(t.item() for t in losses)) > 1 and all(torch.isfinite(t) for t in losses)
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"item {i} (losses first, then LoRA weights): {(a - b).abs().max().item()}"


def test_offload_lowers_the_peak_by_what_the_plan_saves():
    batches = _batches(1)
    peaks, plan = {}, None
    for offloaded in (False, True):
        model, off = _model(), None
        if offloaded:
            model.cpu()
            gc.collect()
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            off = offload_blocks(model, OFFLOADED, "cuda")
            plan = off.plan
            # Set up from the CPU one block at a time: the GPU held at most one offloaded block beyond what stays.
            largest = max(plan.block_bytes[i] for i in plan.offloaded)
            assert torch.cuda.max_memory_allocated() <= torch.cuda.memory_allocated() + largest + 2**26
            assert all(buf.is_pinned() for buf in off.buffers)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        _train(model, batches, steps=1, accumulation=1, offload=off)
        peaks[offloaded] = torch.cuda.max_memory_allocated()
        del model, off
        gc.collect()
        torch.cuda.empty_cache()
    saved = peaks[False] - peaks[True]
    print(f"{plan.describe()}; peak {peaks[False] / 2**30:.3f} GiB without offload, {peaks[True] / 2**30:.3f} GiB "
          "with it")  # fmt: skip
    assert plan.saved_bytes == 4 * plan.block_bytes[-1] and abs(saved - plan.saved_bytes) <= 0.02 * plan.saved_bytes


@pytest.mark.parametrize("precision", ["fp8", "int8", "nf4"])
def test_a_quantized_base_to_offload_never_sits_whole_on_the_gpu_and_trains_as_one_quantized_there(precision):
    """The trainer's way with a quantized base and blocks to offload (flux_cp.model.loading.load_trainee): each linear
    quantized on the GPU and sent back to the CPU (`quantize_base(..., home="cpu")`), then `offload_blocks` places
    each block. The GPU never holds more than a linear or a block beyond what stays, and the weights are those
    quantized and kept on the GPU: training is bit for bit the same."""
    from diffusers import FluxTransformer2DModel

    from flux_cp.families.flux1.tiny import FLUX1_DEV_TRANSFORMER
    from flux_cp.model.precision import check_installed, quantize_base

    try:
        check_installed(precision)
    except Exception as e:  # noqa: BLE001 - the package's own one line
        pytest.skip(str(e))
    batches = _batches(1)
    results = []
    for home in (None, "cpu"):
        with torch.random.fork_rng():
            torch.manual_seed(0)
            model = FluxTransformer2DModel(**{**FLUX1_DEV_TRANSFORMER, **BLOCKS}).to(torch.bfloat16)  # on the CPU
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        quantize_base(model, precision, device="cuda", home=home)
        if home is not None:
            # One bf16 linear (FLUX.1-dev's widest, 3072 x 15360) and its quantized copy at a time.
            assert torch.cuda.max_memory_allocated() <= 2 * 3072 * 15360 * 2 + 2**26
            assert {p.device.type for p in model.parameters()} == {"cpu"}
        prepare_trainable(model, LoraConfig(rank=16, lora_alpha=16, lora_layers=DEFAULT_TARGETS), seed=0)
        with torch.no_grad(), torch.random.fork_rng():
            torch.manual_seed(1)
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.normal_(std=0.01)
        cp.apply_context_parallel(model, cp.CPContext(None, tuning=TUNING))
        model.cpu()
        off = offload_blocks(model, OFFLOADED, "cuda")
        got, _ = _train(model, batches, steps=2, accumulation=1, offload=off)
        results.append(got)
        del model, off
        gc.collect()
        torch.cuda.empty_cache()
    for i, (a, b) in enumerate(zip(*results)):
        assert torch.equal(a, b), f"item {i} (losses first, then LoRA weights): {(a - b).abs().max().item()}"
