"""Run logging: `metrics.jsonl` and `rollouts.jsonl` in the run directory, a console line per
step, and SwanLab.

`metrics.jsonl` is the record of truth (each row fsynced before `log` returns, through
`grpo.training.run_files.MetricsWriter`, so a crash loses nothing logged); SwanLab is a mirror that
may fail: a SwanLab error degrades to offline logging, then to none, with a warning, and
never stops training.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from grpo.training.run_files import MetricsWriter, RolloutsWriter

if TYPE_CHECKING:
    from grpo.core.records import ScoredGroup
    from grpo.training.rollouts import StepRollouts

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


def scrub_secrets(config: Mapping[str, Any]) -> dict[str, Any]:
    """The config without any key that names a credential (API keys never reach logs); a key
    ending in ``_env`` whose value is a variable's name (``judge_api_key_env``) is kept: it
    says where the secret is, so a resume finds it again."""
    return {
        key: value
        for key, value in config.items()
        if not _SECRET_KEY.search(key) or _names_a_variable(key, value)
    }


def _names_a_variable(key: str, value: Any) -> bool:
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


def rollout_records(
    rollouts: StepRollouts, groups_P: Sequence[ScoredGroup], tokenizer: Any, limit: int
) -> list[dict[str, Any]]:
    """The first ``limit`` groups as JSON-ready records for rollouts.jsonl (texts clipped)."""
    records = []
    for index, (problem, group) in enumerate(zip(rollouts.problems_P, groups_P)):
        if index >= limit:
            break
        components = rollouts.scores.components_P[index]
        records.append(
            {
                "group": index,
                "row": problem.index,
                "prompt": clip_text(tokenizer.decode(list(problem.prompt_tokens))),
                "gold": problem.gold,
                "degenerate": group.is_degenerate,
                "completions": [
                    {
                        "text": clip_text(completion.text),
                        "reward": float(group.rewards[member]),
                        "components": {
                            name: float(values[member]) for name, values in components.items()
                        },
                        "advantage": float(group.advantages[member]),
                        "tokens": int(completion.tokens.size),
                        "stop_reason": completion.stop_reason,
                    }
                    for member, completion in enumerate(group.completions)
                ],
            }
        )
    return records


def rollout_text(group: Mapping[str, Any]) -> str:
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
    """Writes each step's metrics to metrics.jsonl, SwanLab (if enabled) and a console line."""

    def __init__(
        self,
        run_dir: Path,
        *,
        config: Mapping[str, Any],
        swanlab_mode: str,
        swanlab_project: str,
        run_name: str,
    ) -> None:
        self._metrics = MetricsWriter(run_dir)
        self._rollouts = RolloutsWriter(run_dir)
        self._swanlab: Any = None
        if swanlab_mode != "disabled":
            self._swanlab = self._start_swanlab(
                swanlab_mode, swanlab_project, run_name, run_dir, scrub_secrets(config)
            )

    @classmethod
    def of_run(cls, run_dir: Path, record: Mapping[str, Any], config: Any) -> RunLogger:
        """The logger of a run whose config (``TrainConfig`` or ``SftConfig``) is ``config``
        and whose config.json is ``record``."""
        return cls(
            run_dir,
            config=record,
            swanlab_mode=config.swanlab_mode,
            swanlab_project=config.swanlab_project,
            run_name=str(config.run_name),
        )

    @staticmethod
    def _start_swanlab(
        mode: str, project: str, run_name: str, run_dir: Path, config: dict[str, Any]
    ) -> Any:
        """Start SwanLab; online failures fall back to offline, any failure to none, warning."""
        try:
            import swanlab
        except Exception as error:  # noqa: BLE001 - an optional mirror must never stop training
            warnings.warn(
                f"SwanLab unavailable ({error}); logging to metrics.jsonl only", stacklevel=2
            )
            return None
        for attempt_mode in (mode, "offline") if mode == "online" else (mode,):
            try:
                swanlab.init(
                    project=project,
                    experiment_name=run_name,
                    config=config,
                    mode=attempt_mode,
                    logdir=str(run_dir / "swanlog"),
                )
                if attempt_mode != mode:
                    warnings.warn(
                        "SwanLab online failed; logging offline to the run directory", stacklevel=2
                    )
                return swanlab
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"SwanLab {attempt_mode} init failed: {error}", stacklevel=2)
        warnings.warn(
            "SwanLab disabled for this run; metrics.jsonl still has everything", stacklevel=2
        )
        return None

    def log(
        self, step: int, metrics: Mapping[str, float], *, rollouts: Sequence[Mapping[str, Any]] = ()
    ) -> None:
        """Append one step's rollouts and metrics everywhere (metrics.jsonl durable on return)."""
        self._rollouts.append(step, rollouts)
        self._metrics.append(step, metrics)
        if self._swanlab is not None:
            try:
                payload: dict[str, Any] = {
                    key: value for key, value in metrics.items() if value is not None
                }
                if rollouts:
                    payload["rollouts"] = [
                        self._swanlab.Text(rollout_text(group), caption=f"group {group['group']}")
                        for group in rollouts
                    ]
                self._swanlab.log(payload, step=step)
            except Exception as error:  # noqa: BLE001 - never stop training for a mirror
                warnings.warn(
                    f"SwanLab log failed ({error}); continuing with metrics.jsonl only",
                    stacklevel=2,
                )
                self._swanlab = None

    def close(self) -> None:
        """Close every sink."""
        self._metrics.close()
        self._rollouts.close()
        if self._swanlab is not None:
            try:
                self._swanlab.finish()
            except Exception as error:  # noqa: BLE001
                warnings.warn(f"SwanLab finish failed: {error}", stacklevel=2)
            self._swanlab = None
