"""Run logging: `metrics.jsonl` and `rollouts.jsonl` in the run directory, a console line per
step, and the --log-to experiment trackers (SwanLab, W&B, TensorBoard, Trackio).

`metrics.jsonl` is the record of truth (each row fsynced before `log` returns, through
`grpo.training.run.run_files.MetricsWriter`, so a crash loses nothing logged); the trackers are
mirrors that may fail (`grpo.training.trackers.fanout`): a tracker's error is one line, the
others go on, and none ever stops or slows training.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import NotRequired, TypedDict

from grpo.training.run.run_files import (
    STEP_KEY,
    JsonObject,
    MetricsWriter,
    RolloutsWriter,
    read_metrics,
)
from grpo.training.settings.config_groups import RunConfig
from grpo.training.trackers.base import RunInfo, Tracker
from grpo.training.trackers.fanout import TrackerSet, make_tracker

# Config values whose key looks like a credential are never written anywhere.
_SECRET_KEY = re.compile(
    r"(api[_-]?key|secret|passw(or)?d|(auth|access|bearer|api)[_-]?token)", re.IGNORECASE
)

_VARIABLE_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")

CONSOLE_KEYS = (
    ("reward", "reward", "{:.3f}"),
    ("frac_degenerate", "degen", "{:.2f}"),
    ("rollout/avg_gen_len", "len", "{:.1f}"),
    ("datums", "datums", "{:.0f}"),
    ("loss", "loss", "{:+.4f}"),
    ("ratio/max_abs_log", "|log r|max", "{:.3f}"),
    ("kl", "kl", "{:.4f}"),
    ("test/reward", "test", "{:.3f}"),
    ("time/step", "s/step", "{:.2f}"),
    ("usage/cum_tokens", "tokens", "{:.0f}"),
    ("cost/cum", "cost", "{:.4f}"),
)

ROLLOUT_TEXT_LIMIT = 2000
"""Characters kept of each prompt and completion in rollouts.jsonl (the rest is elided)."""


class TurnRecord(TypedDict):
    """One turn of a logged episode in rollouts.jsonl (texts clipped)."""

    action: str
    observation: str
    reward: float
    tokens: int
    stop_reason: str
    tool_calls: int
    tool_errors: int


class CompletionRecord(TypedDict):
    """One completion (or episode: its transcript as ``text``, and its turns) of a logged
    group in rollouts.jsonl."""

    text: str
    reward: float
    components: dict[str, float]
    advantage: float
    tokens: int
    stop_reason: str
    turns: NotRequired[list[TurnRecord]]


class RolloutRecord(TypedDict):
    """One logged group of rollouts.jsonl (`grpo.training.rollouts.records` builds them)."""

    group: int
    row: int
    prompt: str
    gold: str
    degenerate: bool
    completions: list[CompletionRecord]


def scrub_secrets(config: Mapping[str, object]) -> JsonObject:
    """The config without any key that names a credential (API keys never reach logs); a key
    ending in ``_env`` whose value is a variable's name (``judge_api_key_env``) is kept: it
    says where the secret is, so a resume finds it again."""
    return {
        key: value
        for key, value in config.items()
        if not _SECRET_KEY.search(key) or _names_a_variable(key, value)
    }


def _names_a_variable(key: str, value: object) -> bool:
    """Whether ``key`` is ``..._env`` and ``value`` an environment variable's name (or None)."""
    return key.endswith("_env") and (
        value is None or (isinstance(value, str) and bool(_VARIABLE_NAME.fullmatch(value)))
    )


def console_line(step: int, total_steps: int, metrics: Mapping[str, float]) -> str:
    """A one-line summary of a step, like the article's."""
    parts = [f"step {step}/{total_steps}"]
    for key, label, fmt in CONSOLE_KEYS:
        value = metrics.get(key)
        if value is not None:
            parts.append(f"{label}={fmt.format(value)}")
    return " | ".join(parts)


