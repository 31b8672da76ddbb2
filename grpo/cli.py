"""The `grpo` command: a recipe's (train, ..., one each in `grpo.training.recipes.RECIPES`) |
eval | compare | sweep | plot | show | ...

`grpo train` flags come from `grpo.training.settings.config.TrainConfig` through
`grpo.training.settings.flags`, so `--help` shows every flag with its default and TOML files
(`--config`) use the same names. Precedence: defaults < `--config` file < flags on the command line
(and, with `--resume`, the run's saved config takes the place of the defaults).

Every error ends in one line naming the input and the fix: exit 2 for bad input (flags,
files, names), 1 for a failure of the run or the machine, 130 for Ctrl-C. `--debug` (or
`GRPO_DEBUG=1`) prints the traceback too.
"""

from __future__ import annotations

import argparse
import errno
import functools
import importlib
import os
import shutil
import sys
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from grpo.backends.pytrio import BackendUnavailableError, error_reason, is_pytrio_error
from grpo.training.recipes import RECIPES, RecipeSpec, recipe_of_command
from grpo.training.run import run_files
from grpo.training.settings import flags
from grpo.training.settings.config import (
    BACKENDS,
    check_user_inputs,
    resolve_run,
)

DEBUG_ENV = "GRPO_DEBUG"
EXIT_BAD_INPUT, EXIT_FAILED, EXIT_INTERRUPTED = 2, 1, 130


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """Every TrainConfig flag in its help group, plus `--config FILE.toml`, `--resume RUN_DIR`
    and `--dry-run` (in the run group)."""
    run = flags.add_train_arguments(parser)["run"]
    run.add_argument(
        "--config",
        dest="config_file",
        default=None,
        metavar="FILE.toml",
        help="TOML file of flag values; flags on the command line override it",
    )
    run.add_argument(
        "--resume",
        default=None,
        metavar="RUN_DIR",
        help="continue a run directory from its last checkpoint "
        "(same data order and random stream)",
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help="run every check a real run does first, print the planned tokens (and cost, "
        "with prices) and exit; no training run is created, nothing is written",
    )


