"""LossSpec: validation, PyTRIO's loss_fn_config round trip, and the call it makes."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from grpo.core.loss_spec import LossSpec
from grpo.core.losses import LOSSES
from grpo.core.reductions import REDUCTIONS
from tests.strategies import PackedLossBatch, packed_loss_batches


def _spec_strategy() -> st.SearchStrategy[LossSpec]:
    def build(name: str, reduction: str, norm_length: float) -> LossSpec:
        length = norm_length if reduction == "seq_mean_token_sum_norm" else None
        return LossSpec.build(name, reduction=reduction, norm_length=length)

    return st.builds(
        build,
        st.sampled_from(sorted(LOSSES)),
        st.sampled_from(REDUCTIONS),
        st.floats(1.0, 4096.0),
    )


@given(_spec_strategy())
def test_loss_fn_config_round_trips_every_spec(spec: LossSpec) -> None:
    assert LossSpec.from_loss_fn_config(spec.name, spec.to_loss_fn_config()) == spec


def test_sum_reduction_sends_only_the_kernel_keys_without_none() -> None:
    spec = LossSpec.build("ppo", {"clip_high_threshold": 1.28})
    assert spec.to_loss_fn_config() == {"clip_low_threshold": 0.8, "clip_high_threshold": 1.28}


def test_non_sum_reduction_travels_in_loss_fn_config() -> None:
    spec = LossSpec.build("cispo", reduction="seq_mean_token_sum_norm", norm_length=24)
    assert spec.to_loss_fn_config() == {
        "clip_low_threshold": 0.0,
        "clip_high_threshold": 4.0,
        "reduction": "seq_mean_token_sum_norm",
        "norm_length": 24.0,
    }


def test_service_builtin_follows_the_registry_and_the_reduction() -> None:
    assert LossSpec.build("ppo").service_builtin
    assert not LossSpec.build("gspo").service_builtin
    assert not LossSpec.build("ppo", reduction="token_mean").service_builtin
    assert {name for name, kernel in LOSSES.items() if not kernel.service_builtin} == {"gspo"}


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        (("nope",), {}, "unknown loss 'nope'"),
        (("ppo", {"beta": 1.0}), {}, "unknown config key 'beta'"),
        (("ppo",), {"reduction": "mean"}, "unknown reduction 'mean'"),
        (("ppo",), {"reduction": "seq_mean_token_sum_norm"}, "needs norm_length"),
        (("ppo",), {"norm_length": 3.0}, "only used by reduction"),
    ],
)
def test_build_rejects_what_the_kernel_rejects(args: tuple, kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LossSpec.build(*args, **kwargs)


def test_config_is_read_only() -> None:
    spec = LossSpec.build("ppo")
    with pytest.raises(TypeError):
        spec.config["clip_low_threshold"] = 0.0  # type: ignore[index]


def test_call_runs_the_kernel_with_the_spec_config_and_reduction() -> None:
    spec = LossSpec.build("ppo", {"clip_high_threshold": 1.1}, reduction="token_mean")
    logprobs = torch.tensor([-1.0, -0.5, -2.0])
    sampling = torch.tensor([-1.2, -0.5, -1.0])
    advantages = torch.tensor([1.0, -1.0, 0.5])
    loss, metrics = spec(logprobs, sampling, advantages, seq_lens=[3])
    expected, expected_metrics = LOSSES["ppo"](
        logprobs,
        sampling,
        advantages,
        seq_lens=[3],
        reduction="token_mean",
        clip_low_threshold=0.8,
        clip_high_threshold=1.1,
    )
    assert torch.equal(loss, expected)
    assert metrics == expected_metrics


@given(_spec_strategy(), packed_loss_batches(), st.floats(1 / 64, 4096.0))
def test_the_scaled_spec_on_scaled_weights_is_the_loss_times_the_scale(
    spec: LossSpec, batch: PackedLossBatch, factor: float
) -> None:
    """What lets a loop pre-scale a service's datums by its divisor D (docs/FORMULAS.md,
    "Service normalization"): loss and gradient of spec.scaled(c) on c·w are c times spec's
    on w, for every kernel and reduction (DRO's β scales with the weights)."""
    results = []
    for used, weights_scale in ((spec, 1.0), (spec.scaled(factor), factor)):
        logprobs, sampling, advantages, mask = batch.tensors()
        loss, _ = used(
            logprobs, sampling, advantages * weights_scale, mask=mask, seq_lens=batch.seq_lens
        )
        (gradient,) = torch.autograd.grad(loss, logprobs)
        results.append((loss.detach(), gradient))
    (loss, gradient), (scaled_loss, scaled_gradient) = results
    largest = float(gradient.abs().max()) if gradient.numel() else 0.0
    bound = 1e-9 * factor * (1.0 + largest)
    torch.testing.assert_close(
        scaled_loss, loss * factor, rtol=1e-9, atol=bound * max(gradient.numel(), 1)
    )
    torch.testing.assert_close(scaled_gradient, gradient * factor, rtol=1e-9, atol=bound)


def test_scaled_multiplies_only_the_weight_scaled_keys() -> None:
    assert LossSpec.build("dro", {"beta": 0.1}).scaled(4.0).config["beta"] == pytest.approx(0.4)
    ppo = LossSpec.build("ppo", {"dual_clip": 3.0})
    assert ppo.scaled(8.0) == ppo
    assert {name for name, kernel in LOSSES.items() if kernel.weight_scaled_keys} == {"dro"}
    for bad in (0.0, -1.0, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="weight scale"):
            ppo.scaled(bad)
