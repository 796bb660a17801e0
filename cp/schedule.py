"""How a compiled block orders its CP exchanges against its compute: the Inductor options for each
`Tuning.overlap` (`inductor_options`), and our own scheduling pass (`fill`, the default).

A block's backward comes out of AOTAutograd in autograd's order: in a single block the attention branch (later in
the forward) first, with its four all-to-alls, then the feed-forward branch, which needs none of them. Inductor's
own passes only move a collective and its wait within that order, so on the GPU the exchanges ran with nothing
beside them while the feed-forward backward waited behind them (benchmarks/archive/NOTES.md). `fill_exchanges` walks the
schedule and, right after each collective is issued, places compute that is ready (all its inputs computed), in
schedule order, until a cost model says the exchange is covered; waits, collectives and everything else keep their
order. Two policies are tried (take what is ready next; or leave a node much longer than the exchange for a later
one), and the order whose exchanges the model finds least exposed is kept, Inductor's own order included. Only the
order changes, never what is computed, so results are the same to the bit.

The cost model is ours rather than Inductor's, so that the order is the same on any device: an exchange moves
(cp - 1) / cp of its tensor at `EXCHANGE_BYTES_PER_S` after `EXCHANGE_LATENCY_S`; compute takes its FLOPs at
`FLOPS_PER_S` plus its memory traffic at `MEMORY_BYTES_PER_S` (H200 figures: 115-170 us measured for 26 MB per
exchange between two GPUs, bf16 dense peak, HBM bandwidth). `benchmarks/archive/schedule.py` prints the orders.

Placing compute beside an exchange is not enough on its own: a matrix product's kernel takes every streaming
multiprocessor (SM) until it ends, so an exchange kernel that becomes ready together with it waits for its end,
even when launched first (`benchmarks/archive/probe_sms.py`). With `Tuning.exchange_first`, `head_starts` makes the
generated code call `cp.comm.head_start` after each exchange's launch and wait, so that the exchange kernel is
dispatched first and the product runs beside it on the other SMs.

The generated code imports nothing but torch and `cp`.
"""

from __future__ import annotations

import functools
import hashlib
import logging
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any, NamedTuple

from .mode import group_by_name
from .tuning import Tuning

EXCHANGE_BYTES_PER_S = 190e9
EXCHANGE_LATENCY_S = 15e-6
FLOPS_PER_S = 700e12
MEMORY_BYTES_PER_S = 3e12
COVERED = 0.9  # an exchange counts as hidden once compute for 90% of its estimated time runs beside it
OVERSHOOTS = (None, 2.0)  # the policies tried: see fill_exchanges

log = logging.getLogger(__name__)

# The passes' own code, as their version: Inductor's graph cache (on disk, kept between runs) keys a compiled graph
# by its config, where the passes are named by reference, not by their code; with this in their arguments, a graph
# compiled with another version of them is compiled again rather than reused.
PASSES_VERSION = hashlib.sha256(Path(__file__).read_bytes()).hexdigest()[:16]


def _bytes(snode) -> int:
    try:
        size = snode.get_read_write_buffers_sizes()
    except Exception:  # an Inductor version without the helper, or a node it cannot size
        return 0
    return int(sum(size.values()) if isinstance(size, dict) else size)


# FLOPs of the CP attention ops per batch x head x query x key x head_dim: the two products of the forward; the
# backward's five (it recomputes the scores), about what cuDNN's kernels take on an H200 (2.8x the forward).
ATTENTION_FLOPS = {"cp::ring_attention": 4, "cp::ring_attention_backward": 10}


def _size(x) -> int:
    try:
        return int(x)
    except TypeError:  # a symbolic size: Inductor's hint for it
        from torch._inductor.virtualized import V

        return V.graph.sizevars.optimization_hint(x)


def _attention_flops(ir_node) -> float:
    """FLOPs of a CP attention op (Inductor counts none for a custom op), over the whole ring when it has one."""
    op = getattr(ir_node, "op_overload", None)
    name = op.name() if hasattr(op, "name") else ""
    if name not in ATTENTION_FLOPS:
        return 0.0
    q, k = ir_node.inputs[1:3] if name.endswith("_backward") else ir_node.inputs[:2]  # the backward's first: dout
    b, h, s, d = (_size(x) for x in q.get_size())
    group_name = next((a for a in ir_node.constant_args if isinstance(a, str)), "")
    ring = 1
    if group_name:
        ring = group_by_name(group_name).size()
    return float(ATTENTION_FLOPS[name] * b * h * s * _size(k.get_size()[2]) * ring * d)


