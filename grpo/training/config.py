"""The typed configuration of a GRPO run: one field per `grpo train` flag, defined and checked here.

The CLI, TOML config files, a run's saved `config.json`, `grpo compare` and `grpo sweep` all
build this one class, so a flag's name, type, default, help and allowed values live here
once. Field `foo_bar` is flag `--foo-bar`. Building a `TrainConfig` checks everything that
needs no data and no model (types, ranges, finiteness, names from the registries of
`grpo.core`, the loss and its config) and raises `ConfigError` naming the flag, the value and
the fix, so a bad flag never fails after a step ran. Building one reads no user data: the
--reward modules and the --fewshot-file are loaded by `check_user_inputs`, the first step of
the pre-flight (`grpo.training.plan.preflight`). The validators live in `grpo.training.fields`.

No `from __future__ import annotations` here: the field transformer reads each field's type.
"""

from collections.abc import Mapping
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import TYPE_CHECKING, Any

import attrs

from grpo.backends.names import BUILTIN_MODEL_NAMES, TINY_MODEL_NAME
from grpo.core.normalization import NORMALIZATIONS
from grpo.tasks.prompts import QUESTION_SUFFIX
from grpo.training.fields import (
    ADVANTAGE_NAMES,
    ENV_VAR_NAME,
    GOLD_RULE,
    KL_ESTIMATOR_NAMES,
    LOSS_NAMES,
    MISMATCH_CORRECTION_NAMES,
    NOT_EMPTY,
    PLAIN_NAME,
    PRICE,
    REDUCTION_NAMES,
    TRACKER_LIST,
    Above,
    AtLeast,
    ConfigError,
    InRange,
    Interval,
    OneOf,
    flag,
    flag_name,
    parse_loss_config,
    with_checks,
)

if TYPE_CHECKING:
    from grpo.core.loss_spec import LossSpec
    from grpo.core.mismatch import MismatchCorrection
    from grpo.envs.base import EnvFactory
    from grpo.rewards import RewardFn
    from grpo.tasks.prompts import PromptTemplate

BACKENDS = ("local", "pytrio", "tinker")
SERVICE_BACKENDS = ("pytrio", "tinker")
"""The backends that are services: their built-in losses only sum, through an SDK."""
TINKER_MASKED_BUILTINS = ("importance_sampling", "ppo", "cispo", "cross_entropy")
"""Tinker's built-in losses that are 0 wherever the weight input (advantage) is 0, so that
advantage 0 masks a token out as grpo's mask does; dro, whose penalty is not, runs as a
custom loss on --backend tinker."""
SWANLAB_MODES = ("online", "offline", "disabled")
SAMPLER_DTYPES = ("float32", "bfloat16")
# PyTRIO's `create_lora_training_client` accepts ranks 4..64 (pytrio/client/service.py);
# the local backend enforces the same range.
LORA_RANKS = range(4, 65)
# numpy's SeedSequence needs seeds >= 0 and the samplers take 31-bit seeds.
SEEDS = range(0, 2**31)
RECIPES = ("grpo", "distill")


# --- the configuration -------------------------------------------------------------------


