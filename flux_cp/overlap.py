"""An Inductor scheduling pass that puts compute beside the CP exchanges of a compiled block
(`FLUX_CP_OVERLAP=fill`, the default).

A block's backward comes out of AOTAutograd in autograd's order: in a single block the attention branch (later in
the forward) first, with its four all-to-alls, then the feed-forward branch, which needs none of them. Inductor's
own passes only move a collective and its wait within that order, so on the GPU the exchanges ran with nothing
beside them while the feed-forward backward waited behind them (benchmarks/NOTES.md). This pass walks the schedule
and, right after each collective is issued, places compute that is ready (all its inputs computed), in schedule
order, until a cost model says the exchange is covered; waits, collectives and everything else keep their order.
Two policies are tried (take what is ready next; or leave a node much longer than the exchange for a later one),
and the order whose exchanges the model finds least exposed is kept, Inductor's own order included. Only the
order changes, never what is computed, so results are the same to the bit.

The cost model is ours rather than Inductor's, so that the order is the same on any device: an exchange moves
(cp - 1) / cp of its tensor at `EXCHANGE_BYTES_PER_S` after `EXCHANGE_LATENCY_S`; compute takes its FLOPs at
`FLOPS_PER_S` plus its memory traffic at `MEMORY_BYTES_PER_S` (H200 figures: 115-170 us measured for 26 MB per
exchange between two GPUs, bf16 dense peak, HBM bandwidth). `benchmarks/schedule.py` prints the orders.

Placing compute beside an exchange is not enough on its own: a matrix product's kernel takes every streaming
multiprocessor (SM) until it ends, so an exchange kernel that becomes ready together with it waits for its end,
even when launched first (`benchmarks/probe_sms.py`). `around_exchanges` offers two remedies: with
`FLUX_CP_EXCHANGE_FIRST=1` the compute stream yields a moment after each exchange's launch and wait, so that the
exchange kernel is dispatched first and the product runs beside it on the other SMs; with `FLUX_CP_SM_CARVEOUT=N`
the products launched while an exchange is in flight leave N SMs free (torch's SM carveout, which cuBLASLt honours
and cuBLAS ignores), and no other product.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from functools import partial
from typing import Any, NamedTuple

import torch

from cp.comm import head_start

EXCHANGE_BYTES_PER_S = 190e9
EXCHANGE_LATENCY_S = 15e-6
FLOPS_PER_S = 700e12
MEMORY_BYTES_PER_S = 3e12
COVERED = 0.9  # an exchange counts as hidden once compute for 90% of its estimated time runs beside it
OVERSHOOTS = (None, 2.0)  # the policies tried: see fill_exchanges

log = logging.getLogger(__name__)


def _bytes(snode) -> int:
    try:
        size = snode.get_read_write_buffers_sizes()
    except Exception:  # an Inductor version without the helper, or a node it cannot size
        return 0
    return int(sum(size.values()) if isinstance(size, dict) else size)


# FLOPs of the CP attention ops per batch x head x query x key x head_dim: the two products of the forward; the
# backward's five (it recomputes the scores), about what cuDNN's kernels take on an H200 (2.8x the forward).
ATTENTION_FLOPS = {"flux_cp::ring_attention": 4, "flux_cp::ring_attention_backward": 10}


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
        from cp.ops import group_by_name

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


def fill_exchanges(snodes: list, cp: int = 2) -> list:
    """Reorder Inductor scheduler nodes: after each collective, ready compute until the exchange is covered. Two
    policies are tried (take whatever is ready next; or leave a node much longer than the exchange for a later
    one) and the order whose exchanges the cost model finds least exposed is kept, Inductor's own order included."""
    try:
        from torch._inductor.utils import contains_collective, contains_wait

        kinds = NodeKinds(contains_collective, contains_wait, estimate_compute, partial(estimate_exchange, cp=cp))
        candidates = [(snodes, 0)] + [fill(snodes, kinds, overshoot=o) for o in OVERSHOOTS]
        scored = [(exposed(order, kinds), order, moved) for order, moved in candidates]
        after, order, placed = min(scored, key=lambda c: c[0])
        before = scored[0][0]
    except Exception as e:  # Inductor's scheduler IR is internal and changes: never fail a compile over an order
        log.warning("FLUX_CP_OVERLAP=fill: kept Inductor's order (%s: %s)", type(e).__name__, e)
        return snodes
    STATS["graphs"] += 1
    STATS["placed"] += placed
    if placed:
        log.info(
            "FLUX_CP_OVERLAP=fill: %d nodes moved beside the exchanges of a compiled graph (exposed by the cost "
            "model: %.0f -> %.0f us)",
            placed,
            before * 1e6,
            after * 1e6,
        )
    return order


