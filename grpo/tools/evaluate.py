"""`grpo eval` and `grpo.evaluate`: avg@n, pass@k, cons@n, format and truncation rates of weights.

The weights come from a run directory (its final sampler weights, else its latest
checkpoint), a checkpoint path (sampler weights or a training state), or neither (the base
model). The task is the run's (or the defaults) with the given overrides, checked like every
flag: its `--reward` list, or its `--env`, its dataset and columns. Every problem gets
`samples` completions (episodes) per seed, for seeds `seed`, `seed + 1`, ... (`seeds` of
them); `grpo.training.rollouts.evaluation` samples and grades, `grpo.core.evaluation` computes each
metric, its mean over seeds and its 95% percentile-bootstrap interval over problems
(docs/FORMULAS.md, "Evaluation metrics").

`EvalReport.record()` is the JSON `--out` writes: what produced the result (weights and
their step, dataset, split and rows, decoding, rewards or env, seeds, backend, tokens used),
every metric with its interval, and every sample's correctness, answer, reward, truncation
and length, from which each figure can be recomputed.

With ``progress`` (as `grpo eval` runs it), `EvalProgress` shows on stderr what it is doing:
a line per slow stage (checking the task, loading the model), then the requests answered,
as a tqdm bar on a terminal or elsewhere (a log file) a whole line at every tenth.
"""

from __future__ import annotations

import json
import math
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import attrs

from grpo.backends.pytrio import sampler_on_weights
from grpo.core.evaluation import BOOTSTRAP_RESAMPLES
from grpo.interrupts import dropping_pool
from grpo.training.recipes import recipe_of_config
from grpo.training.run import run_files
from grpo.training.settings.config import (
    ConfigError,
    TrainConfig,
    check_user_inputs,
    check_value,
    config_from_dict,
)

RECORD_FORMAT = "grpo-eval/1"
BOOTSTRAP_SEED = 0
PROGRESS_LINES = 10
"""Away from a terminal, the progress lines an evaluation prints (one at every tenth)."""


class EvalProgress:
    """What an evaluation shows while it works, on ``stream`` (stderr): a line per stage, then
    a count of the requests answered: a tqdm bar when the stream is a terminal, else a whole
    line at every PROGRESS_LINES-th of the total (a log file gets no carriage returns).
    Disabled, it shows nothing."""

    def __init__(self, enabled: bool, stream: IO[str] | None = None) -> None:
        self.enabled = enabled
        self.stream = stream if stream is not None else sys.stderr

    def stage(self, text: str) -> None:
        """One line saying what starts now."""
        if self.enabled:
            print(f"[grpo eval] {text}", file=self.stream, flush=True)

    @contextmanager
    def counting(self, total: int, unit: str) -> Iterator[Callable[[], None]]:
        """A tick to call as each of ``total`` ``unit``s is done (from any thread)."""
        if not self.enabled:
            yield lambda: None
            return
        if self.stream.isatty():
            from tqdm import tqdm

            with tqdm(
                total=total, unit=unit, desc="eval", file=self.stream, dynamic_ncols=True
            ) as bar:
                yield lambda: bar.update(1)
            return
        lock, done = threading.Lock(), [0]
        every = math.ceil(total / PROGRESS_LINES)

        def tick() -> None:
            with lock:
                done[0] += 1
                if done[0] % every == 0 or done[0] == total:
                    self.stage(f"{done[0]}/{total} {unit}s")

        yield tick


class _TickingPool:
    """A thread pool's ``submit`` whose every call ticks ``tick`` once it is done (an
    evaluation submits one call per problem's samples, or per episode)."""

    def __init__(self, pool: Any, tick: Callable[[], None]) -> None:
        self._pool, self._tick = pool, tick

    def submit(self, fn: Callable[..., Any], /, *args: Any, **kwargs: Any) -> Future[Any]:
        """``pool.submit(fn, *args, **kwargs)``, ticking when its call ends (not when it is
        cancelled: a stopped evaluation drops its queued calls)."""
        future = self._pool.submit(fn, *args, **kwargs)
        future.add_done_callback(lambda done: None if done.cancelled() else self._tick())
        return future


def _at_least_one(name: str, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name} must be an integer >= 1, got {value!r}")
    if value < 1:
        raise ConfigError(f"{name} must be >= 1, got {value}")


