"""torch.compile traces CP attention with fullgraph=True, forward and backward, and computes what eager does.

`aot_eager` runs dynamo and AOTAutograd (the custom ops, the functional collectives, the backward graph)
without code generation: cheap enough for every mode. One Flux block goes through Inductor itself.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch._dynamo.testing import CompileCounterWithBackend

import cp
from tests import distributed

pytestmark = pytest.mark.distributed  # spawns gloo process groups (tests/distributed.py)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.double() - b.double()).abs().max() / b.double().abs().max()).item()


def _compiled_attention_errors(rank: int, world: int, cases: list[tuple[str, int | None, int]]) -> dict:
    """Compiled against eager for each (mode, ulysses_size, Ulysses head chunks), each with its own `CPContext`.
    Chunked cases run at batch 1, the layout in which the exchanges and the kernel share memory without a copy."""
    group = dist.group.WORLD
    errors = {}
    for mode, u, chunks in cases:
        # the pipeline's head starts with the chunks (no-op on CPU)
        tuning = cp.Tuning(ulysses_chunks=chunks, exchange_first=chunks > 1)
        context = cp.CPContext(group, mode, u, tuning=tuning)
        key = (mode, u, chunks)
        g = torch.Generator().manual_seed(len(errors))
        shape = (2 if chunks == 1 else 1, 3 * world, 4 * world, 8)  # [batch, seq, heads, head_dim], full sequence
        full = [torch.randn(shape, generator=g, dtype=torch.float32) for _ in range(4)]
        q, k, v, dout = (cp.shard(t, 1, group) for t in full)

        def step(fn, q=q, k=k, v=v, dout=dout, context=context):
            leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
            out = fn(*leaves, context=context)
            out.backward(dout)
            return [out.detach()] + [t.grad for t in leaves]

        torch._dynamo.reset()
        eager = step(cp.attention)
        backend = CompileCounterWithBackend("aot_eager")
        compiled = step(torch.compile(cp.attention, backend=backend, fullgraph=True))
        errors[key] = max(_rel(a, b) for a, b in zip(compiled, eager))
        # the compiler saw the CP attention itself, not a call it could not look into
        code = "".join(gm.code for gm in backend.graphs)
        errors[(*key, "traced")] = "ops.cp.ring_attention" in code and (mode == "ring" or "all_to_all" in code)
    return errors


def test_attention_compiles_fullgraph_and_equals_eager():
    """Ring, Ulysses, and Ulysses in 2 and 4 head chunks."""
    cases = [
        ("ring", None, 1),
        ("ulysses", None, 1),
        ("ulysses", None, 2),
        ("ulysses", None, 4),
    ]
    for errs in distributed.run(_compiled_attention_errors, 2, cases):
        for case in cases:
            assert errs[(*case, "traced")], f"{case}: the compiled graph lacks the CP attention ops"
            assert errs[case] < 1e-6, f"{case}: compiled differs from eager by {errs[case]:.2e}"


def test_hybrid_attention_compiles_fullgraph_and_equals_eager():
    """Hybrid (Ulysses over 2, a ring over 2), in one head chunk and in 2."""
    cases = [("hybrid", 2, 1), ("hybrid", 2, 2)]
    for errs in distributed.run(_compiled_attention_errors, 4, cases, timeout=300):
        for case in cases:
            assert errs[(*case, "traced")] and errs[case] < 1e-6, (case, errs)


def _pipeline_order(rank: int, world: int, chunk_counts: list[int]) -> dict:
    return {c: _pipeline_order_in(world, c) for c in chunk_counts}


def _pipeline_order_in(world: int, chunks: int) -> dict:
    """Compile Ulysses attention with Inductor and the trainer's passes, in `chunks` head chunks, and read the
    generated code of the forward and the backward: for each attention kernel, whether an exchange is in flight
    beside it (launched before it, waited for after it); and whether the outputs and gradients equal eager."""
    from torch._inductor.utils import run_and_get_code

    from cp.schedule import inductor_options

    group = dist.group.WORLD
    context = cp.CPContext(group, "ulysses", tuning=cp.Tuning(ulysses_chunks=chunks))
    g = torch.Generator().manual_seed(0)
    full = [torch.randn(1, 4 * world, 4 * world, 8, generator=g) for _ in range(4)]  # [batch, seq, heads, dim]
    q, k, v, dout = (cp.shard(t, 1, group) for t in full)

    def step(fn):
        leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
        out = fn(*leaves, context=context)
        out.backward(dout)
        return [out.detach()] + [t.grad for t in leaves]

    eager = step(cp.attention)
    torch._dynamo.reset()  # the chunk count is read while tracing
    options = {**inductor_options(None, cp.Tuning(), world), "fx_graph_cache": False}  # a cached graph skips passes
    compiled, codes = run_and_get_code(step, torch.compile(cp.attention, fullgraph=True, options=options))
    return {"graphs": _exchanges_beside_attention(codes), "error": max(_rel(a, b) for a, b in zip(compiled, eager))}


def _exchanges_beside_attention(codes: list[str]) -> list[dict]:
    """For each generated graph (forward, backward): for each attention kernel, whether an exchange is in flight beside
    it (launched before it, waited for after it); and how many exchanges the graph launches."""
    graphs = []
    for code in codes:
        events = []
        for line in (line.strip() for line in code.splitlines()):
            if "= torch.ops._c10d_functional.all_to_all_single." in line:
                events.append("launch")
            elif line.startswith("torch.ops._c10d_functional.wait_tensor."):
                events.append("wait")
            elif "= torch.ops.cp.ring_attention" in line:
                events.append("attention")
        beside, in_flight = [], False
        for e in events:
            in_flight = e == "launch" or (in_flight and e != "wait")
            if e == "attention":
                beside.append(in_flight)
        graphs.append({"beside": beside, "exchanges": events.count("launch")})
    return graphs


def test_compiled_head_chunks_pipeline_the_exchanges():
    """In 2 head chunks each attention kernel, forward and backward, has an exchange in flight beside it (the later
    chunks' q, k, v beside the first chunk's attention, its output beside the next one's). In one chunk none has:
    checked on the compiled Flux block below (one head chunk, the default)."""
    for by_chunks in distributed.run(_pipeline_order, 2, [2], timeout=300):
        two = by_chunks[2]
        assert two["error"] < 1e-6, by_chunks
        assert [g["beside"] for g in two["graphs"]] == [[True, True], [True, True]], two
        assert [g["exchanges"] for g in two["graphs"]] == [6, 6], two  # q, k, v, the rest, two outputs; mirrored


def _compiled_block_errors(rank: int, world: int, mode: str) -> dict:
    """A tiny Flux single block (the joint text and image sequence, RoPE, LoRA) with CP, `torch.compile(fullgraph=
    True)` with Inductor, the `fill` scheduling pass and the exchanges' head starts (`Tuning.exchange_first`), in one
    head chunk, against the same block in eager mode: outputs and every parameter gradient (all-reduced over the
    group); what the passes did (from their log records), where the generated code gives each exchange its head start,
    and which exchanges are in flight beside the attention. The trainer test compiles every block, double ones too,
    with the default passes (tests/test_train.py); a single block is half the C++ kernels of a double one."""
    import logging

    from torch._inductor.utils import run_and_get_code

    from cp.schedule import inductor_options
    from tests.distributed import HEADS, flux_inputs, flux_model

    group = dist.group.WORLD
    tuning = cp.Tuning(exchange_first=True)
    model = flux_model()
    cp.apply_context_parallel(model, cp.CPContext(group, mode, tuning=tuning))
    inputs = flux_inputs(batch=1)
    hidden = cp.shard(model.x_embedder(inputs["hidden_states"]), 1, group).detach()
    text = cp.shard(model.context_embedder(inputs["encoder_hidden_states"]), 1, group).detach()
    temb = model.time_text_embed(inputs["timestep"], inputs["guidance"], inputs["pooled_projections"]).detach()
    ids = torch.cat([inputs["txt_ids"], inputs["img_ids"]])
    rope = model.pos_embed(torch.cat([cp.shard(inputs["txt_ids"], 0, group), cp.shard(inputs["img_ids"], 0, group)]))
    assert ids.shape[0] % world == 0 and HEADS % world == 0
    block = model.single_transformer_blocks[0]

    def run(fn):
        model.zero_grad()
        enc, hid = fn(hidden_states=hidden, encoder_hidden_states=text, temb=temb, image_rotary_emb=rope)
        (hid.square().mean() + enc.square().mean()).backward()
        grads = {}
        for n, p in model.named_parameters():
            if p.grad is not None:
                g = p.grad.clone()
                dist.all_reduce(g)
                grads[n] = g
        return [hid.detach(), enc.detach()], grads

    class Records(logging.Handler):
        def __init__(self):
            super().__init__(logging.DEBUG)
            self.messages: list[str] = []

        def emit(self, record):
            self.messages.append(record.getMessage())

    records = Records()
    log = logging.getLogger("cp.schedule")
    log.addHandler(records)
    log.setLevel(logging.DEBUG)
    eager_out, eager_grads = run(block)
    torch._dynamo.reset()
    options = {**inductor_options(None, tuning, world), "fx_graph_cache": False}  # a cached graph skips the passes
    (compiled_out, compiled_grads), codes = run_and_get_code(run, torch.compile(block, fullgraph=True, options=options))
    assert eager_grads.keys() == compiled_grads.keys() and eager_grads
    fills = [m for m in records.messages if m.startswith("overlap fill:")]
    marked = [int(m.split()[4]) for m in records.messages if m.startswith("exchange_first: head starts after")]
    return {
        "graphs": len(fills),
        "placed": sum(int(m.split()[2]) for m in fills),
        "marked": sum(marked),
        "head_starts": _head_starts(codes),
        "beside": [g["beside"] for g in _exchanges_beside_attention(codes)],
        "out": max(_rel(a, b) for a, b in zip(compiled_out, eager_out)),
        "grad": max(_rel(compiled_grads[n], eager_grads[n]) for n in eager_grads),
        "n_grads": len(eager_grads),
    }


def _head_starts(codes: list[str]) -> dict:
    """In generated code: whether every exchange and every wait is followed by `head_start()`, and whether the code
    imports anything of flux_cp."""
    counts = {"exchanges": 0, "after_each_exchange": True, "after_each_wait": True, "flux_cp": False}
    for code in codes:
        counts["flux_cp"] |= "flux_cp" in code
        lines = [line.strip() for line in code.splitlines()]
        lines = [line for line in lines if line and not line.startswith(("#", "assert_"))]
        for i, line in enumerate(lines):
            if "= torch.ops._c10d_functional.all_to_all_single." in line:
                counts["exchanges"] += 1
                counts["after_each_exchange"] &= lines[i + 1] == "from cp.comm import head_start; head_start()"
            elif line.startswith("torch.ops._c10d_functional.wait_tensor."):
                counts["after_each_wait"] &= lines[i + 1] == "from cp.comm import head_start; head_start()"
    return counts


def test_flux_block_compiles_fullgraph_with_inductor_and_equals_eager():
    for r in distributed.run(_compiled_block_errors, 2, "ulysses", timeout=600):
        assert r["n_grads"] >= 8, r
        assert r["graphs"] == 2 and r["placed"] > 0, r  # the pass reordered the forward and the backward
        assert r["marked"] == r["head_starts"]["exchanges"] > 0, r  # both graphs' exchanges, forward and backward
        assert r["head_starts"]["after_each_exchange"] and r["head_starts"]["after_each_wait"], r
        assert not r["head_starts"]["flux_cp"], r  # the generated code needs cp alone
        assert r["beside"] == [[False], [False]], r  # one head chunk: no exchange in flight beside the attention
        assert r["out"] < 1e-5 and r["grad"] < 1e-4, r


def test_compiled_backward_keeps_no_tensor_of_a_forward(monkeypatch):
    """The compiled path's backward op finds the forward's aux by shape; tensors in it must not be kept alive (a
    CUDA graph tree refuses live tensors of its pool), so they come back as fresh zero-filled tensors."""
    from cp import kernels

    def forward(q, k, v, scale):
        out, lse, _ = kernels._math_forward(q, k, v, scale)
        return out, lse, (torch.ones(2, dtype=torch.int64), None, 7)

    monkeypatch.setitem(kernels.KERNELS, "probe", kernels.Kernel("probe", forward, kernels._math_backward))
    choice = kernels.KernelChoice(("probe",))
    q, k, v = (torch.randn(1, 2, 5, 4) for _ in range(3))
    choice.forward(q, k, v, 0.5)
    kept = choice._last[kernels._shape_key(q, k)]
    assert not any(isinstance(a, torch.Tensor) for a in kept[1]), kept
    kernel, aux = choice.used_for(q, k)
    assert kernel.name == "probe" and aux[1:] == (None, 7)
    assert torch.equal(aux[0], torch.zeros(2, dtype=torch.int64))
