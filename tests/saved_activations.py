"""What a transformer block keeps for its backward, counted on CPU in units of one token's bf16 hidden state (2 x D
bytes per token): eager (the tensors autograd saves) and compiled (what the min-cut partitioner Inductor uses passes
from a block's forward graph to its backward graph). The planner's `block_keeps` (flux_cp/plan/plan_data.json) are
these counts; tests/test_plan.py recounts them.

The models are FLUX.1's and FLUX.2's transformers with one or two blocks of each kind at head size 128 (as the
released models: what is kept per head, such as the attention's log-sum-exp, weighs as there), bf16 frozen weights,
fp32 LoRA adapters of rank 2 under bf16 autocast, as the trainer runs them. Only tensors with a token dimension
count (token counts are chosen to match no other size): parameters, their casts and the per-sample modulation are
not activations, and the RoPE tables are shared by every block.
"""

from __future__ import annotations

import functools

import torch
from peft import LoraConfig

import cp
from flux_cp.model.blocks import checkpoint_inside, transformer_blocks

HEADS, HEAD_DIM = 2, 128
D = HEADS * HEAD_DIM
LATENT = 30  # latent side: (30 / 2)^2 = 225 image tokens, 91% of the sequence as at 1024 px (89%)
IMAGE, TEXT = (LATENT // 2) ** 2, 23
TOKENS = IMAGE + TEXT
TOKEN_SIZES = {IMAGE, TEXT, TOKENS}
UNIT = TOKENS * D * 2

# FLUX.2's default LoRA targets (diffusers' FLUX.2 LoRA example): the double blocks' image attention, the single
# blocks' fused qkv + MLP input, and each single block's fused output (named per block).
FLUX2_TARGETS = ("to_k", "to_q", "to_v", "to_out.0", "to_qkv_mlp_proj")


def flux2_targets(single_blocks: int) -> tuple[str, ...]:
    return (*FLUX2_TARGETS, *(f"single_transformer_blocks.{i}.attn.to_out" for i in range(single_blocks)))


def _model(family: str, double: int, single: int) -> torch.nn.Module:
    torch.manual_seed(0)
    if family == "flux1":
        from flux_cp.families.flux1.tiny import tiny_transformer

        return tiny_transformer(num_layers=double, num_single_layers=single, num_attention_heads=HEADS,
                                attention_head_dim=HEAD_DIM, axes_dims_rope=(16, 56, 56), joint_attention_dim=64,
                                pooled_projection_dim=32)  # fmt: skip
    from diffusers import Flux2Transformer2DModel

    return Flux2Transformer2DModel(patch_size=1, in_channels=16, num_layers=double, num_single_layers=single,
                                   attention_head_dim=HEAD_DIM, num_attention_heads=HEADS, joint_attention_dim=48,
                                   timestep_guidance_channels=32, mlp_ratio=3.0, axes_dims_rope=(32, 32, 32, 32),
                                   guidance_embeds=True)  # fmt: skip


def _inputs(family: str) -> dict:
    from flux_cp.families.flux1.tokens import image_ids, pack_latents, text_ids

    g = torch.Generator().manual_seed(0)
    if family == "flux1":
        return dict(hidden_states=pack_latents(torch.randn(1, 4, LATENT, LATENT, generator=g)).bfloat16(),
                    encoder_hidden_states=torch.randn(1, TEXT, 64, generator=g).bfloat16(),
                    pooled_projections=torch.randn(1, 32, generator=g).bfloat16(), timestep=torch.rand(1, generator=g),
                    guidance=torch.full((1,), 3.5), img_ids=image_ids(LATENT, LATENT),
                    txt_ids=text_ids(TEXT))  # fmt: skip
    side = LATENT // 2
    ids = torch.zeros(IMAGE, 4, dtype=torch.long)
    ids[:, 1], ids[:, 2] = torch.arange(IMAGE) // side, torch.arange(IMAGE) % side
    return dict(hidden_states=torch.randn(1, IMAGE, 16, generator=g).bfloat16(),
                encoder_hidden_states=torch.randn(1, TEXT, 48, generator=g).bfloat16(),
                timestep=torch.rand(1, generator=g), guidance=torch.full((1,), 3.5), img_ids=ids,
                txt_ids=torch.zeros(TEXT, 4, dtype=torch.long))  # fmt: skip


def _prepared(
    family: str, targets: tuple[str, ...], double: int, single: int, adapter: str = "lora"
) -> torch.nn.Module:
    from flux_cp.model.adapters import peft_config

    model = _model(family, double, single).to(torch.bfloat16)
    model.requires_grad_(False)
    model.add_adapter(
        LoraConfig(r=2, target_modules=list(targets))
        if adapter == "lora"
        else peft_config(adapter, 2, 2, 0.0, list(targets))
    )
    cp.apply_context_parallel(model, None)
    for p in model.parameters():
        if p.requires_grad:
            p.data = p.data.float()
    return model


def _is_activation(t: torch.Tensor) -> bool:
    return bool(set(t.shape) & TOKEN_SIZES)


def eager_units(family: str, targets: tuple[str, ...], adapter: str = "lora") -> dict[str, float]:
    """{block kind: units autograd saves for one block of that kind}, from models with one more block of it;
    `adapter`: --adapter's kind on `targets`."""

    def saved(double: int, single: int) -> float:
        model = _prepared(family, targets, double, single, adapter)
        storages = {}

        def pack(t):
            if not (t.is_leaf and t.requires_grad) and _is_activation(t):
                storages[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
            model(**_inputs(family))
        return sum(storages.values()) / UNIT

    base = saved(1, 1)
    return {"double": saved(2, 1) - base, "single": saved(1, 2) - base}


def compiled_units(family: str, targets: tuple[str, ...], checkpointed: bool = False) -> dict[str, float]:
    """{block kind: units a compiled block of that kind passes from its forward to its backward graph}, with the
    partitioner Inductor uses; `checkpointed`: the block checkpointed inside its graph (flux_cp.model.blocks)."""
    from functorch.compile import make_boxed_func
    from torch._dynamo.backends.common import aot_autograd
    from torch._functorch.partitioners import min_cut_rematerialization_partition

    model = _prepared(family, targets, 1, 1)
    saved: list[float] = []  # one per backward graph, compiled in the order the backward runs: single, then double

    def backward_compiler(gm, _inputs):
        total = 0
        for node in gm.graph.find_nodes(op="placeholder"):
            v = node.meta.get("val")
            if node.name.startswith("tangents") or not isinstance(v, torch.Tensor) or not _is_activation(v):
                continue
            if node.name.startswith("primals") and v.dtype == torch.float32 and v.shape[-1] == HEAD_DIM:
                continue  # the RoPE tables: one pair shared by every block
            total += v.numel() * v.element_size()
        saved.append(total / UNIT)
        return make_boxed_func(gm.forward)

    partition = functools.partial(min_cut_rematerialization_partition, compiler="inductor")
    backend = aot_autograd(fw_compiler=lambda gm, _: make_boxed_func(gm.forward), bw_compiler=backward_compiler,
                           partition_fn=partition)  # fmt: skip
    torch._dynamo.reset()
    for block in transformer_blocks(model):
        if checkpointed:
            checkpoint_inside(block)
        block.compile(backend=backend)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(**_inputs(family))[0]
    out.float().square().mean().backward()
    torch._dynamo.reset()
    single, double = saved
    return {"double": double, "single": single}
