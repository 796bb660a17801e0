"""Third-party messages that tell a user of this trainer nothing, kept out of its output. Each is matched by its own
text where it is made (one library's logger, or one warning's message), so every other message - ours and the
libraries' - still shows.

- torch.distributed.checkpoint, saving or loading in a single process: "torch.distributed is disabled, unavailable
  or uninitialized, assuming the intent is to save in a single process." (a one-process run is meant to be one)
- transformers, when diffusers' pipelines import an image processor: "`CLIPImageProcessor` requires torchvision
  (not installed); falling back to `CLIPImageProcessorPil`..." (validation never uses the image processors)
- matplotlib, building its font cache on the first plot of a machine: "generated new fontManager"
- bitsandbytes, imported on a machine without CUDA (peft imports it when it is installed): "Failed to load CPU
  gemm_4bit_forward from kernels-community..." (4-bit layers are not used here)

Prodigy's "Using decoupled weight decay" (printed by its constructor) is left out where it is made
(flux_cp.optim.make_optimizer).
"""

from __future__ import annotations

import logging
import warnings

# (logger, the start of the message it logs)
LOGGED = (
    ("transformers.utils.import_utils", "`", "requires torchvision (not installed); falling back to `"),
    ("matplotlib.font_manager", "generated new fontManager", ""),
    ("bitsandbytes.backends.cpu.ops", "Failed to load CPU gemm_4bit_forward from kernels-community", ""),
)
DCP_SINGLE_PROCESS = r"torch\.distributed is disabled, unavailable or uninitialized, assuming the intent is to"


class _Drop(logging.Filter):
    def __init__(self, start: str, part: str):
        super().__init__()
        self.start, self.part = start, part

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        return not (text.startswith(self.start) and self.part in text)


def install() -> None:
    """Keep the messages above out of this process's output (idempotent)."""
    warnings.filterwarnings("ignore", message=DCP_SINGLE_PROCESS, category=UserWarning)
    for name, start, part in LOGGED:
        logger = logging.getLogger(name)
        if not any(isinstance(f, _Drop) and (f.start, f.part) == (start, part) for f in logger.filters):
            logger.addFilter(_Drop(start, part))
