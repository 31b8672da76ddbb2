"""User tools over run directories: show, plots, manage (runs, checkpoints), export, experiments;
and warm_start, how the built-in model was warm-started (scripts/make_tiny_model.py)."""
