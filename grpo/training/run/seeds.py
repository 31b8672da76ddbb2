"""Every random choice of a run, as a pure function of (seed, purpose, step, ...).

Which problems a step trains on (``pick_batch``, ``extra_batch``) and every sampler seed
(``rollout_seed``) are drawn here and nowhere else, so a run resumed from a checkpoint, or
sampled ahead and saved, draws exactly what it would have. A ``Purpose`` keeps the streams
of training, evaluation and dynamic-sampling rounds, single-turn and --env, apart.
``RoundSeeds`` gathers the draws of one sampling round of a training step.
"""

from __future__ import annotations

import enum

import attrs
import numpy as np


class Purpose(enum.IntEnum):
    """The stream a seed belongs to (the numbers are part of every recorded run: never reuse)."""

    TRAIN = 0
    EVAL = 1
    EXTRA = 2
    ENV_TRAIN = 3
    ENV_EVAL = 4
    ENV_EXTRA = 5


def rollout_seed(seed: int, purpose: Purpose, *path: int) -> int:
    """A sampler seed: the first word of SeedSequence([seed, purpose, *path]), 31 bits."""
    state = np.random.SeedSequence([seed, int(purpose), *path]).generate_state(1)
    return int(state[0] & 0x7FFFFFFF)


def sampling_seed(seed: int, step: int, index: int, purpose: Purpose = Purpose.TRAIN) -> int:
    """The seed of request ``index`` (a problem's G samples) at ``step``."""
    return rollout_seed(seed, purpose, step, index)


def extra_sampling_seed(seed: int, step: int, round_: int, index: int) -> int:
    """The seed of request ``index`` of dynamic-sampling round ``round_`` >= 1 of ``step``."""
    return rollout_seed(seed, Purpose.EXTRA, step, round_, index)


def episode_seed(seed: int, purpose: Purpose, step: int, episode: int, turn: int) -> int:
    """The seed of one turn of episode ``episode`` at ``step``."""
    return rollout_seed(seed, purpose, step, episode, turn)


def extra_episode_seed(seed: int, step: int, round_: int, episode: int, turn: int) -> int:
    """The seed of one turn of dynamic-sampling round ``round_`` >= 1 of ``step`` (--env)."""
    return rollout_seed(seed, Purpose.ENV_EXTRA, step, round_, episode, turn)


def pick_batch(num_problems: int, batch_size: int, step: int, seed: int) -> np.ndarray:
    """Indices of step ``step``'s problems: slices of a per-pass permutation seeded (seed, pass)."""
    positions = np.arange(step * batch_size, (step + 1) * batch_size)
    passes, offsets = np.divmod(positions, num_problems)
    indices = np.empty(batch_size, dtype=np.int64)
    for data_pass in np.unique(passes):
        order = np.random.default_rng([seed, int(data_pass)]).permutation(num_problems)
        selected = passes == data_pass
        indices[selected] = order[offsets[selected]]
    return indices


def extra_batch(
    num_problems: int, batch_size: int, step: int, round_: int, seed: int
) -> np.ndarray:
    """Problems of extra sampling round ``round_`` >= 1 of ``step``: distinct, seeded by all."""
    rng = np.random.default_rng([seed, int(Purpose.EXTRA), step, round_])
    return rng.choice(num_problems, size=min(batch_size, num_problems), replace=False)


@attrs.frozen
class RoundSeeds:
    """Every random choice of sampling round ``round_`` of training step ``step``: its
    problems and its sampler seeds. Round 0 is the step's own batch (`pick_batch`; the TRAIN
    and ENV_TRAIN streams); a round >= 1 is dynamic sampling's (`extra_batch`; the EXTRA and
    ENV_EXTRA streams)."""

    seed: int
    step: int
    round_: int = 0

    def problem_indices(self, num_problems: int, batch_size: int) -> np.ndarray:
        """Indices of the round's problems among the run's ``num_problems``."""
        if self.round_ == 0:
            return pick_batch(num_problems, batch_size, self.step, self.seed)
        return extra_batch(num_problems, batch_size, self.step, self.round_, self.seed)

    def request(self, index: int) -> int:
        """The seed of the round's request ``index`` (a problem's G samples)."""
        if self.round_ == 0:
            return sampling_seed(self.seed, self.step, index)
        return extra_sampling_seed(self.seed, self.step, self.round_, index)

    def turn(self, episode: int, turn: int) -> int:
        """The seed of turn ``turn`` of the round's episode ``episode`` (--env)."""
        if self.round_ == 0:
            return episode_seed(self.seed, Purpose.ENV_TRAIN, self.step, episode, turn)
        return extra_episode_seed(self.seed, self.step, self.round_, episode, turn)
