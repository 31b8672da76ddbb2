"""The typed configuration of a GRPO run: one field per `grpo train` flag, each with its help.

The CLI, TOML config files, `grpo compare` and `grpo sweep` all read this one class, so a
flag's name, type, default and help live here once. Field `foo_bar` is flag `--foo-bar`.
"""

from __future__ import annotations

import tomllib
from pathlib import Path
from typing import Any

import attrs

from grpo.backends.tiny import TINY_MODEL_NAME

BACKENDS = ("local", "pytrio")
SWANLAB_MODES = ("online", "offline", "disabled")
ADVANTAGE_NAMES = ("center", "standardize", "rloo", "batch_standardize")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")


def _flag(default: Any, help: str, **metadata: Any) -> Any:
    """An attrs field carrying its CLI help text."""
    return attrs.field(default=default, metadata={"help": help, **metadata})


@attrs.frozen
class TrainConfig:
    """Every knob of `grpo train`; defaults give the offline default run on the local backend."""

    # Model and backend
    backend: str = _flag("local", "where training runs: the embedded local model or the PyTRIO service", choices=BACKENDS)
    base_model: str = _flag(TINY_MODEL_NAME, "base model name (PyTRIO catalog id, the built-in tiny model, or a local HF directory)")
    lora_rank: int = _flag(32, "LoRA rank")
    # Data
    dataset: str = _flag("arithmetic", "problems: 'arithmetic' (built-in), 'gsm8k' (hub) or a local JSONL/Parquet path")
    all_data: bool = _flag(False, "iterate over the whole train split instead of --steps x --batch-size problems")
    difficulty: int = _flag(1, "difficulty of the built-in arithmetic problems")
    fewshot: bool | None = _flag(None, "prepend the few-shot example to prompts (default: on for real models, off for the tiny one)")
    # Rollouts
    steps: int = _flag(80, "number of training steps (batches)")
    batch_size: int = _flag(8, "prompts per step")
    group_size: int = _flag(8, "completions sampled per prompt")
    max_tokens: int = _flag(24, "maximum generated tokens per completion")
    temperature: float = _flag(1.0, "sampling temperature")
    top_p: float = _flag(1.0, "nucleus sampling threshold")
    concurrency: int = _flag(32, "sampling requests in flight at once")
    max_steps_off_policy: int = _flag(0, "how many steps stale a rollout may be (0 = strictly on-policy)")
    # Advantages and loss
    advantage: str = _flag("center", "group advantage estimator", choices=ADVANTAGE_NAMES)
    loss_fn: str = _flag("importance_sampling", "policy loss kernel (any name in grpo.core.losses.LOSSES)")
    loss_config: tuple[str, ...] = _flag((), "loss_fn_config entry KEY=VALUE (repeatable), validated against the kernel's keys")
    custom_loss: bool = _flag(False, "run the loss through forward_backward_custom with the core kernel")
    reduction: str = _flag("sum", "how token losses aggregate (sum, token_mean, seq_mean_token_mean, ...)")
    cispo_clip_low_threshold: float = _flag(0.0, "CISPO lower ratio bound (the article's flag)")
    cispo_clip_high_threshold: float = _flag(4.0, "CISPO upper ratio bound (the article's flag)")
    kl_coef: float = _flag(0.0, "KL-to-base-model penalty folded into token advantages (0 = off)")
    kl_estimator: str = _flag("k1", "KL estimator for the penalty", choices=KL_ESTIMATOR_NAMES)
    num_substeps: int = _flag(2, "minibatches per step, one optimizer step each")
    epochs: int = _flag(1, "passes over each batch (PPO-style reuse)")
    # Optimizer
    learning_rate: float = _flag(2e-4, "Adam learning rate")
    beta1: float = _flag(0.9, "Adam beta1")
    beta2: float = _flag(0.95, "Adam beta2")
    eps: float = _flag(1e-8, "Adam epsilon")
    weight_decay: float = _flag(0.0, "AdamW weight decay")
    grad_clip_norm: float = _flag(1.0, "global gradient-norm clip (0 = off)")
    # Evaluation, checkpoints, logging
    seed: int = _flag(0, "seed for data order, sampling and LoRA init")
    eval_every: int = _flag(40, "evaluate on the test split before training and every N steps (0 = never)")
    eval_limit: int = _flag(300, "test problems per evaluation")
    save_every: int = _flag(20, "save a resumable checkpoint every N steps (0 = only at the end)")
    run_dir: str | None = _flag(None, "run directory (default: runs/<run name>)")
    run_name: str | None = _flag(None, "run name (default: derived from loss, seed and time)")
    swanlab_mode: str = _flag("disabled", "SwanLab logging mode", choices=SWANLAB_MODES)
    swanlab_project: str = _flag("grpo", "SwanLab project name")
    max_retries: int = _flag(3, "retries of a failed sampling/training call before the run stops with a checkpoint")


FIELD_NAMES: frozenset[str] = frozenset(field.name for field in attrs.fields(TrainConfig))


def check_keys(overrides: dict[str, Any], *, where: str) -> None:
    """Reject keys that are not `grpo train` flags, naming the key and the fix."""
    for key in overrides:
        if key not in FIELD_NAMES:
            flag = "--" + key.replace("_", "-")
            raise ValueError(
                f"{where}: unknown train flag {key!r} ({flag}); see `grpo train --help` for the flags"
            )


def load_toml(path: str | Path) -> dict[str, Any]:
    """Read a TOML file of flag overrides (keys as in `grpo train --help`, dashes or underscores)."""
    file = Path(path)
    if not file.is_file():
        raise FileNotFoundError(f"--config file {file} not found")
    with file.open("rb") as handle:
        raw = tomllib.load(handle)
    overrides = {key.replace("-", "_"): value for key, value in raw.items()}
    check_keys(overrides, where=str(file))
    return overrides


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as a JSON-ready dict (tuples become lists)."""
    return attrs.asdict(config, value_serializer=lambda _inst, _field, value: list(value) if isinstance(value, tuple) else value)
