"""The training shell: config and flags, the run lifecycle, the per-step story, run files."""
