"""User tools over run directories: show, plots, manage (runs, checkpoints), export, experiments."""
