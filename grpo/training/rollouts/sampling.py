"""Sampling requests in flight: one kind of job for completions and episodes, taken once.

A ``Job`` is a step's sampling on the run's pool: ``sampler_version`` (the updates its weights
had), ``result()`` (waits), ``usage()`` (the tokens it sent and sampled) and ``cancel()``.
`RolloutJob` (G completions of each problem, one request of ``num_samples=G`` each),
`grpo.training.rollouts.episodes.EpisodeJob` and a resumed `grpo.training.run.ahead.ReadyJob`
are all one. Which requests a step makes, K steps ahead, is `grpo.training.rollouts.step`'s.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import attrs
from pytrio.types import ModelInput, SamplingParams

from grpo.backends.clients import Note
from grpo.backends.pytrio import call_with_retries
from grpo.core.records import Completion
from grpo.core.usage import TokenUsage, sample_usage
from grpo.interrupts import request_result
from grpo.training.rollouts.clients import SampledSequence, Sampler, Tokenizer
from grpo.training.rollouts.problems import Problem


def completion_from(sequence: SampledSequence, tokenizer: Tokenizer) -> Completion:
    """A core Completion from one sampled sequence (text decoded if the backend gave none)."""
    text = sequence.text if sequence.text is not None else tokenizer.decode(sequence.tokens)
    return Completion(
        tokens=sequence.tokens,
        logprobs=sequence.logprobs,
        text=text,
        stop_reason=sequence.stop_reason,
    )


class RolloutJob:
    """One step's sampling requests on a bounded pool; ``result()`` waits for all groups."""

    def __init__(
        self,
        pool: ThreadPoolExecutor,
        sampler: Sampler,
        problems: Sequence[Problem],
        *,
        params_for: Callable[[int], SamplingParams],
        num_samples: int,
        tokenizer: Tokenizer,
        max_retries: int,
        note: Note,
        sampler_version: int,
    ) -> None:
        self.sampler_version = sampler_version
        self.problems = list(problems)
        self._usage_P = [TokenUsage() for _ in self.problems]

        def sample_one(index: int) -> list[Completion]:
            prompt = ModelInput.from_ints(list(self.problems[index].prompt_tokens))
            response = call_with_retries(
                lambda: request_result(
                    sampler.sample(
                        prompt=prompt,
                        num_samples=num_samples,
                        sampling_params=params_for(index),
                        return_text=True,
                    )
                ),
                what=f"sample (problem {index})",
                max_retries=max_retries,
                note=note,
            )
            self._usage_P[index] = sample_usage(
                response.input_tokens,
                response.output_tokens,
                len(prompt),
                (len(sequence.tokens) for sequence in response.sequences),
            )
            return [completion_from(sequence, tokenizer) for sequence in response.sequences]

        self._futures: list[Future[list[Completion]]] = [
            pool.submit(sample_one, index) for index in range(len(self.problems))
        ]

    def result(self) -> list[list[Completion]]:
        """The completions of every problem, in problem order."""
        return [future.result() for future in self._futures]

    def usage(self) -> TokenUsage:
        """Tokens the job's requests sent and sampled (complete once ``result()`` returned)."""
        return sum(self._usage_P, TokenUsage())

    def cancel(self) -> None:
        """Drop requests that have not started."""
        for future in self._futures:
            future.cancel()


@attrs.frozen
class Sampling:
    """Where a run's sampling requests go: its thread pool, the tokenizer that decodes a
    completion the backend returned without text, the retries of a request, the note."""

    pool: ThreadPoolExecutor
    tokenizer: Tokenizer
    max_retries: int
    note: Note

    def submit(
        self,
        sampler: Sampler,
        problems: Sequence[Problem],
        params_for: Callable[[int], SamplingParams],
        *,
        num_samples: int,
        sampler_version: int = 0,
    ) -> RolloutJob:
        """``num_samples`` completions of every problem; request ``i`` samples ``params_for(i)``."""
        return RolloutJob(
            self.pool,
            sampler,
            problems,
            params_for=params_for,
            num_samples=num_samples,
            tokenizer=self.tokenizer,
            max_retries=self.max_retries,
            note=self.note,
            sampler_version=sampler_version,
        )