def clip_text(text: str) -> str:
    """``text`` as rollouts.jsonl keeps it: whole up to ROLLOUT_TEXT_LIMIT, else both ends."""
    if len(text) <= ROLLOUT_TEXT_LIMIT:
        return text
    half = ROLLOUT_TEXT_LIMIT // 2
    return f"{text[:half]} [... {len(text) - 2 * half} characters ...] {text[-half:]}"


def rollout_text(group: RolloutRecord) -> str:
    """One logged group as plain text: the prompt, then each completion with its scores."""
    lines = [f"prompt (row {group['row']}, gold {group['gold']!r}):", group["prompt"], ""]
    for member, completion in enumerate(group["completions"]):
        components = ", ".join(f"{k}={v:g}" for k, v in completion["components"].items())
        lines.append(
            f"--- completion {member}: reward {completion['reward']:g} ({components}), "
            f"advantage {completion['advantage']:+.3f}, {completion['tokens']} tokens, "
            f"stop {completion['stop_reason']}"
        )
        lines.append(completion["text"])
    return "\n".join(lines)


class RunLogger:
    """Writes each step's metrics to metrics.jsonl, the --log-to trackers and a console line."""

    def __init__(
        self,
        run_dir: Path,
        *,
        config: Mapping[str, object],
        run: RunInfo,
        log_to: Sequence[str],
        start_step: int = 0,
        note: Callable[[str], None] | None = None,
        factory: Callable[[str], Tracker] | None = None,
    ) -> None:
        self._metrics = MetricsWriter(run_dir)
        self._rollouts = RolloutsWriter(run_dir)
        names = [
            name
            for name in log_to
            if name != "none" and not (name == "swanlab" and run.swanlab_mode == "disabled")
        ]
        replay = (
            [row for row in read_metrics(run_dir) if row[STEP_KEY] <= start_step]
            if names and start_step > 0
            else []
        )
        self._trackers = TrackerSet(
            names,
            run,
            scrub_secrets(config),
            resume_step=start_step,
            replay_rows=replay,
            note=note or _warn,
            factory=factory or make_tracker,
        )

    @classmethod
    def of_run(
        cls,
        run_dir: Path,
        record: Mapping[str, object],
        config: RunConfig,
        *,
        start_step: int = 0,
        note: Callable[[str], None] | None = None,
    ) -> RunLogger:
        """The logger of a run whose config (any recipe's: ``TrainConfig``, ``SftConfig``, ...) is
        ``config``, whose config.json is ``record``, continuing after ``start_step``."""
        tags = [str(record.get("recipe") or "grpo"), f"backend:{config.backend}"]
        if isinstance(record.get("loss_fn"), str):
            tags.append(f"loss:{record['loss_fn']}")
        run = RunInfo(
            run_dir=run_dir,
            run_name=str(config.run_name or run_dir.name),
            project=config.swanlab_project,
            group=config.tracker_group,
            tags=tuple(tags),
            swanlab_mode=config.swanlab_mode,
        )
        return cls(
            run_dir,
            config=record,
            run=run,
            log_to=config.log_to,
            start_step=start_step,
            note=note,
        )

    def log(
        self, step: int, metrics: Mapping[str, float], *, rollouts: Sequence[RolloutRecord] = ()
    ) -> None:
        """Append one step's rollouts and metrics (metrics.jsonl durable on return), then queue
        them for the trackers (which never block)."""
        self._rollouts.append(step, rollouts)
        self._metrics.append(step, metrics)
        texts = [(f"group {group['group']}", rollout_text(group)) for group in rollouts]
        self._trackers.log(step, metrics, texts)

    def close(self) -> None:
        """Close every sink (the trackers get at most a bounded wait to flush)."""
        self._metrics.close()
        self._rollouts.close()
        self._trackers.close()


def _warn(message: str) -> None:
    """A tracker's line when no note was given: a warning."""
    warnings.warn(message, stacklevel=2)
