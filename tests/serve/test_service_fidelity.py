"""The service's loss normalization and what a sampler may load, locally and through
`grpo serve` (docs/FORMULAS.md, "Service normalization")."""

from __future__ import annotations

import numpy as np
import pytest
import pytrio
import torch
from hypothesis import given
from hypothesis import strategies as st
from pytrio import AdamParams, Datum, ModelInput
from pytrio.client.training_batch import plan_training_batch
from pytrio.errors.base import PyTrioError
from pytrio.model.limits import TrainingLimits

from grpo.backends.datums import forward_only, output_logprobs, scale_weights
from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.core.loss_spec import LossSpec
from grpo.core.normalization import DEFAULT_SERVICE_NORMALIZATION, NORMALIZATIONS, BatchTotals
from grpo.serve.client import configured_pytrio
from grpo.serve.server import serve_in_thread
from grpo.tools.evaluate import sampling_client
from grpo.training.run.learner import loss_submission
from grpo.training.settings.config import ConfigError, TrainConfig

MODEL = TINY_MODEL_NAME
KEY = "fidelity-key"


def policy_datums(count: int, prompt: int = 9) -> list[Datum]:
    """`count` datums as the article builds them: prompt positions target 0, advantage 0."""
    datums = []
    for index in range(count):
        completion = [40 + index + step for step in range(3 + index)]
        observed = prompt - 1
        datums.append(
            Datum(
                model_input=ModelInput.from_ints(list(range(10, 10 + prompt)) + completion[:-1]),
                loss_fn_inputs={
                    "target_tokens": np.asarray([0] * observed + completion, dtype=np.int64),
                    "logprobs": np.asarray(
                        [0.0] * observed + [-2.0] * len(completion), dtype=np.float32
                    ),
                    "advantages": np.asarray(
                        [0.0] * observed + [(-1.0) ** index] * len(completion), dtype=np.float32
                    ),
                },
            )
        )
    return datums


def pytrio_totals(datums: list[Datum]) -> BatchTotals:
    """pytrio 0.2.9's own planner's totals of `datums` (importance_sampling)."""
    plan = plan_training_batch(
        datums,
        loss_fn="importance_sampling",
        auto_shift=False,
        limits=TrainingLimits(max_batch_size=None, max_tokens_per_request=None, max_seq_len=None),
        tokenizer_vocab_size=10_000,
    )
    totals = plan.totals
    return BatchTotals(
        totals.total_samples, totals.total_active_tokens, totals.total_advantage_tokens
    )


@given(
    samples=st.integers(1, 50),
    active=st.integers(0, 5000),
    advantage=st.integers(0, 5000),
    normalization=st.sampled_from(NORMALIZATIONS),
)
def test_gradient_scale_is_one_over_the_chosen_total(samples, active, advantage, normalization):
    totals = BatchTotals(samples, active, advantage)
    total = {"sum": 1, "active_tokens": active, "advantage_tokens": advantage, "samples": samples}
    expected = 1.0 / total[normalization] if total[normalization] else 1.0
    assert totals.gradient_scale(normalization) == expected


def test_an_unknown_normalization_is_refused_naming_the_choices(tmp_path):
    with pytest.raises(ValueError, match="active_tokens"):
        LocalServiceClient(root=tmp_path, service_normalization="mean")
    with pytest.raises(ConfigError, match="--service-normalization 'mean' is not one of sum"):
        TrainConfig(backend="pytrio", service_normalization="mean")
    # on a service the flag says what it divides by (the loop pre-scales for it)
    assert TrainConfig(backend="pytrio", service_normalization="active_tokens")


def _grad_norm(client, datums: list[Datum]) -> tuple[dict, float]:
    metrics = client.forward_backward(datums, "importance_sampling").result().metrics
    step = client.optim_step(AdamParams(learning_rate=0.0)).result().metrics
    return dict(metrics), step["grad_norm"]


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_local_metrics_follow_pytrio_and_the_gradient_its_normalization(tmp_path, normalization):
    datums = policy_datums(3)
    totals = pytrio_totals(datums)
    assert totals.active_tokens > totals.advantage_tokens  # prompt targets 0 are active
    with LocalServiceClient(root=tmp_path / "a", seed=0, service_normalization="sum") as plain:
        base_metrics, base_norm = _grad_norm(
            plain.create_lora_training_client(MODEL, rank=4, seed=0), datums
        )
    with LocalServiceClient(root=tmp_path / "b", seed=0, service_normalization=normalization) as s:
        metrics, norm = _grad_norm(s.create_lora_training_client(MODEL, rank=4, seed=0), datums)
    assert metrics["token_count"] == totals.active_tokens
    assert metrics["loss_mean"] == pytest.approx(metrics["loss_sum"] / totals.active_tokens)
    assert metrics["loss_sum"] == base_metrics["loss_sum"]  # the report is the sum's
    assert norm == pytest.approx(base_norm * totals.gradient_scale(normalization), rel=1e-5)


