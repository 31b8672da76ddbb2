"""A run's pre-flight (what it checks before its first call) and its planned usage and cost.

`preflight` is what `grpo train` does before it creates a training client: the config
(checked when built), the prices, the dataset, the base model's tokenizer (from a sampler
on the base model: no training run is created), and every prompt + --max-tokens against
the tokenizer's context and the service's limits (`check_capabilities`). The real run and
`grpo train --dry-run` share it; the dry run then prints `planned_usage`
(docs/FORMULAS.md, "Usage and cost") and, with prices, its cost, and writes nothing.
`grpo compare`/`sweep --dry-run` add the plans of every run of the experiment.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import attrs

from grpo.backends.clients import ServiceClient
from grpo.backends.pytrio import CapabilityError, check_capabilities
from grpo.core.usage import Prices, TokenUsage, cost, planned_episode_tokens, planned_usage
from grpo.rewards.judges import Judge
from grpo.tasks.data import load_problems, run_problem_source
from grpo.training.recipes.grpo.judge_setup import check_judge, resolve_judge
from grpo.training.rollouts.clients import Sampler, Tokenizer
from grpo.training.rollouts.problems import (
    Problem,
    build_problems,
    run_problem_options,
    tokenizer_max_len,
)
from grpo.training.run import run_files
from grpo.training.run.learner import runs_extra_forward
from grpo.training.run.schedule import evaluates_after, evaluates_at_start, saves_after
from grpo.training.run.seeds import extra_batch, pick_batch
from grpo.training.settings.config import ConfigError, TrainConfig, check_user_inputs
from grpo.training.settings.prices import prices_for

if TYPE_CHECKING:
    from datasets import Dataset

    from grpo.training.recipes.distill.teacher import Teacher


@attrs.frozen
class Preflight:
    """Everything a run checked before its first training call, and what it built doing so."""

    config: TrainConfig
    steps: int
    service: ServiceClient
    base_sampler: Sampler
    """A sampler on the base model (the reference sampler when --kl-coef > 0)."""
    tokenizer: Tokenizer
    max_len: int | None
    train_problems: list[Problem]
    test_problems: list[Problem]
    prices: Prices | None
    teacher: Teacher | None = None
    """`grpo distill`'s teacher, resolved and its tokenizer checked (None otherwise)."""
    judge: Judge | None = None
    """The judge of the judge rewards, resolved (else None)."""


class SharedInputs:
    """What the pre-flights of an experiment's runs share: a split's rows and the problems
    built from them, each kept under every argument that makes it, so a run gets only what
    it would have built itself (a sweep over --learning-rate loads and tokenizes once)."""

    def __init__(self) -> None:
        self._rows: dict[tuple[object, ...], Dataset] = {}
        self._problems: dict[
            tuple[object, ...], tuple[Tokenizer, Dataset | tuple[()], list[Problem]]
        ] = {}

    def rows(self, config: TrainConfig, split: str, *, limit: int | None = None) -> Dataset:
        """`load_run_problems(config, split, limit=limit)`, loaded once per distinct source."""
        source = run_problem_source(config, split, limit=limit)
        key = tuple(sorted(source.items()))
        if key not in self._rows:
            self._rows[key] = load_problems(**source)
        return self._rows[key]

    def problems(
        self,
        tokenizer: Tokenizer,
        rows: Dataset | tuple[()],
        config: TrainConfig,
        split: str,
        max_len: int | None,
    ) -> list[Problem]:
        """`run_problems(tokenizer, rows, config, split, max_len=max_len)`, built once."""
        options = run_problem_options(config, split, max_len=max_len)
        key = (id(tokenizer), id(rows), *sorted(options.items()))
        if key not in self._problems:  # the value keeps tokenizer and rows (and so their ids)
            built = build_problems(tokenizer, rows, **options)
            self._problems[key] = (tokenizer, rows, built)
        return self._problems[key][2]


