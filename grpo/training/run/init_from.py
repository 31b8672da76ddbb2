"""`grpo train --init-from RUN_DIR`: start from a finished run's final weights, of any
recipe in `grpo.training.recipes.RECIPES` (SFT, GRPO, ...).

The source run must have finished (summary.json) on the same backend, base model and LoRA
rank; its final training state (checkpoint.json, saved at the end of every run) gives the
new run's first weights, with a fresh optimizer. The reference of --kl-coef stays the base
model. Checked from the run's files before any service call (ConfigError naming the fix).
"""

from __future__ import annotations

from pathlib import Path

from grpo.backends.clients import ServiceClient, TrainingClient
from grpo.backends.pytrio import error_reason
from grpo.training.recipes import recipe_of_config
from grpo.training.run import run_files
from grpo.training.settings.config import ConfigError, TrainConfig


def init_state_path(config: TrainConfig) -> str:
    """The training-state path of ``config.init_from``'s final weights, after its checks."""
    source = Path(str(config.init_from))
    where = f"--init-from {source}"
    try:
        saved = run_files.read_config(source)
    except run_files.RunDirError as error:
        raise ConfigError(f"{where}: {error}") from None
    if run_files.run_status(source) != run_files.FINISHED:
        raise ConfigError(
            f"{where}: the run has not finished (no {run_files.SUMMARY_FILE}); finish it with "
            f"`grpo {recipe_of_config(saved).resume_command} --resume {source}`, "
            "or start from another run"
        )
    for key in ("backend", "base_model", "lora_rank"):
        if key in saved and saved[key] != getattr(config, key):
            raise ConfigError(
                f"{where}: that run has {key} {saved[key]!r} but this one {getattr(config, key)!r}"
                f"; pass --{key.replace('_', '-')} {saved[key]} (or start from a run of yours)"
            )
    checkpoint = run_files.read_checkpoint(source)
    if checkpoint is None:
        raise ConfigError(f"{where}: the run has no {run_files.CHECKPOINT_FILE} (no final state)")
    return checkpoint.state_path


def init_training_client(
    service: ServiceClient, config: TrainConfig, state_path: str
) -> TrainingClient:
    """A training client on the source run's final weights (fresh optimizer state)."""
    try:
        return service.create_training_client_from_state(state_path)
    except Exception as error:  # noqa: BLE001 - every backend has its own not-found error
        raise ConfigError(
            f"--init-from {config.init_from}: its final state {state_path} cannot be loaded: "
            f"{error_reason(error)}; restore those weights, or start from another run"
        ) from error
