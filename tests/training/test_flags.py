"""grpo.training.settings.flags: a TrainConfig written as `grpo train` arguments parses back the
same."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from grpo.cli import build_parser
from grpo.core.advantages import ADVANTAGES
from grpo.core.losses import KL_ESTIMATORS, LOSSES, REDUCTIONS
from grpo.core.mismatch import MISMATCH_CORRECTIONS
from grpo.core.normalization import NORMALIZATIONS
from grpo.training.settings.config import (
    BACKENDS,
    FIELDS,
    SAMPLER_DTYPES,
    SWANLAB_MODES,
    ConfigError,
    TrainConfig,
    to_dict,
)
from grpo.training.settings.flags import checked_overrides, config_from_args, load_toml, train_argv

TEXT = st.text(
    st.characters(min_codepoint=32, blacklist_categories=("Cs",)), min_size=1, max_size=12
).filter(str.strip)
RUN_NAME = TEXT.filter(
    lambda name: not any(bad in name for bad in ("/", "\\", "..")) and name != "."
)


def _floats(low: float, high: float, **kwargs: Any) -> st.SearchStrategy[float]:
    return st.floats(low, high, allow_nan=False, allow_infinity=False, **kwargs)


def _loss_config(loss_fn: str) -> st.SearchStrategy[tuple[str, ...]]:
    keys = sorted(LOSSES[loss_fn].defaults)
    if not keys:
        return st.just(())
    entry = st.tuples(st.sampled_from(keys), _floats(0.0, 5.0)).map(
        lambda pair: f"{pair[0]}={pair[1]!r}"
    )
    return st.lists(entry, max_size=3).map(tuple)


FIELD_VALUES: dict[str, st.SearchStrategy[Any]] = {
    "backend": st.sampled_from(BACKENDS),
    "base_model": TEXT,
    "lora_rank": st.integers(4, 64),
    "init_from": st.none() | TEXT,
    "dataset": TEXT,
    "all_data": st.booleans(),
    "difficulty": st.integers(1, 6),
    "fewshot": st.none() | st.booleans(),
    "steps": st.integers(1, 10**6),
    "batch_size": st.integers(1, 64),
    "group_size": st.integers(2, 64),
    "max_tokens": st.integers(1, 4096),
    "temperature": _floats(0.0, 5.0),
    "top_p": _floats(0.0, 1.0, exclude_min=True),
    "concurrency": st.integers(1, 256),
    "max_steps_off_policy": st.integers(0, 4),
    "advantage": st.sampled_from(sorted(ADVANTAGES)),
    "custom_loss": st.booleans(),
    "reduction": st.sampled_from(REDUCTIONS),
    "cispo_clip_low_threshold": _floats(0.0, 1.0),
    "cispo_clip_high_threshold": _floats(1.0, 10.0),
    "mismatch_correction": st.sampled_from(MISMATCH_CORRECTIONS),
    "mismatch_cap": _floats(1.0, 10.0),
    "mismatch_mask_low": _floats(0.0, 1.0),
    "mismatch_mask_high": _floats(1.0, 10.0),
    "sampler_dtype": st.sampled_from(SAMPLER_DTYPES),
    "threads": st.integers(0, 4),
    "service_normalization": st.none() | st.sampled_from(NORMALIZATIONS),
    "kl_coef": _floats(0.0, 1.0),
    "kl_estimator": st.sampled_from(sorted(KL_ESTIMATORS)),
    "num_substeps": st.integers(1, 64),
    "epochs": st.integers(1, 4),
    "learning_rate": _floats(1e-9, 1.0),
    "beta1": _floats(0.0, 1.0, exclude_max=True),
    "beta2": _floats(0.0, 1.0, exclude_max=True),
    "eps": _floats(1e-12, 1e-2),
    "weight_decay": _floats(0.0, 1.0),
    "grad_clip_norm": _floats(0.0, 10.0),
    "seed": st.integers(0, 2**31 - 1),
    "eval_every": st.integers(0, 100),
    "eval_limit": st.integers(1, 1000),
    "save_every": st.integers(0, 100),
    "run_dir": st.none() | TEXT,
    "run_name": st.none() | RUN_NAME,
    "swanlab_mode": st.sampled_from(SWANLAB_MODES),
    "swanlab_project": TEXT,
    "log_to": st.just(("none",))
    | st.lists(
        st.sampled_from(["swanlab", "wandb", "tensorboard", "trackio"]),
        min_size=1,
        max_size=4,
        unique=True,
    ).map(tuple),
    "tracker_group": st.none() | TEXT,
    "max_retries": st.integers(0, 10),
    "price_file": st.none() | TEXT,
    **{
        f"price_{kind}": st.none() | st.floats(0, 1e3, allow_nan=False)
        for kind in ("prompt", "completion", "train", "forward")
    },
    "price_currency": st.none() | TEXT,
    "connect_timeout": _floats(0.1, 300.0),
    "normalization_probe": st.booleans(),
    "dataset_config": st.none() | TEXT,
    "train_split": TEXT,
    "test_split": TEXT,
    "prompt_column": TEXT,
    "answer_column": TEXT,
    "gold_rule": st.sampled_from(["####", "whole", "regex:answer (\\d+)"]),
    "system_prompt": st.none() | TEXT,
    "question_suffix": TEXT,
    "fewshot_file": st.none(),
    "dynamic_sampling": st.booleans(),
    "recipe": st.sampled_from(("grpo", "distill")),
    "teacher": st.none() | TEXT,
    "teacher_system_prompt": st.none() | TEXT,
    "distill_coef": _floats(0.0, 5.0),
    "distill_discount": _floats(0.0, 1.0),
    "task_reward_weight": _floats(0.0, 5.0),
    "distill_clip": _floats(0.0, 5.0),
    "teacher_concurrency": st.integers(1, 64),
    "max_sampling_rounds": st.integers(1, 8),
    "reward": st.lists(
        st.sampled_from(
            [
                "grpo.rewards:boxed_match",
                "grpo.rewards:boxed_format=0.5",
                "grpo.rewards:overlong_penalty=-1e-3",
            ]
        ),
        unique_by=lambda spec: spec.split("=")[0],
        max_size=3,
    ).map(tuple),
    "reward_errors": st.sampled_from(["stop", "zero"]),
    "reward_workers": st.integers(0, 8),
    "reward_timeout": st.floats(0, 600, allow_nan=False),
    "env_timeout": st.floats(0, 600, allow_nan=False),
    "env_errors": st.sampled_from(["stop", "zero"]),
    "overlong_buffer": st.none() | st.integers(1, 64),
    "mask_truncated": st.booleans(),
    "env": st.none(),
    "env_arg": st.just(()),
    "env_capacity": st.none(),  # read by --env openenv only (its round trip: tests/envs)
    "judge_model": st.none() | TEXT,
    "judge_url": st.none() | TEXT,
    "judge_api_key_env": st.none() | TEXT,
    "judge_rubric": st.none() | TEXT,
    "judge_max_score": _floats(0.5, 100.0),
    "judge_max_tokens": st.integers(1, 1024),
    "judge_temperature": _floats(0.0, 2.0),
    "judge_concurrency": st.integers(1, 64),
    "judge_timeout": _floats(0.1, 600.0),
    "max_turns": st.integers(1, 8),
    "log_rollouts": st.integers(0, 16),
}


@st.composite
def train_configs(draw: st.DrawFn) -> TrainConfig:
    """A valid TrainConfig, each field set with probability 1/2 (the rest at their defaults)."""
    overrides = {name: draw(values) for name, values in FIELD_VALUES.items() if draw(st.booleans())}
    if "num_substeps" in overrides:
        overrides["num_substeps"] = draw(
            st.integers(1, overrides.get("batch_size", FIELDS["batch_size"].default))
        )
    if overrides.get("teacher") is not None:  # a teacher is for distillation only
        overrides.update(recipe="distill", dynamic_sampling=False)
    loss_fn = draw(st.sampled_from(sorted(LOSSES)))
    overrides.update(loss_fn=loss_fn, loss_config=draw(_loss_config(loss_fn)))
    try:
        return TrainConfig(**overrides)
    except ConfigError:
        assume(False)
        raise


def parse_train(argv: list[str]) -> TrainConfig:
    config, resume = config_from_args(build_parser().parse_args(["train", *argv]))
    assert not resume
    return config


def test_the_strategy_covers_every_field() -> None:
    assert set(FIELD_VALUES) | {"loss_fn", "loss_config"} == set(FIELDS)


@pytest.mark.slow
@settings(max_examples=150, deadline=None)
@given(train_configs())
def test_train_argv_of_a_config_parses_back_to_the_same_config(config: TrainConfig) -> None:
    assert parse_train(train_argv(to_dict(config))) == config


@settings(max_examples=60, deadline=None)
@given(train_configs(), st.data())
def test_train_argv_of_some_overrides_sets_exactly_those(
    config: TrainConfig, data: st.DataObject
) -> None:
    names = data.draw(st.sets(st.sampled_from(sorted(FIELDS))))
    saved = to_dict(config)
    overrides = {name: saved[name] for name in names}
    defaults = to_dict(TrainConfig())
    try:
        expected = TrainConfig(**{**defaults, **overrides})
    except ConfigError:
        assume(False)
        raise
    assert parse_train(train_argv(overrides)) == expected


def test_train_argv_writes_values_starting_with_a_dash_with_an_equals_sign() -> None:
    assert train_argv({"cispo_clip_low_threshold": -1.0, "run_dir": "-x"}) == [
        "--cispo-clip-low-threshold=-1.0",
        "--run-dir=-x",
    ]
    with pytest.raises(ConfigError, match="unknown train flag 'stepz'"):
        train_argv({"stepz": 1})
    with pytest.raises(ConfigError, match="--steps needs a value"):
        train_argv({"steps": None})


def test_toml_keys_take_dashes_or_underscores_and_tables(tmp_path: Path) -> None:
    toml = tmp_path / "run.toml"
    toml.write_text('learning-rate = 1\nloss_fn = "ppo"\n[loss_config]\ndual_clip = 3\n')
    assert load_toml(toml) == {
        "learning_rate": 1.0,
        "loss_fn": "ppo",
        "loss_config": ("dual_clip=3",),
    }


def test_checked_overrides_name_the_source() -> None:
    with pytest.raises(ConfigError, match=r"^f\.toml: --top-p must be in \(0, 1\], got 2\.0$"):
        checked_overrides({"top-p": 2.0}, where="f.toml")
    assert checked_overrides({"top-p": 1}, where="f.toml") == {"top_p": 1.0}


def test_help_lists_each_registry_with_exactly_its_names() -> None:
    from grpo.training.settings.fields import REGISTRIES

    for registry in REGISTRIES:
        assert list(registry.shown) == registry.names(), registry
