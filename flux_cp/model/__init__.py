"""The model a run trains: loading it, its adapters (LoRA, DoRA, LoKr) and their files, the frozen base's precision,
block offload, how the blocks run (checkpointing, compile), parallelism applied, the text encoder's LoRA, the EMA and
the optimizer."""