@pytest.mark.slow
@pytest.mark.parametrize("normalization", ["sum", "active_tokens", "advantage_tokens"])
def test_a_batch_pytrio_splits_trains_like_the_unsplit_one(tmp_path, normalization):
    """grpo serve advertises max_batch_size 2: pytrio sends 5 datums as 3 micro-batches,
    each with the logical batch's totals; metrics and gradient equal the unsplit call's."""
    datums = policy_datums(5)
    with LocalServiceClient(
        root=tmp_path / "local", seed=0, service_normalization=normalization
    ) as s:
        local_metrics, local_norm = _grad_norm(
            s.create_lora_training_client(MODEL, rank=4, seed=0), datums
        )
    home = tmp_path / "home"
    home.mkdir()
    with (
        serve_in_thread(
            root=tmp_path / "served",
            api_key=KEY,
            service_normalization=normalization,
            max_batch_size=2,
        ) as handle,
        configured_pytrio(handle.url, api_key=KEY, home=home),
    ):
        trainer = pytrio.ServiceClient().create_lora_training_client(MODEL, rank=4, seed=0)
        metrics, norm = _grad_norm(trainer, datums)
        events = [kind for _, kind in handle.state.events.log]
    assert events.count("trainer.forward_backward") == 3
    assert (
        metrics["token_count"]
        == local_metrics["token_count"]
        == pytrio_totals(datums).active_tokens
    )
    assert metrics["loss_sum"] == pytest.approx(local_metrics["loss_sum"], rel=1e-5)
    assert norm == pytest.approx(local_norm, rel=1e-5)


LINEAR_ADAM = AdamParams(learning_rate=1.0, beta1=0.0, beta2=0.0, eps=1e3, grad_clip_norm=0.0)
"""A memoryless step θ ← θ − g/(|g| + 10³) ≈ θ − 10⁻³·g: its effect is linear in the gradient."""


def _step_response(trainer, calls, probe: list[Datum]) -> tuple[float, np.ndarray]:
    """Run `calls` (forward_backward futures) then one linear step: its grad_norm and the
    change of `probe`'s log-probs, a vector that follows the gradient's direction and size."""
    before = output_logprobs(trainer.forward(probe, "cross_entropy").result().loss_fn_outputs)
    for call in calls:
        call().result()
    norm = trainer.optim_step(LINEAR_ADAM).result().metrics["grad_norm"]
    after = output_logprobs(trainer.forward(probe, "cross_entropy").result().loss_fn_outputs)
    return norm, after - before


def test_the_series_micro_batch_rescaling_gives_the_unsplit_gradient_through_grpo_serve(tmp_path):
    """The series' chapters (05-retool, 03-search-r1) send each micro-batch k of a batch of N
    samples as its own forward_backward, advantages pre-scaled by n_k / N, then one
    optim_step. Under grpo serve's default (samples, per request) that accumulates the
    unsplit batch's gradient; unscaled, it would not."""
    datums = policy_datums(5)
    probe = forward_only(policy_datums(2, prompt=4))
    parts = (datums[:2], datums[2:])
    home = tmp_path / "home"
    home.mkdir()
    with (
        serve_in_thread(root=tmp_path / "served", api_key=KEY) as handle,
        configured_pytrio(handle.url, api_key=KEY, home=home),
    ):
        service = pytrio.ServiceClient()

        def response(batches):
            trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
            calls = [
                lambda batch=batch: trainer.forward_backward(batch, "importance_sampling")
                for batch in batches
            ]
            return _step_response(trainer, calls, probe)

        whole = response([datums])
        rescaled = response(
            [scale_weights(part, len(part) / len(datums), "advantages") for part in parts]
        )
        unscaled = response(list(parts))
    assert DEFAULT_SERVICE_NORMALIZATION == "samples"  # what serve_in_thread ran with
    assert whole[0] > 0 and np.abs(whole[1]).max() > 1e-3
    assert rescaled[0] == pytest.approx(whole[0], rel=1e-5)
    # Each entry is the difference of two float32 log-probs of a few nats (ulp ~5e-7 to 1e-6),
    # so it carries a few 1e-6 of rounding whatever the gradient (another accumulation order
    # of the micro-batches moved one by 1.9e-6); a wrong scaling moves them by 2x.
    resolution = max(1e-3 * np.abs(whole[1]).max(), 4e-6)
    np.testing.assert_allclose(rescaled[1], whole[1], rtol=1e-3, atol=resolution)
    assert unscaled[0] > 1.5 * whole[0]  # each part divided by its own n_k: too large a step


