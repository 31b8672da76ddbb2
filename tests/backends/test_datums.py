"""Datum building: the fast path equals a fully validated construction."""

from __future__ import annotations

import numpy as np
from hypothesis import given
from hypothesis import strategies as st
from pytrio.types import Datum, ModelInput

from grpo.backends.datums import (
    IGNORE_INDEX,
    batch_to_datums,
    datum_totals,
    forward_only,
    output_logprobs,
    scale_weights,
)
from grpo.core.alignment import align, pack
from grpo.core.normalization import BatchTotals


@st.composite
def token_batches(draw: st.DrawFn):
    """A packed batch of 1-4 aligned completions with random tokens, logprobs and advantages."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    sequences = []
    for _ in range(draw(st.integers(1, 4))):
        prompt = rng.integers(0, 97, size=int(rng.integers(1, 6)))
        completion = rng.integers(0, 97, size=int(rng.integers(1, 6)))
        logprobs = -rng.exponential(size=len(completion))
        sequences.append(align(prompt, completion, logprobs, float(rng.normal())))
    return pack(sequences)


@given(token_batches())
def test_fast_datums_equal_validated_datums(batch) -> None:
    fast = batch_to_datums(batch)
    assert len(fast) == len(batch.seq_lens)
    for datum, sequence in zip(fast, batch.sequences(), strict=True):
        validated = Datum(
            model_input=ModelInput.from_ints(sequence.input_tokens.tolist()),
            loss_fn_inputs={
                "target_tokens": np.where(
                    sequence.mask != 0, sequence.target_tokens, IGNORE_INDEX
                ).astype(np.int64),
                "logprobs": sequence.sampling_logprobs.astype(np.float32),
                "advantages": sequence.advantages.astype(np.float32),
            },
        )
        assert datum.model_dump() == validated.model_dump()
        assert Datum.model_validate(datum.model_dump()) == validated


@given(token_batches())
def test_forward_only_keeps_inputs_and_targets(batch) -> None:
    datums = batch_to_datums(batch)
    stripped = forward_only(datums)
    for full, only in zip(datums, stripped, strict=True):
        assert list(only.loss_fn_inputs) == ["target_tokens"]
        assert only.model_input.to_ints() == full.model_input.to_ints()


def test_output_logprobs_concatenates_and_names_missing_datums() -> None:
    from pytrio.types import TensorData

    outputs = [
        {"logprobs": TensorData.from_numpy(np.array([-1.0, -2.0]))},
        {"logprobs": TensorData.from_numpy(np.array([-3.0]))},
    ]
    assert output_logprobs(outputs).tolist() == [-1.0, -2.0, -3.0]
    try:
        output_logprobs([{}, outputs[0]])
    except ValueError as error:
        assert "[0]" in str(error)
    else:
        raise AssertionError("missing logprobs must be an error")


@given(token_batches())
def test_pytrios_planner_counts_exactly_the_masked_in_tokens_as_active(batch) -> None:
    """pytrio 0.2.9's own batch planner (what the service normalizes by) on the loop's datums:
    its active tokens are the mask's tokens, not every position (prompt targets excluded)."""
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits

    datums = batch_to_datums(batch)
    limits = TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None)
    for loss_fn in ("importance_sampling", "cross_entropy"):
        data = datums if loss_fn != "cross_entropy" else forward_only(datums)
        totals = plan_training_batch(
            data, loss_fn=loss_fn, auto_shift=False, limits=limits, tokenizer_vocab_size=97
        ).totals
        assert totals.total_active_tokens == int(np.count_nonzero(batch.mask))
        assert totals.total_samples == len(batch.seq_lens)


@st.composite
def planner_datums(draw: st.DrawFn) -> list[Datum]:
    """1-4 datums with ignored targets, zero advantages and zero or absent weights mixed in."""
    rng = np.random.default_rng(draw(st.integers(0, 2**32 - 1)))
    datums = []
    for _ in range(draw(st.integers(1, 4))):
        length = int(rng.integers(1, 9))
        targets = np.where(rng.random(length) < 0.3, IGNORE_INDEX, rng.integers(0, 97, length))
        inputs = {
            "target_tokens": targets.astype(np.int64),
            "logprobs": -rng.exponential(size=length).astype(np.float32),
            "advantages": np.where(rng.random(length) < 0.4, 0.0, rng.normal(size=length)),
        }
        if rng.random() < 0.7:
            inputs["weights"] = np.where(rng.random(length) < 0.4, 0.0, rng.random(length))
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(rng.integers(0, 97, length).tolist()),
                loss_fn_inputs={
                    key: value.astype(np.float32) if key != "target_tokens" else value
                    for key, value in inputs.items()
                },
            )
        )
    return datums


@given(planner_datums(), st.booleans())
def test_datum_totals_are_pytrios_planners(datums, auto_shift) -> None:
    from pytrio.client.training_batch import plan_training_batch
    from pytrio.model.limits import TrainingLimits

    limits = TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None)
    for loss_fn in ("importance_sampling", "cross_entropy"):
        planned = plan_training_batch(
            datums, loss_fn=loss_fn, auto_shift=auto_shift, limits=limits, tokenizer_vocab_size=97
        ).totals
        expected = BatchTotals(
            planned.total_samples, planned.total_active_tokens, planned.total_advantage_tokens
        )
        assert datum_totals(datums, loss_fn=loss_fn, auto_shift=auto_shift) == expected


@given(planner_datums(), st.sampled_from([0.5, 3.0, 20.0]))
def test_scale_weights_multiplies_only_the_named_weights(datums, factor) -> None:
    for weight_input in ("advantages", "weights"):
        scaled = scale_weights(datums, factor, weight_input)
        for before, after in zip(datums, scaled, strict=True):
            assert after.model_input == before.model_input
            for key, tensor in after.loss_fn_inputs.items():
                if key != weight_input:
                    assert tensor is before.loss_fn_inputs[key]
            original = (
                np.asarray(before.loss_fn_inputs[weight_input].data, dtype=np.float64)
                if weight_input in before.loss_fn_inputs
                else np.ones(len(before.loss_fn_inputs["target_tokens"].data))
            )
            expected = (original * factor).astype(np.float32)
            np.testing.assert_array_equal(
                np.asarray(after.loss_fn_inputs[weight_input].data, np.float32), expected
            )
            assert Datum.model_validate(after.model_dump()) == after
    assert scale_weights(datums, 1.0, "advantages") == datums
