"""The groups of flags of a grpo or distill run (`TrainConfig`), beside the shared ones of
`grpo.training.settings.config_groups`: data and rewards, sampling, loss, update, KL, mismatch,
environments, judge, teacher, evaluation.

Each group is an attrs record usable alone and checked alone: the validators of its fields,
and in `__attrs_post_init__` the checks among its own fields (an --env-arg needs an OpenEnv
--env; --recipe distill needs --teacher). `TrainConfig` is composed of these groups, keeps
every flag a flat attribute (`config.kl_coef`), and gives each concern as a nested record
(`config.kl`, `config.judge`, `config.environment`, ...); the checks across groups stay in
`TrainConfig`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from typing import TYPE_CHECKING

import attrs

from grpo.tasks.prompts import QUESTION_SUFFIX
from grpo.training.recipes import RECIPES as RECIPE_SPECS
from grpo.training.recipes import TASK
from grpo.training.settings.fields import (
    ADVANTAGE_NAMES,
    ENV_VAR_NAME,
    GOLD_RULE,
    KL_ESTIMATOR_NAMES,
    LOSS_NAMES,
    MISMATCH_CORRECTION_NAMES,
    NOT_EMPTY,
    REDUCTION_NAMES,
    Above,
    AtLeast,
    ConfigError,
    Interval,
    OneOf,
    flag,
    grouped,
    parse_loss_config,
)

if TYPE_CHECKING:
    from grpo.core.loss_spec import LossSpec
    from grpo.core.mismatch import MismatchCorrection

RECIPES = tuple(name for name, spec in RECIPE_SPECS.items() if spec.kind == TASK)
"""The values of --recipe: the registered recipes that train on `TrainConfig` (grpo, distill)."""
SAMPLER_DTYPES = ("float32", "bfloat16")


@attrs.frozen(slots=False, field_transformer=grouped("run"))
class TrainRunSettings:
    """What a grpo/distill run starts from."""

    init_from: str | None = flag(
        None,
        "start from the final weights of a finished `grpo sft` or `grpo train` run directory "
        "(same backend, base model and LoRA rank; the --kl-coef reference stays the base model)",
        NOT_EMPTY,
    )


@attrs.frozen(slots=False, field_transformer=grouped("data and task"))
class DataSettings:
    """The problems and how they are prompted."""

    dataset: str = flag(
        "arithmetic",
        "problems: a built-in name ('arithmetic', 'wordproblems', 'gsm8k'), a local "
        "JSONL/Parquet/CSV file or "
        "directory, or a hub dataset OWNER/NAME (with --dataset-config, --train-split)",
        NOT_EMPTY,
    )
    dataset_config: str | None = flag(
        None, "configuration of a hub --dataset (e.g. 'main' for openai/gsm8k)", NOT_EMPTY
    )
    train_split: str = flag("train", "split of a hub --dataset to train on", NOT_EMPTY)
    test_split: str = flag("test", "split of a hub --dataset to evaluate on", NOT_EMPTY)
    prompt_column: str = flag("question", "dataset column holding the question", NOT_EMPTY)
    answer_column: str = flag("answer", "dataset column holding the answer", NOT_EMPTY)
    gold_rule: str = flag(
        "####",
        "how the gold answer comes from the answer column: '####' (the text after the last "
        "####), 'whole' (the whole field) or 'regex:PATTERN' (group 1 of the last match)",
        GOLD_RULE,
    )
    system_prompt: str | None = flag(None, "system message put before every prompt (default: none)")
    question_suffix: str = flag(
        QUESTION_SUFFIX, "text appended to every question (default: the article's instruction)"
    )
    fewshot_file: str | None = flag(
        None,
        "JSON file of few-shot messages [{role, content}, ...] replacing the built-in example "
        "(turns --fewshot on unless --no-fewshot)",
        NOT_EMPTY,
    )
    all_data: bool = flag(
        False, "iterate over the whole train split instead of --steps x --batch-size problems"
    )
    difficulty: int = flag(
        1,
        "difficulty of the built-in arithmetic problems (operands 0..2*10^difficulty)",
        AtLeast(1),
    )
    fewshot: bool | None = flag(
        None,
        "prepend the few-shot example to prompts "
        "(default: on for real models, off for the tiny one)",
    )


@attrs.frozen(slots=False, field_transformer=grouped("data and task"))
class RewardSettings:
    """The rewards and how their calls run."""

    reward: tuple[str, ...] = flag(
        (),
        "reward MODULE:FUNCTION[=WEIGHT] or FILE.py:FUNCTION[=WEIGHT] (repeatable; "
        "default grpo.rewards:boxed_match)",
        metavar="MODULE:FUNCTION[=WEIGHT]",
    )
    reward_errors: str = flag(
        "stop",
        "a reward that raises or returns a non-finite/non-number: stop the run (with a "
        "checkpoint) or score it 0 and count it in reward/errors",
        OneOf(("stop", "zero")),
    )
    reward_workers: int = flag(
        0,
        "threads calling built-in rewards, worker processes calling plugins (0 = serial; "
        "results are identical)",
        AtLeast(0),
    )
    reward_timeout: float = flag(
        60.0,
        "seconds a plugin reward call may take (it runs in a worker process; past it the run "
        "stops, or the call scores 0 under --reward-errors zero); 0 = call plugins in this "
        "process with no limit",
        AtLeast(0),
    )
    overlong_buffer: int | None = flag(
        None,
        "L of DAPO's overlong penalty (grpo.rewards:overlong_penalty): linear over the last L "
        "tokens before --max-tokens (default: --max-tokens // 4)",
        AtLeast(1),
    )
    mask_truncated: bool = flag(
        False, "completions stopped by --max-tokens train no tokens (DAPO overlong filtering)"
    )


@attrs.frozen(slots=False, field_transformer=grouped("sampling"))
class SamplingSettings:
    """What each step samples, and how."""

    batch_size: int = flag(8, "prompts per step", AtLeast(1))
    group_size: int = flag(
        8, "completions sampled per prompt (>= 2; 1 allowed under grpo distill)", AtLeast(1)
    )
    max_tokens: int = flag(24, "maximum generated tokens per completion", AtLeast(1))
    temperature: float = flag(1.0, "sampling temperature", AtLeast(0))
    top_p: float = flag(1.0, "nucleus sampling threshold", Interval(0, 1, "right"))
    concurrency: int = flag(32, "sampling requests in flight at once", AtLeast(1))
    max_steps_off_policy: int = flag(
        0, "how many steps stale a rollout may be (0 = strictly on-policy)", AtLeast(0)
    )
    dynamic_sampling: bool = flag(
        False,
        "DAPO dynamic sampling: sample further prompts until --batch-size groups are "
        "non-degenerate (or --max-sampling-rounds)",
    )
    max_sampling_rounds: int = flag(
        3, "most sampling rounds of a step under --dynamic-sampling (1 = no extra)", AtLeast(1)
    )


@attrs.frozen(slots=False, field_transformer=grouped("loss"))
class LossSettings:
    """The advantage estimator and the policy loss."""

    advantage: str = flag("center", "group advantage estimator", OneOf(ADVANTAGE_NAMES))
    loss_fn: str = flag(
        "importance_sampling",
        "policy loss kernel (a name in grpo.core.losses.LOSSES; `grpo plot-losses` draws them)",
        OneOf(LOSS_NAMES),
    )
    loss_config: tuple[str, ...] = flag(
        (), "loss_fn_config entry KEY=VALUE (repeatable), validated against the kernel's keys"
    )
    custom_loss: bool = flag(
        False, "run the loss through forward_backward_custom with the core kernel"
    )
    reduction: str = flag(
        "sum",
        "how token losses aggregate (a name in grpo.core.losses.REDUCTIONS: sum, token_mean, ...)",
        OneOf(REDUCTION_NAMES),
    )
    cispo_clip_low_threshold: float = flag(0.0, "CISPO lower ratio bound (the article's flag)")
    cispo_clip_high_threshold: float = flag(4.0, "CISPO upper ratio bound (the article's flag)")

    def __attrs_post_init__(self) -> None:
        parse_loss_config(self.loss_config)  # KEY=VALUE entries with numbers

    def spec(self, max_tokens: int) -> "LossSpec":
        """The validated loss: --loss-fn, --loss-config (the CISPO flags folded in), --reduction.

        norm_length comes from `--loss-config norm_length=L`, else `max_tokens` when the
        reduction is seq_mean_token_sum_norm (the constant L of docs/FORMULAS.md).
        """
        from grpo.core.loss_spec import LossSpec

        overrides = parse_loss_config(self.loss_config)
        norm_length = overrides.pop("norm_length", None)
        if self.loss_fn == "cispo":
            overrides = {
                "clip_low_threshold": self.cispo_clip_low_threshold,
                "clip_high_threshold": self.cispo_clip_high_threshold,
                **overrides,
            }
        if self.reduction == "seq_mean_token_sum_norm" and norm_length is None:
            norm_length = float(max_tokens)
        try:
            return LossSpec.build(
                self.loss_fn, overrides, reduction=self.reduction, norm_length=norm_length
            )
        except (ValueError, TypeError) as error:
            flags = "--loss-config" + (
                " / --cispo-clip-*-threshold" if self.loss_fn == "cispo" else ""
            )
            raise ConfigError(f"{flags}: {error}") from None


@attrs.frozen(slots=False, field_transformer=grouped("update"))
class UpdateSettings:
    """How many steps, and the optimizer steps of each."""

    steps: int = flag(80, "number of training steps (batches)", AtLeast(1))
    num_substeps: int = flag(
        2, "minibatches per step, one optimizer step each (1..--batch-size)", AtLeast(1)
    )
    epochs: int = flag(1, "passes over each batch (PPO-style reuse)", AtLeast(1))


@attrs.frozen(slots=False, field_transformer=grouped("KL and mismatch"))
class KlSettings:
    """The KL-to-base-model penalty."""

    kl_coef: float = flag(
        0.0, "KL-to-base-model penalty folded into token advantages (0 = off)", AtLeast(0)
    )
    kl_estimator: str = flag(
        "k1", "KL estimator for the penalty (k1, k2 or k3)", OneOf(KL_ESTIMATOR_NAMES)
    )


@attrs.frozen(slots=False, field_transformer=grouped("KL and mismatch"))
class MismatchSettings:
    """The sampler-trainer mismatch correction."""

    mismatch_correction: str = flag(
        "none",
        "sampler-trainer mismatch correction: token_truncate (truncated IS), token_mask "
        "(masked IS), sequence_truncate, sequence_mask, or recompute (the trainer's own "
        "log-probs as the behaviour policy) (docs/FORMULAS.md); costs one forward",
        OneOf(MISMATCH_CORRECTION_NAMES),
    )
    mismatch_cap: float = flag(2.0, "truncated-IS cap C on the mismatch ratio (>= 1)")
    mismatch_mask_low: float = flag(0.5, "masked IS: lowest mismatch ratio kept (<= 1)")
    mismatch_mask_high: float = flag(2.0, "masked IS: highest mismatch ratio kept (>= 1)")

    def correction(self, loss_fn: str) -> "MismatchCorrection":
        """The validated --mismatch-correction with its cap and mask bounds, for `loss_fn`."""
        from grpo.core.mismatch import MismatchCorrection

        try:
            correction = MismatchCorrection(
                self.mismatch_correction,
                cap=self.mismatch_cap,
                low=self.mismatch_mask_low,
                high=self.mismatch_mask_high,
            )
            correction.check_loss(loss_fn)
        except ValueError as error:
            raise ConfigError(
                f"--mismatch-correction / --mismatch-cap / --mismatch-mask-*: {error}"
            ) from None
        return correction


@attrs.frozen(slots=False, field_transformer=grouped("environments and tools"))
class EnvSettings:
    """Multi-turn environments (--env)."""

    env: str | None = flag(
        None,
        "multi-turn environment MODULE:FACTORY or FILE.py:FACTORY, called with each task "
        "(e.g. grpo.envs:calculator_wordproblems); episodes replace single completions",
        NOT_EMPTY,
    )
    env_arg: tuple[str, ...] = flag(
        (),
        "KEY=VALUE for the --env (repeatable); --env openenv:MODULE:CLIENT takes base_url=URL, "
        "action=/observation= MODULE:FUNCTION hooks, the rest go to the server's reset()",
    )
    env_capacity: int | None = flag(
        None,
        "most sessions the --env openenv server holds at once; episodes beyond it wait in a "
        "queue (default: learnt from the server as the run starts)",
        AtLeast(1),
    )
    max_turns: int = flag(4, "most sampled turns of an --env episode", AtLeast(1))
    env_timeout: float = flag(
        60.0,
        "seconds an --env's initial_observation() or step() may take; past it the call is an "
        "env error, handled by --env-errors (0 = no limit)",
        AtLeast(0),
    )
    env_errors: str = flag(
        "stop",
        "an --env step() that raises or passes --env-timeout: stop the run (with a checkpoint) "
        "or end that episode with reward 0 and count it in env/errors",
        OneOf(("stop", "zero")),
    )

    def __attrs_post_init__(self) -> None:
        openenv = self.env is not None and self.env.startswith("openenv:")
        if self.env_arg and not openenv:
            raise ConfigError(
                f"--env-arg {self.env_arg[0]} is read by --env openenv:MODULE:CLIENT only (an "
                "in-process --env factory takes its settings in its own code); drop --env-arg"
            )
        if self.env_capacity is not None and not openenv:
            raise ConfigError(
                f"--env-capacity {self.env_capacity} is read by --env openenv:MODULE:CLIENT "
                "only (the sessions of an OpenEnv server); drop --env-capacity"
            )


@attrs.frozen(slots=False, field_transformer=grouped("judge"))
class JudgeSettings:
    """The judge of grpo.rewards:judge and judge_rank (docs/FORMULAS.md)."""

    judge_model: str | None = flag(
        None,
        "the judge of grpo.rewards:judge / judge_rank: a model name, a sampler or state path, "
        "or a finished run directory, on the run's backend; with --judge-url, the model name "
        "the endpoint is asked for",
        NOT_EMPTY,
    )
    judge_url: str | None = flag(
        None,
        "an OpenAI-compatible endpoint the judge is asked through (e.g. "
        "http://127.0.0.1:8000/v1) instead of the run's backend",
        NOT_EMPTY,
    )
    judge_api_key_env: str | None = flag(
        None,
        "the environment variable holding --judge-url's API key (the key itself is never "
        "written anywhere)",
        ENV_VAR_NAME,
    )
    judge_rubric: str | None = flag(
        None,
        "the judge's prompt template (a file) with {question}, {completion} (judge_rank: "
        "{completions}) and {reference}; default: a built-in rubric",
        NOT_EMPTY,
    )
    judge_max_score: float = flag(
        10.0, "S of the judge's 'SCORE: s' line (0 <= s <= S); the reward is s / S", Above(0)
    )
    judge_max_tokens: int = flag(256, "most tokens of one judge reply", AtLeast(1))
    judge_temperature: float = flag(
        0.0, "the judge's sampling temperature (0 = greedy)", AtLeast(0)
    )
    judge_concurrency: int = flag(8, "judge requests in flight at once", AtLeast(1))
    judge_timeout: float = flag(
        60.0, "seconds one judge request may take before it is retried (--max-retries)", Above(0)
    )


@attrs.frozen(slots=False, field_transformer=grouped("teacher"))
class TeacherSettings:
    """On-policy distillation (`grpo distill`; docs/FORMULAS.md, "On-policy distillation")."""

    recipe: str = flag(
        "grpo",
        "what trains: grpo (the task reward) or distill (a teacher's log-probs; set by "
        "`grpo distill`)",
        OneOf(RECIPES),
    )
    teacher: str | None = flag(
        None,
        "distill: the teacher, a model name, a sampler or state path, or a finished run "
        "directory (its final weights)",
        NOT_EMPTY,
    )
    teacher_system_prompt: str | None = flag(
        None,
        "distill: the teacher's own system message (context distillation; default: the "
        "teacher scores the student's prompt)",
    )
    distill_coef: float = flag(
        1.0, "distill: c, the weight of the per-token reverse KL s_t - q_t", AtLeast(0)
    )
    distill_discount: float = flag(
        0.0,
        "distill: gamma of the reverse-KL return in [0, 1] (0 = per token, 1 = undiscounted)",
        AtLeast(0),
    )
    task_reward_weight: float = flag(
        0.0, "distill: w, the weight of the task reward's group advantage (0 = pure)", AtLeast(0)
    )
    distill_clip: float = flag(
        0.0, "distill: clamp each |c (s_t - q_t)| to this bound (0 = off)", AtLeast(0)
    )
    teacher_concurrency: int = flag(
        16, "distill: teacher scoring requests in flight at once", AtLeast(1)
    )

    def __attrs_post_init__(self) -> None:
        if self.distill_discount > 1:
            raise ConfigError(f"--distill-discount must be in [0, 1], got {self.distill_discount}")
        if self.recipe == "distill" and self.teacher is None:
            raise ConfigError("--recipe distill needs --teacher MODEL | CHECKPOINT | RUN_DIR")
        if self.recipe != "distill" and self.teacher is not None:
            raise ConfigError(
                f"--teacher {self.teacher} is for distillation; run `grpo distill` (or --recipe "
                "distill), or drop --teacher"
            )


@attrs.frozen(slots=False, field_transformer=grouped("evaluation and checkpoints"))
class EvaluationSettings:
    """Evaluation on the test split and the logged rollouts."""

    eval_every: int = flag(
        40, "evaluate on the test split before training and every N steps (0 = never)", AtLeast(0)
    )
    eval_limit: int = flag(300, "test problems per evaluation", AtLeast(1))
    log_rollouts: int = flag(
        4, "groups per step written to rollouts.jsonl (0 = none; see `grpo show`)", AtLeast(0)
    )


@attrs.frozen(slots=False, field_transformer=grouped("service"))
class LocalServiceSettings:
    """The local sampler's precision and the PyTRIO normalization probe."""

    sampler_dtype: str = flag(
        "float32",
        "local backend: precision the sampler runs in (bfloat16 reproduces a real service's "
        "sampler-trainer mismatch; training stays float32)",
        OneOf(SAMPLER_DTYPES),
    )
    normalization_probe: bool = flag(
        True,
        "--backend pytrio: at start, measure which total the service divides a built-in "
        "loss's gradient by (a throwaway LoRA, a few tiny calls; the result goes to "
        "service_probe.json; docs/FORMULAS.md); --no-normalization-probe skips it",
    )


CONCERNS = (LossSettings, KlSettings, MismatchSettings, EnvSettings, JudgeSettings, TeacherSettings)
"""The concern groups `TrainConfig` checks as records of their own."""
