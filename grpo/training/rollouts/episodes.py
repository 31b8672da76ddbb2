"""Multi-turn rollouts (--env): episodes through the sampler, grouped, evaluated, logged.

An episode's token stream is built by appending: the initial observation rendered with the
chat template (generation prompt on), then each turn's sampled tokens exactly as sampled,
then the tokens of the *new* text the template renders for the environment's answer. Each
turn re-renders the whole conversation and checks that it grows by extension (the previous
rendering + the action's text is a prefix of the new one); a template that re-renders
earlier turns differently (e.g. one that strips earlier reasoning) is refused with
`TemplateError`, so a run never trains on tokens the policy did not produce. Limits:
--max-turns turns, --max-tokens per turn, and the model's context (a turn that cannot get
one more token ends the episode, its last turn marked ``context``).

``play_groups`` plays G episodes per task (`grpo.envs.make_group`) on a pool as an
`EpisodeJob` (`grpo.training.rollouts.step` submits it for a GRPO step, and
`grpo.training.rollouts.evaluation` for an evaluation). Every sampler seed is drawn in
`grpo.training.run.seeds` from (seed, purpose, step, episode, turn), and of the round in a
dynamic-sampling round >= 1.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import attrs
from pytrio.types import ModelInput, SamplingParams

from grpo.backends.pytrio import call_with_retries
from grpo.core.episodes import Episode, Turn
from grpo.core.usage import TokenUsage, sample_usage
from grpo.envs.base import (
    Env,
    EnvError,
    Task,
    env_step,
    env_tools,
    initial_messages,
    make_group,
)
from grpo.interrupts import request_result
from grpo.tasks.prompts import build_messages
from grpo.training.rollouts.clients import Sampler, Tokenizer
from grpo.training.rollouts.grading import PlayedGroups
from grpo.training.rollouts.problems import Problem
from grpo.training.rollouts.sampling import Note
from grpo.training.settings.config import TrainConfig


class TemplateError(EnvError):
    """A chat template whose rendering of a conversation does not extend its earlier one."""


@attrs.frozen
class EpisodeLimits:
    """How an episode samples: turns, tokens per turn, the model's context, temperature."""

    max_turns: int
    max_tokens: int
    max_len: int | None
    temperature: float
    top_p: float = 1.0
    env_timeout_s: float = 0.0
    env_errors: str = "stop"
    """--env-errors: "zero" ends an episode whose step raised or timed out with reward 0."""


def render(
    tokenizer: Tokenizer,
    messages: Sequence[dict[str, str]],
    tools: list[dict[str, Any]] | None = None,
) -> str:
    """chat_template(messages, tools=tools, add_generation_prompt=True, enable_thinking=False),
    as text (``tools``: the env's function signatures, `grpo.envs.base.env_tools`)."""
    return tokenizer.apply_chat_template(
        list(messages),
        tools=tools,
        tokenize=False,
        add_generation_prompt=True,
        enable_thinking=False,
    )


def _encode(tokenizer: Tokenizer, text: str) -> list[int]:
    return list(tokenizer.encode(text, add_special_tokens=False))


def bridge_text(
    tokenizer: Tokenizer,
    shown: str,
    action: str,
    end: str,
    messages: list[dict[str, str]],
    tools: list[dict[str, Any]] | None = None,
) -> tuple[str, str]:
    """(bridge, rendering): the text the template adds after ``shown + action (+ end)`` when
    ``messages`` (ending in the new observation) is rendered, and that whole rendering;
    TemplateError when the rendering does not extend ``shown + action``.

    ``end`` is the text of the end-of-turn token the policy sampled (empty when it did not),
    which the policy has already written, so it is not part of the bridge.
    """
    rendered = render(tokenizer, messages, tools)
    written = shown + action + end
    if end and not rendered.startswith(written) and rendered.startswith(shown + action):
        # The policy ended its turn with another special token than the template's: that
        # token stays as sampled, and the template's own end of turn is observation.
        return rendered[len(shown + action) :], rendered
    if not rendered.startswith(written):
        at = next(
            (i for i, (a, b) in enumerate(zip(rendered, written, strict=False)) if a != b),
            min(len(rendered), len(written)),
        )
        raise TemplateError(
            "the chat template re-renders the conversation differently from the tokens the "
            f"policy saw and sampled (first difference at character {at}: rendered "
            f"{rendered[at : at + 40]!r}, sampled {written[at : at + 40]!r}); multi-turn "
            "training needs a template whose rendering grows by extension (e.g. one that keeps "
            "earlier turns verbatim); use such a template or a one-turn --env"
        )
    return rendered[len(written) :], rendered


