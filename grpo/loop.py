"""The GRPO training loop: the article's ten steps, one named function each.

A step: pick a batch of problems -> build prompts -> refresh the sampler from the current
weights -> sample a group per prompt -> grade -> group advantages -> drop degenerate groups
-> build datums -> update (minibatches x epochs, one optimizer step per minibatch) -> log.

The same code drives the PyTRIO service and the embedded local backend: only the service
client differs. Rollouts of a batch are in flight concurrently (bounded by `concurrency`);
with `max_steps_off_policy = K > 0`, sampling for the next K steps is submitted before this
step trains, and a rollout is never used more than K optimizer-steps stale.

Reproducibility: every random choice is a pure function of (seed, step, index), so a run
stopped at step k and resumed from its checkpoint continues exactly as if never stopped
(strictly on-policy runs; an off-policy pipeline re-samples what was in flight).
"""

from __future__ import annotations

import json
import math
import os
import signal
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from datetime import datetime
from pathlib import Path
from typing import Any, Iterator

import attrs
import numpy as np
import torch
from pytrio.types import AdamParams, ModelInput, SamplingParams

from grpo.backends.pytrio import call_with_retries, make_service_client
from grpo.backends.tiny import TINY_MODEL_NAME
from grpo.config import TrainConfig, to_dict
from grpo.core import losses
from grpo.core.advantages import group_advantages
from grpo.core.alignment import pack_groups
from grpo.core.metrics import rollout_metrics
from grpo.core.records import Completion, ScoredGroup, TokenBatch
from grpo.core.rewards import grade, gsm8k_gold
from grpo.custom_loss import as_custom_loss
from grpo.data import load_problems
from grpo.datums import batch_to_datums, forward_only, output_logprobs
from grpo.logging import RunLogger, console_line, scrub_secrets
from grpo.prompts import build_prompt_tokens

# PyTRIO's built-in losses; any other kernel runs through forward_backward_custom.
SERVICE_BUILTIN_LOSSES = frozenset({"cross_entropy", "importance_sampling", "ppo", "cispo", "dro"})
CHECKPOINT_FILE = "checkpoint.json"
SUMMARY_FILE = "summary.json"
CONFIG_FILE = "config.json"


class ConfigError(ValueError):
    """A flag or input that cannot work; raised before any sampling or training."""


class RunStopped(Exception):
    """The run stopped early (signal or failure) after saving what could be saved."""

    def __init__(self, message: str, exit_code: int) -> None:
        super().__init__(message)
        self.exit_code = exit_code


@attrs.frozen
class Problem:
    """One training or test problem, ready to sample: its prompt tokens and gold answer."""

    question: str
    gold: str
    prompt_tokens: tuple[int, ...]


@attrs.frozen
class LossSetup:
    """The resolved loss: kernel, its config, reduction, and whether it runs as a custom loss."""

    kernel: losses.LossKernel
    config: dict[str, Any]
    reduction: str
    norm_length: float | None
    custom: bool

    @property
    def name(self) -> str:
        """The kernel's registry name, also the metrics prefix."""
        return self.kernel.name


# ---------------------------------------------------------------- validation (before any compute)


def parse_loss_config(entries: Sequence[str]) -> dict[str, Any]:
    """`KEY=VALUE` strings to a dict (numbers parsed; `none`/`off` mean None)."""
    parsed: dict[str, Any] = {}
    for entry in entries:
        key, sep, raw = entry.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--loss-config {entry!r} must look like KEY=VALUE, e.g. clip_high_threshold=1.28")
        raw = raw.strip()
        if raw.lower() in ("none", "off", "null"):
            parsed[key.strip()] = None
            continue
        try:
            parsed[key.strip()] = float(raw)
        except ValueError:
            raise ConfigError(f"--loss-config {key.strip()}={raw!r}: value must be a number (or 'none')") from None
    return parsed


