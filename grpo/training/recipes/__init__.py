"""The recipes the run lifecycle drives (each step reads top to bottom in its own module),
and the one registry the shell finds them through (``RECIPES``).

A recipe is its module(s) plus one ``RecipeSpec`` line in ``RECIPES``: the CLI makes its
command (`grpo <command>`, its flags, help, dry run and run) from the spec, `grpo eval` and
`grpo train --init-from` read a run's ``recipe`` (config.json) through ``recipe_of_config``,
and nothing outside the recipe names it. Two kinds:

- ``TASK``: trains on sampled problems or episodes with `grpo train`'s `TrainConfig` (its
  ``recipe`` field names it): ``grpo`` (GRPO) and ``distill`` (on-policy distillation).
- ``ROWS``: trains on the rows of --data with its own config and samples nothing:
  ``sft`` (supervised fine-tuning) and ``dpo`` (preference optimization).

Each spec names its config, fields, run and dry run as ``"module:name"``, imported only
when asked for, so `grpo --help` imports no recipe (nor torch).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from typing import Any, Literal

import attrs

TASK, ROWS = "task", "rows"
RecipeKind = Literal["task", "rows"]


def _resolve(target: str) -> Any:
    """The object named by ``"module:name"``."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


@attrs.frozen
class RecipeSpec:
    """What the shell outside a recipe knows of it: its names, help, kind and entry points.

    ``name`` is the ``recipe`` of its runs' config.json, ``command`` its `grpo <command>`;
    ``config``, ``fields``, ``run`` and ``dry_run`` are ``"module:name"`` of its config
    class, its fields mapping (flag name -> attrs field), ``run(config, resume=...)`` and
    ``dry_run(config, resume=...) -> lines``. A ``ROWS`` recipe also says, for its help,
    what ``--resume`` continues and what its dry run reads, and, for the refusal of a
    `grpo train` flag it has no use for, what it trains on (``purpose``).
    """

    name: str
    command: str
    summary: str
    kind: RecipeKind
    config: str
    fields: str
    run: str
    dry_run: str
    resumed_by: str = ""
    """The `grpo <command>` that resumes its runs (default: its own command)."""
    pins_recipe: bool = True
    """A TASK recipe's command sets `grpo train --recipe` to its name (False: the user's)."""
    resume_help: str = ""
    dry_run_reads: str = ""
    purpose: str = ""

    def __attrs_post_init__(self) -> None:
        if self.kind not in (TASK, ROWS):
            raise ValueError(f"recipe {self.name!r}: kind must be {TASK!r} or {ROWS!r}")
        if self.kind == ROWS and not (self.resume_help and self.dry_run_reads and self.purpose):
            raise ValueError(
                f"recipe {self.name!r}: a {ROWS!r} recipe needs resume_help, dry_run_reads and "
                "purpose (its help and its refusal of `grpo train` flags)"
            )

    @property
    def resume_command(self) -> str:
        """The `grpo <command>` that resumes one of its runs."""
        return self.resumed_by or self.command

    @property
    def trains_on_rows(self) -> bool:
        """Whether it trains on --data rows (no task, nothing sampled)."""
        return self.kind == ROWS

    def config_class(self) -> type[Any]:
        """Its config class (imported now)."""
        config_class: type[Any] = _resolve(self.config)
        return config_class

    def field_map(self) -> Mapping[str, Any]:
        """Its fields, flag name -> attrs field (imported now)."""
        fields: Mapping[str, Any] = _resolve(self.fields)
        return fields

    def runner(self) -> Callable[..., Any]:
        """``run(config, resume=...)`` (imported now)."""
        run: Callable[..., Any] = _resolve(self.run)
        return run

    def dry_runner(self) -> Callable[..., list[str]]:
        """``dry_run(config, resume=...) -> lines`` (imported now)."""
        dry_run: Callable[..., list[str]] = _resolve(self.dry_run)
        return dry_run


TRAIN_CONFIG_RECIPE: dict[str, str] = {
    "kind": TASK,
    "config": "grpo.training.settings.config:TrainConfig",
    "fields": "grpo.training.settings.config:FIELDS",
    "run": "grpo.training.recipes.grpo.run:train",
    "dry_run": "grpo.training.recipes.grpo.run:dry_run",
}
"""The kind and entry points every TASK recipe shares: the one `TrainConfig` (its ``recipe``
field names the recipe) and the one run of `grpo.training.recipes.grpo.run`."""


def rows_recipe(
    name: str, *, summary: str, resume_help: str, dry_run_reads: str, purpose: str
) -> RecipeSpec:
    """The spec of ROWS recipe `name`, its command `grpo <name>`, laid out as every ROWS recipe
    is: config class ``<Name>Config`` and ``<NAME>_FIELDS`` in its ``config`` module, run
    ``<name>`` and dry run ``dry_run_<name>`` in its ``recipe`` module."""
    package = f"grpo.training.recipes.{name}"
    return RecipeSpec(
        name=name,
        command=name,
        summary=summary,
        kind=ROWS,
        config=f"{package}.config:{name.capitalize()}Config",
        fields=f"{package}.config:{name.upper()}_FIELDS",
        run=f"{package}.recipe:{name}",
        dry_run=f"{package}.recipe:dry_run_{name}",
        resume_help=resume_help,
        dry_run_reads=dry_run_reads,
        purpose=purpose,
    )


RECIPES: dict[str, RecipeSpec] = {
    spec.name: spec
    for spec in (
        RecipeSpec(
            name="grpo",
            command="train",
            summary="one GRPO run (default: offline on the built-in model)",
            **TRAIN_CONFIG_RECIPE,
            pins_recipe=False,
        ),
        rows_recipe(
            "sft",
            summary="supervised fine-tuning on completion / assistant tokens (then grpo train "
            "--init-from)",
            resume_help="an SFT run directory",
            dry_run_reads="read and check the data",
            purpose="SFT trains --epochs passes over the rows of --data with a cross-entropy loss",
        ),
        rows_recipe(
            "dpo",
            summary="preference optimization (DPO, IPO, hinge) on prompt/chosen/rejected pairs",
            resume_help="a DPO run directory",
            dry_run_reads="read and check the pairs and the reference",
            purpose="DPO trains on the preference pairs of --data with the DPO loss",
        ),
        RecipeSpec(
            name="distill",
            command="distill",
            summary="on-policy distillation: `grpo train` with --teacher's log-probs as the reward",
            **TRAIN_CONFIG_RECIPE,
            resumed_by="train",
        ),
    )
}
"""Every recipe by its config.json name, in the order of `grpo --help`."""


def recipe_of_config(saved: Mapping[str, object]) -> RecipeSpec:
    """The recipe of a run's saved config.json (``recipe``; a run without one, or with a name
    no longer registered, is a `grpo train` run)."""
    name = saved.get("recipe")
    return RECIPES.get(name, RECIPES["grpo"]) if isinstance(name, str) else RECIPES["grpo"]


def recipe_of_command(command: str) -> RecipeSpec | None:
    """The recipe whose `grpo <command>` this is (None: not a recipe's command)."""
    return next((spec for spec in RECIPES.values() if spec.command == command), None)