def preflight(
    config: TrainConfig,
    make_service: Callable[[], ServiceClient],
    note: Callable[[str], None] = print,
    shared: SharedInputs | None = None,
) -> Preflight:
    """Check rewards, few-shot file, prices and data (before any service call), then prompts.

    `shared` lets the runs of an experiment share their rows and problems (None: this run's own).
    """
    shared = SharedInputs() if shared is None else shared
    check_user_inputs(config)
    check_judge(config)
    prices = prices_for(config)
    train_rows = shared.rows(config, "train")
    test_rows = shared.rows(config, "test", limit=config.eval_limit) if config.eval_every else ()
    steps = math.ceil(len(train_rows) / config.batch_size) if config.all_data else config.steps
    service = make_service()
    base_sampler = service.create_sampling_client(base_model=config.base_model)
    tokenizer = base_sampler.get_tokenizer()
    max_len = tokenizer_max_len(tokenizer)
    problems = {
        split: shared.problems(tokenizer, rows, config, split, max_len)
        for split, rows in (("train", train_rows), ("test", test_rows))
    }
    if hasattr(service, "get_server_capabilities"):  # test doubles may not have it
        longest_prompt = max(
            (len(problem.prompt_tokens) for split in problems.values() for problem in split),
            default=0,
        )
        try:
            check_capabilities(service, config.base_model, longest_prompt, config.max_tokens)
        except CapabilityError as error:
            raise ConfigError(str(error)) from None
    teacher = None
    if config.teacher is not None:
        from grpo.training.recipes.distill.teacher import resolve_teacher

        teacher = resolve_teacher(service, config, tokenizer)
    judge = resolve_judge(
        service, config, run_dir=Path(config.run_dir) if config.run_dir else None, note=note
    )
    return Preflight(
        teacher=teacher,
        judge=judge,
        config=config,
        steps=steps,
        service=service,
        base_sampler=base_sampler,
        tokenizer=tokenizer,
        max_len=max_len,
        train_problems=problems["train"],
        test_problems=problems["test"],
        prices=prices,
    )


def count_evals(config: TrainConfig, steps: int, start_step: int = 0) -> int:
    """Evaluations the loop runs: a baseline at step 0, then every --eval-every and the last."""
    done = range(start_step + 1, steps + 1)
    return int(evaluates_at_start(config, start_step)) + sum(
        1 for step in done if evaluates_after(config, step, steps)
    )


def count_checkpoints(config: TrainConfig, steps: int, start_step: int = 0) -> int:
    """Checkpoints the loop saves: every --save-every before the last step, then the final one."""
    periodic = sum(1 for step in range(start_step + 1, steps) if saves_after(config, step, steps))
    return periodic + 1


def judge_calls(pre: Preflight, start_step: int = 0) -> int:
    """The most judge requests of steps start_step..steps: per round of a step B·G for
    `judge` and B for `judge_rank`; per evaluation n_test for `judge` (a group of one is
    not ranked); 0 without a judge reward."""
    config = pre.config
    if pre.judge is None:
        return 0
    modes = [reward.judge_mode for reward in config.reward_fns if reward.judge_mode]
    per_round = sum(
        config.batch_size * (config.group_size if mode == "score" else 1) for mode in modes
    )
    per_eval = len(pre.test_problems) * modes.count("score")
    steps = pre.steps - start_step
    evals = count_evals(config, pre.steps, start_step)
    return steps * sampling_rounds(config) * per_round + evals * per_eval


def _judge_line(pre: Preflight, start_step: int) -> list[str]:
    if pre.judge is None:
        return []
    calls = judge_calls(pre, start_step)
    return [
        f"  judge: {pre.config.judge_model}"
        + (f" at {pre.config.judge_url}" if pre.config.judge_url else " (the run's backend)")
        + f", <= {calls:,} requests (cached replies are not sent again), judge completion "
        f"tokens <= {calls * pre.config.judge_max_tokens:,}; judge prompt tokens not planned "
        "(the rubric's and the judge tokenizer's)"
    ]


