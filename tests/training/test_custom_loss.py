"""as_custom_loss: the PyTRIO custom-loss callable equals a per-datum loop; bad datums fail."""

from __future__ import annotations

import math

import numpy as np
import pytest
import pytrio
import torch
from hypothesis import given
from hypothesis import strategies as st
from pytrio.client.training import _invoke_custom_loss

from grpo.backends.datums import IGNORE_INDEX, datum_mask
from grpo.core import losses
from grpo.training.custom_loss import as_custom_loss
from tests.strategies import LOSS_CONFIGS, policy_datums


def _stripped(datums: list[pytrio.Datum]) -> list[pytrio.Datum]:
    """What the article sends to forward_backward_custom: target_tokens only."""
    return [
        pytrio.Datum(
            model_input=datum.model_input,
            loss_fn_inputs={"target_tokens": datum.loss_fn_inputs["target_tokens"]},
        )
        for datum in datums
    ]


def _leaves(
    current_logprobs: list[np.ndarray], dtype: torch.dtype = torch.float32
) -> list[torch.Tensor]:
    """Per-datum leaf tensors, as PyTRIO builds them (float32) from the trainer's forward.

    Comparisons with a loop use float64 leaves, so that only summation order differs.
    """
    return [torch.tensor(values, dtype=dtype, requires_grad=True) for values in current_logprobs]


def _float(datum: pytrio.Datum, key: str) -> torch.Tensor:
    return torch.tensor(datum.loss_fn_inputs[key].data, dtype=torch.float32)


def _loss_tolerance(
    datums: list[pytrio.Datum], current_logprobs: list[np.ndarray], leaves: list[torch.Tensor]
) -> float:
    """Absolute float64 rounding allowance of a summed loss: 1e-10 of a bound on Σ_t |o_t|.

    |o_t| of every kernel is at most (|lp|+1)(|A|+1)(lr²+1)(|∂loss/∂lp|+1) times a small
    constant (IS: |r·A| is the gradient; CISPO: |clip(r)·A·lp|; DRO: |lp·A| + β/2·lr²).
    """
    total = 0.0
    for datum, current, leaf in zip(datums, current_logprobs, leaves, strict=True):
        log_ratio = current - np.asarray(datum.loss_fn_inputs["logprobs"].data)
        advantages = np.asarray(datum.loss_fn_inputs["advantages"].data)
        assert leaf.grad is not None
        gradient = np.abs(leaf.grad.numpy())
        total += float(
            np.sum(
                (np.abs(current) + 1)
                * (np.abs(advantages) + 1)
                * (log_ratio**2 + 1)
                * (gradient + 1)
            )
        )
    return 1e-10 * total


def _article_cispo(
    datums: list[pytrio.Datum], logprobs_list: list[torch.Tensor], low: float, high: float
) -> torch.Tensor:
    """The seed article's make_cispo_loss_fn body, one datum at a time."""
    datum_losses = []
    for datum, target_logprobs in zip(datums, logprobs_list, strict=True):
        prob_ratio = torch.exp(target_logprobs - _float(datum, "logprobs"))
        clipped_ratio = torch.clamp(prob_ratio, min=low, max=high)
        cispo_objective = clipped_ratio.detach() * target_logprobs * _float(datum, "advantages")
        datum_losses.append(-cispo_objective.sum())
    return torch.stack(datum_losses).sum()