def resolve_loss(config: TrainConfig) -> LossSetup:
    """Check the loss name, its config keys and thresholds, and the reduction; pick the call path."""
    try:
        kernel = losses.get_loss(config.loss_fn)
    except ValueError as error:
        raise ConfigError(f"--loss-fn: {error}") from None
    overrides = parse_loss_config(config.loss_config)
    norm_length = overrides.pop("norm_length", None)
    if kernel.name == "cispo":
        overrides = {
            "clip_low_threshold": config.cispo_clip_low_threshold,
            "clip_high_threshold": config.cispo_clip_high_threshold,
            **overrides,
        }
    try:
        resolved = losses.resolve_config(kernel.name, overrides)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"--loss-config: {error}") from None
    if config.reduction not in losses.REDUCTIONS:
        raise ConfigError(f"--reduction {config.reduction!r} is not one of {', '.join(losses.REDUCTIONS)}")
    if config.reduction == "seq_mean_token_sum_norm" and norm_length is None:
        norm_length = float(config.max_tokens)
    # Non-sum reductions and kernels the service lacks run our own kernel client-side.
    custom = (
        config.custom_loss
        or kernel.name not in SERVICE_BUILTIN_LOSSES
        or (config.backend == "pytrio" and config.reduction != "sum")
    )
    return LossSetup(kernel=kernel, config=resolved, reduction=config.reduction, norm_length=norm_length, custom=custom)


def validate_config(config: TrainConfig) -> LossSetup:
    """Every flag check that needs no data or model; the error names the flag and the fix."""
    checks: list[tuple[bool, str]] = [
        (config.backend in ("local", "pytrio"), f"--backend must be local or pytrio, got {config.backend!r}"),
        (config.steps >= 1, f"--steps must be >= 1, got {config.steps}"),
        (config.batch_size >= 1, f"--batch-size must be >= 1, got {config.batch_size}"),
        (config.group_size >= 2, f"--group-size must be >= 2 (a group of one has no baseline), got {config.group_size}"),
        (config.max_tokens >= 1, f"--max-tokens must be >= 1, got {config.max_tokens}"),
        (config.temperature >= 0, f"--temperature must be >= 0, got {config.temperature}"),
        (0 < config.top_p <= 1, f"--top-p must be in (0, 1], got {config.top_p}"),
        (config.concurrency >= 1, f"--concurrency must be >= 1, got {config.concurrency}"),
        (config.max_steps_off_policy >= 0, f"--max-steps-off-policy must be >= 0, got {config.max_steps_off_policy}"),
        (1 <= config.num_substeps <= config.batch_size, f"--num-substeps must be in [1, --batch-size={config.batch_size}], got {config.num_substeps}"),
        (config.epochs >= 1, f"--epochs must be >= 1, got {config.epochs}"),
        (config.learning_rate > 0, f"--learning-rate must be > 0, got {config.learning_rate}"),
        (0 <= config.beta1 < 1 and 0 <= config.beta2 < 1, f"--beta1/--beta2 must be in [0, 1), got {config.beta1}, {config.beta2}"),
        (config.kl_coef >= 0, f"--kl-coef must be >= 0, got {config.kl_coef}"),
        (config.eval_every >= 0, f"--eval-every must be >= 0, got {config.eval_every}"),
        (config.eval_limit >= 1, f"--eval-limit must be >= 1, got {config.eval_limit}"),
        (config.save_every >= 0, f"--save-every must be >= 0, got {config.save_every}"),
        (config.max_retries >= 0, f"--max-retries must be >= 0, got {config.max_retries}"),
        (config.swanlab_mode in ("online", "offline", "disabled"), f"--swanlab-mode must be online, offline or disabled, got {config.swanlab_mode!r}"),
        (config.advantage in ("center", "standardize", "rloo", "batch_standardize"), f"--advantage {config.advantage!r} is not one of center, standardize, rloo, batch_standardize"),
        (config.kl_estimator in losses.KL_ESTIMATORS, f"--kl-estimator must be one of {', '.join(losses.KL_ESTIMATORS)}, got {config.kl_estimator!r}"),
    ]
    for ok, message in checks:
        if not ok:
            raise ConfigError(message)
    return resolve_loss(config)