def plan_usage(pre: Preflight, start_step: int = 0) -> TokenUsage:
    """An upper bound on the usage of steps start_step..steps (exact in the sampled prompts).

    Under --env only the sampled tokens are planned (`planned_episode_tokens`: --max-turns x
    --max-tokens per episode); the other kinds are 0, not planned (`usage_lines` says so).
    """
    config = pre.config
    if config.env is not None:
        return TokenUsage(completion_tokens=episode_token_bound(pre, start_step))
    lens = [len(problem.prompt_tokens) for problem in pre.train_problems]
    lens_by_step = [
        [lens[index] for index in pick_batch(len(lens), config.batch_size, step, config.seed)]
        for step in range(start_step, pre.steps)
    ]
    extra_by_step = [  # --dynamic-sampling: the extra rounds' prompts, as if every round ran
        [
            lens[index]
            for round_ in range(1, sampling_rounds(config))
            for index in extra_batch(len(lens), config.batch_size, step, round_, config.seed)
        ]
        for step in range(start_step, pre.steps)
    ]
    judged = TokenUsage(
        judge_completion_tokens=judge_calls(pre, start_step) * config.judge_max_tokens
    )
    return judged + planned_usage(
        lens_by_step,
        [len(problem.prompt_tokens) for problem in pre.test_problems],
        group_size=config.group_size,
        max_tokens=config.max_tokens,
        epochs=config.epochs,
        num_evals=count_evals(config, pre.steps, start_step),
        num_checkpoints=count_checkpoints(config, pre.steps, start_step),
        with_reference=config.kl_coef > 0,
        extra_forward=runs_extra_forward(config),
        proximal_forward=config.mismatch.enabled,
        teacher_prompt_lens_by_step=_teacher_lens(pre, start_step),
        extra_prompt_lens_by_step=extra_by_step,
    )


def sampling_rounds(config: TrainConfig) -> int:
    """The most sampling rounds of a step: --max-sampling-rounds under --dynamic-sampling."""
    return config.max_sampling_rounds if config.dynamic_sampling else 1


def episode_token_bound(pre: Preflight, start_step: int = 0) -> int:
    """--env: the most tokens steps start_step..steps and their evaluations sample."""
    config = pre.config
    return planned_episode_tokens(
        [config.batch_size * config.group_size] * (pre.steps - start_step),
        len(pre.test_problems),
        max_turns=config.max_turns,
        max_tokens=config.max_tokens,
        num_evals=count_evals(config, pre.steps, start_step),
        max_rounds=sampling_rounds(config),
    )


def episode_plan_line(config: TrainConfig) -> str:
    """--env's per-step bound on sampled tokens, turns x per-turn max tokens, and that it is one."""
    per_episode = config.max_turns * config.max_tokens
    rounds = sampling_rounds(config)
    episodes = config.batch_size * config.group_size * rounds
    played = (
        f"{config.batch_size} x {config.group_size} episodes x at most {rounds} rounds "
        "(--dynamic-sampling)"
        if rounds > 1
        else f"{config.batch_size} x {config.group_size} episodes"
    )
    return (
        f"  episodes (--env): <= --max-turns {config.max_turns} x --max-tokens "
        f"{config.max_tokens} = {per_episode:,} sampled tokens each; a step plays {played}: "
        f"<= {episodes * per_episode:,} sampled tokens a step (an upper bound: episodes that "
        "end sooner, or turns that stop before --max-tokens, sample fewer)"
    )


def _teacher_lens(pre: Preflight, start_step: int) -> list[list[int]] | None:
    if pre.teacher is None:
        return None
    from grpo.training.recipes.distill.teacher import planned_teacher_lens

    return planned_teacher_lens(
        pre.teacher, pre.train_problems, pre.config, range(start_step, pre.steps)
    )


