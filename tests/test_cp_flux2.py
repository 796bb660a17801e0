"""CP for FLUX.2: a tiny Flux2Transformer2DModel (double blocks, single blocks with their fused parallel attention,
guidance embedding, four-axis RoPE) in fp64 with CP over 2, 3 and 4 processes (ring, Ulysses, hybrid) against the
same model without CP; the processors without a group against diffusers' own, bit for bit; diffusers' features that
touch processors either work or are refused clearly under CP; `full_sequence_io` as Flux2Pipeline calls the model."""

from __future__ import annotations

import copy
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.transformers import transformer_flux2
from diffusers.models.transformers.transformer_flux2 import (
    Flux2Attention,
    Flux2AttnProcessor,
    Flux2KVAttnProcessor,
    Flux2KVParallelSelfAttnProcessor,
    Flux2ParallelSelfAttnProcessor,
)

import cp
import cp.processor
from cp import (
    Flux2CPAttnProcessor,
    Flux2CPParallelSelfAttnProcessor,
    apply_context_parallel,
    full_sequence_io,
    remove_context_parallel,
)
from flux_cp.families.flux2.tiny import TRANSFORMER_CONFIG, tiny_flux2_transformer
from tests import distributed

pytestmark = pytest.mark.distributed

# 12 heads of 8 (four RoPE axes of 2): Ulysses works at 2, 3, 4 and 6 ranks. 12 text + 24 image tokens (a 4 x 6
# latent grid): every count divides by 2, 3 and 4.
HEADS, HEAD_DIM, TEXT, LAT_H, LAT_W = 12, 8, 12, 4, 6
SMALL = dict(num_attention_heads=HEADS, attention_head_dim=HEAD_DIM, axes_dims_rope=(2, 2, 2, 2))
IN, JOINT = TRANSFORMER_CONFIG["in_channels"], TRANSFORMER_CONFIG["joint_attention_dim"]


def _model(dtype=torch.float64):
    model = tiny_flux2_transformer(seed=0, **SMALL).to(dtype)
    model.requires_grad_(True)
    return model


def _image_ids(h: int, w: int, t: int = 0) -> torch.Tensor:
    """Flux2Pipeline._prepare_latent_ids (t = 0) / _prepare_image_ids (t = 10, 20, ... for references): (t, h, w, 0)."""
    return torch.cartesian_prod(torch.tensor([t]), torch.arange(h), torch.arange(w), torch.arange(1))


def _text_ids(n: int) -> torch.Tensor:
    """Flux2Pipeline._prepare_text_ids: (0, 0, 0, l)."""
    return torch.cartesian_prod(torch.arange(1), torch.arange(1), torch.arange(1), torch.arange(n))


def _inputs(batch: int = 2, dtype=torch.float64, refs: int = 0) -> dict:
    """Inputs as Flux2Pipeline passes them ([B, S, 4] ids); `refs` reference images' tokens after the target's."""
    g = torch.Generator().manual_seed(7)
    ids = [_image_ids(LAT_H, LAT_W)] + [_image_ids(LAT_H, LAT_W, t=10 + 10 * i) for i in range(refs)]
    img_ids = torch.cat(ids)
    return dict(
        hidden_states=torch.randn(batch, len(img_ids), IN, generator=g, dtype=dtype),
        encoder_hidden_states=torch.randn(batch, TEXT, JOINT, generator=g, dtype=dtype),
        timestep=torch.rand(batch, generator=g, dtype=dtype),
        guidance=torch.full((batch,), 3.5, dtype=dtype),
        img_ids=img_ids.expand(batch, -1, -1),
        txt_ids=_text_ids(TEXT).expand(batch, -1, -1),
    )


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    scale = b.abs().max().item()
    return (a - b).abs().max().item() / scale if scale > 0 else (a - b).abs().max().item()


_SPLIT = (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 1), ("txt_ids", 1))