def build_problems(tokenizer: Any, rows: Any, *, fewshot: bool, max_tokens: int, max_len: int | None, split: str) -> list[Problem]:
    """Prompt tokens and gold answers for dataset rows; empty or over-long prompts are errors."""
    problems = []
    for index, row in enumerate(rows):
        tokens = build_prompt_tokens(tokenizer, row["question"], fewshot=fewshot)
        if max_len is not None and len(tokens) + max_tokens > max_len:
            raise ConfigError(
                f"{split} problem {index}: prompt has {len(tokens)} tokens + --max-tokens {max_tokens} "
                f"exceeds the model's {max_len} positions; lower --max-tokens or drop long problems"
            )
        problems.append(Problem(question=row["question"], gold=gsm8k_gold(row["answer"]), prompt_tokens=tuple(tokens)))
    return problems


# ---------------------------------------------------------------- the ten steps


def pick_batch(num_problems: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Indices of step `step`'s problems: consecutive slices of a per-pass permutation seeded by (seed, pass)."""
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    passes, offsets = np.divmod(positions, num_problems)
    indices = np.empty(batch_size, dtype=np.int64)
    for data_pass in np.unique(passes):
        order = np.random.default_rng([seed, int(data_pass)]).permutation(num_problems)
        selected = passes == data_pass
        indices[selected] = order[offsets[selected]]
    return indices


def sampling_seed(seed: int, step: int, index: int, purpose: int = 0) -> int:
    """The sampler seed of request `index` at `step`: a pure function, so runs are reproducible."""
    return int(np.random.SeedSequence([seed, purpose, step, index]).generate_state(1)[0] & 0x7FFFFFFF)


def refresh_sampler(training_client: Any, max_retries: int, log: Callable[[str], None]) -> Any:
    """A sampling client on the current weights (the old policy for this batch)."""
    return call_with_retries(
        training_client.save_weights_and_get_sampling_client, what="save_weights_and_get_sampling_client", max_retries=max_retries, on_retry=log
    )


def _completion_from(sequence: Any, tokenizer: Any) -> Completion:
    """A core Completion from one sampled sequence (text decoded if the backend did not return it)."""
    text = sequence.text if sequence.text is not None else tokenizer.decode(sequence.tokens)
    return Completion(tokens=sequence.tokens, logprobs=sequence.logprobs, text=text, stop_reason=sequence.stop_reason)


class RolloutJob:
    """One step's sampling requests, submitted to a bounded pool; `result()` waits for all groups."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        sampler: Any,
        problems: Sequence[Problem],
        *,
        params_for: Callable[[int], SamplingParams],
        num_samples: int,
        tokenizer: Any,
        max_retries: int,
        log: Callable[[str], None],
        sampler_version: int,
    ) -> None:
        self.sampler_version = sampler_version
        self.problems = list(problems)

        def sample_one(index: int) -> list[Completion]:
            prompt = ModelInput.from_ints(list(self.problems[index].prompt_tokens))
            response = call_with_retries(
                lambda: sampler.sample(prompt=prompt, num_samples=num_samples, sampling_params=params_for(index), return_text=True).result(),
                what=f"sample (problem {index})",
                max_retries=max_retries,
                on_retry=log,
            )
            return [_completion_from(sequence, tokenizer) for sequence in response.sequences]

        self._futures: list[Future[list[Completion]]] = [pool.submit(sample_one, index) for index in range(len(self.problems))]

    def result(self) -> list[list[Completion]]:
        """The completions of every problem, in problem order."""
        return [future.result() for future in self._futures]

    def cancel(self) -> None:
        """Drop requests that have not started."""
        for future in self._futures:
            future.cancel()


def sample_groups(job: RolloutJob) -> list[list[Completion]]:
    """Wait for a step's groups (sampled concurrently from the sampler the job was given)."""
    return job.result()


def grade_groups(problems: Sequence[Problem], completions_P: Sequence[Sequence[Completion]]) -> list[np.ndarray]:
    """Reward of every completion: 1.0 when its last boxed answer matches the gold answer."""
    return [np.array([grade(c.text, problem.gold) for c in completions], dtype=np.float64) for problem, completions in zip(problems, completions_P, strict=True)]


def compute_advantages(
    problems: Sequence[Problem], completions_P: Sequence[Sequence[Completion]], rewards_P: Sequence[np.ndarray], method: str
) -> tuple[list[ScoredGroup], np.ndarray]:
    """Group-relative advantages for every group (one vectorized call) and the degenerate flags."""
    group_sizes = np.array([len(rewards) for rewards in rewards_P], dtype=np.int64)
    result = group_advantages(np.concatenate(rewards_P), group_sizes, method)
    advantages_P = np.split(result.advantages, np.cumsum(group_sizes)[:-1])
    groups = [
        ScoredGroup(prompt_tokens=problem.prompt_tokens, completions=tuple(completions), rewards=rewards, advantages=advantages)
        for problem, completions, rewards, advantages in zip(problems, completions_P, rewards_P, advantages_P, strict=True)
    ]
    return groups, np.asarray(result.degenerate, dtype=bool)


def drop_degenerate(groups: Sequence[ScoredGroup], degenerate_P: np.ndarray) -> list[ScoredGroup]:
    """The groups that carry a training signal (not all rewards equal)."""
    return [group for group, degenerate in zip(groups, degenerate_P, strict=True) if not degenerate]


def reference_logprobs(pool: ThreadPoolExecutor, ref_sampler: Any, groups: Sequence[ScoredGroup], max_retries: int, log: Callable[[str], None]) -> list[np.ndarray]:
    """Base-model log-probs of every sampled completion token, via prompt log-probs of prompt+completion."""

    def one(prompt_tokens: tuple[int, ...], completion: Completion) -> np.ndarray:
        tokens = [*prompt_tokens, *completion.tokens.tolist()]
        values = call_with_retries(
            lambda: ref_sampler.compute_logprobs(ModelInput.from_ints(tokens)).result(), what="reference compute_logprobs", max_retries=max_retries, on_retry=log
        )
        return np.asarray(values[-len(completion.tokens) :], dtype=np.float64)

    futures = [pool.submit(one, tuple(group.prompt_tokens.tolist()), completion) for group in groups for completion in group.completions]
    return [future.result() for future in futures]


def kl_shape(batch: TokenBatch, ref_logprobs_C: Sequence[np.ndarray], kl_coef: float, estimator: str) -> tuple[TokenBatch, float]:
    """Fold a KL-to-reference penalty into token advantages: A_t - kl_coef * k(lp_old_t - lp_ref_t) on masked tokens.

    Reward shaping (not a loss term) so it works with the service's built-in losses too.
    Returns the shaped batch and the mean per-token KL estimate.
    """
    mask = np.asarray(batch.mask, dtype=bool)
    ref_flat = np.zeros(len(batch.mask), dtype=np.float64)
    ref_flat[mask] = np.concatenate(ref_logprobs_C)
    sampled = torch.tensor(batch.sampling_logprobs, dtype=torch.float64)
    kl_tokens = losses.kl_penalty(sampled, torch.from_numpy(ref_flat), estimator=estimator).numpy() * mask
    shaped = np.where(mask, np.asarray(batch.advantages, dtype=np.float64) - kl_coef * kl_tokens, 0.0)
    kl_mean = float(kl_tokens.sum() / max(mask.sum(), 1))
    return attrs.evolve(batch, advantages=shaped), kl_mean


def build_datums(groups: Sequence[ScoredGroup]) -> TokenBatch:
    """Aligned, packed token arrays of every completion (datums are made from them per minibatch)."""
    return pack_groups(groups, drop_degenerate=False)


def minibatch_slices(batch: TokenBatch, num_substeps: int) -> list[np.ndarray]:
    """Sequence indices of each minibatch: contiguous, near-equal splits (empty ones dropped)."""
    return [part for part in np.array_split(np.arange(len(batch.seq_lens)), num_substeps) if len(part)]


def _subbatch(batch: TokenBatch, sequence_indices: np.ndarray) -> TokenBatch:
    """The packed arrays of a contiguous run of sequences."""
    starts = np.concatenate([[0], np.cumsum(batch.seq_lens)])
    lo, hi = starts[sequence_indices[0]], starts[sequence_indices[-1] + 1]
    return TokenBatch(
        input_tokens=batch.input_tokens[lo:hi],
        target_tokens=batch.target_tokens[lo:hi],
        sampling_logprobs=batch.sampling_logprobs[lo:hi],
        advantages=batch.advantages[lo:hi],
        mask=batch.mask[lo:hi],
        seq_lens=batch.seq_lens[sequence_indices[0] : sequence_indices[-1] + 1],
    )


def ratio_statistics(current_logprobs: np.ndarray, minibatch: TokenBatch, loss: LossSetup) -> dict[str, float]:
    """The kernel's metrics recomputed from the logprobs the backend used, plus ratio statistics.

    Computed client-side from `loss_fn_outputs`, so every backend and call path reports the
    same numbers, and a user sees whether their losses could differ at all.
    """
    mask = torch.from_numpy(np.asarray(minibatch.mask, dtype=np.float32))
    current = torch.from_numpy(current_logprobs.astype(np.float32))
    sampled = torch.from_numpy(np.asarray(minibatch.sampling_logprobs, dtype=np.float32))
    with torch.no_grad():
        loss_value, metrics = loss.kernel(
            current,
            sampled,
            torch.from_numpy(np.asarray(minibatch.advantages, dtype=np.float32)),
            mask=mask,
            seq_lens=torch.tensor(minibatch.seq_lens),
            reduction=loss.reduction,
            norm_length=loss.norm_length,
            **loss.config,
        )
    log_ratio = (current - sampled)[mask.bool()]
    stats = {f"{loss.name}/{key}": float(value) for key, value in metrics.items()}
    stats["loss"] = float(loss_value)
    stats["ratio/max_abs_log"] = float(log_ratio.abs().max()) if log_ratio.numel() else 0.0
    stats["ratio/mean"] = float(log_ratio.exp().mean()) if log_ratio.numel() else 1.0
    return stats


def update(training_client: Any, batch: TokenBatch, loss: LossSetup, adam: AdamParams, config: TrainConfig, log: Callable[[str], None], on_first_optim: Callable[[], None]) -> dict[str, float]:
    """Minibatches x epochs of forward_backward (built-in or custom) + optim_step; mean metrics."""
    slices = minibatch_slices(batch, config.num_substeps)
    collected: list[dict[str, float]] = []
    loss_fn_config: dict[str, Any] = {key: value for key, value in loss.config.items() if value is not None}
    if loss.reduction != "sum":
        loss_fn_config["reduction"] = loss.reduction
        if loss.norm_length is not None:
            loss_fn_config["norm_length"] = loss.norm_length
    for _epoch in range(config.epochs):
        for sequence_indices in slices:
            minibatch = _subbatch(batch, sequence_indices)
            datums = batch_to_datums(minibatch)
            if loss.custom:
                custom_fn = as_custom_loss(loss.name, datums, reduction=loss.reduction, norm_length=loss.norm_length, **loss.config)
                submit = lambda: training_client.forward_backward_custom(forward_only(datums), custom_fn)  # noqa: E731
            else:
                submit = lambda: training_client.forward_backward(datums, loss_fn=loss.name, loss_fn_config=loss_fn_config)  # noqa: E731
            output = call_with_retries(lambda: submit().result(), what="forward_backward", max_retries=config.max_retries, on_retry=log)
            on_first_optim()
            call_with_retries(lambda: training_client.optim_step(adam).result(), what="optim_step", max_retries=config.max_retries, on_retry=log)
            collected.append(ratio_statistics(output_logprobs(output.loss_fn_outputs), minibatch, loss))
    metrics = {key: float(np.mean([m[key] for m in collected])) for key in collected[0]}
    metrics["ratio/max_abs_log"] = max(m["ratio/max_abs_log"] for m in collected)
    metrics["optim_steps"] = float(len(collected))
    return metrics


# ---------------------------------------------------------------- evaluation


def pass_at_k(num_samples: int, num_correct: int, k: int) -> float:
    """Unbiased pass@k = 1 - C(n - c, k) / C(n, k) (Chen et al., 2021)."""
    if num_samples - num_correct < k:
        return 1.0
    return 1.0 - math.comb(num_samples - num_correct, k) / math.comb(num_samples, k)


def evaluate(
    pool: ThreadPoolExecutor, sampler: Any, problems: Sequence[Problem], tokenizer: Any, *, num_samples: int, temperature: float, max_tokens: int, seed: int, max_retries: int, log: Callable[[str], None]
) -> dict[str, float]:
    """Accuracy (mean reward over all samples) and pass@k for k = 1, 2, 4, ... <= num_samples."""
    params = lambda index: SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=1.0, seed=sampling_seed(seed, 0, index, purpose=1))  # noqa: E731
    job = RolloutJob(pool, sampler, problems, params_for=params, num_samples=num_samples, tokenizer=tokenizer, max_retries=max_retries, log=log, sampler_version=0)
    rewards_P = grade_groups(problems, job.result())
    correct = np.array([int(rewards.sum()) for rewards in rewards_P])
    metrics = {"test/reward": float(np.mean(np.concatenate(rewards_P)))}
    k = 1
    while k <= num_samples:
        metrics[f"test/pass@{k}"] = float(np.mean([pass_at_k(num_samples, int(c), k) for c in correct]))
        k *= 2
    return metrics


