"""The pure parts of SFT: extension masks, token batches, the held-out split, the schedule,
and the token-mean loss (docs/FORMULAS.md, "Supervised fine-tuning")."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.losses import LOSSES
from grpo.core.sft import (
    SftExample,
    extension_mask,
    heldout_split,
    lr_multiplier,
    token_batches,
    token_mean_cross_entropy,
    token_mean_weights,
)


@given(
    st.lists(st.integers(1, 60), min_size=1, max_size=40),
    st.integers(60, 200),
    st.integers(0, 2**31 - 1),
    st.integers(0, 5),
)
def test_token_batches_hold_every_row_once_within_the_budget(
    lengths: list[int], budget: int, seed: int, epoch: int
) -> None:
    batches = token_batches(lengths, budget=budget, seed=seed, epoch=epoch)
    rows = np.concatenate(batches)
    assert sorted(rows.tolist()) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in batch) <= budget for batch in batches)
    # Greedy in order: the next batch's first row would not have fit in this one.
    for batch, following in zip(batches, batches[1:]):
        assert sum(lengths[i] for i in batch) + lengths[following[0]] > budget
    assert [b.tolist() for b in batches] == [
        b.tolist() for b in token_batches(lengths, budget=budget, seed=seed, epoch=epoch)
    ]


def test_token_batches_refuse_a_row_over_the_budget_and_epochs_reorder() -> None:
    with pytest.raises(ValueError, match="row 1 has 9 tokens, more than the batch budget of 8"):
        token_batches([3, 9], budget=8, seed=0, epoch=0)
    lengths = [1] * 50
    first = np.concatenate(token_batches(lengths, budget=10, seed=0, epoch=0))
    second = np.concatenate(token_batches(lengths, budget=10, seed=0, epoch=1))
    assert first.tolist() != second.tolist()


@given(st.integers(1, 300), st.floats(0, 0.9), st.integers(0, 1000))
def test_heldout_split_partitions_the_rows(num_rows: int, fraction: float, seed: int) -> None:
    if fraction > 0 and math.ceil(fraction * num_rows) >= num_rows:
        with pytest.raises(ValueError, match="leaves no training row"):
            heldout_split(num_rows, fraction, seed)
        return
    train, held = heldout_split(num_rows, fraction, seed)
    assert sorted([*train.tolist(), *held.tolist()]) == list(range(num_rows))
    assert held.size == (math.ceil(fraction * num_rows) if fraction > 0 else 0)


def _reference_lr(step: int, total: int, warmup: int, schedule: str) -> float:
    if step < warmup:
        return (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return {"constant": 1.0, "linear": 1 - p, "cosine": (1 + math.cos(math.pi * p)) / 2}[schedule]


@given(
    st.integers(1, 200),
    st.integers(0, 30),
    st.sampled_from(["constant", "linear", "cosine"]),
    st.data(),
)
def test_lr_multiplier_is_warmup_then_decay(
    total: int, warmup: int, schedule: str, data: st.DataObject
) -> None:
    step = data.draw(st.integers(0, total - 1))
    value = lr_multiplier(step, total_steps=total, warmup_steps=warmup, schedule=schedule)
    assert value == pytest.approx(_reference_lr(step, total, warmup, schedule))
    assert 0 < value <= 1
    if step >= warmup and step + 1 < total and schedule != "constant":
        following = lr_multiplier(
            step + 1, total_steps=total, warmup_steps=warmup, schedule=schedule
        )
        assert following < value  # decays strictly after the warm-up


def test_lr_multiplier_endpoints() -> None:
    assert lr_multiplier(0, total_steps=10, warmup_steps=4, schedule="cosine") == 0.25
    assert lr_multiplier(3, total_steps=10, warmup_steps=4, schedule="linear") == 1.0
    assert lr_multiplier(4, total_steps=10, warmup_steps=4, schedule="cosine") == 1.0
    assert lr_multiplier(9, total_steps=10, warmup_steps=0, schedule="linear") == pytest.approx(0.1)


@given(st.lists(st.lists(st.booleans(), min_size=1, max_size=12), min_size=1, max_size=6))
def test_builtin_cross_entropy_with_token_mean_weights_is_the_mean_nll(
    masks: list[list[bool]],
) -> None:
    """Σ w·(−lp) with w = mask / Σ mask (the service's summed cross_entropy) equals the
    reference token mean, and its gradient is −mask / Σ mask per token."""
    masks_B = [np.array(mask) for mask in masks]
    if not any(mask.any() for mask in masks_B):
        with pytest.raises(ValueError, match="trains no token"):
            token_mean_weights(masks_B)
        return
    weights = torch.from_numpy(np.concatenate(token_mean_weights(masks_B)))
    mask = np.concatenate(masks_B)
    generator = torch.Generator().manual_seed(len(mask))
    logprobs = (-torch.rand(mask.size, generator=generator, dtype=torch.float64)).float()
    logprobs.requires_grad_(True)
    loss, _ = LOSSES["cross_entropy"](
        logprobs, None, weights, mask=torch.from_numpy(mask), seq_lens=[mask.size]
    )
    reference = token_mean_cross_entropy(logprobs.detach().numpy(), mask)
    assert float(loss.detach()) == pytest.approx(reference, rel=1e-5, abs=1e-6)
    loss.backward()
    expected = -mask.astype(np.float32) / mask.sum()
    np.testing.assert_allclose(logprobs.grad.numpy(), expected, rtol=1e-5, atol=1e-7)


def test_extension_mask_marks_each_assistant_turn_up_to_its_end_of_turn() -> None:
    eos, newline = 9, 8
    # [u1 u2] gen [a a eos nl] [u3] gen [b eos nl]
    full = [1, 2, 7, 5, 5, eos, newline, 3, 7, 6, eos, newline]
    turns = [([1, 2, 7], [1, 2, 7, 5, 5, eos, newline]), (full[:9], full)]
    mask = extension_mask(full, turns, eos)
    assert mask.tolist() == [0, 0, 0, 1, 1, 1, 0, 0, 0, 1, 1, 0]
    with pytest.raises(ValueError, match="turn 1: the rendering of the whole chat"):
        extension_mask(full, [turns[0], ([1, 2, 7], [1, 2, 7, 4])], eos)
    with pytest.raises(ValueError, match="turn 0: the chat template's rendering up to this turn"):
        extension_mask(full, [([1, 3], [1, 2, 7])], eos)


def test_an_example_must_train_a_token() -> None:
    with pytest.raises(ValueError, match="trains no token"):
        SftExample(tokens_T=[1, 2, 3], mask_T=[0, 0, 0])
    with pytest.raises(ValueError, match="token 0 cannot be trained"):
        SftExample(tokens_T=[1, 2], mask_T=[1, 1])