@attrs.frozen(field_transformer=with_checks)
class TrainConfig:
    """Every knob of `grpo train`; defaults give the offline default run on the local backend."""

    # Model and backend
    backend: str = flag(
        "local",
        "where training runs: the embedded local model or the PyTRIO service",
        OneOf(BACKENDS),
    )
    base_model: str = flag(
        TINY_MODEL_NAME,
        "base model name (PyTRIO catalog id, the built-in tiny model, or a local HF directory)",
        NOT_EMPTY,
    )
    lora_rank: int = flag(
        32, f"LoRA rank ({LORA_RANKS.start}..{LORA_RANKS.stop - 1})", InRange(LORA_RANKS)
    )
    init_from: str | None = flag(
        None,
        "start from the final weights of a finished `grpo sft` or `grpo train` run directory "
        "(same backend, base model and LoRA rank; the --kl-coef reference stays the base model)",
        NOT_EMPTY,
    )
    # Data
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
    system_prompt: str | None = flag(None, "system message put before every prompt (default none)")
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
    # Rollouts
    steps: int = flag(80, "number of training steps (batches)", AtLeast(1))
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
    # Rewards
    reward: tuple[str, ...] = flag(
        (),
        "reward MODULE:FUNCTION[=WEIGHT] or FILE.py:FUNCTION[=WEIGHT] (repeatable; "
        "default grpo.rewards:boxed_match)",
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
    # Judge rewards (grpo.rewards:judge, grpo.rewards:judge_rank; docs/FORMULAS.md)
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
    overlong_buffer: int | None = flag(
        None,
        "L of DAPO's overlong penalty (grpo.rewards:overlong_penalty): linear over the last L "
        "tokens before --max-tokens (default: --max-tokens // 4)",
        AtLeast(1),
    )
    mask_truncated: bool = flag(
        False, "completions stopped by --max-tokens train no tokens (DAPO overlong filtering)"
    )
    # Multi-turn environments
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
    # Advantages and loss
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
    mismatch_correction: str = flag(
        "none",
        "sampler-trainer mismatch correction: token_truncate (truncated IS), token_mask "
        "(masked IS), sequence_truncate, sequence_mask (docs/FORMULAS.md); costs one forward",
        OneOf(MISMATCH_CORRECTION_NAMES),
    )
    mismatch_cap: float = flag(2.0, "truncated-IS cap C on the mismatch ratio (>= 1)")
    mismatch_mask_low: float = flag(0.5, "masked IS: lowest mismatch ratio kept (<= 1)")
    mismatch_mask_high: float = flag(2.0, "masked IS: highest mismatch ratio kept (>= 1)")
    sampler_dtype: str = flag(
        "float32",
        "local backend: precision the sampler runs in (bfloat16 reproduces a real service's "
        "sampler-trainer mismatch; training stays float32)",
        OneOf(SAMPLER_DTYPES),
    )
    threads: int = flag(
        0,
        "local backend: torch intra-op threads of its worker (0 = auto: 1 for small models "
        "such as the built-in one, every core for large ones; OMP_NUM_THREADS or "
        "torch.set_num_threads, when set, are left alone)",
        AtLeast(0),
    )
    service_normalization: str | None = flag(
        None,
        "what the trainer divides a loss's gradient by: nothing (sum) or the request's active "
        "tokens, advantage tokens or samples; the loop pre-scales its datums for it, so the "
        "gradient applied is the loss's either way (docs/FORMULAS.md). Local backend: what "
        "it divides by (default sum); --backend pytrio: what the service is taken to divide "
        "by (default: the probe's verdict, else samples)",
        OneOf(NORMALIZATIONS, none_ok=True),
    )
    kl_coef: float = flag(
        0.0, "KL-to-base-model penalty folded into token advantages (0 = off)", AtLeast(0)
    )
    kl_estimator: str = flag(
        "k1", "KL estimator for the penalty (k1, k2 or k3)", OneOf(KL_ESTIMATOR_NAMES)
    )
    # On-policy distillation (`grpo distill`; docs/FORMULAS.md, "On-policy distillation")
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
    num_substeps: int = flag(
        2, "minibatches per step, one optimizer step each (1..--batch-size)", AtLeast(1)
    )
    epochs: int = flag(1, "passes over each batch (PPO-style reuse)", AtLeast(1))
    # Optimizer
    learning_rate: float = flag(2e-4, "Adam learning rate", Above(0))
    beta1: float = flag(0.9, "Adam beta1", Interval(0, 1, "left"))
    beta2: float = flag(0.95, "Adam beta2", Interval(0, 1, "left"))
    eps: float = flag(1e-8, "Adam epsilon", Above(0))
    weight_decay: float = flag(0.0, "AdamW weight decay", AtLeast(0))
    grad_clip_norm: float = flag(1.0, "global gradient-norm clip (0 = off)", AtLeast(0))
    # Evaluation, checkpoints, logging
    seed: int = flag(
        0, f"seed for data order, sampling and LoRA init (0..{SEEDS.stop - 1})", InRange(SEEDS)
    )
    eval_every: int = flag(
        40, "evaluate on the test split before training and every N steps (0 = never)", AtLeast(0)
    )
    eval_limit: int = flag(300, "test problems per evaluation", AtLeast(1))
    save_every: int = flag(
        20, "save a resumable checkpoint every N steps (0 = only at the end)", AtLeast(0)
    )
    run_dir: str | None = flag(None, "run directory (default: runs/<run name>)", NOT_EMPTY)
    run_name: str | None = flag(
        None,
        "run name (default: the run directory's name, else derived from loss, seed and time)",
        PLAIN_NAME,
    )
    log_to: tuple[str, ...] = flag(
        ("swanlab",),
        "experiment tracker (repeatable): swanlab (in --swanlab-mode), wandb, tensorboard, "
        "trackio, or none; metrics.jsonl is always written (README, Experiment tracking)",
        TRACKER_LIST,
    )
    swanlab_mode: str = flag("disabled", "SwanLab logging mode", OneOf(SWANLAB_MODES))
    swanlab_project: str = flag(
        "grpo", "project name in SwanLab, and in W&B and Trackio too", NOT_EMPTY
    )
    tracker_group: str | None = flag(
        None,
        "the group of this run in the trackers (W&B group, Trackio group); `grpo compare` and "
        "`grpo sweep` set it to the experiment directory's name",
        NOT_EMPTY,
    )
    connect_timeout: float = flag(
        30.0, "seconds to wait for the PyTRIO service to answer before giving up", Above(0)
    )
    normalization_probe: bool = flag(
        True,
        "--backend pytrio: at start, measure which total the service divides a built-in "
        "loss's gradient by (a throwaway LoRA, a few tiny calls; the result goes to "
        "service_probe.json; docs/FORMULAS.md); --no-normalization-probe skips it",
    )
    max_retries: int = flag(
        3,
        "retries of a failed sampling/training call before the run stops with a checkpoint",
        AtLeast(0),
    )
    log_rollouts: int = flag(
        4, "groups per step written to rollouts.jsonl (0 = none; see `grpo show`)", AtLeast(0)
    )
    # Prices (none built in: a cost is shown only for prices the user gives)
    price_file: str | None = flag(
        None, "TOML file of prices per million tokens, per model (see README, Cost)", NOT_EMPTY
    )
    price_prompt: float | None = flag(
        None,
        "price per million prompt tokens sent to the sampler (overrides the file)",
        PRICE,
    )
    price_completion: float | None = flag(
        None,
        "price per million sampled completion tokens (overrides the file)",
        PRICE,
    )
    price_train: float | None = flag(
        None,
        "price per million trained tokens (positions x passes; overrides the file)",
        PRICE,
    )
    price_forward: float | None = flag(
        None,
        "price per million forward-only tokens (default: the train price)",
        PRICE,
    )
    price_currency: str | None = flag(
        None, "currency of the prices (overrides the file's; e.g. CNY)", NOT_EMPTY
    )

    def __attrs_post_init__(self) -> None:
        if self.group_size < 2 and self.recipe != "distill":
            raise ConfigError(
                f"--group-size must be >= 2 (a group of one has no baseline), got {self.group_size}"
            )
        check_recipe(self)
        if self.num_substeps > self.batch_size:
            raise ConfigError(
                f"--num-substeps must be in [1, --batch-size={self.batch_size}], "
                f"got {self.num_substeps}"
            )
        _ = self.loss_spec  # builds (and checks) the loss once, at construction
        _ = self.mismatch  # checks the correction against the loss
        if self.sampler_dtype != "float32" and self.backend != "local":
            raise ConfigError(
                f"--sampler-dtype {self.sampler_dtype} needs --backend local (a service's "
                "sampler precision is the service's); drop the flag or use --backend local"
            )

    @cached_property
    def reward_fns(self) -> tuple["RewardFn", ...]:
        """The loaded --reward callables (grpo.rewards:boxed_match when none is given).

        Imported on first read, never at construction (`check_user_inputs` reads it first).
        """
        from grpo.rewards import load_rewards

        try:
            return load_rewards(self.reward)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @cached_property
    def env_factory(self) -> "EnvFactory":
        """The loaded --env factory (read on first use, never at construction)."""
        from grpo.envs.base import load_env_factory

        if self.env is None:
            raise ConfigError("no --env given; this run samples single completions")
        try:
            if self.env.startswith("openenv:"):
                from grpo.envs.openenv import openenv_factory

                return openenv_factory(
                    self.env,
                    self.env_arg,
                    timeout_s=self.env_timeout,
                    max_retries=self.max_retries,
                    capacity=self.env_capacity,
                    concurrency=self.concurrency,
                )
            return load_env_factory(self.env)
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @cached_property
    def prompt_template(self) -> "PromptTemplate":
        """--system-prompt, --question-suffix and the few-shot messages (--fewshot-file, read on
        first use, never at construction)."""
        from grpo.tasks.prompts import PromptTemplate

        try:
            return PromptTemplate.build(
                system_prompt=self.system_prompt,
                question_suffix=self.question_suffix,
                fewshot_file=self.fewshot_file,
            )
        except ValueError as error:
            raise ConfigError(str(error)) from None

    @property
    def overlong_tokens(self) -> int:
        """L of the overlong penalty: --overlong-buffer, else --max-tokens // 4 (at least 1)."""
        if self.overlong_buffer is not None:
            return self.overlong_buffer
        return max(1, self.max_tokens // 4)

    @cached_property
    def mismatch(self) -> "MismatchCorrection":
        """The validated --mismatch-correction with its cap and mask bounds."""
        from grpo.core.mismatch import MismatchCorrection

        try:
            correction = MismatchCorrection(
                self.mismatch_correction,
                cap=self.mismatch_cap,
                low=self.mismatch_mask_low,
                high=self.mismatch_mask_high,
            )
            correction.check_loss(self.loss_fn)
        except ValueError as error:
            raise ConfigError(
                f"--mismatch-correction / --mismatch-cap / --mismatch-mask-*: {error}"
            ) from None
        return correction

    @cached_property
    def loss_spec(self) -> "LossSpec":
        """The validated loss: --loss-fn, --loss-config (the CISPO flags folded in), --reduction.

        norm_length comes from `--loss-config norm_length=L`, else --max-tokens when the
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
            norm_length = float(self.max_tokens)
        try:
            return LossSpec.build(
                self.loss_fn, overrides, reduction=self.reduction, norm_length=norm_length
            )
        except (ValueError, TypeError) as error:
            flags = "--loss-config" + (
                " / --cispo-clip-*-threshold" if self.loss_fn == "cispo" else ""
            )
            raise ConfigError(f"{flags}: {error}") from None

    @property
    def runs_custom_loss(self) -> bool:
        """Whether the loss runs client-side through forward_backward_custom.

        Asked for (--custom-loss), a kernel PyTRIO lacks, a non-sum reduction on a service
        (their built-in losses only sum; the local backend reduces any way itself), or on
        Tinker a loss that is not 0 where the advantage is (dro: Tinker has no mask input, so
        its built-in would also train the prompt and every zero-advantage token).
        """
        return (
            self.custom_loss
            or not self.loss_spec.kernel.service_builtin
            or (self.backend in SERVICE_BACKENDS and self.reduction != "sum")
            or (self.backend == "tinker" and self.loss_fn not in TINKER_MASKED_BUILTINS)
        )

    @property
    def use_fewshot(self) -> bool:
        """Few-shot prompts for real models or a --fewshot-file; the built-in model has its own."""
        if self.fewshot is not None:
            return self.fewshot
        return self.fewshot_file is not None or self.base_model not in BUILTIN_MODEL_NAMES


def check_recipe(config: "TrainConfig") -> None:
    """The combinations that cannot do what they say, refused naming both flags: --recipe
    distill needs --teacher (no --dynamic-sampling, no --teacher-system-prompt under --env);
    --teacher needs distill; --env takes its rewards from the environment (no --reward)."""
    if config.distill_discount > 1:
        raise ConfigError(f"--distill-discount must be in [0, 1], got {config.distill_discount}")
    if config.recipe == "distill" and config.teacher is None:
        raise ConfigError("--recipe distill needs --teacher MODEL | CHECKPOINT | RUN_DIR")
    if config.recipe != "distill" and config.teacher is not None:
        raise ConfigError(
            f"--teacher {config.teacher} is for distillation; run `grpo distill` (or --recipe "
            "distill), or drop --teacher"
        )
    if config.env is not None and config.reward:
        raise ConfigError(
            f"--reward {config.reward[0]} with --env {config.env}: an episode's return is the "
            "environment's reward, so --reward would be ignored; drop --reward, or score the "
            "answer inside the environment's step"
        )
    if config.env_arg and (config.env is None or not config.env.startswith("openenv:")):
        raise ConfigError(
            f"--env-arg {config.env_arg[0]} is read by --env openenv:MODULE:CLIENT only (an "
            "in-process --env factory takes its settings in its own code); drop --env-arg"
        )
    if config.env_capacity is not None and (
        config.env is None or not config.env.startswith("openenv:")
    ):
        raise ConfigError(
            f"--env-capacity {config.env_capacity} is read by --env openenv:MODULE:CLIENT only "
            "(the sessions of an OpenEnv server); drop --env-capacity"
        )
    if config.recipe == "distill" and config.env is not None and config.teacher_system_prompt:
        raise ConfigError(
            "--teacher-system-prompt with --env: the teacher scores each episode's own stream "
            "(the environment's prompt), so a teacher system message has nowhere to go; drop "
            "--teacher-system-prompt, or put the privileged context in the environment"
        )
    if config.recipe == "distill" and config.dynamic_sampling:
        raise ConfigError(
            "--dynamic-sampling refills degenerate groups, and under grpo distill no group is "
            "degenerate (the teacher scores every one); drop --dynamic-sampling"
        )


FIELDS: Mapping[str, "attrs.Attribute[Any]"] = attrs.fields_dict(TrainConfig)
FIELD_NAMES: frozenset[str] = frozenset(FIELDS)


def check_keys(overrides: Mapping[str, Any], *, where: str) -> None:
    """Reject keys that are not `grpo train` flags, naming the key and the fix."""
    for key in overrides:
        if key not in FIELD_NAMES:
            raise ConfigError(
                f"{where}: unknown train flag {key!r} ({flag_name(key)}); "
                "see `grpo train --help` for the flags"
            )


def check_value(name: str, value: Any) -> Any:
    """`value` converted and checked as field `name` alone (type and range; ConfigError if not)."""
    field = FIELDS[name]
    if field.converter is not None:
        value = field.converter(value)
    if field.validator is not None:
        field.validator(None, field, value)
    return value


def config_from_dict(values: Mapping[str, Any], *, where: str | None = None) -> TrainConfig:
    """A TrainConfig from flag values (underscore keys); errors prefixed with `where` if given."""
    check_keys(values, where=where or "configuration")
    try:
        return TrainConfig(**values)
    except ConfigError as error:
        if where is None:
            raise
        raise ConfigError(f"{where}: {error}") from None


def check_user_inputs(config: TrainConfig, *, where: str | None = None) -> None:
    """Load what the config names outside itself: every --reward, then the --fewshot-file.

    The explicit step before a run (or a planned run) touches any service; ConfigError naming
    the flag and the fix, prefixed with `where` if given, as `config_from_dict` does.
    """
    try:
        _ = config.reward_fns
        _ = config.prompt_template
        if config.env is not None:
            _ = config.env_factory
    except ConfigError as error:
        if where is None:
            raise
        raise ConfigError(f"{where}: {error}") from None


def to_dict(config: TrainConfig) -> dict[str, Any]:
    """The config as a JSON-ready dict (tuples become lists)."""
    return attrs.asdict(
        config,
        value_serializer=lambda _inst, _field, value: (
            list(value) if isinstance(value, tuple) else value
        ),
    )


def default_run_name(config: TrainConfig) -> str:
    """`<loss>-seed<k>-<local time>` (a distillation: `distill-seed<k>-<local time>`, as
    `sft-...` and `dpo-...`): unique per launch, readable in a listing."""
    what = "distill" if config.recipe == "distill" else config.loss_fn
    return f"{what}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def resolve_run(config: TrainConfig) -> TrainConfig:
    """The config with its derived run name and directory filled in, once, right after parsing.

    run_name: --run-name, else the run directory's name, else `default_run_name`;
    run_dir: --run-dir, else runs/<run name>. `steps` under --all-data needs the dataset's
    size, so the loop resolves it after loading the data.
    """
    directory_name = Path(config.run_dir).name if config.run_dir else ""
    if directory_name in ("", ".", ".."):
        directory_name = ""
    run_name = config.run_name or directory_name or default_run_name(config)
    run_dir = config.run_dir or str(Path("runs") / run_name)
    return attrs.evolve(config, run_name=run_name, run_dir=run_dir)