def _model_errors(rank: int, world: int, mode: str, ulysses_size: int | None, ckpt: bool) -> dict:
    group = dist.group.WORLD
    inputs = _inputs()
    g = torch.Generator().manual_seed(11)
    target = torch.randn(2, LAT_H * LAT_W, IN, generator=g, dtype=torch.float64)
    for key in ("hidden_states", "encoder_hidden_states"):
        inputs[key].requires_grad_(True)

    ref_model = _model()
    if ckpt:
        ref_model.enable_gradient_checkpointing()
    ref_out = ref_model(**inputs).sample
    F.mse_loss(ref_out, target).backward()
    ref_grads = {n: p.grad for n, p in ref_model.named_parameters()}

    model = _model()
    if ckpt:
        model.enable_gradient_checkpointing()
    apply_context_parallel(model, group, mode=mode, ulysses_size=ulysses_size)
    local = dict(inputs)
    for key, dim in _SPLIT:
        local[key] = cp.shard(inputs[key].detach(), dim, group)
    for key in ("hidden_states", "encoder_hidden_states"):
        local[key].requires_grad_(True)
    out = model(**local).sample
    # The training rule: loss = mean over the rank's local tokens; gradients averaged over all CP ranks.
    F.mse_loss(out, cp.shard(target, 1, group)).backward()
    grad_errors = {}
    for n, p in model.named_parameters():
        grad = p.grad.clone()
        dist.all_reduce(grad)
        grad_errors[n] = _rel(grad / world, ref_grads[n])
    # An input chunk's gradient is its slice of the full one (over world: each rank's loss is its chunk's mean).
    for key in ("hidden_states", "encoder_hidden_states"):
        grad_errors[key] = _rel(local[key].grad / world, cp.shard(inputs[key].grad, 1, group))
    kinds = {type(p).__name__ for p in model.attn_processors.values()}
    remove_context_parallel(model)
    return {
        "out": _rel(cp.gather(out.detach(), 1, group), ref_out.detach()),
        "grad": max(grad_errors.values()),
        "worst": max(grad_errors, key=grad_errors.get),
        "n_grads": len(grad_errors),
        "n_params": sum(1 for _ in ref_model.parameters()),
        "kinds": kinds,
        "restored": {type(p).__name__ for p in model.attn_processors.values()},
    }


CASES = [  # (CP size, mode, ulysses_size, gradient checkpointing)
    (2, "ring", None, False),
    (2, "ulysses", None, True),
    (3, "ring", None, True),
    (3, "ulysses", None, False),
    (4, "ring", None, False),
    (4, "ulysses", None, False),
    (4, "hybrid", 2, True),
]


def _rope_in_input_dtype(x, freqs_cis, use_real=True, use_real_unbind_dim=-1, sequence_dim=2):
    """diffusers' `apply_rotary_emb` (the path FLUX.2 takes) without its cast of `x` to fp32."""
    assert use_real and use_real_unbind_dim == -1 and sequence_dim == 1
    cos, sin = (f[None, :, None, :].to(x) for f in freqs_cis)
    x_real, x_imag = x.reshape(*x.shape[:-1], -1, 2).unbind(-1)
    return x * cos + torch.stack([-x_imag, x_real], dim=-1).flatten(3) * sin


def _world(rank: int, world: int, variants: list[tuple], folders: dict | None) -> dict:
    """Every variant of one CP size in the same process group, and with `folders` (on 2 ranks) the checks of
    diffusers' features and pipelines under CP (`_under_cp`): starting the processes costs more than a case.

    diffusers applies RoPE in fp32 whatever the model's dtype, which rounds the last-bit differences of a chunk's
    matmuls against the full sequence's to ~1e-7 in an fp64 model; with RoPE in the model's dtype (the same change
    for the model with and without CP) the comparison is at fp64 precision. `_under_cp` (fp32) keeps diffusers'
    RoPE."""
    rope = _rope_in_input_dtype
    with (
        mock.patch.object(transformer_flux2, "apply_rotary_emb", rope),
        mock.patch.object(cp.processor, "apply_rotary_emb", rope),
    ):
        exact = [_model_errors(rank, world, *v) for v in variants]
    return {"exact": exact, "features": _under_cp(rank, world, folders) if folders else None}


