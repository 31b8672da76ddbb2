"""The teacher of on-policy distillation (`grpo distill`): resolved, checked, scoring.

docs/FORMULAS.md, "On-policy distillation"; the step's pieces are in
`grpo.training.recipes.distill.recipe`.

- `resolve_teacher` (pre-flight, before any training call): --teacher as a finished run
  directory (its final sampler weights, else its last checkpoint), a weights path (sampler
  weights or a training state), or a model name; refused unless its tokenizer equals the
  student's (`check_same_tokenizer`: vocabulary and chat template).
- `TeacherScoring` (step 2b): one ``compute_logprobs`` per completion (x_T + y) or episode
  (its whole stream) on the teacher's own thread pool (--teacher-concurrency), retried like
  every call, while the step grades; ``result_N`` places q on the batch's sampled positions.
- `distill_batch` (step 7b): the batch with A_t of `grpo.core.distill.distill_advantages`
  and the `distill/*` metrics; under --mismatch-correction recompute it runs inside the
  update on the trainer's log-probs (``update``'s ``reshape`` hook).
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import attrs
import numpy as np
from pytrio.types import ModelInput

from grpo.backends.clients import Note, ServiceClient
from grpo.backends.pytrio import call_with_retries, sampler_on_weights
from grpo.core.distill import distill_advantages, distill_metrics, teacher_logprobs_at
from grpo.core.episodes import Episode
from grpo.core.records import Completion, TokenBatch
from grpo.core.usage import TokenUsage, planned_teacher_tokens
from grpo.tasks.prompts import build_prompt_tokens
from grpo.training.rollouts.clients import Sampler, Tokenizer
from grpo.training.rollouts.problems import Problem
from grpo.training.run import run_files
from grpo.training.run.seeds import pick_batch
from grpo.training.settings.config import ConfigError, TrainConfig


@attrs.frozen
class Teacher:
    """The teacher's sampler, what --teacher named, the weights it resolved to, its pool."""

    sampler: Sampler
    source: str
    weights: str | None
    pool: ThreadPoolExecutor = attrs.field(eq=False, repr=False)
    tokenizer: Tokenizer = attrs.field(eq=False, repr=False)
    config: TrainConfig = attrs.field(eq=False, repr=False)

    def prompt_tokens(self, problem: Problem) -> tuple[int, ...]:
        """x_T: the student's prompt, or the question under --teacher-system-prompt."""
        if self.config.teacher_system_prompt is None:
            return problem.prompt_tokens
        template = attrs.evolve(
            self.config.prompt_template, system_prompt=self.config.teacher_system_prompt
        )
        return tuple(
            build_prompt_tokens(
                self.tokenizer, problem.question, fewshot=self.config.use_fewshot, template=template
            )
        )

    def close(self) -> None:
        """Drop scoring requests that have not started."""
        self.pool.shutdown(wait=False, cancel_futures=True)


def is_run_dir(path: Path) -> bool:
    """Whether ``path`` is a run directory (a summary, checkpoint or metrics file in it)."""
    return path.is_dir() and any(
        (path / name).is_file()
        for name in (run_files.SUMMARY_FILE, run_files.CHECKPOINT_FILE, run_files.METRICS_FILE)
    )