def eval_config(
    run_dir: str | Path | None,
    overrides: dict[str, Any],
) -> TrainConfig:
    """The run's saved config (or the defaults) with `overrides` (None values ignored), checked.

    A run of a recipe trained on data rows, not on a task (SFT, ...): its backend and base
    model, with `grpo train`'s default task (the built-in arithmetic problems) unless overridden.

    Its --reward modules, --env factory and --fewshot-file are loaded too
    (`check_user_inputs`), so a missing one fails here, before any model is loaded.
    """
    values: dict[str, object] = run_files.read_config(Path(run_dir)) if run_dir else {}
    if recipe_of_config(values).trains_on_rows:  # not trained on a task: the default task
        values = {key: values[key] for key in ("backend", "base_model") if key in values}
    values.update({name: value for name, value in overrides.items() if value is not None})
    where = f"--run-dir {run_dir}" if run_dir else None
    config = config_from_dict(values, where=where)
    check_user_inputs(config, where=where)
    judged = [reward.spec for reward in config.reward_fns if reward.judge_mode is not None]
    if judged and config.env is None:
        raise ConfigError(
            f"{where + ': ' if where else ''}--reward {judged[0]} needs a judge, which grpo "
            "eval does not resolve; grade with another --reward (e.g. --reward "
            "grpo.rewards:boxed_match), or read the run's own test/reward"
        )
    return config


def sampling_client(service: Any, base_model: str, model_path: str | None) -> Any:
    """A sampler on the base model, on sampler weights, or on a training state's weights."""
    if model_path is None:
        return service.create_sampling_client(base_model=base_model)
    return sampler_on_weights(
        service,
        base_model,
        model_path,
        lambda reason: ConfigError(
            f"--checkpoint {model_path}: neither sampler weights nor a training state "
            f"({reason}); give the sampler_path of a run's {run_files.SUMMARY_FILE} or "
            f"the state path of its {run_files.CHECKPOINT_FILE}, "
            "or use --run-dir"
        ),
    )


def weights_of(run_dir: str | Path | None, checkpoint: str | None, base_model: str) -> dict:
    """What is evaluated: the weights' path and their training step (None when unknown)."""
    if run_dir is None:
        if checkpoint is None:
            return {"source": "base model", "path": None, "step": 0, "base_model": base_model}
        return {"source": "checkpoint", "path": checkpoint, "step": None, "base_model": base_model}
    directory = Path(run_dir)
    path = run_files.eval_weights_path(directory)
    summary = run_files.read_summary(directory)
    if summary is not None and summary.get("sampler_path") == path:
        step = summary.get("steps")
        source = "run directory: final sampler weights"
    else:
        saved = run_files.read_checkpoint(directory)
        step = saved.step if saved is not None else None
        source = "run directory: latest checkpoint"
    return {
        "source": source,
        "run_dir": str(directory),
        "path": path,
        "step": step,
        "base_model": base_model,
    }


def _sample_record(samples: Any, p: int, g: int) -> dict[str, Any]:
    """Sample g of problem p of one seed's `EvalSamples`, as the record stores it."""
    record = {
        "correct": bool(samples.correct_PG[p, g]),
        "answer": samples.answers_PG[p][g],
        "reward": float(samples.reward_PG[p, g]),
        "truncated": bool(samples.truncated_PG[p, g]),
        "tokens": int(samples.tokens_PG[p, g]),
    }
    if samples.turns_PG is not None and samples.tool_calls_PG is not None:
        record["turns"] = int(samples.turns_PG[p, g])
        record["tool_calls"] = int(samples.tool_calls_PG[p, g])
    return record


