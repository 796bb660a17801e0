"""`FluxCPAttnProcessor` as a drop-in for diffusers' `FluxAttnProcessor`: bit-for-bit equal without CP, and
diffusers' features that touch processors (IP-Adapter load/unload, attention backends, attention masks,
diffusers rebuilding processors with no arguments) either work or are refused with a clear error under CP."""

from __future__ import annotations

import copy
import types

import pytest
import torch
import torch.distributed as dist
from diffusers import FluxPipeline
from diffusers.models.attention_dispatch import _AttentionBackendRegistry
from diffusers.models.transformers.transformer_flux import FluxAttnProcessor

import cp
from flux_cp.families.flux1.tiny import TRANSFORMER_CONFIG, tiny_transformer
from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids
from tests import distributed

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)

TEXT, LAT = 8, 16  # 8 text + 64 image tokens: divisible by 2
CLIP_DIM, IP_TOKENS = 8, 4


def _inputs(batch: int = 2, lat: int = LAT, text: int = TEXT) -> dict:
    g = torch.Generator().manual_seed(3)
    dim = TRANSFORMER_CONFIG["joint_attention_dim"]
    return dict(
        hidden_states=pack_latents(torch.randn(batch, 4, lat, lat, generator=g)),
        encoder_hidden_states=torch.randn(batch, text, dim, generator=g),
        pooled_projections=torch.randn(batch, TRANSFORMER_CONFIG["pooled_projection_dim"], generator=g),
        timestep=torch.rand(batch, generator=g),
        guidance=torch.full((batch,), 3.5),
        img_ids=image_ids(lat, lat),
        txt_ids=text_ids(text),
    )


def _ip_adapter_state(model) -> dict:
    """An IP-Adapter checkpoint in the layout `load_ip_adapter` reads (one adapter, random weights)."""
    g = torch.Generator().manual_seed(5)
    cross, inner = model.config.joint_attention_dim, model.inner_dim
    image_proj = {
        "proj.weight": torch.randn(IP_TOKENS * cross, CLIP_DIM, generator=g) * 0.2,
        "proj.bias": torch.zeros(IP_TOKENS * cross),
        "norm.weight": torch.ones(cross),
        "norm.bias": torch.zeros(cross),
    }
    ip = {}
    for i in range(len(model.transformer_blocks)):
        for kind in ("k", "v"):
            ip[f"{i}.to_{kind}_ip.weight"] = torch.randn(inner, cross, generator=g) * 0.2
            ip[f"{i}.to_{kind}_ip.bias"] = torch.zeros(inner)
    return {"image_proj": image_proj, "ip_adapter": ip}


def _ip_embeds(batch: int = 2) -> list[torch.Tensor]:
    return [torch.randn(batch, 1, CLIP_DIM, generator=torch.Generator().manual_seed(9))]


def _unload_ip_adapter(model) -> None:
    """diffusers' own `FluxPipeline.unload_ip_adapter`, on a pipeline holding only this transformer."""
    FluxPipeline.unload_ip_adapter(types.SimpleNamespace(transformer=model))


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
    from diffusers.models.transformers.transformer_flux import FluxAttention

    torch.manual_seed(0)
    ref = tiny_transformer(seed=0)
    if fused:  # diffusers' fused q/k/v projections (to_qkv, to_added_qkv), kept by both processors
        for m in ref.modules():
            if isinstance(m, FluxAttention):
                m.fuse_projections()
        assert all(m.fused_projections for m in ref.modules() if isinstance(m, FluxAttention))
    ours = cp.apply_context_parallel(copy.deepcopy(ref), None)
    assert _processor_types(ref) == {"FluxAttnProcessor"} and _processor_types(ours) == {"FluxCPAttnProcessor"}
    inputs = _inputs(lat=32, text=16)  # 256 image + 16 text tokens
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


def test_processor_without_arguments_is_no_cp():
    p = cp.FluxCPAttnProcessor()
    assert p.group is None and p.cp_size == 1
    assert p._attention_backend is None and p._parallel_config is None


def test_ip_adapter_load_and_unload_without_cp_match_diffusers():
    ref = tiny_transformer(seed=0)
    ours = cp.apply_context_parallel(copy.deepcopy(ref), None)
    inputs = _inputs()
    with torch.no_grad():
        for model in (ref, ours):
            model._load_ip_adapter_weights(_ip_adapter_state(model))
        # diffusers rebuilt the single-block processors as `type(processor)()`: ours must survive that.
        assert _processor_types(ours) == {"FluxIPAdapterAttnProcessor", "FluxCPAttnProcessor"}
        kwargs = {"joint_attention_kwargs": {"ip_adapter_image_embeds": _ip_embeds()}}
        with_ip = [m(**inputs, **copy.deepcopy(kwargs)).sample for m in (ref, ours)]
        assert torch.equal(with_ip[0], with_ip[1])
        for model in (ref, ours):
            _unload_ip_adapter(model)
        after = [m(**inputs).sample for m in (ref, ours)]
    assert torch.equal(after[0], after[1])
    assert not torch.equal(with_ip[0], after[0]), "the IP-Adapter should change the output"