@contextlib.contextmanager
def _env_session(env: Env, note: Note) -> Iterator[None]:
    """Waits for the env's session first (its ``wait_for_session(note)``, outside --env-timeout)
    and closes the env at the end (its ``close()``), logging a failed close."""
    try:
        wait_for_session = getattr(env, "wait_for_session", None)
        if callable(wait_for_session):
            wait_for_session(note)
        yield
    finally:
        close = getattr(env, "close", None)
        if callable(close):
            try:
                close()
            except Exception as error:  # noqa: BLE001 - the episode is over either way
                note(f"closing {type(env).__name__} failed: {type(error).__name__}: {error}")


def play_episode(
    sampler: Sampler,
    env: Env,
    tokenizer: Tokenizer,
    limits: EpisodeLimits,
    seed_for: Callable[[int], int],
    *,
    max_retries: int,
    note: Note,
) -> tuple[Episode, TokenUsage, list[str]]:
    """One episode: sample a turn, let the env answer, append its rendering; until done or a
    limit. Returns the episode, the sampler usage, and the decoded observation of each turn.
    An env with a ``wait_for_session(note)`` (a server of few sessions, `grpo.envs.openenv`)
    waits there first, outside --env-timeout; one with a ``close()`` is closed at the end."""
    with _env_session(env, note):
        special_ids = set(getattr(tokenizer, "all_special_ids", []) or [])
        messages = list(initial_messages(env, limits.env_timeout_s))
        tools = env_tools(env)
        shown = render(tokenizer, messages, tools)
        observation = _encode(tokenizer, shown)
        context: list[int] = []
        turns: list[Turn] = []
        seen: list[str] = [shown]
        usage = TokenUsage()
        for index in range(limits.max_turns):
            context += observation
            room = limits.max_tokens if limits.max_len is None else limits.max_len - len(context)
            if room < 1:
                if not turns:
                    raise EnvError(
                        f"the initial observation has {len(context)} tokens, the model's whole "
                        f"context of {limits.max_len}; shorten the environment's prompt"
                    )
                turns[-1] = attrs.evolve(turns[-1], stop_reason="context")
                break
            budget = min(limits.max_tokens, room)
            prompt = ModelInput.from_ints(context)
            params = SamplingParams(
                max_tokens=budget,
                temperature=limits.temperature,
                top_p=limits.top_p,
                seed=seed_for(index),
            )
            response = call_with_retries(
                lambda prompt=prompt, params=params: request_result(
                    sampler.sample(
                        prompt=prompt, num_samples=1, sampling_params=params, return_text=True
                    )
                ),
                what=f"sample (episode turn {index})",
                max_retries=max_retries,
                note=note,
            )
            (sequence,) = response.sequences
            tokens = [int(token) for token in sequence.tokens]
            usage += sample_usage(
                response.input_tokens, response.output_tokens, len(context), [len(tokens)]
            )
            ended = sequence.stop_reason == "stop" and bool(tokens) and tokens[-1] in special_ids
            action = tokenizer.decode(tokens[:-1] if ended else tokens, skip_special_tokens=False)
            end = tokenizer.decode(tokens[-1:], skip_special_tokens=False) if ended else ""
            try:
                result = env_step(env, action, index, limits.env_timeout_s)
            except EnvError as error:
                if limits.env_errors != "zero":
                    raise
                note(f"{error}; the episode ends with reward 0 (--env-errors zero)")
                turns.append(
                    Turn(
                        observation_tokens=observation,
                        action_tokens=tokens,
                        action_logprobs=list(sequence.logprobs),
                        reward=0.0,
                        action_text=action,
                        stop_reason="env_error",
                    )
                )
                break
            stop = "stop" if sequence.stop_reason == "stop" else "length"
            if stop == "length" and budget < limits.max_tokens:
                stop = "context"
            turns.append(
                Turn(
                    observation_tokens=observation,
                    action_tokens=tokens,
                    action_logprobs=list(sequence.logprobs),
                    reward=result.reward,
                    action_text=action,
                    stop_reason=stop,
                    tool_calls=result.tool_calls,
                    tool_errors=result.tool_errors,
                )
            )
            context += tokens
            if result.done or index + 1 == limits.max_turns:
                break
            messages += [{"role": "assistant", "content": action}, *result.observation]
            bridge, shown = bridge_text(tokenizer, shown, action, end, messages, tools)
            observation = _encode(tokenizer, bridge)
            seen.append(bridge)
        return Episode(turns=turns), usage, seen