@pytest.mark.parametrize("world", sorted({c[0] for c in CASES}))
def test_flux2_with_cp_equals_without(world, tmp_path):
    """The transformer at every CP size and mode; on 2 ranks also full_sequence_io, both pipelines and the
    refusals (`_assert_features`)."""
    from flux_cp.families.flux2.tiny import ensure_tiny_flux2_pipeline

    variants = [c[1:] for c in CASES if c[0] == world]
    folders = None
    if world == 2:
        folders = {k: str(ensure_tiny_flux2_pipeline(tmp_path / k, klein=k == "klein")) for k in ("dev", "klein")}
    for rank, results in enumerate(distributed.run(_world, world, variants, folders, timeout=300)):
        for (mode, ulysses_size, ckpt), r in zip(variants, results["exact"], strict=True):
            case = f"rank {rank}, {mode} (ulysses_size {ulysses_size}, checkpointing {ckpt})"
            assert r["kinds"] == {"Flux2CPAttnProcessor", "Flux2CPParallelSelfAttnProcessor"}, (case, r)
            assert r["n_grads"] == r["n_params"] + 2, (case, r)  # every parameter and both float inputs
            assert r["out"] < 1e-10, f"{case}: output rel err {r['out']:.2e}"
            assert r["grad"] < 1e-10, f"{case}: grad rel err {r['grad']:.2e} at {r['worst']}"
            assert r["restored"] == {"Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}, (case, r)
        if folders:
            _assert_features(results["features"])


# --- without CP: the processors are diffusers' own ---------------------------------------------------------------


def _processor_types(model) -> set[str]:
    return {type(p).__name__ for p in model.attn_processors.values()}


@pytest.fixture
def keep_active_backend():
    # set_attention_backend also changes diffusers' process-wide default backend: restore it.
    backend = _AttentionBackendRegistry.get_active_backend()[0]
    yield
    _AttentionBackendRegistry.set_active_backend(backend)


@pytest.mark.parametrize("fused", [False, True], ids=["separate", "fused_projections"])
def test_without_cp_outputs_and_gradients_equal_diffusers_bit_for_bit(fused: bool):
    ref = tiny_flux2_transformer(seed=0)
    if fused:  # diffusers' fused q/k/v projections of the double blocks (to_qkv, to_added_qkv)
        ref.fuse_qkv_projections()
        assert all(m.fused_projections for m in ref.modules() if isinstance(m, Flux2Attention))
    ours = apply_context_parallel(copy.deepcopy(ref), None)
    assert _processor_types(ref) == {"Flux2AttnProcessor", "Flux2ParallelSelfAttnProcessor"}
    assert _processor_types(ours) == {"Flux2CPAttnProcessor", "Flux2CPParallelSelfAttnProcessor"}
    inputs = _inputs(dtype=torch.float32, refs=1)
    outs, grads = [], []
    for model in (ref, ours):
        model.requires_grad_(True)
        out = model(**inputs).sample
        out.square().mean().backward()
        outs.append(out.detach())
        grads.append([p.grad for p in model.parameters()])
    assert torch.equal(outs[0], outs[1])
    # fused: the separate projections stay in the module unused, without gradients in both
    assert [a is None for a in grads[0]] == [b is None for b in grads[1]] and any(a is not None for a in grads[0])
    assert all(a is None or torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("kind", [Flux2CPAttnProcessor, Flux2CPParallelSelfAttnProcessor])
def test_processor_without_arguments_is_no_cp(kind):
    p = kind()
    assert p.group is None and p.cp_size == 1 and p.mode == "ring" and p.ulysses_size is None
    assert p._attention_backend is None and p._parallel_config is None


def test_attention_backend_applies_without_cp(keep_active_backend):
    ref = tiny_flux2_transformer(seed=0)
    ours = apply_context_parallel(copy.deepcopy(ref), None)
    inputs = _inputs(dtype=torch.float32)
    with torch.no_grad():
        for model in (ref, ours):
            model.set_attention_backend("_native_math")
        assert {p._attention_backend.value for p in ours.attn_processors.values()} == {"_native_math"}
        math = [m(**inputs).sample for m in (ref, ours)]
        assert torch.equal(math[0], math[1])
        for model in (ref, ours):
            model.reset_attention_backend()
        assert all(p._attention_backend is None for p in ours.attn_processors.values())


def test_attention_mask_without_cp_matches_diffusers():
    ref = tiny_flux2_transformer(seed=0)
    ours = apply_context_parallel(copy.deepcopy(ref), None)
    inputs = _inputs(dtype=torch.float32)
    mask = torch.ones(2, 1, 1, TEXT + LAT_H * LAT_W, dtype=torch.bool)
    mask[0, ..., TEXT // 2 : TEXT] = False  # the first sample's last text tokens are padding
    kwargs = {"joint_attention_kwargs": {"attention_mask": mask}}
    with torch.no_grad():
        masked = [m(**inputs, **kwargs).sample for m in (ref, ours)]
        plain = ref(**inputs).sample
    assert torch.equal(masked[0], masked[1])
    assert not torch.equal(masked[0][0], plain[0]) and torch.allclose(masked[0][1], plain[1], atol=1e-6)


def test_remove_restores_diffusers_processors_and_apply_rejects_other_models():
    model = apply_context_parallel(tiny_flux2_transformer(seed=0), None)
    remove_context_parallel(model)
    assert {type(p) for p in model.attn_processors.values()} == {Flux2AttnProcessor, Flux2ParallelSelfAttnProcessor}
    with pytest.raises(ValueError, match="has no attention module of a supported model"):
        apply_context_parallel(torch.nn.Linear(2, 2), None)


# --- under CP: diffusers' features are refused clearly; full_sequence_io ------------------------------------------


# --- the pipelines under CP, as validation runs them -------------------------------------------------------------


def _pipelines_under_cp(group: dist.ProcessGroup, folders: dict) -> dict:
    from diffusers import Flux2KleinPipeline, Flux2Pipeline
    from PIL import Image

    reference = Image.fromarray(
        (torch.rand(64, 64, 3, generator=torch.Generator().manual_seed(1)) * 255).byte().numpy()
    )
    errors = {}  # on the denoised latents: the tiny VAE's decoded images are mostly clipped to 0 or 1
    for name, cls, extra in [
        ("dev", Flux2Pipeline, {}),
        # [klein] with classifier-free guidance and a reference image: 16 target + 16 reference tokens
        ("klein+reference", Flux2KleinPipeline, {"image": [reference]}),
    ]:
        pipe = cls.from_pretrained(folders[name.split("+")[0]])
        pipe.set_progress_bar_config(disable=True)

        kwargs = dict(prompt="a red circle", height=64, width=64, num_inference_steps=2, output_type="latent", **extra)
        expected = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
        apply_context_parallel(pipe.transformer, group, mode="ring")
        with full_sequence_io(pipe.transformer, group):
            got = pipe(**kwargs, generator=torch.Generator().manual_seed(0)).images
        errors[name] = _rel(got, expected)
    return errors


def _set_kv_processors(model) -> None:
    """What Flux2KleinKVPipeline._set_kv_attn_processors does."""
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2KVAttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2KVParallelSelfAttnProcessor())


def _set_default_processors(model) -> None:
    for block in model.transformer_blocks:
        block.attn.set_processor(Flux2AttnProcessor())
    for block in model.single_transformer_blocks:
        block.attn.set_processor(Flux2ParallelSelfAttnProcessor())


def _under_cp(rank: int, world: int, folders: dict) -> dict:
    group = dist.group.WORLD
    errors = {}

    def refused(name: str, fn) -> None:
        try:
            fn()
            errors[name] = None
        except ValueError as e:
            errors[name] = str(e)

    with torch.no_grad():
        inputs = _inputs(dtype=torch.float32, refs=2)  # 12 text + 3 x 24 image tokens (target, two references)
        expected = tiny_flux2_transformer(seed=0)(**inputs).sample
        model = apply_context_parallel(tiny_flux2_transformer(seed=0), group, mode="ulysses")
        with full_sequence_io(model, group):
            full = model(**inputs).sample
            as_tuple = model(**inputs, return_dict=False)[0]
        local = {k: cp.shard(v, 1, group) if k in dict(_SPLIT) else v for k, v in inputs.items()}

        refused("backend", lambda: model.set_attention_backend("_native_math"))
        first = next(iter(model.attn_processors.values()))
        refused("parallel_config_set", lambda: setattr(first, "_parallel_config", "diffusers' CP config"))
        mask = torch.ones(2, 1, 1, local["hidden_states"].shape[1] + TEXT // world, dtype=torch.bool)
        refused("mask", lambda: model(**local, joint_attention_kwargs={"attention_mask": mask}))
        refused("kv_cache_mode", lambda: model(**local, kv_cache_mode="extract", num_ref_tokens=LAT_H * LAT_W))
        _set_kv_processors(model)
        refused("kv_processors", lambda: model(**local))
        # diffusers' default processors put back (the KV pipeline undone) and a processor rebuilt without
        # arguments rejoin CP
        _set_default_processors(model)
        after_default = cp.gather(model(**local).sample, 1, group)
        kinds_after_default = _processor_types(model)
        model.transformer_blocks[0].attn.set_processor(Flux2CPAttnProcessor())
        after_rebuilt = cp.gather(model(**local).sample, 1, group)
        groups = {p.group is group for p in model.attn_processors.values()}
        parallel = Flux2CPParallelSelfAttnProcessor()
        parallel._parallel_config = "set while no CP group"  # accepted without CP ...
        refused("parallel_config", lambda: setattr(parallel, "group", group))  # ... refused when CP joins
    return {
        "errors": errors,
        "full_err": _rel(full, expected),
        "tuple_err": _rel(as_tuple, expected),
        "shape": tuple(full.shape),
        "default_err": _rel(after_default, expected),
        "rebuilt_err": _rel(after_rebuilt, expected),
        "kinds_after_default": kinds_after_default,
        "groups": groups,
        "pipelines": _pipelines_under_cp(group, folders),  # in the same process group: starting one costs more
    }


def _assert_features(r: dict) -> None:
    """What `_under_cp` found on one rank of 2."""
    # Flux2Pipeline / Flux2KleinPipeline under CP (as validation runs them) generate what they generate without.
    assert set(r["pipelines"]) == {"dev", "klein+reference"}, r
    assert all(e < 1e-5 for e in r["pipelines"].values()), r["pipelines"]
    e = r["errors"]
    assert r["shape"] == (2, 3 * LAT_H * LAT_W, IN)
    assert r["full_err"] < 1e-5 and r["tuple_err"] < 1e-5, r
    assert e["backend"] and "cannot apply under flux-cp's context parallelism over 2 ranks" in e["backend"], e
    assert e["parallel_config_set"] and "enable_parallelism" in e["parallel_config_set"], e
    assert e["parallel_config"] and "enable_parallelism" in e["parallel_config"], e
    assert e["mask"] and "attention masks are not supported with context parallelism" in e["mask"], e
    assert e["kv_cache_mode"] and "Flux2KleinKVPipeline" in e["kv_cache_mode"], e
    assert e["kv_processors"] and "Flux2KVAttnProcessor" in e["kv_processors"], e
    assert r["kinds_after_default"] == {"Flux2CPAttnProcessor", "Flux2CPParallelSelfAttnProcessor"}, r
    assert r["groups"] == {True}, r
    assert r["default_err"] < 1e-5 and r["rebuilt_err"] < 1e-5, r


def test_full_sequence_io_without_a_group_is_the_plain_model():
    model = tiny_flux2_transformer(seed=0)
    inputs = _inputs(dtype=torch.float32)
    with torch.no_grad(), full_sequence_io(model, None) as same:
        assert same is model
        assert torch.equal(model(**inputs).sample, tiny_flux2_transformer(seed=0)(**inputs).sample)
