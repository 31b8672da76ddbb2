"""The `grpo` command: train | eval | compare | sweep | plot | plot-losses.

`grpo train` flags are generated from `grpo.config.TrainConfig`, so `--help` shows every
flag with its default, and TOML files (`--config`) use the same names. Precedence:
defaults < `--config` file < flags on the command line (and, with `--resume`, the run's
saved config takes the place of the defaults).
"""

from __future__ import annotations

import argparse
import json
import sys
import types
import typing
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs

from grpo.config import TrainConfig, check_keys, load_toml


def _field_type(field: attrs.Attribute) -> Any:
    """The runtime type of a TrainConfig field (its annotation resolved, Optional unwrapped)."""
    hints = typing.get_type_hints(TrainConfig)
    hint = hints[field.name]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        hint = args[0]
    return hint


def add_train_arguments(parser: argparse.ArgumentParser) -> None:
    """One `--flag` per TrainConfig field (defaults suppressed, so explicit flags can be told apart)."""
    for field in attrs.fields(TrainConfig):
        flag = "--" + field.name.replace("_", "-")
        help_text = f"{field.metadata['help']} (default: {field.default!r})"
        kind = _field_type(field)
        kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "help": help_text, "dest": field.name}
        if kind is bool:
            kwargs["action"] = argparse.BooleanOptionalAction
        elif typing.get_origin(kind) is tuple:
            kwargs.update(action="append", metavar="KEY=VALUE")
        else:
            kwargs["type"] = kind
            if "choices" in field.metadata:
                kwargs["choices"] = field.metadata["choices"]
        parser.add_argument(flag, **kwargs)
    parser.add_argument("--config", dest="config_file", default=None, metavar="FILE.toml", help="TOML file of flag values; flags on the command line override it")
    parser.add_argument("--resume", default=None, metavar="RUN_DIR", help="continue a run directory from its last checkpoint (same data order and random stream)")


def _coerce(overrides: dict[str, Any]) -> dict[str, Any]:
    """TOML/JSON values to TrainConfig's types (lists -> tuples)."""
    return {key: tuple(value) if isinstance(value, list) else value for key, value in overrides.items()}


def config_from_args(args: argparse.Namespace) -> tuple[TrainConfig, bool]:
    """Merge defaults (or the resumed run's config), the TOML file and explicit flags."""
    explicit = {field.name: getattr(args, field.name) for field in attrs.fields(TrainConfig) if hasattr(args, field.name)}
    base: dict[str, Any] = {}
    resume = args.resume is not None
    if resume:
        saved = Path(args.resume) / "config.json"
        if not saved.exists():
            raise FileNotFoundError(f"--resume {args.resume}: no config.json there; is it a run directory made by `grpo train`?")
        base = json.loads(saved.read_text())
        check_keys(base, where=str(saved))
        explicit["run_dir"] = str(args.resume)
    if args.config_file:
        base.update(load_toml(args.config_file))
    base.update(explicit)
    try:
        return TrainConfig(**_coerce(base)), resume
    except TypeError as error:
        raise ValueError(f"bad configuration: {error}") from None


def run_train(args: argparse.Namespace) -> int:
    """`grpo train`: one GRPO run; exit 0 when finished, 130 when stopped by a signal, 1 on failure."""
    from grpo.loop import RunStopped, train

    config, resume = config_from_args(args)
    try:
        train(config, resume=resume)
    except RunStopped as stopped:
        print(f"[grpo] {stopped}", file=sys.stderr)
        return stopped.exit_code
    return 0


def add_eval_arguments(parser: argparse.ArgumentParser) -> None:
    """Flags of `grpo eval`."""
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--run-dir", help="evaluate a run's final sampler weights (or its latest checkpoint)")
    source.add_argument("--checkpoint", help="a state path from save_state, or a sampler weights path")
    parser.add_argument("--backend", default="local", choices=("local", "pytrio"), help="(default: local)")
    parser.add_argument("--base-model", default=None, help="base model (default: the run's, else the built-in tiny model)")
    parser.add_argument("--dataset", default=None, help="problems (default: the run's, else arithmetic)")
    parser.add_argument("--split", default="test", help="(default: test)")
    parser.add_argument("--limit", type=int, default=200, help="number of problems (default: 200)")
    parser.add_argument("--samples", type=int, default=1, help="samples per problem; pass@k is reported for k = 1, 2, 4 ... <= samples (default: 1)")
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default: 0.0)")
    parser.add_argument("--max-tokens", type=int, default=None, help="(default: the run's, else 24)")
    parser.add_argument("--seed", type=int, default=0, help="(default: 0)")
    parser.add_argument("--concurrency", type=int, default=32, help="(default: 32)")