STATS = {"graphs": 0, "placed": 0, "marked": 0}  # what the passes did in this process (tests read it)


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


def around_exchanges(snodes: list, sms: int = 0, first: bool = False) -> list:
    """An Inductor pass, after `fill_exchanges`, that changes no order: the generated code calls
    `exchange_started` right after launching each collective and `exchange_waited` / `exchange_done` right
    before / after each wait. With `sms`, the products launched in between (on the GPU, beside the exchange) leave
    that many SMs free for it (FLUX_CP_SM_CARVEOUT); with `first`, the compute stream yields a moment after each
    launch and wait, so that a ready exchange kernel is dispatched before the compute behind it
    (FLUX_CP_EXCHANGE_FIRST, `cp.comm.head_start`)."""
    if not (sms or first):
        return snodes
    try:
        from torch._inductor.utils import contains_collective, contains_wait

        starts = [n for n in snodes if contains_collective(n)]
        waits = [n for n in snodes if contains_wait(n) and not contains_collective(n)]
        if len(starts) != len(waits):
            raise ValueError(f"{len(starts)} collectives against {len(waits)} waits")
        for node in starts:
            _write_around(node, after=f"exchange_started({int(sms)}, {bool(first)})")
        for node in waits:
            _write_around(node, before="exchange_waited()" if sms else "", after="exchange_done()" if first else "")
    except Exception as e:  # Inductor's scheduler IR is internal: never fail a compile over these calls
        log.warning(
            "FLUX_CP_SM_CARVEOUT / FLUX_CP_EXCHANGE_FIRST: left out of a compiled graph (%s: %s)", type(e).__name__, e
        )
        return snodes
    STATS["marked"] += len(starts)
    return snodes


def _write_around(snode, before: str = "", after: str = "") -> None:
    """Make a scheduler node's code generation write a line calling `before` / `after` (calls of this module).
    The IR node's `codegen` is the one every Inductor version calls for an extern kernel."""
    node = snode.node
    codegen = node.codegen

    def call(line: str) -> str:
        return f"from flux_cp.overlap import {line.split('(')[0]}; {line}"

    def with_calls(wrapper) -> None:
        if before:
            wrapper.writeline(call(before))
        codegen(wrapper)
        if after:
            wrapper.writeline(call(after))

    node.codegen = with_calls


_in_flight = 0  # exchanges launched and not yet waited for, as the generated code runs


def exchange_started(sms: int = 0, first: bool = False) -> None:
    """Called by compiled code after it launches an exchange: products from here leave `sms` SMs free; with
    `first`, the compute stream yields so that the exchange kernel starts before the next compute kernel."""
    global _in_flight
    if first:
        head_start()
    if not sms:
        return
    _in_flight += 1
    if _in_flight == 1:
        torch._C._set_sm_carveout_experimental(sms)


def exchange_done() -> None:
    """Called by compiled code after it waits for an exchange: the next exchange may be ready at this moment too."""
    head_start()


def exchange_waited() -> None:
    """Called by compiled code before it waits for an exchange: once none is in flight, products take every SM."""
    global _in_flight
    _in_flight = max(0, _in_flight - 1)
    if _in_flight == 0:
        torch._C._set_sm_carveout_experimental(None)