def task_of(problem: Problem, config: TrainConfig) -> Task:
    """The env's view of a problem: question, gold, row and the run's prompt messages."""
    messages = build_messages(
        problem.question, fewshot=config.use_fewshot, template=config.prompt_template
    )
    return Task(
        question=problem.question,
        gold=problem.gold,
        index=problem.index,
        row=problem.row,
        messages=tuple(messages),
    )


class EpisodeJob:
    """One batch of tasks' episodes in flight on the run's pool; ``result()`` waits for all.

    The episode counterpart of `grpo.training.rollouts.sampling.RolloutJob` (``sampler_version``,
    ``result``, ``cancel``), so a step can be sampled ahead (--max-steps-off-policy).
    """

    def __init__(
        self,
        problems: Sequence[Problem],
        futures: list[Future[tuple[Episode, TokenUsage, list[str]]]],
        *,
        group_size: int,
        sampler_version: int,
    ) -> None:
        self.problems = tuple(problems)
        self.sampler_version = sampler_version
        self._futures, self._group_size = futures, group_size

    def result(self) -> PlayedGroups:
        """Every task's episodes, in problem order, with the usage of all their turns."""
        played = [future.result() for future in self._futures]
        episodes = [episode for episode, _usage, _seen in played]
        seen = [tuple(observed) for _episode, _usage, observed in played]
        size = self._group_size
        cut = range(0, len(played), size)
        return PlayedGroups(
            problems_P=self.problems,
            episodes_P=tuple(tuple(episodes[i : i + size]) for i in cut),
            seen_P=tuple(tuple(seen[i : i + size]) for i in cut),
            usage=sum((usage for _episode, usage, _seen in played), TokenUsage()),
        )

    def usage(self) -> TokenUsage:
        """The tokens every turn sent and sampled (waits for the episodes)."""
        return self.result().usage

    def cancel(self) -> None:
        """Drop episodes that have not started."""
        for future in self._futures:
            future.cancel()


def play_groups(
    pool: ThreadPoolExecutor,
    sampler: Sampler,
    tokenizer: Tokenizer,
    config: TrainConfig,
    problems: Sequence[Problem],
    limits: EpisodeLimits,
    *,
    group_size: int,
    seed_for: Callable[[int, int], int],
    max_retries: int,
    note: Note,
    sampler_version: int = 0,
) -> EpisodeJob:
    """``group_size`` episodes of every problem's env (``config.env_factory``) submitted to
    ``pool``, not waited for; turn t of episode e (``e = problem * group_size + member``)
    samples with seed ``seed_for(e, t)``."""
    futures = []
    for index, problem in enumerate(problems):
        envs = make_group(config.env_factory, task_of(problem, config), group_size)
        for member, env in enumerate(envs):
            episode = index * group_size + member
            futures.append(
                pool.submit(
                    play_episode,
                    sampler,
                    env,
                    tokenizer,
                    limits,
                    functools.partial(seed_for, episode),
                    max_retries=max_retries,
                    note=note,
                )
            )
    return EpisodeJob(problems, futures, group_size=group_size, sampler_version=sampler_version)
