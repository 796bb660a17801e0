"""The compiled Ulysses head-chunk pipeline on a GPU, bf16: the later chunks' q, k and v arrive interleaved in one
buffer and go to cuDNN as they are, the output and gradients come back dense; the result matches attention in fp32.
One GPU: a one-rank NCCL group keeps the exchanges in the graph (each rank's part is then the whole sequence)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from cp import Tuning, kernels
from cp.mode import CallSpec
from cp.schedule import inductor_options
from cp.ulysses import ulysses_traced

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize(
    "chunks, mode", [(1, None), (2, None), (4, None), (2, "reduce-overhead")], ids=["1", "2", "4", "2-cudagraphs"]
)
def test_compiled_head_chunks_match_fp32_attention(one_rank_group, chunks, mode):
    """In 1, 2 and 4 chunks with the head start (`--cp_exchange_first`), and in 2 as CUDA graphs (the trainer's
    --compile_mode reduce-overhead), whose third call replays the recorded graphs."""
    g = torch.Generator(device="cuda").manual_seed(chunks)
    q, k, v, dout = (torch.randn(1, 4608, 24, 128, device="cuda", dtype=torch.bfloat16, generator=g) for _ in "qkvd")
    scale = 128**-0.5
    options = {**inductor_options(mode, Tuning(exchange_first=True), 2), "fx_graph_cache": False}
    torch._dynamo.reset()
    attention = torch.compile(
        lambda a, b, c: ulysses_traced(a, b, c, CallSpec(scale, 1, one_rank_group.group_name, "", chunks, "", True)),
        fullgraph=True,
        options=options,
    )
    for _ in range(3 if mode else 1):
        torch.compiler.cudagraph_mark_step_begin()
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = attention(*leaves)
        out.backward(dout)
    got = [out.detach().clone(), *(t.grad.clone() for t in leaves)]
    if mode:  # free the recorded graphs: with them alive, destroying the group at teardown hung (torch 2.11)
        from torch._inductor.cudagraph_trees import reset_cudagraph_trees

        del attention, out, leaves
        torch._dynamo.reset()
        reset_cudagraph_trees()
        torch.cuda.synchronize()
    assert kernels.chosen_kernels() and set(kernels.chosen_kernels().values()) == {"cudnn"}

    ref = [t.float().requires_grad_(True) for t in (q, k, v)]
    ref_out = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in ref), scale=scale).transpose(1, 2)
    ref_out.backward(dout.float())
    for mine, want in zip(got, [ref_out, *(t.grad for t in ref)]):
        err = ((mine.float() - want).abs().max() / want.abs().max()).item()
        assert err < 2e-2, f"{chunks} chunks: relative error {err:.3g}"