def usage_lines(
    usage: TokenUsage, prices: Prices | None, *, env: bool = False, dynamic: bool = False
) -> list[str]:
    """The planned totals, one kind a line, and the cost when prices are given.

    ``env`` (an --env run): only the sampled tokens are planned; the other lines say why not.
    ``dynamic`` (--dynamic-sampling): the prompts are a bound, every extra round counted.
    """
    if env:
        return _episode_usage_lines(usage, prices)
    prompts = (
        "<= (every --max-sampling-rounds round sampled; exact prompts)"
        if dynamic
        else "exact for rollouts and evaluations"
    )
    rows = [
        ("prompt tokens (sampler)", usage.prompt_tokens, prompts),
        ("completion tokens", usage.completion_tokens, "<= (every completion --max-tokens long)"),
        ("trained tokens", usage.trained_tokens, "<= (positions x passes, no group dropped)"),
        ("forward-only tokens", usage.forward_tokens, "<= (checkpoint checks, custom loss)"),
        *(
            [("judge reply tokens", usage.judge_completion_tokens, "<= (--judge-max-tokens each)")]
            if usage.judge_completion_tokens
            else []
        ),
    ]
    lines = [f"  {label:<24} {value:>14,}  {note}" for label, value, note in rows]
    if prices is None:
        lines.append("  cost: no prices given (--price-file or --price-* flags)")
    else:
        lines.append(
            f"  cost <= {cost(usage, prices):.4f} {prices.currency}  (prices {prices.source})"
        )
    return lines


ENV_UNPLANNED = (
    "not planned under --env: each turn re-sends the conversation so far, with the "
    "environment's answers, which are not known before the run"
)


def _episode_usage_lines(usage: TokenUsage, prices: Prices | None) -> list[str]:
    """--env's totals: the sampled tokens' upper bound; the other kinds are not planned."""
    lines = [
        f"  {'completion tokens':<24} {usage.completion_tokens:>14,}  <= (every episode "
        "--max-turns turns of --max-tokens tokens; an upper bound)",
        *(
            f"  {label:<24} {'-':>14}  {note}"
            for label, note in (
                ("prompt tokens (sampler)", ENV_UNPLANNED),
                ("trained tokens", "not planned under --env (they hold the observations too)"),
                ("forward-only tokens", "not planned under --env (as the trained tokens)"),
            )
        ),
    ]
    if prices is None:
        lines.append("  cost: no prices given (--price-file or --price-* flags)")
    else:
        sampled = cost(TokenUsage(completion_tokens=usage.completion_tokens), prices)
        lines.append(
            f"  cost of the sampled tokens alone <= {sampled:.4f} {prices.currency}  (prices "
            f"{prices.source}); prompt, trained and forward tokens are not planned under --env"
        )
    return lines


def describe(pre: Preflight, usage: TokenUsage, start_step: int = 0) -> list[str]:
    """The dry run's report: what was checked, then the plan."""
    config = pre.config
    prompt_lens = [len(problem.prompt_tokens) for problem in pre.train_problems]
    loss = (
        "custom, through forward_backward_custom"
        + (" (+1 forward per update on PyTRIO)" if runs_extra_forward(config) else "")
        if config.runs_custom_loss
        else "built-in on the service"
    )
    return [
        f"dry run of {config.run_dir}: every check passed; no training run was created",
        f"  backend {config.backend}, model {config.base_model}, context "
        f"{pre.max_len if pre.max_len is not None else 'not stated by the tokenizer'} "
        "(and the service's limits, where it reports them)",
        f"  data: {len(pre.train_problems)} train / {len(pre.test_problems)} test problems "
        f"({config.dataset}), prompts {min(prompt_lens)}..{max(prompt_lens)} tokens "
        f"+ --max-tokens {config.max_tokens}",
        f"  loss: {config.loss_fn} ({loss}), reduction {config.reduction}",
        f"  plan: steps {start_step}..{pre.steps} x {config.batch_size} prompts x "
        f"{config.group_size} {'completions' if config.env is None else 'episodes'}, "
        f"{config.epochs} epoch(s) x {config.num_substeps} "
        f"minibatch(es); {count_evals(config, pre.steps, start_step)} evaluation(s) of "
        f"{len(pre.test_problems)} problems; "
        f"{count_checkpoints(config, pre.steps, start_step)} checkpoint(s)",
        *_teacher_line(pre, start_step),
        *_judge_line(pre, start_step),
        *([episode_plan_line(config)] if config.env is not None else []),
        *_probe_line(config),
        *usage_lines(
            usage, pre.prices, env=config.env is not None, dynamic=config.dynamic_sampling
        ),
    ]