@given(batch=policy_datums(), config=LOSS_CONFIGS["cispo"])
def test_as_custom_loss_matches_the_articles_per_datum_cispo_loop(
    batch: tuple[list[pytrio.Datum], list[np.ndarray]], config: dict
) -> None:
    datums, current_logprobs = batch
    resolved = losses.resolve_config("cispo", config)
    expected_leaves = _leaves(current_logprobs, torch.float64)
    expected = _article_cispo(
        datums, expected_leaves, resolved["clip_low_threshold"], resolved["clip_high_threshold"]
    )
    expected.backward()
    leaves = _leaves(current_logprobs, torch.float64)
    loss, metrics = as_custom_loss("cispo", datums, **config)(_stripped(datums), leaves)
    loss.backward()
    tolerance = _loss_tolerance(datums, current_logprobs, leaves)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-9, abs_tol=tolerance)
    for leaf, expected_leaf in zip(leaves, expected_leaves, strict=True):
        torch.testing.assert_close(leaf.grad, expected_leaf.grad, rtol=1e-12, atol=0.0)
    assert metrics["cispo/loss"] == loss.item()


@pytest.mark.parametrize("name", sorted(set(losses.LOSSES) - {"cross_entropy"}))
@given(data=st.data())
def test_sum_reduction_equals_the_per_datum_loop_of_the_kernel(
    name: str, data: st.DataObject
) -> None:
    """Packing all datums into one kernel call changes nothing for `sum`: Σ over datums."""
    datums, current_logprobs = data.draw(policy_datums(), label="batch")
    config = data.draw(LOSS_CONFIGS[name], label="config")
    expected_leaves = _leaves(current_logprobs, torch.float64)
    expected = torch.zeros((), dtype=torch.float64)
    for datum, leaf in zip(datums, expected_leaves, strict=True):
        advantages = _float(datum, "advantages")
        datum_loss, _ = losses.LOSSES[name](
            leaf, _float(datum, "logprobs"), advantages, mask=advantages != 0, **config
        )
        expected = expected + datum_loss
    expected.backward()
    leaves = _leaves(current_logprobs, torch.float64)
    loss, _ = as_custom_loss(name, datums, **config)(_stripped(datums), leaves)
    loss.backward()
    tolerance = _loss_tolerance(datums, current_logprobs, leaves)
    assert math.isclose(loss.item(), expected.item(), rel_tol=1e-9, abs_tol=tolerance)
    for leaf, expected_leaf in zip(leaves, expected_leaves, strict=True):
        torch.testing.assert_close(leaf.grad, expected_leaf.grad, rtol=1e-12, atol=1e-300)


@pytest.mark.parametrize("reduction", losses.REDUCTIONS)
@given(batch=policy_datums())
def test_every_reduction_equals_the_kernel_on_the_concatenated_datums(
    reduction: str, batch: tuple[list[pytrio.Datum], list[np.ndarray]]
) -> None:
    datums, current_logprobs = batch
    norm_length = 16.0 if reduction == "seq_mean_token_sum_norm" else None
    flat = torch.tensor(np.concatenate(current_logprobs), requires_grad=True)
    advantages = torch.cat([_float(datum, "advantages") for datum in datums])
    expected, expected_metrics = losses.ppo(
        flat,
        torch.cat([_float(datum, "logprobs") for datum in datums]),
        advantages,
        mask=advantages != 0,
        seq_lens=[len(values) for values in current_logprobs],
        reduction=reduction,
        norm_length=norm_length,
    )
    leaves = _leaves(current_logprobs)
    custom = as_custom_loss("ppo", datums, reduction=reduction, norm_length=norm_length)
    loss, metrics = custom(_stripped(datums), leaves)
    assert torch.equal(loss, expected)
    assert metrics == {f"ppo/{key}": value for key, value in expected_metrics.items()}


def test_metrics_are_prefixed_with_the_loss_name() -> None:
    datums = [_datum([5, 6, 7], [0.0, -1.0, -2.0], [0.0, 1.0, 1.0])]
    _, metrics = as_custom_loss("cispo", datums)(datums, _leaves([np.array([-0.5, -1.2, -1.5])]))
    assert set(metrics) == {
        "cispo/loss",
        "cispo/train_tokens",
        "cispo/ratio_mean",
        "cispo/ratio_min",
        "cispo/ratio_max",
        "cispo/clip_fraction",
        "cispo/clip_low_fraction",
        "cispo/clip_high_fraction",
        "cispo/clipped_ratio_mean",
    }
    assert metrics["cispo/train_tokens"] == 2.0