def estimate_compute(snode) -> float:
    """Seconds an Inductor scheduler node's compute takes by the cost model."""
    flops = 0.0
    for node in snode.get_nodes():
        try:
            flops += node.estimate_flops() or _attention_flops(node.node)
        except Exception:
            pass
    return flops / FLOPS_PER_S + _bytes(snode) / MEMORY_BYTES_PER_S


def estimate_exchange(snode, cp: int) -> float:
    """Seconds a collective node's exchange takes by the cost model: it reads the tensor and writes one of the
    same size, and (cp - 1) / cp of it crosses to other ranks."""
    return EXCHANGE_LATENCY_S + _bytes(snode) / 2 * (cp - 1) / cp / EXCHANGE_BYTES_PER_S


class NodeKinds(NamedTuple):
    """How the pass reads a schedule's nodes: Inductor's scheduler nodes in a compile, plain stand-ins in tests."""

    is_collective: Callable[[Any], bool]
    is_wait: Callable[[Any], bool]
    compute_cost: Callable[[Any], float]  # seconds
    exchange_cost: Callable[[Any], float]  # seconds


def fill_exchanges(snodes: list, cp: int = 2, version: str = "") -> list:
    """Reorder Inductor scheduler nodes: after each collective, ready compute until the exchange is covered. Two
    policies are tried (take whatever is ready next; or leave a node much longer than the exchange for a later
    one) and the order whose exchanges the cost model finds least exposed is kept, Inductor's own order included.
    `version`: `PASSES_VERSION`, for the cache key only."""
    try:
        from torch._inductor.utils import contains_collective, contains_wait

        kinds = NodeKinds(contains_collective, contains_wait, estimate_compute, partial(estimate_exchange, cp=cp))
        candidates = [(snodes, 0)] + [fill(snodes, kinds, overshoot=o) for o in OVERSHOOTS]
        scored = [(exposed(order, kinds), order, moved) for order, moved in candidates]
        after, order, placed = min(scored, key=lambda c: c[0])
        before = scored[0][0]
    except Exception as e:  # Inductor's scheduler IR is internal and changes: never fail a compile over an order
        log.warning("overlap fill: kept Inductor's order (%s: %s)", type(e).__name__, e)
        return snodes
    log.log(
        logging.INFO if placed else logging.DEBUG,
        "overlap fill: %d nodes moved beside the exchanges of a compiled graph (exposed by the cost model: %.0f -> "
        "%.0f us)",
        placed,
        before * 1e6,
        after * 1e6,
    )
    return order


def exposed(order: list, kinds: NodeKinds) -> float:
    """Estimated time of the exchanges with no compute beside them: compute issued between an exchange and the
    next wait runs beside it (Inductor issues one exchange after the previous one's wait)."""
    total, pending, beside = 0.0, None, 0.0
    for node in order:
        if kinds.is_collective(node):
            pending, beside = kinds.exchange_cost(node), 0.0
        elif kinds.is_wait(node):
            if pending is not None:
                total += max(0.0, pending - beside)
            pending = None
        elif pending is not None:
            beside += kinds.compute_cost(node)
    return total


def fill(nodes: list, kinds: NodeKinds, overshoot: float | None = None) -> tuple[list, int]:
    """The order, and how many nodes moved up beside an exchange. A node is ready when every operation in its
    `ancestors` has been placed; nodes keep their order otherwise, so every dependency still comes first. With
    `overshoot`, a node longer than `overshoot` times what is left of an exchange is left for a later exchange
    (not for the graph's last one)."""
    names = [set(n.get_operation_names()) for n in nodes]
    needs = [set(n.ancestors) - own for n, own in zip(nodes, names)]  # a fused node's ancestors list its own parts
    movable = [not (kinds.is_collective(n) or kinds.is_wait(n)) for n in nodes]
    last = max((i for i, n in enumerate(nodes) if kinds.is_collective(n)), default=-1)
    done: set[str] = set()
    placed = [False] * len(nodes)
    order: list = []
    moved = 0

    def place(i: int) -> None:
        placed[i] = True
        done.update(names[i])
        order.append(nodes[i])

    for i, node in enumerate(nodes):
        if placed[i]:
            continue
        place(i)
        if not kinds.is_collective(node):
            continue
        budget = kinds.exchange_cost(node)
        # stop near the mark rather than past it: the next exchange may need the next large node more
        enough = (1 - COVERED) * budget
        for j in range(i + 1, len(nodes)):
            if budget <= enough:
                break
            if placed[j] or not movable[j] or not needs[j] <= done:
                continue
            cost = kinds.compute_cost(nodes[j])
            if overshoot is not None and i < last and cost > overshoot * budget:
                continue
            place(j)
            moved += 1
            budget -= cost
    return order, moved


