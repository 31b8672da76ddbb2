"""The typed configuration of a GRPO run: one field per `grpo train` flag, each with its help.

The CLI, TOML config files, `grpo compare` and `grpo sweep` all read this one class, so a
flag's name, type, default and help live here once. Field `foo_bar` is flag `--foo-bar`.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import attrs

from grpo.backends.tiny import TINY_MODEL_NAME
from grpo.core import losses
from grpo.core.loss_spec import LossSpec

BACKENDS = ("local", "pytrio")
SWANLAB_MODES = ("online", "offline", "disabled")
ADVANTAGE_NAMES = ("center", "standardize", "rloo", "batch_standardize")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")


class ConfigError(ValueError):
    """A flag or input that cannot work; raised before any sampling or training."""


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

    def __attrs_post_init__(self) -> None:
        _validate(self)
        _resolve_loss(self)

    @property
    def loss_spec(self) -> LossSpec:
        """The resolved loss: kernel, config (cispo flags folded in), reduction, norm length."""
        return _resolve_loss(self)

    @property
    def runs_custom_loss(self) -> bool:
        """Whether the loss runs through forward_backward_custom: asked for, or the service lacks it."""
        spec = self.loss_spec
        return (
            self.custom_loss
            or not spec.kernel.service_builtin
            or (self.backend == "pytrio" and not spec.service_builtin)
        )

    @property
    def use_fewshot(self) -> bool:
        """Few-shot prompts for real models; the built-in tiny model was warm-started without."""
        return self.fewshot if self.fewshot is not None else self.base_model != TINY_MODEL_NAME


def parse_loss_config(entries: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings to a dict (numbers parsed; `none`/`off` mean None)."""
    parsed: dict[str, Any] = {}
    for entry in entries:
        key, sep, raw = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--loss-config {entry!r} must look like KEY=VALUE, e.g. clip_high_threshold=1.28")
        raw = raw.strip()
        if raw.lower() in ("none", "off", "null"):
            parsed[key.strip()] = None
            continue
        try:
            parsed[key.strip()] = float(raw)
        except ValueError:
            raise ConfigError(f"--loss-config {key.strip()}={raw!r}: value must be a number (or 'none')") from None
    return parsed


def _resolve_loss(config: TrainConfig) -> LossSpec:
    """Check the loss name, its config keys and thresholds, and the reduction."""
    try:
        kernel = losses.get_loss(config.loss_fn)
    except ValueError as error:
        raise ConfigError(f"--loss-fn: {error}") from None
    overrides = parse_loss_config(config.loss_config)
    norm_length = overrides.pop("norm_length", None)
    if kernel.name == "cispo":
        overrides = {
            "clip_low_threshold": config.cispo_clip_low_threshold,
            "clip_high_threshold": config.cispo_clip_high_threshold,
            **overrides,
        }
    if config.reduction not in losses.REDUCTIONS:
        raise ConfigError(f"--reduction {config.reduction!r} is not one of {', '.join(losses.REDUCTIONS)}")
    if config.reduction == "seq_mean_token_sum_norm" and norm_length is None:
        norm_length = float(config.max_tokens)
    try:
        return LossSpec.build(kernel, overrides, reduction=config.reduction, norm_length=norm_length)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"--loss-config: {error}") from None


def _validate(config: TrainConfig) -> None:
    """Every flag check that needs no data or model; the error names the flag and the fix."""
    checks: list[tuple[bool, str]] = [
        (config.backend in ("local", "pytrio"), f"--backend must be local or pytrio, got {config.backend!r}"),
        (config.steps >= 1, f"--steps must be >= 1, got {config.steps}"),
        (config.batch_size >= 1, f"--batch-size must be >= 1, got {config.batch_size}"),
        (config.group_size >= 2, f"--group-size must be >= 2 (a group of one has no baseline), got {config.group_size}"),
        (config.max_tokens >= 1, f"--max-tokens must be >= 1, got {config.max_tokens}"),
        (config.temperature >= 0, f"--temperature must be >= 0, got {config.temperature}"),
        (0 < config.top_p <= 1, f"--top-p must be in (0, 1], got {config.top_p}"),
        (config.concurrency >= 1, f"--concurrency must be >= 1, got {config.concurrency}"),
        (config.max_steps_off_policy >= 0, f"--max-steps-off-policy must be >= 0, got {config.max_steps_off_policy}"),
        (1 <= config.num_substeps <= config.batch_size, f"--num-substeps must be in [1, --batch-size={config.batch_size}], got {config.num_substeps}"),
        (config.epochs >= 1, f"--epochs must be >= 1, got {config.epochs}"),
        (config.learning_rate > 0, f"--learning-rate must be > 0, got {config.learning_rate}"),
        (0 <= config.beta1 < 1 and 0 <= config.beta2 < 1, f"--beta1/--beta2 must be in [0, 1), got {config.beta1}, {config.beta2}"),
        (config.kl_coef >= 0, f"--kl-coef must be >= 0, got {config.kl_coef}"),
        (config.eval_every >= 0, f"--eval-every must be >= 0, got {config.eval_every}"),
        (config.eval_limit >= 1, f"--eval-limit must be >= 1, got {config.eval_limit}"),
        (config.save_every >= 0, f"--save-every must be >= 0, got {config.save_every}"),
        (config.max_retries >= 0, f"--max-retries must be >= 0, got {config.max_retries}"),
        (config.swanlab_mode in SWANLAB_MODES, f"--swanlab-mode must be online, offline or disabled, got {config.swanlab_mode!r}"),
        (config.advantage in ADVANTAGE_NAMES, f"--advantage {config.advantage!r} is not one of {', '.join(ADVANTAGE_NAMES)}"),
        (config.kl_estimator in losses.KL_ESTIMATORS, f"--kl-estimator must be one of {', '.join(losses.KL_ESTIMATORS)}, got {config.kl_estimator!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)


def default_run_name(config: TrainConfig) -> str:
    """`<loss>-seed<k>-<local time>`: unique per launch, readable in a listing."""
    return f"{config.loss_fn}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resolve_run(config: TrainConfig) -> TrainConfig:
    """The config with its derived run name and run directory filled in (done once, at start).

    `steps` under `--all-data` depends on the dataset's size and is resolved by the loop.
    """
    run_name = config.run_name or (Path(config.run_dir).name if config.run_dir else default_run_name(config))
    run_dir = config.run_dir or str(Path("runs") / run_name)
    return attrs.evolve(config, run_name=run_name, run_dir=run_dir)


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