def test_attention_backend_applies_without_cp(keep_active_backend):
    ref = tiny_transformer(seed=0)
    ours = cp.apply_context_parallel(copy.deepcopy(ref), None)
    inputs = _inputs()
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
    ref = tiny_transformer(seed=0)
    ours = cp.apply_context_parallel(copy.deepcopy(ref), None)
    inputs = _inputs()
    seq = TEXT + LAT * LAT // 4
    mask = torch.ones(2, 1, 1, seq, dtype=torch.bool)
    mask[0, ..., TEXT // 2 : TEXT] = False  # the first sample's last text tokens are padding
    kwargs = {"joint_attention_kwargs": {"attention_mask": mask}}
    with torch.no_grad():
        masked = [m(**inputs, **kwargs).sample for m in (ref, ours)]
        plain = ref(**inputs).sample
    assert torch.equal(masked[0], masked[1])
    assert not torch.equal(masked[0][0], plain[0]) and torch.allclose(masked[0][1], plain[1], atol=1e-6)


def _under_cp(rank: int, world: int) -> dict:
    group = dist.group.WORLD
    inputs = _inputs()
    with torch.no_grad():
        ref = tiny_transformer(seed=0)
        expected = ref(**inputs).sample
        model = cp.apply_context_parallel(tiny_transformer(seed=0), group)
        local = dict(inputs)
        for key, dim in (("hidden_states", 1), ("encoder_hidden_states", 1), ("img_ids", 0), ("txt_ids", 0)):
            local[key] = cp.shard(inputs[key], dim, group)

        def run(**kwargs) -> torch.Tensor:
            return cp.gather(model(**local, **kwargs).sample, 1, group)

        errors = {}

        def refused(name: str, fn) -> None:
            try:
                fn()
                errors[name] = None
            except ValueError as e:
                errors[name] = str(e)

        refused("backend", lambda: model.set_attention_backend("_native_math"))
        first = next(iter(model.attn_processors.values()))
        refused("parallel_config_set", lambda: setattr(first, "_parallel_config", "diffusers' CP config"))
        mask = torch.ones(2, 1, 1, local["hidden_states"].shape[1] + local["encoder_hidden_states"].shape[1]).bool()
        refused("mask", lambda: run(joint_attention_kwargs={"attention_mask": mask}))
        model._load_ip_adapter_weights(_ip_adapter_state(model))
        types_after_load = _processor_types(model)
        refused("ip_adapter", lambda: run(joint_attention_kwargs={"ip_adapter_image_embeds": _ip_embeds()}))
        _unload_ip_adapter(model)
        after_unload = run()
        groups_after_unload = {p.group is group for p in model.attn_processors.values()}
        diffusers_cp = cp.FluxCPAttnProcessor()
        diffusers_cp._parallel_config = "set while no CP group"  # accepted without CP ...
        refused("parallel_config", lambda: setattr(diffusers_cp, "group", group))  # ... refused when CP joins
    return {
        "errors": errors,
        "types_after_load": types_after_load,
        "unload_err": (after_unload - expected).abs().max().item() / expected.abs().max().item(),
        "groups_after_unload": groups_after_unload,
        "types_after_unload": _processor_types(model),
    }


def test_under_cp_diffusers_features_work_or_are_refused_clearly():
    for r in distributed.run(_under_cp, 2, timeout=240):
        e = r["errors"]
        assert e["backend"] and "cannot apply under flux-cp's context parallelism over 2 ranks" in e["backend"], e
        assert e["mask"] and "attention masks are not supported with context parallelism" in e["mask"], e
        assert e["ip_adapter"] and "FluxIPAdapterAttnProcessor" in e["ip_adapter"], e
        assert "unload_ip_adapter()" in e["ip_adapter"], e
        assert e["parallel_config"] and "enable_parallelism" in e["parallel_config"], e
        assert e["parallel_config_set"] and "enable_parallelism" in e["parallel_config_set"], e
        assert r["types_after_load"] == {"FluxIPAdapterAttnProcessor", "FluxCPAttnProcessor"}
        # After unload_ip_adapter CP works again: every processor is ours, on the model's group, and exact.
        assert r["types_after_unload"] == {"FluxCPAttnProcessor"} and r["groups_after_unload"] == {True}
        assert r["unload_err"] < 2e-5, r["unload_err"]


def test_remove_context_parallel_restores_diffusers_processors():
    model = cp.apply_context_parallel(tiny_transformer(seed=0), None)
    cp.remove_context_parallel(model)
    assert all(type(p) is FluxAttnProcessor for p in model.attn_processors.values())
