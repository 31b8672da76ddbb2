"""The records of rollouts.jsonl: the first --log-rollouts groups of a step, texts clipped.

A group of completions logs each completion's text, reward, --reward components, advantage,
tokens and stop reason; a group of episodes logs the same per episode (its transcript as
the text, no components) plus its turns. ``step_records`` picks the one a graded step needs.
"""

from __future__ import annotations

from collections.abc import Sequence

from grpo.core.episodes import EpisodeGroup
from grpo.core.records import ScoredGroup
from grpo.training.rollouts.clients import Tokenizer
from grpo.training.rollouts.grading import GradedStep, PlayedGroups, StepRollouts
from grpo.training.rollouts.problems import Problem
from grpo.training.run.run_log import CompletionRecord, RolloutRecord, TurnRecord, clip_text


def step_records(graded: GradedStep, tokenizer: Tokenizer, limit: int) -> list[RolloutRecord]:
    """The first ``limit`` groups of a graded step for rollouts.jsonl (--log-rollouts), of
    completions or of episodes."""
    rollouts = graded.rollouts
    if isinstance(rollouts, PlayedGroups):
        return episode_records(  # type: ignore[arg-type]
            rollouts.problems_P, graded.groups_P, rollouts.seen_P, tokenizer, limit
        )
    return completion_records(rollouts, graded.groups_P, tokenizer, limit)  # type: ignore[arg-type]


def completion_records(
    rollouts: StepRollouts, groups_P: Sequence[ScoredGroup], tokenizer: Tokenizer, limit: int
) -> list[RolloutRecord]:
    """The first ``limit`` groups of completions as JSON-ready records for rollouts.jsonl: the
    prompt, each completion's text (clipped), reward, components, advantage, tokens, stop."""
    records: list[RolloutRecord] = []
    for index, (problem, group) in enumerate(zip(rollouts.problems_P, groups_P)):
        if index >= limit:
            break
        components = rollouts.scores.components_P[index]
        records.append(
            {
                "group": index,
                "row": problem.index,
                "prompt": clip_text(tokenizer.decode(list(problem.prompt_tokens))),
                "gold": problem.gold,
                "degenerate": group.is_degenerate,
                "completions": [
                    {
                        "text": clip_text(completion.text),
                        "reward": float(group.rewards[member]),
                        "components": {
                            name: float(values[member]) for name, values in components.items()
                        },
                        "advantage": float(group.advantages[member]),
                        "tokens": int(completion.tokens.size),
                        "stop_reason": completion.stop_reason,
                    }
                    for member, completion in enumerate(group.completions)
                ],
            }
        )
    return records


def episode_records(
    problems: Sequence[Problem],
    groups_P: Sequence[EpisodeGroup],
    seen_P: Sequence[Sequence[Sequence[str]]],
    tokenizer: Tokenizer,
    limit: int,
) -> list[RolloutRecord]:
    """The first ``limit`` groups for rollouts.jsonl: each episode's transcript after the
    prompt as ``text`` (actions and tool responses, as `grpo show` prints it) and its turns."""
    records: list[RolloutRecord] = []
    for index, (problem, group, seen_G) in enumerate(zip(problems, groups_P, seen_P)):
        if index >= limit:
            break
        completions: list[CompletionRecord] = []
        for member, (episode, seen) in enumerate(zip(group.episodes, seen_G, strict=True)):
            turns: list[TurnRecord] = [
                {
                    "action": clip_text(turn.action_text),
                    "observation": clip_text(seen[t + 1]) if t + 1 < len(seen) else "",
                    "reward": turn.reward,
                    "tokens": int(turn.action_tokens.size),
                    "stop_reason": turn.stop_reason,
                    "tool_calls": turn.tool_calls,
                    "tool_errors": turn.tool_errors,
                }
                for t, turn in enumerate(episode.turns)
            ]
            transcript = "".join(turn["action"] + turn["observation"] for turn in turns)
            completions.append(
                {
                    "text": clip_text(transcript),
                    "reward": episode.reward,
                    "components": {},
                    "advantage": float(group.advantages[member]),
                    "tokens": episode.num_sampled,
                    "stop_reason": episode.turns[-1].stop_reason,
                    "turns": turns,
                }
            )
        records.append(
            {
                "group": index,
                "row": problem.index,
                "prompt": clip_text(seen_G[0][0]),
                "gold": problem.gold,
                "degenerate": group.is_degenerate,
                "completions": completions,
            }
        )
    return records