def run_task_recipe(recipe: RecipeSpec, args: argparse.Namespace) -> int:
    """`grpo train` (or `grpo distill`, ...: train with its --recipe): one run of a recipe on
    `TrainConfig`; exit 0 when finished, 130 on a signal, 1 on failure."""
    from grpo.training.recipes.grpo.run import RunStopped
    from grpo.training.run.inputs import read_paths, refuse_run_dir_over_inputs

    if recipe.pins_recipe:
        args.recipe = recipe.name
    config, resume = flags.config_from_args(args)
    refuse_run_dir_over_inputs(resolve_run(config), read_paths("--config", args.config_file))
    check_user_inputs(config)  # before anything, as a dry run makes its service client first
    if args.dry_run:
        for line in recipe.dry_runner()(resolve_run(config), resume=resume):
            print(line)
        return 0
    try:
        recipe.runner()(resolve_run(config), resume=resume)
    except RunStopped as stopped:
        print(f"[grpo] {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0


def add_rows_recipe_arguments(recipe: RecipeSpec, parser: argparse.ArgumentParser) -> None:
    """A data recipe's flags (its own and those shared with `grpo train`), --resume and
    --dry-run (which reads its data before printing the plan)."""
    run = flags.add_train_arguments(parser, fields=recipe.field_map())["run"]
    run.add_argument(
        "--resume", default=None, metavar="RUN_DIR", help=f"continue {recipe.resume_help}"
    )
    run.add_argument(
        "--dry-run",
        action="store_true",
        help=f"{recipe.dry_run_reads}, print the plan (tokens, steps, cost) and exit; nothing "
        "is written",
    )


def run_rows_recipe(recipe: RecipeSpec, args: argparse.Namespace) -> int:
    """A data recipe's command (`grpo sft`, ...): flags over the resumed run's
    config.json, then the dry run or the run; exit 0 when finished, 130 on a signal, 1 on
    failure."""
    from grpo.training.recipes.grpo.run import RunStopped
    from grpo.training.recipes.sft.config import recipe_config_from_dict

    fields = recipe.field_map()
    values = flags.explicit_flags(args, fields=fields)
    if args.resume is not None:
        saved = run_files.read_config(Path(args.resume))
        saved.pop("recipe", None)
        values = {**saved, **values, "run_dir": str(args.resume)}
    config = recipe_config_from_dict(
        recipe.config_class(), recipe.command, values, where=f"grpo {recipe.command}"
    )
    if args.dry_run:
        for line in recipe.dry_runner()(config, resume=args.resume is not None):
            print(line)
        return 0
    try:
        recipe.runner()(config, resume=args.resume is not None)
    except RunStopped as stopped:
        print(f"[grpo] {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `grpo eval`: the weights, the task (as `grpo train`'s), decoding, seeds, output."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument(
        "--run-dir", help="evaluate a run's final sampler weights (or its latest checkpoint)"
    )
    source.add_argument(
        "--checkpoint", help="a state path from save_state, or a sampler weights path"
    )
    parser.add_argument(
        "--backend",
        default=None,
        metavar="{" + ",".join(BACKENDS) + "}",
        help="where the weights are sampled (default: the run's, else local)",
    )
    parser.add_argument(
        "--base-model",
        default=None,
        help="base model (default: the run's, else the built-in tiny model)",
    )
    task = parser.add_argument_group("task (default: the run's, else grpo train's defaults)")
    task.add_argument(
        "--dataset",
        default=None,
        help="arithmetic, wordproblems, gsm8k, a local .jsonl/.parquet/.csv file (or a "
        "directory of train.*/test.*), or a hub OWNER/NAME",
    )
    task.add_argument("--dataset-config", default=None, help="config of a hub --dataset")
    task.add_argument("--prompt-column", default=None, help="dataset column holding the question")
    task.add_argument("--answer-column", default=None, help="dataset column holding the answer")
    task.add_argument(
        "--gold-rule", default=None, help="gold answer of the answer column: ####, whole or regex:P"
    )
    task.add_argument(
        "--reward",
        action="append",
        default=None,
        metavar="MODULE:FUNCTION[=WEIGHT]",
        help="reward, repeatable (replaces the run's list); the first one grades correctness "
        "(correct when it scores >= 1), e.g. grpo.rewards:math_verify",
    )
    task.add_argument(
        "--env",
        default=None,
        metavar="MODULE:FACTORY",
        help="play episodes of an environment (correct when the return is >= 1), e.g. "
        "grpo.envs:calculator_wordproblems",
    )
    task.add_argument("--max-turns", type=int, default=None, help="most turns of an --env episode")
    parser.add_argument(
        "--split",
        default="test",
        metavar="{train,test}",
        help="the split evaluated (default: test)",
    )
    parser.add_argument(
        "--limit", type=int, default=200, help="number of problems, >= 1 (default: 200)"
    )
    decoding = parser.add_argument_group("decoding and seeds")
    decoding.add_argument(
        "--samples",
        type=int,
        default=1,
        help="samples n per problem, >= 1: avg@n, pass@k for k = 1, 2, 4 ... <= n, cons@n "
        "(default: 1)",
    )
    decoding.add_argument(
        "--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)"
    )
    decoding.add_argument(
        "--top-p", type=float, default=1.0, help="nucleus threshold in (0, 1] (default: 1.0)"
    )
    decoding.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help="most generated tokens per completion (default: the run's, else 24)",
    )
    decoding.add_argument(
        "--seed", type=int, default=0, help="sampling seed of the first seed (default: 0)"
    )
    decoding.add_argument(
        "--seeds",
        type=int,
        default=1,
        help="evaluate with seeds --seed, --seed + 1, ...: each metric's mean over them and "
        "its 95%% bootstrap interval over problems (default: 1)",
    )
    parser.add_argument(
        "--concurrency",
        type=int,
        default=32,
        help="sampling requests in flight at once (default: 32)",
    )
    parser.add_argument(
        "--out",
        default=None,
        metavar="FILE.json",
        help="write the result: what produced it, every metric with its interval, and every "
        "sample's correctness and answer",
    )
    from grpo.tools.paths import add_force_argument

    add_force_argument(parser, "--out file")


def eval_reads(args: argparse.Namespace) -> list[Any]:
    """What `grpo eval` reads on this machine: --run-dir (its weights, and the files its
    config names), --checkpoint, and the data, reward, env and model files of the flags."""
    from grpo.training.run.inputs import config_read_paths, read_paths

    reads = [*read_paths("--run-dir", args.run_dir), *read_paths("--checkpoint", args.checkpoint)]
    if args.run_dir and (Path(args.run_dir) / run_files.CONFIG_FILE).is_file():
        try:
            saved = run_files.read_config(Path(args.run_dir))
        except run_files.RunDirError:
            saved = {}  # evaluate_report names the damage
        reads += config_read_paths(saved, owner=f"the run {args.run_dir}'s ")
    return reads + config_read_paths(vars(args))


def run_eval(args: argparse.Namespace) -> int:
    """`grpo eval`: avg@n, pass@k, cons@n, format and truncation rates, with intervals."""
    from grpo.tools.evaluate import evaluate_report, write_record
    from grpo.tools.paths import check_out

    out = Path(args.out) if args.out is not None else None
    if out is not None:
        if out.suffix != ".json":
            raise ValueError(f"--out {out} must be a .json file; e.g. --out eval.json")
        check_out(out, force=args.force, reads=eval_reads(args))
    report = evaluate_report(
        args.run_dir,
        checkpoint=args.checkpoint,
        backend=args.backend,
        base_model=args.base_model,
        dataset=args.dataset,
        dataset_config=args.dataset_config,
        prompt_column=args.prompt_column,
        answer_column=args.answer_column,
        gold_rule=args.gold_rule,
        reward=args.reward,
        env=args.env,
        max_turns=args.max_turns,
        split=args.split,
        limit=args.limit,
        samples=args.samples,
        temperature=args.temperature,
        top_p=args.top_p,
        max_tokens=args.max_tokens,
        seed=args.seed,
        seeds=args.seeds,
        concurrency=args.concurrency,
        progress=True,
    )
    for line in report.table():
        print(line)
    if out is not None:
        write_record(report, out)
        print(f"wrote {out}")
    return 0


def add_export_arguments(parser: argparse.ArgumentParser) -> None:
    """Arguments of `grpo export RUN_DIR|CHECKPOINT --out DIR [--merge]`."""
    parser.add_argument(
        "source",
        help="a run directory (its final weights), a checkpoint path (local://...), a "
        "checkpoint directory, or an archive from `grpo checkpoints download`",
    )
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write")
    parser.add_argument(
        "--merge",
        action="store_true",
        help="write the base model with the LoRA merged in (a Hugging Face model directory)",
    )
    from grpo.tools.paths import add_force_argument

    add_force_argument(parser, "non-empty --out directory")


def run_export(args: argparse.Namespace) -> int:
    """`grpo export`: a PEFT adapter directory, or a merged model with --merge."""
    from grpo.tools.export import export

    written = export(args.source, Path(args.out), merge=args.merge, force=args.force)
    print(f"{'merged model' if args.merge else 'PEFT adapter'}: {written}")
    return 0


# Each tool's subcommand: (name, help, its arguments, its handler), the last two as
# "module:function" resolved only for the command being run, so `grpo --help` imports
# neither torch nor transformers. The recipes' commands come first, from RECIPES.
TOOL_COMMANDS: tuple[tuple[str, str, str, str], ...] = (
    (
        "eval",
        "avg@n, pass@k, cons@n, format and truncation rates of weights, with intervals",
        "grpo.cli:add_eval_arguments",
        "grpo.cli:run_eval",
    ),
    (
        "compare",
        "the same run for several losses and seeds, with a report and plot",
        "grpo.tools.experiments.compare:add_compare_arguments",
        "grpo.tools.experiments.compare:run_compare",
    ),
    (
        "sweep",
        "a grid or list of flag overrides from a TOML file, ranked",
        "grpo.tools.experiments.sweep:add_sweep_arguments",
        "grpo.tools.experiments.sweep:run_sweep",
    ),
    (
        "plot",
        "PNG plots of metrics across run directories",
        "grpo.tools.plots:add_plot_arguments",
        "grpo.tools.plots:run_plot",
    ),
    (
        "show",
        "print a run's logged rollouts (prompts, completions, rewards), or write HTML",
        "grpo.tools.show:add_show_arguments",
        "grpo.tools.show:run_show",
    ),
    (
        "plot-losses",
        "each loss's objective and gradient weight against the ratio",
        "grpo.tools.plots:add_plot_losses_arguments",
        "grpo.tools.plots:run_plot_losses",
    ),
    (
        "serve",
        "the PyTRIO service on localhost, backed by the local backend",
        "grpo.serve.command:add_serve_arguments",
        "grpo.serve.command:run_serve",
    ),
    (
        "runs",
        "training runs of the local store(s) or PyTRIO and their last checkpoints",
        "grpo.tools.manage:add_runs_arguments",
        "grpo.tools.manage:run_runs",
    ),
    (
        "checkpoints",
        "list (size, expiry) | download | delete | cleanup checkpoints",
        "grpo.tools.manage:add_checkpoints_arguments",
        "grpo.tools.manage:run_checkpoints",
    ),
    (
        "export",
        "a run's or checkpoint's LoRA as a PEFT adapter directory (--merge: merged)",
        "grpo.cli:add_export_arguments",
        "grpo.cli:run_export",
    ),
)


def _resolve(target: str) -> Any:
    """The function named by "module:function"."""
    module, _, name = target.partition(":")
    return getattr(importlib.import_module(module), name)


Command = tuple[
    str, str, Callable[[argparse.ArgumentParser], None], Callable[[argparse.Namespace], int]
]


def _recipe_command(recipe: RecipeSpec) -> Command:
    """A recipe's subcommand: (name, help, its arguments, its handler)."""
    if recipe.trains_on_rows:
        return (
            recipe.command,
            recipe.summary,
            functools.partial(add_rows_recipe_arguments, recipe),
            functools.partial(run_rows_recipe, recipe),
        )
    return (
        recipe.command,
        recipe.summary,
        add_train_arguments,
        functools.partial(run_task_recipe, recipe),
    )


def _lazy(target: str) -> Callable[..., Any]:
    """A function that imports the function named by "module:function" when first called."""

    def call(*args: Any) -> Any:
        return _resolve(target)(*args)

    return call


def commands() -> list[Command]:
    """Every subcommand in `grpo --help`'s order, the recipes' (from RECIPES) first; a tool's
    module is imported only when its arguments or handler are called."""
    tools = [
        (name, summary, _lazy(add), _lazy(handler)) for name, summary, add, handler in TOOL_COMMANDS
    ]
    return [*map(_recipe_command, RECIPES.values()), *tools]


def build_parser(argv: Sequence[str] | None = None) -> argparse.ArgumentParser:
    """The `grpo` parser; only the subcommand named in ``argv`` gets its arguments (all if None)."""
    chosen = None if argv is None else next((arg for arg in argv if not arg.startswith("-")), None)
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--debug",
        action="store_true",
        help=f"print the traceback of an error (or set {DEBUG_ENV}=1)",
    )
    parser = argparse.ArgumentParser(
        prog="grpo",
        description="Run and study GRPO on LLMs (PyTRIO or the embedded local backend).",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text, add_arguments, handler in commands():
        command = sub.add_parser(name, help=help_text, description=help_text, parents=[common])
        if argv is None or name == chosen:
            add_arguments(command)
            command.set_defaults(handler=handler)
    return parser


def _free_space(path: Path) -> str:
    """The free space of the file system holding `path` (its nearest existing ancestor)."""
    for parent in (path, *path.parents):
        if parent.exists():
            return f"{shutil.disk_usage(parent).free / 2**20:.0f} MiB free there"
    return "free space unknown"


def describe_error(error: BaseException) -> tuple[str, int]:
    """The one-line message and exit code of an error reaching the command line."""
    if isinstance(error, OSError) and error.errno == errno.ENOSPC:
        where = Path(error.filename) if error.filename else Path.cwd()
        return (
            f"no space left on the device writing {where} ({_free_space(where.parent)}); "
            "free some space or choose another --run-dir",
            EXIT_FAILED,
        )
    if isinstance(error, (FileNotFoundError, IsADirectoryError, NotADirectoryError)):
        return f"{error.strerror or error}: {error.filename}" if error.filename else str(
            error
        ), EXIT_BAD_INPUT
    if isinstance(error, PermissionError):
        return f"permission denied: {error.filename}; choose a path you can write", EXIT_FAILED
    if is_pytrio_error(error):  # its message and hint, not its request and details
        bad_input = type(error).__name__ == "ValidationError"
        return error_reason(error, hint=True), EXIT_BAD_INPUT if bad_input else EXIT_FAILED
    if isinstance(error, (ValueError, ConnectionError)):  # ours: whole, the fix at its end
        return str(error), EXIT_BAD_INPUT
    if isinstance(error, BackendUnavailableError):
        return str(error), EXIT_BAD_INPUT
    if isinstance(error, OSError):
        return f"{error.strerror or error}" + (
            f": {error.filename}" if error.filename else ""
        ), EXIT_FAILED
    return f"{type(error).__name__}: {error}", EXIT_FAILED


def recipe_flag_refusal(arguments: Sequence[str]) -> str | None:
    """Why a data recipe's command (`grpo sft`, ...) refuses a `grpo train` flag
    it has no use for (None: no such flag, or not such a command).

    A data recipe trains on --data's rows and samples nothing, so the sampling, reward, loss
    and teacher flags of `grpo train` would do nothing.
    """
    recipe = recipe_of_command(arguments[0]) if arguments else None
    if recipe is None or not recipe.trains_on_rows:
        return None
    from grpo.training.settings.config import FIELDS as TRAIN_FIELDS

    command, own = recipe.command, recipe.field_map()
    for argument in arguments[1:]:
        name = argument.split("=", 1)[0]
        if not name.startswith("--"):
            continue
        field = name[2:].replace("-", "_").removeprefix("no_")
        if field in TRAIN_FIELDS and field not in own:
            return (
                f"{name} is a `grpo train` flag that `grpo {command}` has no use for "
                f"({recipe.purpose} and samples nothing; see `grpo {command} "
                f"--help`); drop {name}, or use it in a `grpo train --init-from` run after "
                f"the {command.upper()}"
            )
    return None


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `grpo` console script: bad input exits 2 with one line naming it."""
    arguments = list(sys.argv[1:] if argv is None else argv)
    refused = recipe_flag_refusal(arguments)
    if refused is not None:
        print(f"grpo {arguments[0]}: error: {refused}", file=sys.stderr)
        return 2
    args = build_parser(arguments).parse_args(arguments)
    debug = args.debug or os.environ.get(DEBUG_ENV, "") not in ("", "0")
    try:
        code = int(args.handler(args))
    except KeyboardInterrupt:
        print(f"grpo {args.command}: interrupted", file=sys.stderr)
        code = EXIT_INTERRUPTED
    except Exception as error:  # noqa: BLE001 - every error ends in one line (traceback with --debug)
        if debug:
            traceback.print_exc()
        message, code = describe_error(error)
        hint = (
            ""
            if debug
            else f" (traceback: --debug or {DEBUG_ENV}=1)"
            if code == EXIT_FAILED
            else ""
        )
        print(f"grpo {args.command}: error: {message}{hint}", file=sys.stderr)
        return code
    if code == EXIT_INTERRUPTED and argv is None:  # the process's own command, about to exit
        from grpo.interrupts import exit_without_collecting

        exit_without_collecting()  # stopped within seconds, also on a loaded machine
    return code