def head_starts(snodes: list, version: str = "") -> list:
    """An Inductor pass, after the reordering ones, that changes no order: the generated code calls
    `cp.comm.head_start` right after launching each collective and right after each wait (`Tuning.exchange_first`),
    so that a ready exchange kernel is dispatched before the compute behind it. `version`: `PASSES_VERSION`, for the
    cache key only."""
    try:
        from torch._inductor.utils import contains_collective, contains_wait

        starts = [n for n in snodes if contains_collective(n)]
        waits = [n for n in snodes if contains_wait(n) and not contains_collective(n)]
        if len(starts) != len(waits):
            raise ValueError(f"{len(starts)} collectives against {len(waits)} waits")
        for node in starts + waits:
            _call_after(node, "head_start")
    except Exception as e:  # Inductor's scheduler IR is internal: never fail a compile over these calls
        log.warning("exchange_first: left out of a compiled graph (%s: %s)", type(e).__name__, e)
        return snodes
    log.debug("exchange_first: head starts after %d exchanges and their waits", len(starts))
    return snodes


def _call_after(snode, name: str) -> None:
    """Make a scheduler node's code generation write a line calling `cp.comm.<name>()` after the node's own. The IR
    node's `codegen` is the one every Inductor version calls for an extern kernel."""
    node = snode.node
    codegen = node.codegen

    def with_call(wrapper) -> None:
        codegen(wrapper)
        wrapper.writeline(f"from cp.comm import {name}; {name}()")

    node.codegen = with_call


def inductor_options(mode: str | None, tuning: Tuning | str = "fill", cp_size: int = 2) -> dict:
    """Inductor options for a compiled block with CP exchanges over `cp_size` ranks: those of torch.compile's
    `mode`, plus how the exchanges are ordered against compute, by `tuning.overlap` (a `Tuning`, or the overlap
    alone):

    - "fill" (the default) starts each exchange as soon as its input exists and adds `fill_exchanges`, which moves
      ready compute, such as a block's feed-forward backward, beside each exchange by a cost model;
    - "passes" starts each exchange as soon as its input exists and waits for it only where its output is first read;
    - "compute" moves compute that does not need an exchange to run beside it, by Inductor's runtime estimates
      (`reorder_compute_for_overlap`, which exist on GPUs only);
    - "scheduler" is Inductor's estimate-driven overlap scheduler (GPU only);
    - "none" keeps the graph's order.

    `tuning.exchange_first` adds `head_starts`. Without CP (`cp_size` 1) none of this applies."""
    import torch._inductor

    tuning = Tuning(overlap=tuning) if isinstance(tuning, str) else tuning
    options = dict(torch._inductor.list_mode_options(mode)) if mode else {}
    if cp_size <= 1:
        return options
    passes: list = []
    if tuning.overlap == "passes":
        passes = ["sink_waits", "raise_comms"]
    elif tuning.overlap == "compute":
        passes = ["reorder_compute_for_overlap"]
    elif tuning.overlap == "fill":
        passes = ["raise_comms", functools.partial(fill_exchanges, cp=cp_size, version=PASSES_VERSION)]
    elif tuning.overlap == "scheduler":
        options["aten_distributed_optimizations.enable_overlap_scheduling"] = True
    if tuning.exchange_first:
        passes.append(functools.partial(head_starts, version=PASSES_VERSION))
    if passes:
        options["reorder_for_compute_comm_overlap"] = True
        options["reorder_for_compute_comm_overlap_passes"] = passes
    return options
