"""Third-party messages that tell a user of this trainer nothing, kept out of its output. Each is matched by its own
text where it is made (one library's logger, or one warning's message), so every other message - ours and the
libraries' - still shows.

- torch.distributed.checkpoint, saving or loading in a single process: "torch.distributed is disabled, unavailable
  or uninitialized, assuming the intent is to save in a single process." (a one-process run is meant to be one)
- transformers, when diffusers' pipelines import an image processor: "`CLIPImageProcessor` requires torchvision
  (not installed); falling back to `CLIPImageProcessorPil`..." (validation never uses the image processors)
- matplotlib, building its font cache on the first plot of a machine: "generated new fontManager"
- bitsandbytes, imported on a machine without CUDA (peft imports it when it is installed): "Failed to load CPU
  gemm_4bit_forward from kernels-community..." (an optional faster CPU kernel; the 4-bit layers run without it)
- torchao, imported by transformers whenever it is installed: "Failed to load .../torchao/_C_mxfp8...so: ..." for
  kernels of other GPUs or torch builds (--base_precision's weight-only layers use none of them); torch, while torchao
  registers its enums: "<enum 'KernelPreference'> is an Enum subclass and is now natively supported by torch.compile
  ..."; diffusers: "Unable to import `torchao` Tensor objects. This may affect loading checkpoints serialized with
  `torchao`" (no torchao checkpoint is loaded here: the base is quantized after loading)
- peft, wrapping a torchao linear in LoRA: "TorchaoLoraLinear was instantiated without `get_apply_tensor_subclass`
  ..." (only merging a LoRA into the quantized weights needs it; training never merges)
- torch.compile of a block holding torchao weights: "Int8Tensor does not implement _stable_hash_for_caching ..."
  (those graphs are compiled anew each run instead of read from the cache)

torchao's and diffusers' lines come while the libraries are imported: `install` runs before train_flux_cp.py imports
the trainer.

Prodigy's "Using decoupled weight decay" (printed by its constructor) is left out where it is made
(flux_cp.model.optim.make_optimizer).
"""

from __future__ import annotations

import logging
import warnings

# (logger, the start of the message it logs)
LOGGED = (
    ("transformers.utils.import_utils", "`", "requires torchvision (not installed); falling back to `"),
    ("matplotlib.font_manager", "generated new fontManager", ""),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community", ""),
    ("torchao", "Failed to load ", "/torchao/_C"),
    ("torch.utils._pytree", "<enum '", "is an Enum subclass and is now natively supported by torch.compile"),
    ("diffusers.quantizers.torchao.torchao_quantizer", "Unable to import `torchao` Tensor objects", ""),
)
DCP_SINGLE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to"
# (the start of a warning's message) warned by torch or a library
WARNED = (
    DCP_SINGLE_PROCESS,
    r"TorchaoLoraLinear was instantiated without `get_apply_tensor_subclass`",
    r"\w+ does not implement _stable_hash_for_caching",
)


class _Drop(logging.Filter):
    def __init__(self, start: str, part: str):
        super().__init__()
        self.start, self.part = start, part

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith(self.start) and self.part in text)


def install() -> None:
    """Keep the messages above out of this process's output (idempotent)."""
    for message in WARNED:
        warnings.filterwarnings("ignore", message=message, category=UserWarning)
    for name, start, part in LOGGED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and (f.start, f.part) == (start, part) for f in logger.filters):
            logger.addFilter(_Drop(start, part))
