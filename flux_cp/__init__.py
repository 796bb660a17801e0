"""Training pieces behind `train_flux_cp.py`: one module per concern (see README.md, "Layout")."""
