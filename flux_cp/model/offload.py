"""Exact block offload (`--offload_blocks N|auto`): the frozen weights of N transformer blocks live in pinned host
memory, and each is copied to the GPU on a side stream ahead of its use, forward and backward. The math does not
change: every block computes with its own weights, bit for bit, so losses and LoRA weights equal those of the same
run without offload.

**Slots.** The blocks of one kind (FLUX.1 and FLUX.2: double and single; blocks are grouped by the shapes and dtypes
of their frozen tensors) share `SLOTS` slots on the GPU: one set of tensors shaped like one block's frozen tensors.
Each offloaded block owns one slot for good (the j-th offloaded block of a kind: slot j mod SLOTS), and its frozen
parameters *are* that slot's tensors (`.data` points at them): their addresses never change, so torch.compile's
graphs, CUDA graphs (static parameter addresses) and autograd's saved tensors keep working, and nothing is allocated
per step. A block's true values live in its home: one page-locked host buffer per block, exactly its size. Copies
write the slot's own tensor objects, never the parameters, so the parameters' autograd version counters do not move
and tensors saved for the backward stay valid; correctness rests on the schedule below. Frozen tensors are handled
as the plain tensors they are made of: a torchao wrapper subclass (Int8Tensor, Float8Tensor) by its
`__tensor_flatten__` inner tensors, a bitsandbytes Params4bit by its packed data and its quant_state's tensors; a
tensor whose storage another tensor shares stays on the GPU.

**Schedule.** Whenever a block computes (forward, its recomputation under gradient checkpointing, backward), its
slot holds its weights:

- forward: a pre-hook of each offloaded block makes the compute stream wait for its copy, then copies the next
  offloaded blocks, in the order they run, into their slots as far as the slots are free: a slot is free once every
  use of its occupant has been enqueued on the compute stream (its forward returned) and the copy stream waits for
  that point (an event) before overwriting it;
- backward: a hook on the gradient of each block's outputs fires before any of the block's backward nodes run (its
  recomputation and a compiled block's backward graph included); it does the same in the reverse order. The autograd
  engine runs a block's nodes only after those of every block that ran later in the forward, so when the hook of
  block i fires, the backward of every later block is enqueued and their slots are free;
- the last offloaded blocks of a forward are still in their slots when the backward starts with them, and the first
  ones when the next forward starts: per kind, SLOTS blocks fewer are copied each way (`OffloadPlan.moved_bytes`).

The hooks run outside compiled graphs (torch.compiler.disable): a compiled block, or its CUDA graph replayed, reads
its slot after the compute stream waited for the copy. A forward under no_grad (validation) is the forward alone;
each forward of the transformer starts the schedule again, so gradient accumulation is a sequence of forward/backward
pairs. Other orders (two forwards before their backwards, a kept graph's second backward) stay exact: a block whose
slot does not hold it when due is copied then, unprefetched. Without CUDA (tests) there are no
streams: the copies run when issued, the earliest the schedule allows, and `debug` checks at every use that the slot
holds its block's bytes.

Which blocks: the kind with more blocks first (FLUX.1: 38 single against 19 double; FLUX.2: 48 against 8), spread
evenly over that kind's blocks so that resident blocks sit between the offloaded ones and their compute hides the
copies, then the other kind likewise. Offloading n blocks of a kind saves n - SLOTS of them (the slots take the
rest): fewer than SLOTS + 1 saves nothing.
"""

from __future__ import annotations

import functools
import itertools
import weakref
from collections.abc import Callable, Iterable

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from flux_cp.errors import UsageError
from flux_cp.families.base import blocks_of
from flux_cp.model.blocks import transformer_blocks
from flux_cp.model.offload_plan import GIB, SLOTS, OffloadPlan, choose_offloaded

Tensor = torch.Tensor

_ALIGN = 512  # bytes: each tensor of a home starts at a multiple (the CUDA caching allocator's alignment)
_PAGE = 4096


# --- the flag ---------------------------------------------------------------------------------------------------


# --- the plan: which blocks, and what it saves and moves ---------------------------------------------------------


def block_kinds(transformer: torch.nn.Module) -> list[str]:
    """The kind of every block (FLUX.1 and FLUX.2: 'double' or 'single'), in the order they run (its family's block
    lists)."""
    return [kind for kind, _ in blocks_of(transformer)]


def frozen_block_bytes(transformer: torch.nn.Module) -> list[int]:
    """The bytes of every block's frozen tensors (those offloading moves), in run order. Works on a model built on
    the meta device (the planner's)."""
    return [sum(leaf.nbytes for _, leaf in _frozen_leaves(block)) for block in transformer_blocks(transformer)]


