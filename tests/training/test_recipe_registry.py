"""The recipe registry: every spec resolves, and one registration line makes a recipe's
command, its flag refusal, its `grpo eval` default and its `--init-from` resume hint."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from grpo.cli import build_parser, main
from grpo.tools.evaluate import eval_config
from grpo.training import recipes
from grpo.training.recipes import RECIPES, ROWS, RecipeSpec, recipe_of_command, recipe_of_config
from grpo.training.run.init_from import init_state_path
from grpo.training.settings.config import ConfigError, TrainConfig


@pytest.mark.parametrize("name", sorted(RECIPES))
def test_every_registered_recipe_resolves_its_config_fields_and_entry_points(name: str) -> None:
    spec = RECIPES[name]
    assert spec.name == name and recipe_of_command(spec.command) is spec
    assert dict(spec.field_map()) == attrs.fields_dict(spec.config_class())
    assert callable(spec.runner()) and callable(spec.dry_runner())


def test_the_recipes_commands_come_first_in_registry_order() -> None:
    subcommands = next(
        action for action in build_parser()._actions if action.dest == "command"
    ).choices
    assert list(subcommands)[: len(RECIPES)] == [spec.command for spec in RECIPES.values()]


def test_a_saved_config_without_a_registered_recipe_is_a_grpo_train_run() -> None:
    assert recipe_of_config({}).command == "train"
    assert recipe_of_config({"recipe": "gone"}).command == "train"
    assert recipe_of_config({"recipe": "distill"}).resume_command == "train"
    assert recipe_of_config({"recipe": "sft"}).trains_on_rows


def test_a_rows_recipe_without_its_help_texts_is_refused() -> None:
    with pytest.raises(ValueError, match="'half': a 'rows' recipe needs resume_help"):
        attrs.evolve(RECIPES["sft"], name="half", purpose="")


@pytest.fixture
def registered_copy(monkeypatch: pytest.MonkeyPatch) -> RecipeSpec:
    """SFT registered a second time as `grpo sft2` (one registration line)."""
    spec = attrs.evolve(RECIPES["sft"], name="sft2", command="sft2", purpose="SFT2 trains")
    monkeypatch.setitem(recipes.RECIPES, spec.name, spec)
    return spec


def test_one_registration_line_makes_a_command_with_its_flags_and_refusal(
    registered_copy: RecipeSpec, capsys: pytest.CaptureFixture[str]
) -> None:
    args = build_parser(["sft2", "--data", "rows.jsonl"]).parse_args(["sft2", "--data", "x"])
    assert args.data == "x" and args.resume is None
    assert main(["sft2", "--temperature", "1"]) == 2
    assert "`grpo sft2` has no use for (SFT2 trains and samples nothing" in capsys.readouterr().err


def test_eval_and_init_from_ask_the_registry_about_a_new_recipe(
    registered_copy: RecipeSpec, tmp_path: Path
) -> None:
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text(json.dumps({"recipe": "sft2", "data": "rows.jsonl"}))
    assert eval_config(run, {}).dataset == TrainConfig().dataset  # rows: the default task
    with pytest.raises(ConfigError, match="has not finished .* `grpo sft2 --resume"):
        init_state_path(TrainConfig(init_from=str(run)))
    assert registered_copy.kind == ROWS