def _is_model_dir(path: Path) -> bool:
    return path.is_dir() and any(
        (path / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
    )


def weights_sampler(
    service: ServiceClient, base_model: str, path: str, source: str, flag: str = "--teacher"
) -> Sampler:
    """A sampler on sampler weights at ``path``, else on a training state's weights (ConfigError
    naming ``flag`` and ``source`` when it is neither)."""
    return sampler_on_weights(
        service,
        base_model,
        path,
        lambda reason: ConfigError(
            f"{flag} {source}: {path} is neither sampler weights nor a training state on "
            f"{base_model} ({reason}); give a finished run directory, the sampler_path of its "
            f"{run_files.SUMMARY_FILE}, or a model name"
        ),
    )


def named_sampler(
    service: ServiceClient, config: TrainConfig, source: str, flag: str
) -> tuple[Sampler, str | None]:
    """The sampler ``source`` names on the run's backend (a finished run directory, a weights
    path, or a model name) and the weights path it resolved to (None: a base model)."""
    path = Path(source).expanduser()
    if is_run_dir(path):
        if config.run_dir is not None and path.resolve() == Path(config.run_dir).resolve():
            raise ConfigError(f"{flag} {source} is this run itself; name another run")
        saved = run_files.read_config(path)
        try:
            weights = run_files.eval_weights_path(path)
        except run_files.RunDirError as error:
            raise ConfigError(f"{flag} {source}: {error}") from None
        base_model = str(saved.get("base_model", config.base_model))
        return weights_sampler(service, base_model, weights, source, flag), weights
    if "://" in source or (path.exists() and not _is_model_dir(path)):
        return weights_sampler(service, config.base_model, source, source, flag), source
    try:
        return service.create_sampling_client(base_model=source), None
    except Exception as error:  # noqa: BLE001 - every backend has its own not-found error
        raise ConfigError(
            f"{flag} {source}: not a run directory, a weights path or a model the service "
            f"has ({str(error).splitlines()[0] if str(error) else type(error).__name__})"
        ) from None


def teacher_sampler(service: ServiceClient, config: TrainConfig) -> tuple[Sampler, str | None]:
    """The sampler --teacher names and the weights path it resolved to (None: a base model)."""
    return named_sampler(service, config, str(config.teacher), "--teacher")


def check_same_tokenizer(
    teacher: Tokenizer, student: Tokenizer, *, teacher_name: str, student_name: str
) -> None:
    """ConfigError naming both models unless the vocabularies and chat templates are equal."""
    teacher_vocab, student_vocab = teacher.get_vocab(), student.get_vocab()
    problems = []
    if teacher_vocab != student_vocab:
        differing = sum(
            1
            for token in set(teacher_vocab) | set(student_vocab)
            if teacher_vocab.get(token) != student_vocab.get(token)
        )
        problems.append(
            f"vocabularies differ ({len(teacher_vocab)} vs {len(student_vocab)} tokens, "
            f"{differing} token ids disagree)"
        )
    if getattr(teacher, "chat_template", None) != getattr(student, "chat_template", None):
        problems.append("chat templates differ")
    if problems:
        raise ConfigError(
            f"--teacher {teacher_name}: its tokenizer is not the student's ({student_name}): "
            f"{'; '.join(problems)}. The teacher scores the student's token ids, so both need "
            "one tokenizer; choose a teacher of the student's model family"
        )


def resolve_teacher(
    service: ServiceClient, config: TrainConfig, student_tokenizer: Tokenizer
) -> Teacher:
    """The checked teacher of --teacher (tokenizer equal to the student's), before any work."""
    sampler, weights = teacher_sampler(service, config)
    tokenizer = sampler.get_tokenizer()
    check_same_tokenizer(
        tokenizer,
        student_tokenizer,
        teacher_name=str(config.teacher),
        student_name=config.base_model,
    )
    return Teacher(
        sampler=sampler,
        source=str(config.teacher),
        weights=weights,
        pool=ThreadPoolExecutor(
            max_workers=config.teacher_concurrency, thread_name_prefix="teacher"
        ),
        tokenizer=tokenizer,
        config=config,
    )


TEMPERED_DISTILLATION = (
    "s_t is then not the student's own distribution, so s_t - q_t is not a reverse-KL sample; "
    "use --temperature 1 --top-p 1 (or --mismatch-correction recompute for s)"
)
"""What distilling at T ≠ 1 or top-p < 1 costs: the start-up warning's consequence
(`grpo.training.recipes.grpo.run.tempered_sampling_note`)."""


class TeacherScoring:
    """Step 2b: the teacher's log-probs of every sampled token, requested concurrently.

    One ``compute_logprobs`` per sequence (a prompt + completion, or an episode's whole
    stream), read at the sequence's sampled positions; sequences in packing order.
    """

    def __init__(
        self,
        teacher: Teacher,
        sequences: Sequence[tuple[list[int], np.ndarray]],
        *,
        max_retries: int,
        note: Note,
    ) -> None:
        self._started = time.perf_counter()
        self._finished: list[float] = []
        self._tokens = sum(len(tokens) for tokens, _positions in sequences)

        def score(tokens: list[int], positions: np.ndarray) -> np.ndarray:
            values = call_with_retries(
                lambda: teacher.sampler.compute_logprobs(ModelInput.from_ints(tokens)).result(),
                what="teacher compute_logprobs",
                max_retries=max_retries,
                note=note,
            )
            self._finished.append(time.perf_counter())
            return teacher_logprobs_at(values, positions)

        self._futures_C: list[Future[np.ndarray]] = [
            teacher.pool.submit(score, tokens, positions) for tokens, positions in sequences
        ]

    @classmethod
    def of_completions(
        cls,
        teacher: Teacher,
        problems_P: Sequence[Problem],
        completions_P: Sequence[Sequence[Completion]],
        *,
        max_retries: int,
        note: Note,
    ) -> TeacherScoring:
        """Each completion scored after the teacher's prompt x_T: q(y_t | x_T, y_<t)."""
        sequences = []
        for problem, completions in zip(problems_P, completions_P, strict=True):
            prompt = list(teacher.prompt_tokens(problem))
            for completion in completions:
                tokens = [*prompt, *completion.tokens.tolist()]
                sequences.append((tokens, np.arange(len(prompt), len(tokens))))
        return cls(teacher, sequences, max_retries=max_retries, note=note)

    @classmethod
    def of_episodes(
        cls, teacher: Teacher, episodes: Sequence[Episode], *, max_retries: int, note: Note
    ) -> TeacherScoring:
        """Each episode's whole stream scored at its sampled tokens (observations and tool
        outputs are context, never scored)."""
        sequences = [
            (episode.tokens.tolist(), np.flatnonzero(episode.sampled)) for episode in episodes
        ]
        return cls(teacher, sequences, max_retries=max_retries, note=note)

    def result_N(self, batch: TokenBatch) -> np.ndarray:
        """q on ``batch``'s sampled positions (mask 1, as packed), 0 elsewhere."""
        values_C = [future.result() for future in self._futures_C]
        mask = np.asarray(batch.mask, dtype=bool)
        teacher_N = np.zeros(mask.size, dtype=np.float64)
        flat = np.concatenate(values_C) if values_C else np.zeros(0)
        if flat.size != int(mask.sum()):
            raise AssertionError(
                f"the teacher scored {flat.size} sampled tokens, the batch has "
                f"{int(mask.sum())}: the groups must be packed in sampling order"
            )
        teacher_N[mask] = flat
        return teacher_N

    def seconds(self) -> float:
        """Wall time from the first request to the last answer (valid after ``result_N``)."""
        return max(self._finished, default=self._started) - self._started

    def usage(self) -> TokenUsage:
        """The prompt tokens sent to the teacher: every scored sequence's tokens."""
        return TokenUsage(prompt_tokens=self.num_tokens())

    def num_tokens(self) -> int:
        """Σ |sequence| (|x_T| + |y| per completion): ``usage/teacher_prompt_tokens``."""
        return self._tokens


def distill_batch(
    batch: TokenBatch, teacher_N: np.ndarray, config: TrainConfig
) -> tuple[TokenBatch, dict[str, float]]:
    """The batch with the distillation advantages (s = its sampling log-probs), and the metrics."""
    terms = distill_advantages(
        batch.advantages,
        batch.sampling_logprobs,
        teacher_N,
        batch.mask,
        batch.seq_lens,
        coef=config.distill_coef,
        discount=config.distill_discount,
        task_weight=config.task_reward_weight,
        clip=config.distill_clip,
    )
    metrics = distill_metrics(batch.sampling_logprobs, teacher_N, batch.mask, terms.clipped_N)
    return attrs.evolve(batch, advantages=terms.advantages_N), metrics


def in_update(config: TrainConfig) -> bool:
    """Whether the advantages are computed inside the update, on the trainer's log-probs."""
    return config.mismatch.mode == "recompute"


def planned_teacher_lens(
    teacher: Teacher, problems: Sequence[Problem], config: TrainConfig, steps: range
) -> list[list[int]]:
    """|x_T| of every problem of every step (the dry run's teacher-token bound)."""
    lens = [len(teacher.prompt_tokens(problem)) for problem in problems]
    return [
        [lens[index] for index in pick_batch(len(lens), config.batch_size, step, config.seed)]
        for step in steps
    ]


def teacher_plan_line(
    teacher: Teacher, lens_by_step: Sequence[Sequence[int]], config: TrainConfig
) -> str:
    """The dry run's teacher line: what it resolved to and its token bound."""
    bound = sum(
        planned_teacher_tokens(lens, config.group_size, config.max_tokens) for lens in lens_by_step
    )
    return (
        f"  teacher: {teacher.source}"
        + (f" (weights {teacher.weights})" if teacher.weights else " (a base model)")
        + f", tokenizer equal to the student's; teacher prompt tokens <= {bound:,} "
        "(in the prompt tokens below)"
    )