# --- refusals ----------------------------------------------------------------------------------------------------


# --- frozen tensors as plain tensors -----------------------------------------------------------------------------


def _plain_leaves(t: Tensor) -> list[tuple[str, Tensor]]:
    """The plain tensors a frozen tensor is made of, with their paths: itself, a wrapper subclass's inner tensors
    (recursively), or a bitsandbytes parameter's data and its quant_state's tensors."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()
        return [(f"{n}.{p}" if p else n, leaf) for n in names for p, leaf in _plain_leaves(getattr(t, n))]
    leaves = [("", t)]
    state = getattr(t, "quant_state", None)
    if state is not None:
        leaves += [(f"quant_state.{p}", leaf) for p, leaf in _state_tensors(state)]
    return leaves


def _state_tensors(state, prefix: str = "") -> list[tuple[str, Tensor]]:
    """The tensors of a bitsandbytes QuantState (absmax, code, offset, and its nested state2's)."""
    found = []
    for name, value in sorted(vars(state).items()):
        if isinstance(value, Tensor):
            found.append((prefix + name, value))
        elif type(value).__name__ == "QuantState":
            found += _state_tensors(value, f"{prefix}{name}.")
    return found


def _frozen_leaves(block: torch.nn.Module) -> list[tuple[str, Tensor]]:
    """(path, plain tensor) of every frozen parameter of `block`, in a fixed order."""
    return [
        (f"{name}:{path}", leaf)
        for name, p in block.named_parameters()
        if not p.requires_grad
        for path, leaf in _plain_leaves(p)
        if leaf.numel() > 0
    ]


def _model_tensors(model: torch.nn.Module) -> list[Tensor]:
    """Every plain tensor of the model (parameters' leaves and buffers), each once."""
    tensors = [leaf for p in model.parameters() for _, leaf in _plain_leaves(p)] + list(model.buffers())
    return [t for t in {id(t): t for t in tensors}.values() if t.numel() > 0]


def _storage_key(t: Tensor) -> tuple:
    return (t.device, t.untyped_storage().data_ptr())


def _span(t: Tensor) -> int:
    """Elements of storage a tensor's shape and strides reach (from its first element)."""
    return 1 + sum((s - 1) * st for s, st in zip(t.shape, t.stride()))


def _signature(leaves: list[tuple[str, Tensor]]) -> tuple:
    return tuple((path, type(t), tuple(t.shape), t.stride(), t.dtype) for path, t in leaves)


def _tensors(value) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, dict):
        value = list(value.values())
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in _tensors(v)]
    return []


def _in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


# --- the runtime -------------------------------------------------------------------------------------------------


class _Group:
    """The slots of one kind of block: per slot, one tensor per frozen leaf (typed, and the same memory as bytes)."""

    def __init__(self, leaves: list[tuple[str, Tensor]], slots: int, device: torch.device):
        self.typed: list[list[Tensor]] = []
        self.raw: list[list[Tensor]] = []
        for _ in range(slots):
            bases = [torch.empty(_span(t), dtype=t.dtype, device=device) for _, t in leaves]
            self.typed.append([b.as_strided(t.shape, t.stride()) for b, (_, t) in zip(bases, leaves)])
            self.raw.append([b.view(torch.uint8) for b in bases])
        self.occupant: list[_Block | None] = [None] * slots
        self.busy: list[int | None] = [None] * slots  # the forward clock of the use in progress; None: free
        self.members: list[_Block] = []


class _Block:
    def __init__(self, index: int, kind: str, module: torch.nn.Module):
        self.index, self.kind, self.module = index, kind, module
        self.group: _Group | None = None  # None: resident
        self.slot = 0
        self.paths: list[str] = []  # the offloaded leaves (`_frozen_leaves` paths)
        self.home: list[Tensor] = []  # per leaf, its bytes in the home buffer
        self.nbytes = 0
        self.ready: torch.cuda.Event | None = None  # recorded on the copy stream after its latest copy


