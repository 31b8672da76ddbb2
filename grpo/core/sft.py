"""Supervised fine-tuning, the pure parts: trained-token masks, token batches, the schedule.

- `SftExample`: one row as tokens and a 0/1 mask of the tokens the loss trains on;
- `extension_mask`: the assistant-token mask of a chat from its renderings, each turn's
  rendering required to extend the previous one (refused when it does not);
- `token_batches`: every row once per epoch, in a seeded order, cut into batches whose
  token count stays within a budget;
- `heldout_split`: the seeded train / held-out split of `--eval-fraction`;
- `lr_multiplier`: warm-up, then constant, linear or cosine decay;
- `token_mean_weights` and `token_mean_cross_entropy`: the loss of docs/FORMULAS.md
  ("Supervised fine-tuning"): the mean negative log-prob over the batch's trained tokens.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import attrs
import numpy as np

LR_SCHEDULES = ("constant", "linear", "cosine")


def _tokens(value: object) -> np.ndarray:
    array = np.array(value, dtype=np.int64, copy=True).reshape(-1)
    array.setflags(write=False)
    return array


def _mask(value: object) -> np.ndarray:
    array = np.array(value, dtype=bool, copy=True).reshape(-1)
    array.setflags(write=False)
    return array


@attrs.frozen
class SftExample:
    """One training row: ``tokens_T`` and ``mask_T`` (True where the token is trained on).

    Token 0 has no predecessor, so it is never trained; at least one other must be.
    """

    tokens_T: np.ndarray = attrs.field(converter=_tokens)
    mask_T: np.ndarray = attrs.field(converter=_mask)

    def __attrs_post_init__(self) -> None:
        if self.tokens_T.size != self.mask_T.size:
            raise ValueError(
                f"mask_T has {self.mask_T.size} entries but tokens_T has {self.tokens_T.size}"
            )
        if self.tokens_T.size < 2 or not self.mask_T[1:].any():
            raise ValueError("the example trains no token (no completion/assistant token)")
        if self.mask_T[0]:
            raise ValueError("token 0 cannot be trained (nothing predicts it)")

    @property
    def num_positions(self) -> int:
        """Positions of its datum: input tokens_T[:-1] predicting targets tokens_T[1:]."""
        return int(self.tokens_T.size - 1)

    @property
    def num_trained(self) -> int:
        """Tokens the loss trains on."""
        return int(self.mask_T.sum())


def extension_mask(
    full_T: Sequence[int], turns: Sequence[tuple[Sequence[int], Sequence[int]]], eos: int | None
) -> np.ndarray:
    """Trained-token mask of a chat: for each assistant turn, the tokens its rendering adds.

    ``turns`` holds, per assistant turn i, (the rendering of the messages before it with the
    generation prompt, the rendering up to and including it). Each must be a prefix of the
    next and of ``full_T``; the turn's tokens are the difference, cut after its last ``eos``
    (the end-of-turn token the sampler stops at; what follows it formats the next turn).
    ValueError naming the turn when a rendering does not extend the previous one.
    """
    full = list(full_T)
    mask = np.zeros(len(full), dtype=bool)
    for turn, (before, through) in enumerate(turns):
        before, through = list(before), list(through)
        if through[: len(before)] != before:
            raise ValueError(
                f"assistant turn {turn}: the chat template's rendering up to this turn does "
                "not start with its rendering of the messages before it (plus the generation "
                "prompt), so its tokens cannot be told apart"
            )
        if full[: len(through)] != through:
            raise ValueError(
                f"assistant turn {turn}: the rendering of the whole chat does not start with its "
                "rendering up to this turn (the template rewrites earlier turns, e.g. drops "
                "their reasoning); split the chat into one row per assistant turn"
            )
        span = through[len(before) :]
        if eos is not None and eos in span:
            span = span[: len(span) - span[::-1].index(eos)]
        mask[len(before) : len(before) + len(span)] = True
    mask[0] = False
    return mask


def token_batches(
    lengths_R: Sequence[int], *, budget: int, seed: int, epoch: int
) -> list[np.ndarray]:
    """Row indices of each batch of an epoch: a permutation seeded by (seed, epoch), cut in order
    into batches of at most ``budget`` tokens each (a row longer than the budget is refused)."""
    lengths = np.asarray(lengths_R, dtype=np.int64)
    if budget < 1:
        raise ValueError(f"budget must be >= 1, got {budget}")
    too_long = np.flatnonzero(lengths > budget)
    if too_long.size:
        row = int(too_long[0])
        raise ValueError(
            f"row {row} has {int(lengths[row])} tokens, more than the batch budget of {budget}; "
            "raise --batch-tokens or shorten the row"
        )
    order = np.random.default_rng([seed, epoch]).permutation(lengths.size)
    batches: list[np.ndarray] = []
    start, used = 0, 0
    for position, row in enumerate(order):
        if used + lengths[row] > budget:
            batches.append(order[start:position])
            start, used = position, 0
        used += int(lengths[row])
    if start < order.size:
        batches.append(order[start:])
    return batches


def heldout_split(num_rows: int, fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows): ceil(fraction · rows) rows drawn by a seeded permutation."""
    if not 0 <= fraction < 1:
        raise ValueError(f"fraction must be in [0, 1), got {fraction}")
    held = math.ceil(fraction * num_rows) if fraction > 0 else 0
    if held >= num_rows and num_rows:
        raise ValueError(f"--eval-fraction {fraction} leaves no training row of {num_rows}")
    order = np.random.default_rng([seed, 1]).permutation(num_rows)
    return np.sort(order[held:]), np.sort(order[:held])


def lr_multiplier(step: int, *, total_steps: int, warmup_steps: int, schedule: str) -> float:
    """The learning rate's factor at 0-based ``step`` of ``total_steps``.

    Warm-up: (step + 1) / warmup_steps while step < warmup_steps. After it, with
    p = (step − W) / (total − W): constant 1, linear 1 − p, cosine (1 + cos πp) / 2.
    """
    if schedule not in LR_SCHEDULES:
        raise ValueError(f"schedule must be one of {', '.join(LR_SCHEDULES)}, got {schedule!r}")
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
    if schedule == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def token_mean_weights(masks_B: Sequence[np.ndarray]) -> list[np.ndarray]:
    """Per-token weights w = mask / (trained tokens of the whole batch), datum by datum."""
    total = sum(int(np.count_nonzero(mask)) for mask in masks_B)
    if total == 0:
        raise ValueError("the batch trains no token")
    return [np.asarray(mask, dtype=np.float32) / np.float32(total) for mask in masks_B]


def token_mean_cross_entropy(logprobs_N: np.ndarray, mask_N: np.ndarray) -> float:
    """L = −Σ_t m_t · lp_t / Σ_t m_t: the mean negative log-prob of the trained tokens."""
    mask = np.asarray(mask_N, dtype=bool)
    if not mask.any():
        raise ValueError("mask_N trains no token")
    return float(-np.asarray(logprobs_N, dtype=np.float64)[mask].sum() / mask.sum())
