"""Seconds-long training runs on the built-in model, shared by the loop, task and serve tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.training.recipes.grpo.run import RunResult, train
from grpo.training.settings.config import TrainConfig

TINY = dict(
    steps=2,
    batch_size=2,
    group_size=4,
    max_tokens=24,
    eval_every=0,
    save_every=0,
    concurrency=4,
    num_substeps=1,
)


def tiny_config(tmp_path: Path, name: str = "run", **overrides: Any) -> TrainConfig:
    """A seconds-long run on the built-in model, in tmp_path / name."""
    return TrainConfig(**{**TINY, "run_dir": str(tmp_path / name), **overrides})


def quiet_train(config: TrainConfig, **kwargs: Any) -> RunResult:
    """Train without console output."""
    return train(config, echo=lambda _line: None, progress=False, **kwargs)


def embedded_service(root: Path | str, **kwargs: Any) -> Any:
    """A LocalServiceClient dividing as a run's own embedded backend does
    (`LOCAL_TRAIN_NORMALIZATION`, not the service's `samples`), so that a run given it equals,
    bit for bit, a run that makes its own (under another divisor the loop pre-scales to the
    same gradients, but only to float rounding)."""
    from grpo.backends.local import LocalServiceClient
    from grpo.core.normalization import LOCAL_TRAIN_NORMALIZATION

    return LocalServiceClient(root=root, service_normalization=LOCAL_TRAIN_NORMALIZATION, **kwargs)


def comparable(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Metrics rows without wall-clock timings."""
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]
