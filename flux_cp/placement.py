"""Which of a model's encoding components (the VAE, each text encoder) is on the accelerator, and when.

The components live in host memory and one at a time is on the accelerator: `use(name)` puts that one there and
takes the one there before off, so the encoding phase's peak is its largest component's (with that component's
activations), never their sum, and the transformer never shares the GPU with a text encoder. A component stays on
the accelerator after its use until another is needed or `release()` is called (the trainer calls it before the
transformer loads): a run of calls to one component moves it once. Taking a component off is free: its host tensors
are kept while it is on the accelerator, and only the accelerator's copy is dropped.

A component too large for the accelerator is *streamed* (`stream`): its weights stay in host memory and each layer is
copied to the accelerator for its own forward (accelerate's `cpu_offload` hooks), exact as the resident model.
`resident` (`--no_cache`, which encodes every batch while the transformer trains) keeps every component on the
accelerator for good, as before."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager

import torch

logger = logging.getLogger("flux_cp")

ON_DEVICE, ON_HOST, STREAMED = "device", "host", "streamed"


class Placement:
    """The placement of `modules` ({component name: module}, all in host memory when given) between `host` and
    `device` (module doc)."""

    def __init__(
        self, modules: dict[str, torch.nn.Module], device: torch.device, host: torch.device | None = None
    ) -> None:
        self.modules = dict(modules)
        self.device = torch.device(device)
        self.host = torch.device("cpu") if host is None else torch.device(host)
        self.state = dict.fromkeys(self.modules, ON_HOST)
        self.resident = False
        self._host_tensors: dict[str, list[tuple[torch.nn.Module, str, bool, torch.Tensor]]] = {}

    # --- what is where ----------------------------------------------------------------------------------------

    def where(self) -> dict[str, str]:
        """{component: 'device' | 'host' | 'streamed'} now."""
        return dict(self.state)

    def on_device(self) -> list[str]:
        """The components whose weights are on the accelerator now (streamed ones hold only the layer running)."""
        return [name for name, s in self.state.items() if s == ON_DEVICE]

    # --- policies -----------------------------------------------------------------------------------------------

    def stream(self, name: str) -> None:
        """Keep component `name` in host memory and copy each of its layers to the accelerator for its own forward."""
        from accelerate import cpu_offload

        self._to_host(name)
        cpu_offload(self.modules[name], execution_device=self.device)
        self.state[name] = STREAMED

    def keep_resident(self) -> None:
        """Every component (but streamed ones) on the accelerator for good (`--no_cache`)."""
        for name, s in self.state.items():
            if s == ON_HOST:
                self._to_device(name)
        self.resident = True

    # --- use --------------------------------------------------------------------------------------------------

    @contextmanager
    def use(self, name: str) -> Iterator[torch.nn.Module]:
        """Component `name` on the accelerator (or streamed), every other one off it, for the body."""
        if not self.resident:
            for other in self.on_device():
                if other != name:
                    self._to_host(other)
            if self.state[name] == ON_HOST:
                self._to_device(name)
        yield self.modules[name]

    def release(self) -> None:
        """Every component off the accelerator (but resident ones): room for the transformer."""
        if self.resident:
            return
        for name in self.on_device():
            self._to_host(name)
        _empty_cache(self.device)

    def forget(self, name: str) -> None:
        """Drop component `name` (freed once nothing else refers to it)."""
        if self.state.get(name) == ON_DEVICE:
            self._to_host(name)
        self.modules.pop(name, None)
        self.state.pop(name, None)
        self._host_tensors.pop(name, None)

    # --- moves ------------------------------------------------------------------------------------------------

    def _to_device(self, name: str) -> None:
        """Copy the component's parameters and buffers to the accelerator, keeping the host tensors to go back to."""
        kept, seen = [], set()
        for owner in self.modules[name].modules():
            for table, is_param in ((owner._parameters, True), (owner._buffers, False)):
                for key, t in table.items():
                    if t is None or id(t) in seen or t.device == self.device:
                        continue  # a tied parameter is one object: moved once, it stays tied
                    seen.add(id(t))
                    host = t.data if is_param else t
                    kept.append((owner, key, is_param, host))
                    if is_param:
                        t.data = self._copy(host, self.device)
                    else:
                        table[key] = self._copy(host, self.device)
        self._host_tensors[name] = kept
        self.state[name] = ON_DEVICE

    def _to_host(self, name: str) -> None:
        """Back to the host tensors kept by `_to_device` (nothing copied: the accelerator's copy is dropped)."""
        for owner, key, is_param, host in self._host_tensors.pop(name, ()):
            if is_param:
                owner._parameters[key].data = host
            else:
                owner._buffers[key] = host
        if self.state.get(name) == ON_DEVICE:
            self.state[name] = ON_HOST

    def _copy(self, t: torch.Tensor, device: torch.device) -> torch.Tensor:
        """`t` on `device` (tests replace it to watch the moves on a machine without an accelerator)."""
        return t.to(device)


def _empty_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
