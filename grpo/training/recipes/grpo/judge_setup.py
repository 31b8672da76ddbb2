"""A run's judge from its flags: the judge rewards' rubrics checked, then the judge resolved.

The judge itself (a sampler on the run's backend or an OpenAI-compatible endpoint, its cache,
pool and retries) is `grpo.rewards.judges`; this module reads `--judge-*` and `--reward` of a
`TrainConfig`, checks them before any call (`check_judge`) and builds the run's `Judge`
(`resolve_judge`), a sampler judge through the distillation teacher's model resolution.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from grpo.core.judging import DEFAULT_RANK_RUBRIC, DEFAULT_SCORE_RUBRIC
from grpo.rewards.judges import (
    CACHE_FILE,
    EndpointJudge,
    Judge,
    JudgeBackend,
    JudgeCallError,
    Note,
    SamplerJudge,
)
from grpo.training.settings.config import ConfigError, TrainConfig

__all__ = ["check_judge", "judge_modes", "resolve_judge"]


def judge_modes(config: TrainConfig) -> tuple[str, ...]:
    """The judge modes of the run's --reward list ("score" for judge, "rank" for judge_rank)."""
    return tuple(reward.judge_mode for reward in config.reward_fns if reward.judge_mode is not None)


_NEEDS = {"score": "{completion}", "rank": "{completions}"}


def _rubrics(config: TrainConfig, modes: Sequence[str]) -> dict[str, str]:
    """The rubric of each mode: --judge-rubric's text, else the built-in one; checked."""
    rubrics = {"score": DEFAULT_SCORE_RUBRIC, "rank": DEFAULT_RANK_RUBRIC}
    if config.judge_rubric is None:
        return {mode: rubrics[mode] for mode in modes}
    path = Path(config.judge_rubric).expanduser()
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(
            f"--judge-rubric {config.judge_rubric}: cannot read it ({type(error).__name__}: "
            f"{error}); give a UTF-8 text file"
        ) from None
    for mode in modes:
        if _NEEDS[mode] not in text:
            reward = "judge" if mode == "score" else "judge_rank"
            raise ConfigError(
                f"--judge-rubric {config.judge_rubric} has no {_NEEDS[mode]} placeholder, which "
                f"grpo.rewards:{reward} fills in; add it (placeholders: {{question}}, "
                "{completion} or {completions}, {reference})"
            )
    return dict.fromkeys(modes, text)


def check_judge(config: TrainConfig) -> dict[str, str]:
    """The rubric of each judge reward of the run (empty: none), checked with no call made:
    ConfigError for a judge flag without a judge reward, a judge reward without
    --judge-model, an unreadable rubric or one without the reward's placeholder."""
    modes = judge_modes(config)
    flags = [
        name
        for name in ("judge_model", "judge_url", "judge_rubric", "judge_api_key_env")
        if getattr(config, name)
    ]
    if not modes:
        if flags:
            flag = "--" + flags[0].replace("_", "-")
            raise ConfigError(
                f"{flag} is for the judge rewards; add --reward grpo.rewards:judge (or "
                "grpo.rewards:judge_rank), or drop it"
            )
        return {}
    if config.judge_model is None:
        raise ConfigError(
            "--reward grpo.rewards:judge needs a judge: --judge-model MODEL (a model name, a "
            "sampler path or a run directory, on the run's backend), or --judge-url URL with "
            "--judge-model NAME (an OpenAI-compatible endpoint)"
        )
    if config.judge_api_key_env is not None and config.judge_url is None:
        raise ConfigError(
            "--judge-api-key-env is the key of a --judge-url endpoint; a judge on the run's "
            "backend needs none: drop it, or add --judge-url"
        )
    return _rubrics(config, modes)


def resolve_judge(
    service: Any, config: TrainConfig, *, run_dir: Path | None, note: Note = print
) -> Judge | None:
    """The run's checked judge when a --reward is a judge reward (else None), before any
    training call: `check_judge`'s errors, and ConfigError for a --judge-model the backend
    does not have or an endpoint that does not answer."""
    rubrics = check_judge(config)
    if not rubrics:
        return None
    assert config.judge_model is not None
    backend: JudgeBackend
    if config.judge_url is not None:
        api_key = None
        if config.judge_api_key_env is not None:
            api_key = os.environ.get(config.judge_api_key_env)
            if not api_key:
                raise ConfigError(
                    f"--judge-api-key-env {config.judge_api_key_env}: that environment variable "
                    "is not set (or empty); export it, or drop the flag for an endpoint "
                    "without a key"
                )
        endpoint = EndpointJudge(
            config.judge_url,
            model=config.judge_model,
            api_key=api_key,
            max_tokens=config.judge_max_tokens,
            temperature=config.judge_temperature,
            timeout_s=config.judge_timeout,
            note=note,
        )
        try:
            endpoint.check()
        except JudgeCallError as error:
            raise ConfigError(str(error)) from None
        backend = endpoint
    else:
        from grpo.training.recipes.distill.teacher import named_sampler

        sampler, weights = named_sampler(service, config, config.judge_model, "--judge-model")
        backend = SamplerJudge(
            sampler,
            identity=(
                f"model:{config.judge_model}:{weights or ''}:{config.judge_max_tokens}:"
                f"{config.judge_temperature:g}"
            ),
            max_tokens=config.judge_max_tokens,
            temperature=config.judge_temperature,
            timeout_s=config.judge_timeout,
        )
    return Judge(
        backend,
        rubrics=rubrics,
        max_score=config.judge_max_score,
        question_column=config.prompt_column,
        concurrency=config.judge_concurrency,
        max_retries=config.max_retries,
        cache_path=None if run_dir is None else run_dir / CACHE_FILE,
        note=note,
    )