def _trainer_gradients(client) -> list[torch.Tensor]:
    """The gradient a local training client has accumulated, parameter by parameter."""
    return [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in client._parameters]


SUBMISSIONS = [  # (loss spec, through forward_backward_custom): every path the learner takes
    (LossSpec.build("importance_sampling"), False),
    (LossSpec.build("ppo", {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}), False),
    (LossSpec.build("dro", {"beta": 0.5}), False),
    (LossSpec.build("cispo", reduction="token_mean"), False),  # the local backend reduces
    (LossSpec.build("ppo", reduction="seq_mean_token_mean"), True),  # as on --backend pytrio
    (LossSpec.build("gspo"), True),
]


@pytest.mark.parametrize(("spec", "custom"), SUBMISSIONS, ids=lambda v: getattr(v, "name", v))
def test_the_learners_calls_apply_the_losss_gradient_under_every_normalization(
    tmp_path, spec, custom
):
    """`loss_submission` pre-scales for the service's divisor: the gradient a service
    applies under each convention is the one it applies under `sum` (the loss's own)."""
    datums = policy_datums(4)
    applied = {}
    for normalization in NORMALIZATIONS:
        with LocalServiceClient(
            root=tmp_path / normalization, seed=0, service_normalization=normalization
        ) as service:
            client = service.create_lora_training_client(MODEL, rank=4, seed=0)
            client.forward_backward(datums, "importance_sampling").result()
            client.optim_step(AdamParams(learning_rate=1e-2)).result()  # ratios away from 1
            submit = loss_submission(
                client, spec, datums, custom=custom, normalization=normalization
            )
            submit().result()
            applied[normalization] = _trainer_gradients(client)
    assert any(float(g.abs().sum()) > 0 for g in applied["sum"])
    for normalization in NORMALIZATIONS:
        for got, expected in zip(applied[normalization], applied["sum"], strict=True):
            # float32 sums in another order: to 1e-4 of the tensor's largest entry
            scale = float(expected.abs().max())
            torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4 * scale)


def test_a_sampler_refuses_a_training_state_and_eval_still_loads_it(tmp_path):
    with LocalServiceClient(root=tmp_path, seed=0) as service:
        trainer = service.create_lora_training_client(MODEL, rank=4, seed=0)
        state = trainer.save_state("s").result().path
        weights = trainer.save_weights_for_sampler("w").result().path
        for create in (
            lambda: service.create_sampling_client(MODEL, model_path=state),
            lambda: trainer.create_sampling_client(state),
        ):
            with pytest.raises(PyTrioError, match="training state .*save_weights_for_sampler"):
                create()
        service.create_sampling_client(MODEL, model_path=weights)  # sampler weights: fine
        # grpo eval --checkpoint STATE: a sampler first, then the state's weights
        assert sampling_client(service, MODEL, state).get_tokenizer() is not None


@pytest.mark.slow
def test_grpo_serve_refuses_a_state_path_for_a_sampler_at_once(tmp_path):
    home = tmp_path / "home"
    home.mkdir()
    with (
        serve_in_thread(root=tmp_path / "served", api_key=KEY) as handle,
        configured_pytrio(handle.url, api_key=KEY, home=home),
    ):
        trainer = pytrio.ServiceClient().create_lora_training_client(MODEL, rank=4, seed=0)
        state = trainer.save_state("s").result().path
        with pytest.raises(PyTrioError, match="training state"):
            trainer.create_sampling_client(state)
        trainer.create_sampling_client(trainer.save_weights_for_sampler("w").result().path)