@attrs.frozen
class EvalReport:
    """An evaluation over seeds: its provenance, its per-seed results, every metric's summary."""

    provenance: dict[str, Any]
    problems: tuple[Any, ...] = attrs.field(repr=False)
    results: tuple[Any, ...] = attrs.field(repr=False)
    """One `grpo.training.rollouts.evaluation.Evaluation` per seed."""
    summary: dict[str, Any]
    """name -> `grpo.core.evaluation.MetricSummary` (mean over seeds, interval, per seed)."""

    @property
    def metrics(self) -> dict[str, float]:
        """``test/<name>``: each metric's mean over the seeds."""
        return {f"test/{name}": stat.mean for name, stat in self.summary.items()}

    def record(self) -> dict[str, Any]:
        """The JSON of `--out`: provenance, metrics with intervals, every sample (see module)."""
        first = next(iter(self.summary.values()))
        metrics = {
            name: {
                "mean": stat.mean,
                "low": stat.interval.low,
                "high": stat.interval.high,
                "per_seed": list(stat.per_seed),
            }
            for name, stat in self.summary.items()
        }
        problems = [
            {
                "index": problem.index,
                "question": problem.question,
                "gold": problem.gold,
                "samples": [
                    [
                        _sample_record(result.samples, p, g)
                        for g in range(result.samples.num_samples)
                    ]
                    for result in self.results
                ],
            }
            for p, problem in enumerate(self.problems)
        ]
        return {
            "format": RECORD_FORMAT,
            **self.provenance,
            "interval": {
                "level": first.interval.level,
                "method": first.interval.method,
                "how": "per problem p: v_p = mean over seeds of the problem's metric; "
                "draws = numpy.random.default_rng(bootstrap_seed).integers(0, P, (resamples, P)); "
                "interval = numpy.quantile(v[draws].mean(axis=1), [0.025, 0.975])",
                "resamples": BOOTSTRAP_RESAMPLES,
                "bootstrap_seed": BOOTSTRAP_SEED,
            },
            "metrics": metrics,
            "problems": problems,
        }

    def table(self) -> list[str]:
        """The terminal table: one line per metric, its mean, interval and per-seed values."""
        seeds = len(self.results)
        width = max(len(name) for name in self.summary)
        intervals = {
            name: f"[{stat.interval.low:.4f}, {stat.interval.high:.4f}]"
            for name, stat in self.summary.items()
        }
        span = max(len(text) for text in intervals.values())
        header = f"  {'metric':<{width}}  {'mean':>9}  {'95% interval':<{span}}"
        lines = [header + ("  per seed" if seeds > 1 else "")]
        for name, stat in self.summary.items():
            line = f"  {name:<{width}}  {stat.mean:>9.4f}  {intervals[name]:<{span}}"
            if seeds > 1:
                line += "  " + " ".join(f"{value:.4f}" for value in stat.per_seed)
            lines.append(line.rstrip())
        return lines


