"""Experiments as one command: `grpo compare` (losses x seeds) and `grpo sweep` (a grid or list
of flag overrides x seeds), each run a `grpo train` subprocess, then a report and plots.

- `runner`: plans (`RunSpec`), validation of every run's config before any launch, and
  skip / resume / start of the runs, `--jobs` at a time;
- `stats`: run directories -> per-run numbers -> mean ± sample std over seeds;
- `report`: markdown tables, JSON, band plots, and `run_and_report`, the tail both share;
- `compare`, `sweep`: the two commands.
"""