class BlockOffload:
    """The offloaded blocks of one transformer and their schedule (the module's doc). Made by `offload_blocks`;
    lives as long as the transformer's hooks. `copies` and `copied_bytes` count the copies since it was made."""

    def __init__(self, transformer: torch.nn.Module, device: torch.device, debug: bool):
        self.device = device
        self.debug = debug
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None
        kinds = block_kinds(transformer)
        self.blocks = [_Block(i, k, m) for i, (k, m) in enumerate(zip(kinds, transformer_blocks(transformer)))]
        self.offloaded: list[_Block] = []
        self.groups: list[_Group] = []
        self.model = weakref.ref(transformer)
        self.buffers: list[Tensor] = []  # the homes' host buffers (page-locked for a CUDA device)
        self.pending: list[tuple[int, _Block]] = []  # (clock, block) of this forward's blocks whose outputs need grad
        self.clock = 0  # counts block forwards: a backward hook frees the slots of the uses that came later
        self.last_index = -1  # the last offloaded block this forward ran
        self.backwards: set[int] = set()  # the graph task of the backward running now
        self.copies = 0
        self.copied_bytes = 0
        self.plan: OffloadPlan | None = None
        self._handles: list = []

    # -- the schedule --

    def _issue(self, blk: _Block) -> None:
        """Copy blk's home into its slot, after everything enqueued so far on the compute stream."""
        g, s = blk.group, blk.slot
        g.occupant[s] = blk
        if self.stream is None:
            for dst, src in zip(g.raw[s], blk.home):
                dst.copy_(src)
        else:
            self.stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self.stream):
                for dst, src in zip(g.raw[s], blk.home):
                    dst.copy_(src, non_blocking=True)
            blk.ready.record(self.stream)
        self.copies += 1
        self.copied_bytes += blk.nbytes

    def _ensure(self, blk: _Block, clock: int | None) -> None:
        """blk is about to compute: its weights in its slot, the compute stream waiting for their copy."""
        g, s = blk.group, blk.slot
        if g.occupant[s] is not blk:
            if g.busy[s] is not None:  # never, by the schedule: refuse rather than compute with another block's weights
                raise RuntimeError(
                    f"block offload: block {blk.index} needs its slot while block {g.occupant[s].index} still uses it"
                )
            self._issue(blk)
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_event(blk.ready)
        g.busy[s] = clock
        if self.debug:
            self._verify(blk)

    def _release(self, after: int | None = None) -> None:
        """Free the slots whose uses have all been enqueued: every slot, or those of uses later than `after`."""
        for g in self.groups:
            for s, clock in enumerate(g.busy):
                if clock is not None and (after is None or clock > after):
                    if self.debug:  # nothing overwrote it while in use
                        self._verify(g.occupant[s])
                    g.busy[s] = None

    def _fill(self, upcoming: Iterable[_Block]) -> None:
        """Copy the upcoming blocks, in order, into their slots while the slots are free."""
        ahead: set[int] = set()
        for blk in upcoming:
            g, s = blk.group, blk.slot
            occupant = g.occupant[s]
            if occupant is not blk:
                if g.busy[s] is not None or (occupant is not None and occupant.index in ahead):
                    return
                self._issue(blk)
            ahead.add(blk.index)

    def _verify(self, blk: _Block) -> None:
        if self.stream is not None:
            torch.cuda.synchronize(self.device)
        g = blk.group
        if g.occupant[blk.slot] is not blk or any(
            not torch.equal(dst.cpu(), src.cpu()) for dst, src in zip(g.raw[blk.slot], blk.home)
        ):
            raise RuntimeError(f"block offload: block {blk.index}'s slot does not hold its weights")

    # -- the hooks --

    def _forward_begins(self, *_args) -> None:
        if _in_backward():
            return
        self.pending.clear()
        self.backwards.clear()
        self.last_index = -1
        self._release()

    def _before(self, blk: _Block, _module, _args) -> None:
        if _in_backward():  # a recomputation that calls the block itself: its backward hook made it resident
            self._ensure(blk, blk.group.busy[blk.slot])
            return
        if blk.index <= self.last_index:  # a forward that did not go through the transformer's own call
            self._forward_begins()
        self.last_index = blk.index
        self._release()  # everything before this block has been enqueued
        self._ensure(blk, self.clock + 1)
        self._fill(b for b in self.offloaded if b.index > blk.index)

    def _after(self, blk: _Block, _module, args, kwargs, output) -> None:
        if _in_backward():
            return
        self.clock += 1
        if blk.group is not None:
            self._release()
            self._fill(b for b in self.offloaded if b.index > blk.index)
        if not torch.is_grad_enabled():
            return
        inputs = {id(t) for t in _tensors((args, kwargs))}
        outputs = [t for t in _tensors(output) if t.requires_grad and t.grad_fn is not None and id(t) not in inputs]
        if outputs:
            self.pending.append((self.clock, blk))
            hook = self._grad_hook(blk, self.clock)
            for t in outputs:
                t.register_hook(hook)

    def _grad_hook(self, blk: _Block, clock: int) -> Callable:
        seen: list[int] = []

        def hook(_grad) -> None:
            task = torch._C._current_graph_task_id()
            if task not in seen:  # once per backward, whichever output's gradient comes first
                seen[:] = [task]
                self._backward_reaches(blk, clock)

        return hook

    def _backward_reaches(self, blk: _Block, clock: int) -> None:
        if not self.backwards:  # when this backward ends, all its work is enqueued (a kept graph may run again)
            task = torch._C._current_graph_task_id()
            self.backwards.add(task)
            torch.autograd.Variable._execution_engine.queue_callback(functools.partial(self._backward_ends, task))
        # The engine runs a node only after every node created later in the forward that it waits for, and picks
        # the latest-created of the ready ones first: every block that ran after this one in the forward has had its
        # backward enqueued by now, so their slots are free.
        self._release(after=clock)
        if blk.group is not None:
            self._ensure(blk, clock)
        self._fill(b for c, b in reversed(self.pending) if c < clock and b.group is not None)

    def _backward_ends(self, task: int) -> None:
        self.backwards.discard(task)
        self._release()

    # -- checks --

    def check(self) -> None:
        """Raise unless every offloaded frozen tensor still is its slot's memory and nothing else in the model
        shares a slot's memory: a `.to()` or conversion of the model after `offload_blocks` may have re-created
        them. Cheap; call it once the model is wrapped (DDP)."""
        slots = {
            _storage_key(t): (g, s, j) for g in self.groups for s, ts in enumerate(g.typed) for j, t in enumerate(ts)
        }
        owned = set()
        for blk in self.offloaded:
            leaves = dict(_frozen_leaves(blk.module))
            found = [leaves.get(p) for p in blk.paths]
            if any(t is None or slots.get(_storage_key(t)) != (blk.group, blk.slot, j) for j, t in enumerate(found)):
                raise RuntimeError(
                    f"block offload: the frozen weights of block {blk.index} are no longer its slot's memory (was the "
                    "model moved or converted after offload_blocks? do that before)"
                )
            owned.update(id(t) for t in found)
        model = self.model()
        if model is not None and any(id(t) not in owned and _storage_key(t) in slots for t in _model_tensors(model)):
            raise RuntimeError("block offload: a tensor outside the offloaded blocks shares a slot's memory")

    def remove(self) -> None:
        """Remove the hooks (the offloaded blocks then compute with whatever their slots hold)."""
        for h in self._handles:
            h.remove()
        self._handles.clear()


