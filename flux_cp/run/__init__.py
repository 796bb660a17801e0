"""A run, phase by phase: the trainer (setup, load_data, build_model, resume, train, finish), the data and output
phases it calls, the checks at start, the environment it starts in, and how `train_flux_cp.py` ends (exit codes,
one line per failure)."""
