"""Guess the number: a multi-turn environment with feedback (grpo train --env ...:make)."""

import re

from grpo.envs import StepResult, Task


class GuessNumber:
    """The secret is 1..20 (from the row's index); each guess gets "higher" or "lower"."""

    def __init__(self, task: Task) -> None:
        self.secret = task.index * 7 % 20 + 1
        self.guesses = 0

    def initial_observation(self) -> list[dict[str, str]]:
        question = "I am thinking of a number from 1 to 20. Guess it: answer with one number."
        return [{"role": "user", "content": question}]

    def step(self, action_text: str) -> StepResult:
        self.guesses += 1
        found = re.findall(r"-?\d+", action_text)
        if not found:
            return StepResult([{"role": "user", "content": "Answer with a number."}], 0.0, False)
        guess = int(found[-1])
        if guess == self.secret:  # fewer guesses, more reward
            return StepResult([], 1.0 / self.guesses, True)
        hint = "higher" if guess < self.secret else "lower"
        return StepResult([{"role": "user", "content": f"No, {hint}."}], 0.0, False)


def make(task: Task) -> GuessNumber:
    """The factory --env calls once per episode."""
    return GuessNumber(task)
