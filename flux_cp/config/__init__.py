"""The flags of a run: the flag table (typed, frozen sections), the demo's defaults, the parser with its help and
one-line errors, `--config` files, the ranges of numeric flags and path flags as typed."""
