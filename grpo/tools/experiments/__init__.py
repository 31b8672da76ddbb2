"""Experiments as one command: `grpo compare` (losses x seeds) and `grpo sweep` (a grid or list
of flag overrides x seeds), each run a `grpo train` subprocess, then a report and plots.

- `runner`: plans (`RunSpec`), validation of every run's config before any launch, and
  skip / resume / start of the runs, `--jobs` at a time;
- `stats`: run directories -> per-run numbers -> mean ± sample std over seeds;
- `report`: markdown tables, JSON, band plots, and `run_and_report`, the tail both share;
- `sweep`: the planning both commands use (a grid of flag overrides x seeds, one run
  directory per run) and `grpo sweep`; `compare`: `grpo compare`, the plan of a one-axis
  grid over `loss_fn`, with its own report.
"""