def _host_buffer(nbytes: int, device: torch.device) -> Tensor:
    """`nbytes` of host memory, page-aligned; page-locked when copying to a CUDA device. Registered with
    cudaHostRegister rather than `pin_memory()`: torch's pinned allocator rounds every allocation up to a power of
    two (a 648 MiB block would take 1 GiB)."""
    buf = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
    start = -buf.data_ptr() % _PAGE
    buf = buf[start : start + nbytes]
    if device.type == "cuda":
        err = torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
        if int(err) != 0:
            raise UsageError(
                f"--offload_blocks: cannot page-lock {nbytes / GIB:.2f} GiB more of host memory (CUDA error "
                f"{int(err)}): offload fewer blocks"
            )
    return buf


def _unregister(pointers: list[int], device: torch.device) -> None:
    torch.cuda.synchronize(device)  # no copy still reads them
    for ptr in pointers:
        torch.cuda.cudart().cudaHostUnregister(ptr)


def offload_blocks(
    transformer: torch.nn.Module,
    n: int,
    device: torch.device | str,
    *,
    slots: int = SLOTS,
    debug: bool = False,
) -> BlockOffload | None:
    """Place `transformer` on `device` with the frozen weights of n of its blocks (`choose_offloaded`) in host
    memory, and install the schedule that copies them back ahead of each use (the module's doc). n 0: the
    transformer is only moved, and None is returned.

    Call it once the trainable weights are chosen (LoRA added: what requires grad stays on the GPU), before or after
    `flux_cp.model.blocks.prepare_blocks`, and before DDP wraps the model. The transformer may be on the CPU (each
    offloaded block then passes through the GPU on its way home, one at a time) or already on `device`. Nothing may
    move or convert the model afterwards (`BlockOffload.check`). `debug`: check at every use that the slot holds the
    block's bytes (synchronizes: for tests)."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    elif device.type == "cpu":  # accelerate's "cpu:0" of a multi-process run: a .to() of it copies every CPU tensor
        device = torch.device("cpu")
    kinds = block_kinds(transformer)
    if n > len(kinds):
        raise UsageError(f"--offload_blocks {n}: the transformer has {len(kinds)} blocks; give at most {len(kinds)}")
    if n == 0:
        transformer.to(device)
        return None
    off = BlockOffload(transformer, device, debug)
    chosen = choose_offloaded(kinds, n)
    # Tensors whose storage another tensor shares (tied weights, a table several quantized weights share) stay put.
    counts: dict[tuple, int] = {}
    for t in _model_tensors(transformer):
        counts[_storage_key(t)] = counts.get(_storage_key(t), 0) + 1
    shared = {i: {p for p, t in _frozen_leaves(off.blocks[i].module) if counts[_storage_key(t)] > 1} for i in chosen}
    groups: dict[tuple, _Group] = {}
    pointers: list[int] = []
    for i in chosen:
        blk = off.blocks[i]
        blk.module.to(device)  # one block at a time: from the CPU, its way home passes through the GPU
        leaves = [(p, t) for p, t in _frozen_leaves(blk.module) if p not in shared[i]]
        if not leaves:
            continue
        key = (blk.kind, _signature(leaves))
        if key not in groups:
            groups[key] = _Group(leaves, min(slots, sum(kinds[j] == blk.kind for j in chosen)), device)
            off.groups.append(groups[key])
            if off.stream is not None:  # freed with the model: not before the copies into them are done
                for t in itertools.chain.from_iterable(groups[key].raw):
                    t.record_stream(off.stream)
        g = blk.group = groups[key]
        blk.slot = len(g.members) % len(g.occupant)
        g.members.append(blk)
        off.offloaded.append(blk)
        blk.paths = [p for p, _ in leaves]
        blk.ready = torch.cuda.Event() if off.stream is not None else None
        # its home: every leaf's bytes, each at an aligned offset of one host buffer of the block's size
        sizes = [_span(t) * t.element_size() for _, t in leaves]
        offsets = list(itertools.accumulate([0] + [-(-s // _ALIGN) * _ALIGN for s in sizes[:-1]]))
        buf = _host_buffer(offsets[-1] + sizes[-1], device)
        if device.type == "cuda":
            pointers.append(buf.data_ptr())
        off.buffers.append(buf)
        blk.home = [buf[o : o + s] for o, s in zip(offsets, sizes)]
        blk.nbytes = sum(t.nbytes for _, t in leaves)
        for home, (_, leaf) in zip(blk.home, leaves):
            home.view(leaf.dtype).as_strided(leaf.shape, leaf.stride()).copy_(leaf)
        for (_, leaf), slot in zip(leaves, g.typed[blk.slot]):
            leaf.data = slot  # the parameter (or its inner tensor) is its slot's memory from now on
    if pointers:
        weakref.finalize(off, _unregister, pointers, device)
    transformer.to(device)
    for g in off.groups:  # the first blocks of each kind start in their slots
        for blk in g.members[: len(g.occupant)]:
            off._issue(blk)
    if off.stream is not None:
        torch.cuda.synchronize(device)
    off.copies = off.copied_bytes = 0
    sizes = [blk.nbytes if blk.group is not None else b for blk, b in zip(off.blocks, frozen_block_bytes(transformer))]
    off.plan = OffloadPlan(tuple(sizes), tuple(tuple(b.index for b in g.members) for g in off.groups), slots)
    off._handles.append(transformer.register_forward_pre_hook(torch.compiler.disable(off._forward_begins)))
    for blk in off.blocks:
        if blk.group is not None:
            pre = torch.compiler.disable(functools.partial(off._before, blk))
            off._handles.append(blk.module.register_forward_pre_hook(pre))
        post = torch.compiler.disable(functools.partial(off._after, blk))
        off._handles.append(blk.module.register_forward_hook(post, with_kwargs=True))
    _leave_out_of_ddp_broadcast(transformer, off)
    off.check()
    return off


def _leave_out_of_ddp_broadcast(transformer: torch.nn.Module, off: BlockOffload) -> None:
    """DDP broadcasts every parameter from rank 0 when it wraps the model; the offloaded ones are slots (the same on
    every rank, and refilled before each use): leave them out of it."""
    prefix = {id(m): name for name, m in transformer.named_modules()}
    names = {
        f"{prefix[id(blk.module)]}.{name}"
        for blk in off.offloaded
        for name, p in blk.module.named_parameters()
        if not p.requires_grad
    }
    ignored = set(getattr(transformer, "_ddp_params_and_buffers_to_ignore", ()))
    transformer._ddp_params_and_buffers_to_ignore = sorted(ignored | names)