def test_pytrio_calls_the_loss_with_datums_and_logprobs_even_when_given_a_config() -> None:
    datums = [_datum([5, 6], [-1.0, -2.0], [1.0, -1.0])]
    loss_fn = as_custom_loss(losses.ppo, datums)
    loss, metrics = _invoke_custom_loss(
        loss_fn, datums, _leaves([np.array([-1.0, -2.0])]), {"unused": 1}
    )
    assert loss.item() == pytest.approx(0.0)
    assert metrics["ppo/ratio_mean"] == 1.0


# --- the mask rule ----------------------------------------------------------------------


def _datum(
    targets: list[int],
    logprobs: list[float],
    advantages: list[float],
    **extra: np.ndarray,
) -> pytrio.Datum:
    return pytrio.Datum(
        model_input=pytrio.ModelInput.from_ints([1] * len(targets)),
        loss_fn_inputs={
            "target_tokens": np.array(targets, dtype=np.int64),
            "logprobs": np.array(logprobs, dtype=np.float32),
            "advantages": np.array(advantages, dtype=np.float32),
            **extra,
        },
    )


def test_datum_mask_trains_nonzero_advantages_and_never_ignored_targets() -> None:
    datum = _datum([3, 4, IGNORE_INDEX, 5], [0.0] * 4, [0.0, 1.5, 2.0, -1.0])
    np.testing.assert_array_equal(datum_mask(datum), [False, True, False, True])


def test_datum_mask_prefers_an_explicit_mask_entry() -> None:
    datum = _datum(
        [3, 4, 5, IGNORE_INDEX],
        [0.0] * 4,
        [0.0, 1.0, 1.0, 1.0],
        mask=np.array([1.0, 0.0, 1.0, 1.0], dtype=np.float32),
    )
    np.testing.assert_array_equal(datum_mask(datum), [True, False, True, False])


def test_datum_mask_reads_weights_for_cross_entropy() -> None:
    datum = pytrio.Datum(
        model_input=pytrio.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={
            "target_tokens": np.array([3, 4, 5], dtype=np.int64),
            "weights": np.array([0.0, 1.0, 1.0], dtype=np.float32),
        },
    )
    np.testing.assert_array_equal(datum_mask(datum, weight_input="weights"), [False, True, True])
    leaves = _leaves([np.array([-1.0, -2.0, -3.0])])
    loss, metrics = as_custom_loss("cross_entropy", [datum])([datum], leaves)
    assert loss.item() == pytest.approx(5.0)
    assert metrics == {"cross_entropy/loss": pytest.approx(5.0), "cross_entropy/train_tokens": 2.0}


def test_explicit_mask_entry_excludes_positions_from_the_loss() -> None:
    masked = _datum(
        [3, 4, 5], [-1.0] * 3, [1.0, 1.0, 1.0], mask=np.array([0, 1, 1], dtype=np.int64)
    )
    leaves = _leaves([np.array([-0.5, -0.7, -1.2])])
    loss, metrics = as_custom_loss("importance_sampling", [masked])([masked], leaves)
    loss.backward()
    assert metrics["importance_sampling/train_tokens"] == 2.0
    assert leaves[0].grad is not None and leaves[0].grad[0].item() == 0.0
    assert loss.item() == pytest.approx(-(math.exp(0.3) + math.exp(-0.2)))


# --- errors -----------------------------------------------------------------------------


