"""The scheduling pass of `--cp_overlap fill` (cp/schedule.py) on a schedule shaped like a single Flux block's
backward at FLUX.1 width: the order stays a valid one, and compute that needs no exchange moves beside each
exchange. The pass inside Inductor, with exactness: tests/test_cp_compile.py."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from cp import schedule as overlap


@dataclass(eq=False)
class Node:
    name: str
    needs: tuple[str, ...] = ()
    us: float = 0.0  # estimated time: of the exchange for a collective, else of the compute
    kind: str = "compute"  # compute, collective, wait
    ancestors: set[str] = field(default_factory=set)

    def get_operation_names(self) -> set[str]:
        return {self.name}


def _schedule() -> list[Node]:
    """Autograd's order for a single block's backward with the attention kept (us at 2048 px, measured sizes):
    the output's gradient is exchanged, the attention's backward runs, the gradients of q, k, v go back, the
    q/k/v projections' backward needs them; the feed-forward branch (recomputed proj_mlp, GELU's backward, the
    input gradient of proj_mlp) needs none of that and comes last."""
    spec = [
        ("proj_out_dx", (), 900, "compute"),
        ("a2a_out", ("proj_out_dx",), 120, "collective"),
        ("wait_out", ("a2a_out",), 0, "wait"),
        ("attn_bwd", ("wait_out",), 8100, "compute"),
        ("a2a_dq", ("attn_bwd",), 120, "collective"),
        ("wait_dq", ("a2a_dq",), 0, "wait"),
        ("a2a_dk", ("attn_bwd", "wait_dq"), 150, "collective"),  # Inductor chains each collective to the last wait
        ("wait_dk", ("a2a_dk",), 0, "wait"),
        ("a2a_dv", ("attn_bwd", "wait_dk"), 170, "collective"),
        ("wait_dv", ("a2a_dv",), 0, "wait"),
        ("q_dx", ("wait_dq",), 60, "compute"),
        ("k_dx", ("wait_dk",), 60, "compute"),
        ("v_dx", ("wait_dv",), 60, "compute"),
        ("mlp_recompute", (), 1070, "compute"),
        ("gelu_bwd", ("mlp_recompute", "proj_out_dx"), 180, "compute"),
        ("mlp_dx_a", ("gelu_bwd",), 400, "compute"),
        ("mlp_dx_b", ("gelu_bwd",), 400, "compute"),
        ("norm_bwd", ("q_dx", "k_dx", "v_dx", "mlp_dx_a", "mlp_dx_b"), 100, "compute"),
    ]
    nodes = {name: Node(name, needs, us, kind) for name, needs, us, kind in spec}
    for node in nodes.values():  # transitive, as Inductor's scheduler computes them
        stack = list(node.needs)
        while stack:
            n = stack.pop()
            if n not in node.ancestors:
                node.ancestors.add(n)
                stack.extend(nodes[n].needs)
    return list(nodes.values())


def _fill(nodes: list[Node]) -> tuple[list[Node], int]:
    kinds = overlap.NodeKinds(
        lambda n: n.kind == "collective", lambda n: n.kind == "wait", lambda n: n.us, lambda n: n.us
    )
    return overlap.fill(nodes, kinds)


def test_fill_keeps_every_dependency_and_the_order_of_the_exchanges():
    nodes = _schedule()
    order, moved = _fill(nodes)
    assert sorted(n.name for n in order) == sorted(n.name for n in nodes) and len(order) == len(nodes)
    position = {n.name: i for i, n in enumerate(order)}
    for n in order:
        assert all(position[a] < position[n.name] for a in n.ancestors), n.name
    comms = [n.name for n in nodes if n.kind != "compute"]
    assert [n.name for n in order if n.kind != "compute"] == comms
    assert moved > 0


def test_fill_puts_independent_compute_beside_each_exchange():
    order, _ = _fill(_schedule())
    names = [n.name for n in order]
    beside = {}
    for exchange in ("out", "dq", "dk", "dv"):
        start, end = names.index(f"a2a_{exchange}"), names.index(f"wait_{exchange}")
        beside[exchange] = names[start + 1 : end]
    # before: every exchange waited for at once, the feed-forward branch after all of them
    before = [n.name for n in _schedule()]
    assert all(before.index(f"wait_{e}") == before.index(f"a2a_{e}") + 1 for e in beside)
    assert beside["out"] == ["mlp_recompute"], beside  # ready and large enough: 1,070 us beside 120 us
    assert beside["dq"] == ["gelu_bwd"], beside
    # q's projection backward is ready once dq arrived: it goes beside the exchange of dk, with the next branch node
    assert beside["dk"] == ["q_dx", "mlp_dx_a"] and beside["dv"] == ["k_dx", "mlp_dx_b"], beside
    # what needs an exchange's result still comes after its wait
    assert names.index("q_dx") > names.index("wait_dq") and names.index("norm_bwd") == len(names) - 1


def test_fill_stops_once_an_exchange_is_covered():
    """Compute is placed until 90% of the exchange's estimated time is covered, not beyond: small nodes first in
    schedule order, and the rest stays where it was for the exchanges after it."""
    nodes = [
        Node("a2a", (), 100, "collective"),
        Node("wait", ("a2a",), 0, "wait"),
        Node("small_1", (), 50),
        Node("small_2", (), 45),
        Node("big", (), 1000),
    ]
    for n in nodes:
        n.ancestors = set(n.needs)
    order, moved = _fill(nodes)
    assert [n.name for n in order] == ["a2a", "small_1", "small_2", "wait", "big"] and moved == 2


def test_fill_exchanges_keeps_inductors_order_when_its_ir_changes(caplog):
    nodes = [object(), object()]
    with caplog.at_level(logging.WARNING, logger="cp.schedule"):
        assert overlap.fill_exchanges(nodes) is nodes
    assert "kept Inductor's order" in caplog.text


class _Buffer:
    def __init__(self, *size: int) -> None:
        self.size = list(size)

    def get_size(self) -> list[int]:
        return self.size


class _Op:
    def __init__(self, op, *inputs: _Buffer) -> None:
        self.op_overload, self.inputs, self.constant_args = op, list(inputs), (0.125, "")


def test_the_cost_model_counts_the_attention_ops():
    """Inductor counts no FLOPs for a custom op; without its own count the model would take the CP attention for a
    short kernel and leave exchanges beside it counted as exposed (b=1, 12 heads, 16,896 tokens, head_dim 128)."""
    import torch

    import cp.ring  # noqa: F401 - registers torch.ops.cp

    x = _Buffer(1, 12, 16896, 128)
    forward = overlap._attention_flops(_Op(torch.ops.cp.ring_attention.default, x, x, x))
    backward = overlap._attention_flops(_Op(torch.ops.cp.ring_attention_backward.default, x, x, x, x, x))
    assert forward == 4 * 12 * 16896**2 * 128 and backward == 2.5 * forward
    assert 2e-3 < forward / overlap.FLOPS_PER_S < 4e-3  # measured on one H200: 2.7 ms
    assert overlap._attention_flops(_Op(torch.ops.aten.mm.default, x, x)) == 0