def _probe_line(config: TrainConfig) -> list[str]:
    if config.backend != "pytrio" or not config.normalization_probe:
        return []
    from grpo.backends.normalization_probe import DEFAULT_TIMEOUT_S, MAX_CALLS

    return [
        "  normalization probe at start: a throwaway rank-4 LoRA, two tiny batches, at most "
        f"{MAX_CALLS} calls, {DEFAULT_TIMEOUT_S:g} s (not in the usage below; "
        "--no-normalization-probe skips it)"
    ]


def _teacher_line(pre: Preflight, start_step: int) -> list[str]:
    if pre.teacher is None:
        return []
    from grpo.training.recipes.distill.teacher import teacher_plan_line

    teacher = pre.teacher
    if pre.config.env is not None:  # the streams' lengths are the environment's to decide
        return [
            f"  teacher: {teacher.source}"
            + (f" (weights {teacher.weights})" if teacher.weights else " (a base model)")
            + ", tokenizer equal to the student's; it scores each episode's whole stream "
            "(teacher prompt tokens not planned: the observations' lengths are the env's)"
        ]
    return [teacher_plan_line(teacher, _teacher_lens(pre, start_step) or [], pre.config)]


def plan_experiment(
    configs: Sequence[TrainConfig], make_service: Callable[[TrainConfig], ServiceClient]
) -> tuple[list[tuple[TrainConfig, TokenUsage, Prices | None]], list[str]]:
    """Every run's pre-flight and plan, and the report lines with the experiment's totals."""
    planned = []
    shared = SharedInputs()
    for config in configs:
        pre = preflight(config, lambda config=config: make_service(config), shared=shared)
        planned.append((config, plan_usage(pre), pre.prices))
    lines = [
        f"dry run of {len(planned)} run(s): every check passed; nothing was started "
        "(each run planned from step 0; finished runs are skipped by the real command)"
    ]
    for config, usage, prices in planned:
        priced = f", cost <= {cost(usage, prices):.4f} {prices.currency}" if prices else ""
        status = run_files.run_status(Path(str(config.run_dir)))
        counted = (
            f"<= {usage.completion_tokens:,} sampled tokens (--env: prompt, trained and "
            "forward tokens not planned)"
            if config.env is not None
            else f"{usage.total:,} tokens ({usage.prompt_tokens:,} prompt, "
            f"<= {usage.completion_tokens:,} completion, <= {usage.trained_tokens:,} trained)"
        )
        lines.append(f"  {Path(str(config.run_dir)).name} ({status}): {counted}{priced}")
    total = sum((usage for _config, usage, _prices in planned), TokenUsage())
    lines.append("total:")
    if any(config.env is not None for config, _usage, _prices in planned):
        lines.append("  (--env runs count only their sampled tokens)")
    currencies = {prices.currency for _config, _usage, prices in planned if prices}
    all_priced = all(prices for _config, _usage, prices in planned)
    dynamic = any(config.dynamic_sampling for config, _usage, _prices in planned)
    lines += usage_lines(total, None, dynamic=dynamic)[:-1]
    if all_priced and len(currencies) == 1:
        spent = sum(cost(usage, prices) for _config, usage, prices in planned if prices)
        lines.append(f"  cost <= {spent:.4f} {currencies.pop()}  (user-supplied prices)")
    else:
        lines.append("  cost: not every run has prices in one currency")
    return planned, lines