def run_eval(args: argparse.Namespace) -> int:
    """`grpo eval`: accuracy and pass@k of a checkpoint or the base model on a split."""
    from concurrent.futures import ThreadPoolExecutor

    from grpo.backends.pytrio import make_service_client
    from grpo.data import load_problems
    from grpo.loop import build_problems, evaluate, wants_fewshot, _tokenizer_max_len

    run_config = TrainConfig()
    local_root = None
    model_path = args.checkpoint
    if args.run_dir:
        run_dir = Path(args.run_dir)
        run_config = TrainConfig(**_coerce(json.loads((run_dir / "config.json").read_text())))
        local_root = str(run_dir / "backend")
        summary, checkpoint = run_dir / "summary.json", run_dir / "checkpoint.json"
        if summary.exists():
            model_path = json.loads(summary.read_text())["sampler_path"]
        elif checkpoint.exists():
            model_path = json.loads(checkpoint.read_text())["state_path"]
        else:
            raise FileNotFoundError(f"--run-dir {run_dir}: no summary.json or checkpoint.json to evaluate")
    base_model = args.base_model or run_config.base_model
    max_tokens = args.max_tokens or run_config.max_tokens
    run_config = attrs.evolve(run_config, base_model=base_model)
    service = make_service_client(args.backend if not args.run_dir else run_config.backend, local_root=local_root, seed=args.seed)
    if model_path is None:
        sampler = service.create_sampling_client(base_model=base_model)
    else:
        try:
            sampler = service.create_sampling_client(base_model=base_model, model_path=model_path)
        except Exception:  # noqa: BLE001 - not sampler weights: treat it as a training state
            sampler = service.create_training_client_from_state(model_path).save_weights_and_get_sampling_client()
    tokenizer = sampler.get_tokenizer()
    rows = load_problems(args.dataset or run_config.dataset, args.split, seed=run_config.seed, difficulty=run_config.difficulty, limit=args.limit)
    problems = build_problems(tokenizer, rows, fewshot=wants_fewshot(run_config), max_tokens=max_tokens, max_len=_tokenizer_max_len(tokenizer), split=args.split)
    with ThreadPoolExecutor(max_workers=args.concurrency) as pool:
        metrics = evaluate(pool, sampler, problems, tokenizer, num_samples=args.samples, temperature=args.temperature, max_tokens=max_tokens, seed=args.seed, max_retries=3, log=print)
    label = model_path or f"base model {base_model}"
    print(f"{label}: {len(problems)} {args.split} problems, {args.samples} sample(s), temperature {args.temperature}")
    for key, value in metrics.items():
        print(f"  {key.removeprefix('test/')}: {value:.4f}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The `grpo` argument parser with every subcommand."""
    from grpo import experiments, plots
    from grpo.backends import serve

    parser = argparse.ArgumentParser(prog="grpo", description="Run and study GRPO on LLMs (PyTRIO or the embedded local backend).")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = [
        ("train", "one GRPO run (default: offline on the built-in model)", add_train_arguments, run_train),
        ("eval", "accuracy and pass@k of a checkpoint or the base model", add_eval_arguments, run_eval),
        ("compare", "the same run for several losses and seeds, with a report and plot", experiments.add_compare_arguments, experiments.run_compare),
        ("sweep", "a grid or list of flag overrides from a TOML file, ranked", experiments.add_sweep_arguments, experiments.run_sweep),
        ("plot", "PNG plots of metrics across run directories", plots.add_plot_arguments, plots.run_plot),
        ("plot-losses", "each loss's objective and gradient weight against the ratio", plots.add_plot_losses_arguments, plots.run_plot_losses),
        ("serve", "the PyTRIO service on localhost, backed by the local backend", serve.add_serve_arguments, serve.run_serve),
    ]
    for name, help_text, add_arguments, handler in commands:
        command = sub.add_parser(name, help=help_text, description=help_text)
        add_arguments(command)
        command.set_defaults(handler=handler)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `grpo` console script; bad input exits 2 with a message naming the problem."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return int(args.handler(args))
    except (ValueError, FileNotFoundError) as error:
        print(f"grpo {args.command}: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"grpo {args.command}: interrupted", file=sys.stderr)
        return 130