def test_bad_loss_name_config_or_reduction_fails_at_construction() -> None:
    datums = [_datum([3, 4], [-1.0, -1.0], [1.0, 1.0])]
    with pytest.raises(ValueError, match="unknown loss 'grpo'"):
        as_custom_loss("grpo", datums)
    with pytest.raises(ValueError, match="unknown config key 'clip' for loss 'cispo'"):
        as_custom_loss("cispo", datums, clip=0.2)
    with pytest.raises(ValueError, match=r"clip_low_threshold \(5\.0\) must not exceed"):
        as_custom_loss("cispo", datums, clip_low_threshold=5.0)
    with pytest.raises(ValueError, match="unknown reduction 'mean'"):
        as_custom_loss("cispo", datums, reduction="mean")
    with pytest.raises(ValueError, match="needs norm_length"):
        as_custom_loss("cispo", datums, reduction="seq_mean_token_sum_norm")
    with pytest.raises(ValueError, match="datums is empty"):
        as_custom_loss("cispo", [])


@pytest.mark.parametrize(
    ("bad_datum", "message"),
    [
        (
            _datum([3, 4, 5], [-1.0, -1.0], [1.0, 1.0, 1.0]),
            "logprobs has 2 entries but target_tokens has 3 \\(datum 1\\)",
        ),
        (
            _datum([3, 4, 5], [-1.0] * 3, [1.0] * 4),
            "advantages has 4 entries but target_tokens has 3 \\(datum 1\\)",
        ),
        (
            _datum([3, 4], [-1.0, math.nan], [1.0, 1.0]),
            "logprobs holds nan at position 1 \\(datum 1\\); "
            "every entry at a trained position must be finite",
        ),
        (
            _datum([3, 4], [-1.0, -1.0], [math.inf, 1.0]),
            "advantages holds inf at position 0 \\(datum 1\\)",
        ),
        (
            _datum([3, 4], [-1.0, -1.0], [1.0, 1.0], mask=np.array([1, 1, 1], dtype=np.int64)),
            "mask has 3 entries but target_tokens has 2 \\(datum 1\\)",
        ),
        (
            _datum([3, 4], [-1.0, -1.0], [1.0, 1.0], mask=np.array([1, 0.5], dtype=np.float32)),
            "mask holds 0.5 at position 1 \\(datum 1\\), but a mask holds only 0 and 1",
        ),
        (
            _datum([3, 4], [-1.0, -1.0], [1.0, 1.0], mask=np.array([2, 1], dtype=np.int64)),
            "mask holds 2.0 at position 0 \\(datum 1\\), but a mask holds only 0 and 1",
        ),
        (
            pytrio.Datum(
                model_input=pytrio.ModelInput.from_ints([1, 2]),
                loss_fn_inputs={"target_tokens": np.array([3, 4], dtype=np.int64)},
            ),
            "loss_fn_inputs has no 'advantages' \\(datum 1\\) \\(it holds target_tokens\\)",
        ),
    ],
)
def test_bad_datums_are_rejected_naming_the_datum_index(
    bad_datum: pytrio.Datum, message: str
) -> None:
    good = _datum([3, 4], [-1.0, -1.0], [1.0, 1.0])
    with pytest.raises(ValueError, match=message):
        as_custom_loss("cispo", [good, bad_datum, good])


def test_calls_with_other_datums_or_logprobs_are_rejected_naming_the_datum_index() -> None:
    datums = [_datum([3, 4], [-1.0, -1.0], [1.0, 1.0]), _datum([5, 6, 7], [-1.0] * 3, [1.0] * 3)]
    loss_fn = as_custom_loss("cispo", datums)
    with pytest.raises(
        ValueError, match="got 2 datums and 1 logprob tensors but this loss was built for 2"
    ):
        loss_fn(datums, _leaves([np.zeros(2)]))
    with pytest.raises(
        ValueError, match="logprobs has 2 entries but target_tokens has 3 \\(datum 1\\)"
    ):
        loss_fn(datums, _leaves([np.zeros(2), np.zeros(2)]))
    swapped = [datums[1], datums[0]]
    with pytest.raises(
        ValueError, match="target_tokens has 3 entries but the loss was built for 2 \\(datum 0\\)"
    ):
        loss_fn(swapped, _leaves([np.zeros(2), np.zeros(3)]))
