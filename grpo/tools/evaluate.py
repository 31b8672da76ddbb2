"""`grpo eval` and `grpo.evaluate`: accuracy and pass@k of a run, a checkpoint or a base model.

The weights come from a run directory (its final sampler weights, else its latest
checkpoint), a checkpoint path (sampler weights or a training state), or neither (the base
model). The config is the run's (or the defaults) with the given overrides, checked like
every flag. Metrics are the run's own `test/*` metrics (`grpo.training.rollouts.evaluate`):
mean reward over all samples and pass@k for k = 1, 2, 4, ... <= samples.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpo.training import run_files
from grpo.training.config import (
    ConfigError,
    TrainConfig,
    check_user_inputs,
    check_value,
    config_from_dict,
)


def _at_least_one(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


def eval_config(
    run_dir: str | Path | None,
    overrides: dict[str, Any],
) -> TrainConfig:
    """The run's saved config (or the defaults) with `overrides` (None values ignored), checked.

    Its --reward modules and --fewshot-file are loaded too (`check_user_inputs`), so a missing
    one fails here, before any model is loaded.
    """
    values: dict[str, object] = run_files.read_config(Path(run_dir)) if run_dir else {}
    values.update({name: value for name, value in overrides.items() if value is not None})
    where = f"--run-dir {run_dir}" if run_dir else None
    config = config_from_dict(values, where=where)
    check_user_inputs(config, where=where)
    return config


def sampling_client(service: Any, base_model: str, model_path: str | None) -> Any:
    """A sampler on the base model, on sampler weights, or on a training state's weights."""
    if model_path is None:
        return service.create_sampling_client(base_model=base_model)
    try:
        return service.create_sampling_client(base_model=base_model, model_path=model_path)
    except Exception:  # noqa: BLE001 - not sampler weights: try it as a training state
        pass
    try:
        training = service.create_training_client_from_state(model_path)
    except Exception as error:  # noqa: BLE001 - the message below says what the path must be
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise ConfigError(
            f"--checkpoint {model_path}: neither sampler weights nor a training state "
            f"({reason}); give the sampler_path of a run's {run_files.SUMMARY_FILE} or "
            f"the state path of its {run_files.CHECKPOINT_FILE}, "
            "or use --run-dir"
        ) from None
    return training.save_weights_and_get_sampling_client()


def evaluate(
    run_dir: str | Path | None = None,
    *,
    checkpoint: str | None = None,
    backend: str | None = None,
    base_model: str | None = None,
    dataset: str | None = None,
    split: str = "test",
    limit: int = 200,
    samples: int = 1,
    temperature: float = 0.0,
    max_tokens: int | None = None,
    seed: int = 0,
    concurrency: int = 32,
    echo: Callable[[str], None] = print,
) -> dict[str, float]:
    """`test/reward` (mean reward of `samples` completions per problem) and `test/pass@k`.

    Of `run_dir`'s final weights, a `checkpoint` path, or (neither given) the base model, on
    the first `limit` problems of `split`. Bad input raises `ConfigError` naming the
    argument and the fix before any model is loaded.
    """
    from grpo.backends.pytrio import make_service_client
    from grpo.tasks.data import SPLITS, columns_of, load_run_problems
    from grpo.training.rollouts import build_problems, tokenizer_max_len
    from grpo.training.rollouts import evaluate as evaluate_problems

    if run_dir is not None and checkpoint is not None:
        raise ConfigError("give --run-dir or --checkpoint, not both")
    _at_least_one("--limit", limit)
    _at_least_one("--samples", samples)
    if split not in SPLITS:
        raise ConfigError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    for name, value in (("temperature", temperature), ("seed", seed), ("concurrency", concurrency)):
        check_value(name, value)
    config = eval_config(
        run_dir,
        {
            "backend": backend,
            "base_model": base_model,
            "dataset": dataset,
            "max_tokens": max_tokens,
        },
    )
    model_path = run_files.eval_weights_path(Path(run_dir)) if run_dir else checkpoint
    local_root = str(Path(run_dir) / run_files.BACKEND_DIR) if run_dir else None
    rows = load_run_problems(config, split, limit=limit)
    service = make_service_client(config.backend, local_root=local_root, seed=seed)
    sampler = sampling_client(service, config.base_model, model_path)
    tokenizer = sampler.get_tokenizer()
    problems = build_problems(
        tokenizer,
        rows,
        fewshot=config.use_fewshot,
        max_tokens=config.max_tokens,
        max_len=tokenizer_max_len(tokenizer),
        split=split,
        template=config.prompt_template,
        columns=columns_of(config),
    )
    with ThreadPoolExecutor(max_workers=concurrency) as pool:
        metrics, _usage = evaluate_problems(
            pool,
            sampler,
            problems,
            tokenizer,
            num_samples=samples,
            temperature=temperature,
            max_tokens=config.max_tokens,
            seed=seed,
            max_retries=3,
            log=echo,
            config=config,
        )
    label = model_path or f"base model {config.base_model}"
    echo(
        f"{label}: {len(problems)} {split} problems, {samples} sample(s), temperature {temperature}"
    )
    return metrics