def evaluate_report(
    run_dir: str | Path | None = None,
    *,
    checkpoint: str | None = None,
    backend: str | None = None,
    base_model: str | None = None,
    dataset: str | None = None,
    dataset_config: str | None = None,
    prompt_column: str | None = None,
    answer_column: str | None = None,
    gold_rule: str | None = None,
    reward: Sequence[str] | None = None,
    env: str | None = None,
    max_turns: int | None = None,
    split: str = "test",
    limit: int = 200,
    samples: int = 1,
    temperature: float = 0.0,
    top_p: float = 1.0,
    max_tokens: int | None = None,
    seed: int = 0,
    seeds: int = 1,
    concurrency: int = 32,
    echo: Callable[[str], None] = print,
    progress: bool = False,
) -> EvalReport:
    """Evaluate the weights on the first `limit` problems of `split`, for `seeds` seeds.

    Of `run_dir`'s final weights, a `checkpoint` path, or (neither given) the base model. The
    task is the run's unless overridden (`reward` replaces its --reward list). Bad input
    raises `ConfigError` naming the flag and the fix before any model is loaded. With
    `progress`, its stages and requests show on stderr (`EvalProgress`).
    """
    from grpo.backends.pytrio import make_service_client
    from grpo.core.evaluation import seed_summary
    from grpo.tasks.data import SPLITS, columns_of, load_run_problems
    from grpo.training.rollouts.evaluation import Decoding, evaluate_policy
    from grpo.training.rollouts.problems import run_problems, tokenizer_max_len

    if run_dir is not None and checkpoint is not None:
        raise ConfigError("give --run-dir or --checkpoint, not both")
    _at_least_one("--limit", limit)
    _at_least_one("--samples", samples)
    _at_least_one("--seeds", seeds)
    if split not in SPLITS:
        raise ConfigError(f"--split {split!r} is not one of {', '.join(SPLITS)}")
    for name, value in (
        ("temperature", temperature),
        ("top_p", top_p),
        ("seed", seed),
        ("concurrency", concurrency),
    ):
        check_value(name, value)
    if reward is not None and len(reward) == 0:
        raise ConfigError("--reward needs MODULE:FUNCTION; e.g. --reward grpo.rewards:math_verify")
    shown = EvalProgress(progress)
    shown.stage("checking the task (its rewards or environment, its dataset)")
    config = eval_config(
        run_dir,
        {
            "backend": backend,
            "base_model": base_model,
            "dataset": dataset,
            "dataset_config": dataset_config,
            "prompt_column": prompt_column,
            "answer_column": answer_column,
            "gold_rule": gold_rule,
            "reward": tuple(reward) if reward is not None else None,
            "env": env,
            "max_turns": max_turns,
            "max_tokens": max_tokens,
        },
    )
    # --reward with --env is refused by the config itself
    # (grpo.training.settings.config.check_combinations).
    model_path = run_files.eval_weights_path(Path(run_dir)) if run_dir else checkpoint
    weights = weights_of(run_dir, checkpoint, config.base_model)
    local_root = str(Path(run_dir) / run_files.BACKEND_DIR) if run_dir else None
    rows = load_run_problems(config, split, limit=limit)
    shown.stage(f"loading {config.base_model} ({config.backend} backend)")
    service = make_service_client(config.backend, local_root=local_root, seed=seed)
    sampler = sampling_client(service, config.base_model, model_path)
    tokenizer = sampler.get_tokenizer()
    problems = run_problems(tokenizer, rows, config, split, max_len=tokenizer_max_len(tokenizer))
    if temperature == 0.0 and (samples > 1 or seeds > 1):
        echo(
            "note: at --temperature 0 every sample is the greedy one, so pass@k = avg@n and the "
            "seeds agree; pass e.g. --temperature 1.0 (or 0.6 --top-p 0.95) to sample"
        )
    label = model_path or f"base model {config.base_model}"
    echo(
        f"{label}: {len(problems)} {split} problems, {samples} sample(s) x {seeds} seed(s), "
        f"temperature {temperature}, top-p {top_p}, max tokens {config.max_tokens}"
    )
    decoding = Decoding(temperature=temperature, top_p=top_p, max_tokens=config.max_tokens)
    seed_list = [seed + offset for offset in range(seeds)]
    # One pool call per problem (its samples), or per episode under --env: what is counted.
    # The pool is left (its threads, which run the ticks, joined) before the count closes.
    unit = "episode" if config.env else "problem"
    per_seed = len(problems) * samples if config.env else len(problems)
    with (
        shown.counting(per_seed * seeds, unit) as tick,
        dropping_pool(concurrency, "eval") as pool,  # Ctrl-C: queued requests dropped
    ):
        results = tuple(
            evaluate_policy(
                sampler,
                problems,
                tokenizer,
                config,
                pool=_TickingPool(pool, tick),  # evaluate_policy uses its submit only
                decoding=decoding,
                samples=samples,
                seed=one_seed,
                note=echo,
            )
            for one_seed in seed_list
        )
    from grpo.training.run.lifecycle import close_opened

    close_opened(service, None)  # done with the service made above
    summary = seed_summary(
        [result.samples for result in results],
        resamples=BOOTSTRAP_RESAMPLES,
        bootstrap_seed=BOOTSTRAP_SEED,
    )
    usage = sum((result.usage for result in results[1:]), results[0].usage)
    columns = columns_of(config)
    provenance = {
        "weights": weights,
        "backend": config.backend,
        "dataset": {
            "name": config.dataset,
            "config": config.dataset_config,
            "split": split,
            "hub_split": config.test_split if split == "test" else config.train_split,
            "rows": len(problems),
            "limit": limit,
            "prompt_column": columns[0],
            "answer_column": columns[1],
            "gold_rule": columns[2],
        },
        "decoding": {**decoding.as_dict(), "samples": samples},
        "task": (
            {"env": config.env, "max_turns": config.max_turns, "correct": "episode return >= 1"}
            if config.env is not None
            else {
                "rewards": [fn.spec for fn in config.reward_fns],
                "correct": f"{config.reward_fns[0].name} >= 1",
            }
        ),
        "seeds": seed_list,
        "usage": {**attrs.asdict(usage), "total": usage.total},
    }
    return EvalReport(
        provenance=provenance, problems=tuple(problems), results=results, summary=summary
    )


def evaluate(
    run_dir: str | Path | None = None,
    *,
    echo: Callable[[str], None] = print,
    **options: Any,
) -> dict[str, float]:
    """`test/<metric>` of `evaluate_report` (the same keyword arguments): means over seeds.

    ``test/avg@n``, ``test/pass@k`` (k = 1, 2, 4, ... <= samples), ``test/cons@n``,
    ``test/format_rate``, ``test/truncation_rate``, ``test/avg_gen_len``, ``test/reward``;
    under --env also ``test/turns`` and ``test/tool_calls``.
    """
    return evaluate_report(run_dir, echo=echo, **options).metrics


def write_record(report: EvalReport, out: Path) -> None:
    """`report.record()` as JSON at `out` (atomically)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(out.name + ".tmp")
    tmp.write_text(json.dumps(report.record(), indent=1) + "\n", encoding="utf-8")
    tmp.replace(out)