# ---------------------------------------------------------------- run state


def _write_json_atomic(path: Path, payload: dict[str, Any]) -> None:
    """Write JSON via a temp file and rename, so a crash never leaves half a file."""
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, sort_keys=True))
    os.replace(tmp, path)


@contextmanager
def stop_on_signals() -> Iterator[threading.Event]:
    """SIGINT/SIGTERM set an event the loop checks between steps; a second SIGINT aborts at once."""
    requested = threading.Event()
    if threading.current_thread() is not threading.main_thread():
        yield requested
        return

    def handler(signum: int, _frame: Any) -> None:
        if requested.is_set() and signum == signal.SIGINT:
            raise KeyboardInterrupt
        requested.set()

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield requested
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@attrs.frozen
class RunResult:
    """What a finished run leaves: its directory, last metrics, final sampler path."""

    run_dir: Path
    steps: int
    final_metrics: dict[str, float]
    sampler_path: str | None


def default_run_name(config: TrainConfig) -> str:
    """`<loss>-seed<k>-<UTC time>`: unique per launch, readable in a listing."""
    return f"{config.loss_fn}-seed{config.seed}-{datetime.now().strftime('%Y%m%d-%H%M%S')}"


def wants_fewshot(config: TrainConfig) -> bool:
    """Few-shot prompts for real models; the tiny model defaults to its own short prompt."""
    return config.fewshot if config.fewshot is not None else config.base_model != TINY_MODEL_NAME


