"""Reductions (grpo.core.reductions): the checks of a reduction and its norm_length, and
the sum's additivity through every kernel (docs/FORMULAS.md, Aggregation)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core import losses, reductions
from tests.core.kernel_reference import (
    KERNELS,
    PATHS,
    run_kernel,
    term_scale,
)
from tests.strategies import (
    LOSS_CONFIGS,
    PackedLossBatch,
    packed_loss_batches,
)

pytestmark = pytest.mark.usefixtures("uncompiled_fused_forms")


@PATHS
@given(data=st.data())
def test_sum_is_additive_over_any_split_of_the_batch_into_sequences(
    fused: bool, data: st.DataObject
) -> None:
    batch = data.draw(packed_loss_batches(), label="batch")
    split = data.draw(st.integers(0, len(batch.seq_lens)), label="split")
    cut = sum(batch.seq_lens[:split])

    def part(positions: slice, seq_lens: tuple[int, ...]) -> PackedLossBatch:
        return PackedLossBatch(
            logprobs=batch.logprobs[positions],
            sampling_logprobs=batch.sampling_logprobs[positions],
            advantages=batch.advantages[positions],
            mask=batch.mask[positions],
            seq_lens=seq_lens,
        )

    head = part(slice(0, cut), batch.seq_lens[:split])
    tail = part(slice(cut, None), batch.seq_lens[split:])
    tolerance = 1e-12 * term_scale(batch)
    for name in KERNELS:
        config = data.draw(LOSS_CONFIGS[name], label=f"{name} config")
        loss, gradient, _ = run_kernel(name, batch, **config, fused=fused)
        head_loss, head_gradient, _ = run_kernel(name, head, **config, fused=fused)
        tail_loss, tail_gradient, _ = run_kernel(name, tail, **config, fused=fused)
        assert math.isclose(
            loss.item(), (head_loss + tail_loss).item(), rel_tol=1e-9, abs_tol=tolerance
        ), name
        np.testing.assert_array_equal(
            gradient, np.concatenate([head_gradient, tail_gradient]), err_msg=name
        )


def test_unknown_reduction_raises_listing_the_reductions() -> None:
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="unknown reduction 'mean'; choose one of sum, token_mean"):
        losses.ppo(logprobs, torch.zeros(2), torch.zeros(2), reduction="mean")


@pytest.mark.parametrize("norm_length", [None, 0.0, -4.0, math.nan, math.inf])
def test_seq_mean_token_sum_norm_needs_a_positive_norm_length(norm_length: float | None) -> None:
    logprobs = torch.zeros(2, requires_grad=True)
    with pytest.raises(ValueError, match="norm_length"):
        losses.ppo(
            logprobs,
            torch.zeros(2),
            torch.zeros(2),
            reduction="seq_mean_token_sum_norm",
            norm_length=norm_length,
        )


def test_norm_length_with_another_reduction_raises() -> None:
    with pytest.raises(
        ValueError, match="norm_length=16 is only used by reduction 'seq_mean_token_sum_norm'"
    ):
        reductions.validate_reduction("token_mean", 16)
