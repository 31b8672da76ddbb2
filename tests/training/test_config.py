"""TrainConfig checks every flag when it is built: one case per validator, each naming the flag."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import attrs
import pytest

from grpo.backends.names import TINY_MODEL_NAME
from grpo.core.advantages import ADVANTAGES
from grpo.core.losses import KL_ESTIMATORS, LOSSES, REDUCTIONS
from grpo.training.recipes.grpo.plan import preflight
from grpo.training.settings import fields
from grpo.training.settings.config import (
    FIELDS,
    ConfigError,
    TrainConfig,
    check_user_inputs,
    check_value,
    config_from_dict,
    parse_loss_config,
    resolve_run,
    to_dict,
)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # types, as a TOML or JSON file can give them
        ({"steps": "abc"}, "--steps must be an integer, got 'abc'"),
        ({"steps": 2.5}, "--steps must be an integer, got 2.5"),
        ({"steps": True}, "--steps must be an integer, got True"),
        ({"temperature": True}, "--temperature must be a number, got True"),
        ({"temperature": "1.0"}, "--temperature must be a number, got '1.0'"),
        ({"custom_loss": 1}, "--custom-loss must be true or false, got 1"),
        ({"fewshot": "yes"}, "--fewshot must be true or false, got 'yes'"),
        ({"dataset": 3}, "--dataset must be a string, got 3"),
        ({"loss_config": "dual_clip=3"}, "--loss-config must be a list of KEY=VALUE strings"),
        ({"loss_config": (3,)}, "--loss-config must be a list of KEY=VALUE strings"),
        # finiteness of every float
        ({"learning_rate": math.inf}, "--learning-rate must be a finite number, got inf"),
        ({"temperature": math.inf}, "--temperature must be a finite number, got inf"),
        ({"kl_coef": math.nan}, "--kl-coef must be a finite number, got nan"),
        (
            {"cispo_clip_high_threshold": -math.inf},
            "--cispo-clip-high-threshold must be a finite number",
        ),
        # ranges
        ({"steps": 0}, "--steps must be >= 1, got 0"),
        ({"batch_size": 0}, "--batch-size must be >= 1, got 0"),
        ({"group_size": 1}, "--group-size must be >= 2 (a group of one has no baseline), got 1"),
        ({"max_tokens": 0}, "--max-tokens must be >= 1, got 0"),
        ({"temperature": -0.5}, "--temperature must be >= 0, got -0.5"),
        ({"top_p": 0.0}, "--top-p must be in (0, 1], got 0.0"),
        ({"top_p": 1.5}, "--top-p must be in (0, 1], got 1.5"),
        ({"concurrency": 0}, "--concurrency must be >= 1, got 0"),
        ({"max_steps_off_policy": -1}, "--max-steps-off-policy must be >= 0, got -1"),
        ({"num_substeps": 0}, "--num-substeps must be >= 1, got 0"),
        (
            {"num_substeps": 9, "batch_size": 8},
            "--num-substeps must be in [1, --batch-size=8], got 9",
        ),
        ({"epochs": 0}, "--epochs must be >= 1, got 0"),
        ({"learning_rate": 0.0}, "--learning-rate must be > 0, got 0.0"),
        ({"beta1": 1.0}, "--beta1 must be in [0, 1), got 1.0"),
        ({"beta2": -0.1}, "--beta2 must be in [0, 1), got -0.1"),
        ({"eps": 0.0}, "--eps must be > 0, got 0.0"),
        ({"weight_decay": -1.0}, "--weight-decay must be >= 0, got -1.0"),
        ({"grad_clip_norm": -1.0}, "--grad-clip-norm must be >= 0, got -1.0"),
        ({"kl_coef": -0.1}, "--kl-coef must be >= 0, got -0.1"),
        ({"lora_rank": 0}, "--lora-rank must be in [4, 64], got 0"),
        ({"lora_rank": 65}, "--lora-rank must be in [4, 64], got 65"),
        ({"seed": -1}, "--seed must be in [0, 2147483647], got -1"),
        ({"seed": 2**31}, "--seed must be in [0, 2147483647], got 2147483648"),
        ({"difficulty": 0}, "--difficulty must be >= 1, got 0"),
        ({"eval_every": -1}, "--eval-every must be >= 0, got -1"),
        ({"eval_limit": 0}, "--eval-limit must be >= 1, got 0"),
        ({"save_every": -1}, "--save-every must be >= 0, got -1"),
        ({"max_retries": -1}, "--max-retries must be >= 0, got -1"),
        # names
        ({"run_name": "a/../../x"}, "--run-name 'a/../../x' must be a plain name"),
        ({"run_name": ".."}, "--run-name '..' must be a plain name"),
        ({"run_name": "a\\b"}, "--run-name 'a\\\\b' must be a plain name"),
        ({"run_name": ""}, "--run-name '' must be a plain name"),
        ({"run_dir": " "}, "--run-dir must not be empty"),
        ({"base_model": ""}, "--base-model must not be empty"),
        ({"dataset": ""}, "--dataset must not be empty"),
        ({"swanlab_project": ""}, "--swanlab-project must not be empty"),
        # allowed values, from the registries
        ({"backend": "cloud"}, "--backend 'cloud' is not one of local, pytrio"),
        (
            {"swanlab_mode": "cloud"},
            "--swanlab-mode 'cloud' is not one of online, offline, disabled",
        ),
        ({"advantage": "mean"}, f"--advantage 'mean' is not one of {', '.join(ADVANTAGES)}"),
        (
            {"loss_fn": "reinforce"},
            f"--loss-fn 'reinforce' is not one of {', '.join(sorted(LOSSES))}",
        ),
        ({"reduction": "mean"}, f"--reduction 'mean' is not one of {', '.join(REDUCTIONS)}"),
        ({"kl_estimator": "k4"}, f"--kl-estimator 'k4' is not one of {', '.join(KL_ESTIMATORS)}"),
        # the loss and its config
        (
            {"loss_config": ("clip_high_threshold",)},
            "--loss-config 'clip_high_threshold' must look like KEY=VALUE",
        ),
        (
            {"loss_config": ("dual_clip=abc",)},
            "--loss-config dual_clip='abc': value must be a number",
        ),
        (
            {"loss_config": ("typo_key=1",)},
            "--loss-config: unknown config key 'typo_key' for loss 'importance_sampling'",
        ),
        (
            {"loss_fn": "ppo", "loss_config": ("clip_low_threshold=-1",)},
            "--loss-config: clip_low_threshold must be >= 0",
        ),
        (
            {"loss_fn": "cispo", "cispo_clip_low_threshold": 5.0},
            "--cispo-clip-*-threshold: clip_low_threshold (5.0) must not exceed",
        ),
        (
            {"loss_config": ("norm_length=8",)},
            "--loss-config: norm_length=8.0 is only used by reduction 'seq_mean_token_sum_norm'",
        ),
    ],
)
def test_each_bad_flag_is_refused_when_the_config_is_built(
    overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError) as error:
        TrainConfig(**overrides)
    assert message in str(error.value)


def test_every_registry_name_is_accepted() -> None:
    for name in LOSSES:
        assert TrainConfig(loss_fn=name).loss_spec.name == name
    for name in REDUCTIONS:
        assert TrainConfig(reduction=name).loss_spec.reduction == name
    for name in ADVANTAGES:
        assert TrainConfig(advantage=name).advantage == name
    for name in KL_ESTIMATORS:
        assert TrainConfig(kl_estimator=name).kl_estimator == name


def test_toml_and_json_values_are_converted_to_the_field_types() -> None:
    config = TrainConfig(learning_rate=1, loss_fn="ppo", loss_config=["dual_clip=3"])
    assert type(config.learning_rate) is float and config.loss_config == ("dual_clip=3",)
    table = TrainConfig(loss_fn="ppo", loss_config={"clip_high_threshold": 1.28})
    assert table.loss_config == ("clip_high_threshold=1.28",)
    assert table.loss_spec.config["clip_high_threshold"] == 1.28


def test_loss_spec_folds_in_the_cispo_flags_and_derives_the_norm_length() -> None:
    cispo = TrainConfig(
        loss_fn="cispo", cispo_clip_low_threshold=0.5, cispo_clip_high_threshold=2.0
    )
    assert dict(cispo.loss_spec.config) == {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    explicit = TrainConfig(loss_fn="cispo", loss_config=("clip_high_threshold=3",))
    assert explicit.loss_spec.config["clip_high_threshold"] == 3.0
    assert explicit.loss_spec.config["clip_low_threshold"] == 0.0
    # the CISPO flags mean nothing to other kernels
    assert dict(
        TrainConfig(
            loss_fn="ppo", cispo_clip_low_threshold=9.0, cispo_clip_high_threshold=9.0
        ).loss_spec.config
    ) == dict(LOSSES["ppo"].defaults)
    norm = TrainConfig(reduction="seq_mean_token_sum_norm", max_tokens=17)
    assert norm.loss_spec.norm_length == 17.0
    given = TrainConfig(reduction="seq_mean_token_sum_norm", loss_config=("norm_length=5",))
    assert given.loss_spec.norm_length == 5.0
    assert TrainConfig(reduction="token_mean").loss_spec.norm_length is None
    ppo = TrainConfig(loss_fn="ppo", loss_config=("dual_clip=none",))
    assert ppo.loss_spec.config["dual_clip"] is None and parse_loss_config(["a=off"]) == {"a": None}


@pytest.mark.parametrize(
    ("overrides", "custom"),
    [
        ({}, False),
        ({"custom_loss": True}, True),
        ({"loss_fn": "gspo"}, True),
        ({"reduction": "token_mean"}, False),
        ({"reduction": "token_mean", "backend": "pytrio"}, True),
        ({"backend": "pytrio"}, False),
    ],
)
def test_runs_custom_loss(overrides: dict[str, Any], custom: bool) -> None:
    assert TrainConfig(**overrides).runs_custom_loss is custom


def test_use_fewshot_defaults_by_model() -> None:
    assert TrainConfig().use_fewshot is False
    assert TrainConfig(base_model="Qwen/Qwen3-4B").use_fewshot is True
    assert TrainConfig(base_model=TINY_MODEL_NAME, fewshot=True).use_fewshot is True
    assert TrainConfig(base_model="Qwen/Qwen3-4B", fewshot=False).use_fewshot is False


def test_resolve_run_fills_run_name_and_dir_once() -> None:
    named = resolve_run(TrainConfig(run_name="mine"))
    assert (named.run_name, named.run_dir) == ("mine", str(Path("runs") / "mine"))
    in_dir = resolve_run(TrainConfig(run_dir="out/exp1"))
    assert (in_dir.run_name, in_dir.run_dir) == ("exp1", "out/exp1")
    derived = resolve_run(TrainConfig(loss_fn="ppo", seed=3))
    assert derived.run_name.startswith("ppo-seed3-") and derived.run_dir == str(
        Path("runs") / derived.run_name
    )
    assert resolve_run(derived) == derived
    dot = resolve_run(TrainConfig(run_dir="."))
    assert dot.run_dir == "." and dot.run_name.startswith("importance_sampling-seed0-")


def test_check_value_and_config_from_dict_name_the_source() -> None:
    assert check_value("learning_rate", 1) == 1.0
    with pytest.raises(ConfigError, match="--eps must be > 0"):
        check_value("eps", 0)
    with pytest.raises(ConfigError, match=r"run\.json: --steps must be >= 1, got 0"):
        config_from_dict({"steps": 0}, where="run.json")
    with pytest.raises(ConfigError, match=r"run\.json: unknown train flag 'stepz' \(--stepz\)"):
        config_from_dict({"stepz": 0}, where="run.json")


def test_to_dict_round_trips_through_config_from_dict() -> None:
    config = TrainConfig(loss_fn="ppo", loss_config=("dual_clip=3",), fewshot=True, run_name="x")
    saved = to_dict(config)
    assert saved.keys() == FIELDS.keys() and saved["loss_config"] == ["dual_clip=3"]
    assert config_from_dict(saved) == config
    assert attrs.evolve(config, steps=5).loss_spec == config.loss_spec


def test_every_validator_says_what_it_checks() -> None:
    for name, field in FIELDS.items():
        validators = field.validator._validators  # attrs flattens and_ into this tuple
        assert validators[0] == fields.StrictType(*fields.field_kind(field)), name
        for validator in validators:
            assert not repr(validator).startswith("<function"), (name, validator)
    assert repr(FIELDS["loss_fn"].validator._validators[1]) == (
        "OneOf(sorted(grpo.core.losses.LOSSES))"
    )
    assert repr(FIELDS["top_p"].validator._validators[1]) == "Interval((0, 1])"
    assert repr(FIELDS["steps"].validator._validators[1]) == "AtLeast(1)"


MISSING_INPUTS = [
    ({"reward": ("no_such_module_xyz:f",)}, "no module 'no_such_module_xyz'"),
    ({"fewshot_file": "no_such_shots.json"}, "--fewshot-file 'no_such_shots.json' not found"),
]


@pytest.mark.parametrize(("overrides", "message"), MISSING_INPUTS)
def test_building_a_config_reads_no_user_data_the_user_inputs_check_does(
    overrides: dict[str, Any], message: str
) -> None:
    config = TrainConfig(**overrides)
    with pytest.raises(ConfigError) as error:
        check_user_inputs(config)
    assert message in str(error.value)
    with pytest.raises(ConfigError, match=r"^run out/a: "):
        check_user_inputs(config, where="run out/a")


@pytest.mark.parametrize(("overrides", "message"), MISSING_INPUTS)
def test_the_preflight_checks_the_user_inputs_before_any_service_call(
    overrides: dict[str, Any], message: str
) -> None:
    def no_service() -> None:
        raise AssertionError("the pre-flight asked for the service")

    # An unreadable dataset would fail too: the user inputs are checked before the data.
    config = TrainConfig(dataset="no_such_data.jsonl", **overrides)
    with pytest.raises(ConfigError) as error:
        preflight(config, no_service)
    assert message in str(error.value)


def test_each_concern_is_a_nested_record_with_its_own_checks() -> None:
    from grpo.training.settings.train_groups import EnvSettings, TeacherSettings

    config = TrainConfig(kl_coef=0.25, judge_max_tokens=64, price_prompt=1.5)
    assert (config.kl.kl_coef, config.judge.judge_max_tokens) == (0.25, 64)
    assert config.prices.price_prompt == 1.5 and config.kl_coef == 0.25
    with pytest.raises(ConfigError, match="--env-arg base_url=x is read by --env openenv"):
        EnvSettings(env_arg=("base_url=x",))
    with pytest.raises(ConfigError, match="--recipe distill needs --teacher"):
        TeacherSettings(recipe="distill")
    with pytest.raises(ConfigError, match="--distill-discount must be in"):
        TrainConfig(recipe="distill", teacher="t", group_size=1, distill_discount=1.5)


def test_a_flag_every_recipe_has_is_defined_once() -> None:
    from grpo.training.recipes.dpo.config import DPO_FIELDS
    from grpo.training.recipes.sft.config import SFT_FIELDS
    from grpo.training.settings.config_groups import SHARED_GROUPS

    shared = {name for group in SHARED_GROUPS for name in attrs.fields_dict(group)}
    assert shared <= set(FIELDS) & set(SFT_FIELDS) & set(DPO_FIELDS)
    for name in shared:
        same = (FIELDS[name].metadata, FIELDS[name].validator, FIELDS[name].default)
        assert (SFT_FIELDS[name].metadata, SFT_FIELDS[name].validator) == same[:2], name
        assert SFT_FIELDS[name].default == same[2], name
        assert DPO_FIELDS[name].metadata == same[0], name
    assert DPO_FIELDS["learning_rate"].default == 5e-4  # DPO's own default of the shared flag