def _tokenizer_max_len(tokenizer: Any) -> int | None:
    """The model's context length when the tokenizer states a believable one."""
    value = getattr(tokenizer, "model_max_length", None)
    return int(value) if isinstance(value, int) and 0 < value < 10_000_000 else None


def train(config: TrainConfig, *, resume: bool = False, service_client: Any = None, echo: Callable[[str], None] = print, progress: bool = True) -> RunResult:
    """Run GRPO for `config.steps` steps (or continue a run directory with `resume=True`)."""
    loss = validate_config(config)
    run_name = config.run_name or (Path(config.run_dir).name if config.run_dir else default_run_name(config))
    run_dir = Path(config.run_dir) if config.run_dir else Path("runs") / run_name
    checkpoint = _read_checkpoint(run_dir) if resume else None
    if resume and checkpoint is None and not (run_dir / CONFIG_FILE).exists():
        raise ConfigError(f"--resume {run_dir}: not a run directory (no {CONFIG_FILE})")

    # Data is checked before the service is asked for anything.
    train_rows = load_problems(config.dataset, "train", seed=config.seed, difficulty=config.difficulty)
    test_rows = load_problems(config.dataset, "test", seed=config.seed, difficulty=config.difficulty, limit=config.eval_limit) if config.eval_every else []
    steps = math.ceil(len(train_rows) / config.batch_size) if config.all_data else config.steps

    run_dir.mkdir(parents=True, exist_ok=True)
    _write_json_atomic(run_dir / CONFIG_FILE, scrub_secrets(to_dict(config)))
    service = service_client or make_service_client(config.backend, local_root=str(run_dir / "backend"), seed=config.seed)
    if checkpoint is not None:
        training_client = service.create_training_client_from_state_with_optimizer(checkpoint["state_path"])
        start_step = int(checkpoint["step"])
    else:
        training_client = service.create_lora_training_client(base_model=config.base_model, rank=config.lora_rank, seed=config.seed)
        start_step = 0
    tokenizer = training_client.get_tokenizer()
    max_len = _tokenizer_max_len(tokenizer)
    fewshot = wants_fewshot(config)
    train_problems = build_problems(tokenizer, train_rows, fewshot=fewshot, max_tokens=config.max_tokens, max_len=max_len, split="train")
    test_problems = build_problems(tokenizer, test_rows, fewshot=fewshot, max_tokens=config.max_tokens, max_len=max_len, split="test")

    adam = AdamParams(learning_rate=config.learning_rate, beta1=config.beta1, beta2=config.beta2, eps=config.eps, weight_decay=config.weight_decay, grad_clip_norm=config.grad_clip_norm)
    logger = RunLogger(run_dir, config=to_dict(config), swanlab_mode=config.swanlab_mode, swanlab_project=config.swanlab_project, run_name=run_name, resume_from_step=start_step)
    pool = ThreadPoolExecutor(max_workers=config.concurrency, thread_name_prefix="rollout")
    ref_sampler = service.create_sampling_client(base_model=config.base_model) if config.kl_coef > 0 else None

    def note(message: str) -> None:
        echo(f"[grpo] {message}")

    def params_for_step(step: int) -> Callable[[int], SamplingParams]:
        return lambda index: SamplingParams(max_tokens=config.max_tokens, temperature=config.temperature, top_p=config.top_p, seed=sampling_seed(config.seed, step, index))

    version = start_step  # optimizer-step count at batch granularity: one per training step
    sampler: Any = None
    sampler_version = -1
    jobs: dict[int, RolloutJob] = {}
    last_metrics: dict[str, float] = {}
    last_saved_step = start_step
    weights_dirty = False

    def mark_dirty() -> None:
        nonlocal weights_dirty
        weights_dirty = True

    def save(step: int, name: str) -> None:
        nonlocal last_saved_step
        result = call_with_retries(lambda: training_client.save_state(name).result(), what="save_state", max_retries=config.max_retries, on_retry=note)
        _write_json_atomic(run_dir / CHECKPOINT_FILE, {"step": step, "state_path": result.path, "run_name": run_name})
        last_saved_step = step

    def current_sampler() -> Any:
        nonlocal sampler, sampler_version
        if sampler_version != version:
            sampler = refresh_sampler(training_client, config.max_retries, note)
            sampler_version = version
        return sampler

    def evaluate_now() -> dict[str, float]:
        return evaluate(pool, current_sampler(), test_problems, tokenizer, num_samples=1, temperature=config.temperature, max_tokens=config.max_tokens, seed=config.seed, max_retries=config.max_retries, log=note)

    def submit(step: int) -> None:
        indices = pick_batch(len(train_problems), config.batch_size, step, config.seed)
        jobs[step] = RolloutJob(
            pool, current_sampler(), [train_problems[i] for i in indices], params_for=params_for_step(step), num_samples=config.group_size,
            tokenizer=tokenizer, max_retries=config.max_retries, log=note, sampler_version=version,
        )

    from tqdm import tqdm

    bar = tqdm(total=steps, initial=start_step, desc="grpo", unit="step", disable=not progress, dynamic_ncols=True)
    run_start = time.perf_counter()
    completed = start_step
    try:
        with stop_on_signals() as stop_requested:
            if config.eval_every and start_step == 0:
                baseline = evaluate_now()
                logger.log(0, baseline)
                (bar.write if progress else echo)(console_line(0, steps, baseline))
            for step in range(start_step, steps):
                if stop_requested.is_set():
                    raise KeyboardInterrupt
                step_start = time.perf_counter()
                for ahead in range(step, min(step + config.max_steps_off_policy, steps - 1) + 1):
                    if ahead not in jobs:
                        submit(ahead)
                job = jobs.pop(step)
                staleness = version - job.sampler_version
                if staleness > config.max_steps_off_policy:
                    raise AssertionError(f"rollouts {staleness} steps stale > --max-steps-off-policy {config.max_steps_off_policy}")
                completions_P = sample_groups(job)
                sample_time = time.perf_counter() - step_start
                rewards_P = grade_groups(job.problems, completions_P)
                groups, degenerate_P = compute_advantages(job.problems, completions_P, rewards_P, config.advantage)
                trainable = drop_degenerate(groups, degenerate_P)
                metrics = rollout_metrics(groups)
                metrics["off_policy_steps"] = float(staleness)
                train_start = time.perf_counter()
                if trainable:
                    batch = build_datums(trainable)
                    if ref_sampler is not None:
                        ref_C = reference_logprobs(pool, ref_sampler, trainable, config.max_retries, note)
                        batch, metrics["kl"] = kl_shape(batch, ref_C, config.kl_coef, config.kl_estimator)
                    metrics.update({"datums": float(len(batch.seq_lens)), "train_tokens": float(np.sum(batch.mask))})
                    metrics.update(update(training_client, batch, loss, adam, config, note, mark_dirty))
                    version += 1
                else:
                    metrics.update({"datums": 0.0, "train_tokens": 0.0})
                metrics["time/sample"] = sample_time
                metrics["time/train"] = time.perf_counter() - train_start
                completed, weights_dirty = step + 1, False
                if config.eval_every and (completed % config.eval_every == 0 or completed == steps):
                    metrics.update(evaluate_now())
                metrics["time/step"] = time.perf_counter() - step_start
                logger.log(completed, metrics)
                last_metrics = metrics
                bar.update(1)
                (bar.write if progress else echo)(console_line(completed, steps, metrics))
                if config.save_every and completed % config.save_every == 0 and completed < steps:
                    save(completed, f"step-{completed:06d}")
            save(steps, "final")
            sampler_path = call_with_retries(lambda: training_client.save_weights_for_sampler(run_name).result(), what="save_weights_for_sampler", max_retries=config.max_retries, on_retry=note).path
    except KeyboardInterrupt:
        _stop_with_checkpoint(save, completed, weights_dirty, last_saved_step, note)
        raise RunStopped(f"stopped by signal after step {completed}; resume with `grpo train --resume {run_dir}`", exit_code=130) from None
    except Exception as error:
        _stop_with_checkpoint(save, completed, weights_dirty, last_saved_step, note)
        raise RunStopped(f"run failed at step {completed + 1}: {type(error).__name__}: {error}\nresume with `grpo train --resume {run_dir}`", exit_code=1) from error
    finally:
        for pending in jobs.values():
            pending.cancel()
        pool.shutdown(wait=False, cancel_futures=True)
        bar.close()
        logger.close()

    wall_time = time.perf_counter() - run_start
    _write_json_atomic(
        run_dir / SUMMARY_FILE,
        {"finished": True, "steps": steps, "wall_time_s": wall_time, "final": last_metrics, "test/reward": last_metrics.get("test/reward"), "sampler_path": sampler_path, "run_name": run_name},
    )
    echo(f"[grpo] done: {steps} steps in {wall_time:.1f}s; final sampler weights: {sampler_path}")
    return RunResult(run_dir=run_dir, steps=steps, final_metrics=last_metrics, sampler_path=sampler_path)


def _stop_with_checkpoint(save: Callable[[int, str], None], completed: int, weights_dirty: bool, last_saved_step: int, note: Callable[[str], None]) -> None:
    """Save a resumable checkpoint at the last completed step, unless weights are mid-update."""
    if weights_dirty:
        note(f"stopped mid-update: keeping the checkpoint of step {last_saved_step} (weights of a half-done step are not resumable)")
        return
    if completed == last_saved_step:
        return
    try:
        save(completed, f"step-{completed:06d}")
        note(f"checkpoint saved at step {completed}")
    except Exception as error:  # noqa: BLE001 - the original failure is what the user must see
        note(f"could not save a checkpoint ({type(error).__name__}: {error}); the last one is step {last_saved_step}")


def _read_checkpoint(run_dir: Path) -> dict[str, Any] | None:
    """The run directory's latest checkpoint record, if any."""
    path = run_dir / CHECKPOINT_FILE
    return json.loads(path.read_text()) if path.exists() else None
