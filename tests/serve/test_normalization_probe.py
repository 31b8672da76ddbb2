"""The loss-normalization probe against the local backend and a real `grpo serve`, for each
--service-normalization (grpo/backends/normalization_probe.py; docs/FORMULAS.md,
"Service normalization", the probe)."""

from __future__ import annotations

import json
import threading
import time
from concurrent.futures import Future

import numpy as np
import pytest
import pytrio
from pytrio.types import APIFuture, ModelInput, TensorData

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.backends.normalization_probe import (
    MAX_CALLS,
    ProbeError,
    batch_totals,
    probe_batches,
    probe_normalization,
)
from grpo.core.normalization import NORMALIZATIONS, BatchTotals
from grpo.core.normalization_probe import expected_scale_ratios
from grpo.serve.client import configured_pytrio
from grpo.serve.server import serve_in_thread
from grpo.training.recipes.grpo.run import dry_run, train
from grpo.training.run.run_files import PROBE_FILE, read_metrics, read_summary
from grpo.training.settings.config import TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import TINY, comparable

MODEL = TINY_MODEL_NAME
KEY = "probe-key"


def test_the_crafted_batches_tell_every_convention_apart():
    first, second = probe_batches(np.zeros(7), np.zeros(13))
    assert batch_totals(first, "importance_sampling") == BatchTotals(1, 4, 4)
    assert batch_totals(second, "importance_sampling") == BatchTotals(4, 32, 8)
    expected = expected_scale_ratios(BatchTotals(1, 4, 4), BatchTotals(4, 32, 8))
    assert expected == {
        "sum": 1.0,
        "active_tokens": 1 / 8,
        "advantage_tokens": 0.5,
        "samples": 0.25,
    }


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_the_probe_names_the_local_backends_normalization(tmp_path, normalization):
    with LocalServiceClient(root=tmp_path, seed=0, service_normalization=normalization) as service:
        result = probe_normalization(service, MODEL)
    assert result.verdict.convention == normalization, result.verdict.describe()
    assert result.changes[0] > 0 > result.changes[1]
    assert result.calls <= MAX_CALLS == 17
    record = result.to_record()
    assert record["convention"] == normalization
    assert record["first_batch"] == {"samples": 1, "active_tokens": 4, "advantage_tokens": 4}


@pytest.mark.parametrize("loss_fn", ["ppo", "cispo", "dro"])
def test_the_probe_runs_every_builtin_policy_loss(tmp_path, loss_fn):
    with LocalServiceClient(root=tmp_path, seed=0, service_normalization="samples") as service:
        result = probe_normalization(service, MODEL, loss_fn=loss_fn)
    assert result.verdict.convention == "samples", result.verdict.describe()
    assert result.loss_fn == loss_fn


@pytest.mark.parametrize("normalization", NORMALIZATIONS)
def test_the_probe_names_grpo_serves_normalization(tmp_path, normalization):
    """Through pytrio 0.2.9 and HTTP; max_batch_size 2 splits batch 2 into micro-batches,
    which must not change what the probe sees."""
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
        result = probe_normalization(pytrio.ServiceClient(), MODEL, timeout_s=60.0)
    assert result.verdict.convention == normalization, result.verdict.describe()


class _Trainer:
    """A training client whose forward_backward fails, or never answers."""

    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def forward(self, data, loss_fn):
        class Output:
            loss_fn_outputs = [
                {"logprobs": TensorData.from_numpy(np.zeros(d.model_input.length, np.float32))}
                for d in data
            ]

        return APIFuture.completed(Output())

    def forward_backward(self, data, loss_fn):
        if self.hang:
            return APIFuture(Future())
        raise RuntimeError("trainer is down")


class _Service:
    def __init__(self, hang: bool) -> None:
        self.hang = hang

    def create_lora_training_client(self, **_kwargs):
        return _Trainer(self.hang)


def test_a_failing_call_is_a_probe_error_naming_it():
    with pytest.raises(ProbeError, match="forward_backward failed: RuntimeError: trainer is down"):
        probe_normalization(_Service(hang=False), MODEL)


def test_a_call_that_never_answers_ends_at_the_deadline():
    with pytest.raises(ProbeError, match="forward_backward gave no answer within 0.5 s"):
        probe_normalization(_Service(hang=True), MODEL, timeout_s=0.5)


# --- grpo train --backend pytrio runs it once, at start ------------------------------------


def _train(tmp_path, name: str, service=None, **overrides):
    """A quiet tiny --backend pytrio run; its notes and its directory."""
    notes: list[str] = []
    config = TrainConfig(
        **{**TINY, "steps": 1, "run_dir": str(tmp_path / name), "backend": "pytrio", **overrides}
    )
    result = train(config, service_client=service, echo=notes.append, progress=False)
    return notes, result.run_dir


LINEAR_ADAM = dict(learning_rate=1.0, beta1=0.0, beta2=0.0, eps=1e3, grad_clip_norm=0.0)
"""Memoryless steps θ ← θ − g/(|g| + 10³) ≈ θ − 10⁻³·g: the weights follow the gradients."""


def test_grpo_train_applies_the_same_gradients_whatever_grpo_serve_divides_by(tmp_path):
    """grpo train --backend pytrio against grpo serve started with each
    --service-normalization: the probe names the convention, the loop pre-scales its datums
    for it, and the run's weights (two linear steps, so the weights are the summed gradients
    of two steps) end where they end under every other convention."""
    prompt = ModelInput.from_ints(list(range(10, 40)))
    changes = {}
    for normalization in NORMALIZATIONS:
        home = tmp_path / normalization / "home"
        home.mkdir(parents=True)
        with (
            serve_in_thread(
                root=tmp_path / normalization / "served",
                api_key=KEY,
                service_normalization=normalization,
            ) as handle,
            configured_pytrio(handle.url, api_key=KEY, home=home),
        ):
            notes, run_dir = _train(tmp_path / normalization, "run", steps=2, **LINEAR_ADAM)
            service = pytrio.ServiceClient()
            final = read_summary(run_dir)["sampler_path"]
            trained = service.create_sampling_client(MODEL, model_path=final)
            base = service.create_sampling_client(MODEL)
            changes[normalization] = np.asarray(
                trained.compute_logprobs(prompt).result()[1:]
            ) - np.asarray(base.compute_logprobs(prompt).result()[1:])
        record = json.loads((run_dir / PROBE_FILE).read_text())
        assert record["convention"] == normalization, record
        assert record["loss_fn"] == "importance_sampling"
        (line,) = [note for note in notes if note.startswith("[grpo] normalization probe (")]
        assert f"gradient scale is {normalization} (measured" in line
        assert KEY not in line and KEY not in json.dumps(record)
        assert any(f"divides a loss's gradient by: {normalization}" in note for note in notes)
    reference = changes["sum"]
    assert np.abs(reference).max() > 1e-3  # the run moved the weights
    for normalization in NORMALIZATIONS:
        np.testing.assert_allclose(
            changes[normalization], reference, rtol=1e-3, atol=1e-3 * np.abs(reference).max()
        )


def test_the_probe_leaves_the_run_unchanged_and_can_be_skipped(tmp_path):
    with LocalServiceClient(root=tmp_path / "a", seed=0) as service:
        _, probed = _train(tmp_path, "probed", service, loss_fn="cispo")
    with LocalServiceClient(root=tmp_path / "b", seed=0) as service:
        notes, skipped = _train(
            tmp_path, "skipped", service, loss_fn="cispo", normalization_probe=False
        )
    assert json.loads((probed / PROBE_FILE).read_text())["loss_fn"] == "cispo"
    assert not (skipped / PROBE_FILE).exists()
    assert not any("normalization probe" in note for note in notes)
    assert_same_rows(comparable(read_metrics(probed)), comparable(read_metrics(skipped)))


def test_a_failed_probe_is_noted_and_the_run_goes_on(tmp_path, monkeypatch):
    from grpo.backends import normalization_probe

    def fail(*_args, **_kwargs):
        raise ProbeError("forward_backward gave no answer within 120 s")

    monkeypatch.setattr(normalization_probe, "probe_normalization", fail)
    with LocalServiceClient(root=tmp_path / "a", seed=0) as service:
        notes, run_dir = _train(tmp_path, "run", service)
    assert any(
        note.startswith("[grpo] normalization probe failed: ProbeError: forward_backward gave")
        for note in notes
    ), notes
    assert json.loads((run_dir / PROBE_FILE).read_text())["convention"] is None
    assert len(read_metrics(run_dir)) == 1


def test_a_local_run_has_no_probe(tmp_path):
    _, run_dir = _train(tmp_path, "local", backend="local", normalization_probe=True)
    assert not (run_dir / PROBE_FILE).exists()


class _BlockingService:
    """A service whose create_lora_training_client blocks (pytrio's is synchronous)."""

    def __init__(self) -> None:
        self.release = threading.Event()

    def create_lora_training_client(self, **_kwargs):
        self.release.wait(30)
        raise RuntimeError("released")


def test_a_call_that_blocks_ends_at_the_deadline():
    service = _BlockingService()
    started = time.monotonic()
    try:
        with pytest.raises(ProbeError, match="no answer within 0.5 s"):
            probe_normalization(service, MODEL, timeout_s=0.5)
        assert time.monotonic() - started < 5
    finally:
        service.release.set()


def test_the_dry_run_plans_the_probe_of_a_pytrio_run(tmp_path):
    def plan(**overrides):
        config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / "plan"), **overrides})
        with LocalServiceClient(root=tmp_path / "service", seed=0) as service:
            return [line for line in dry_run(config, service_client=service) if "probe" in line]

    (line,) = plan(backend="pytrio")
    assert "at most 17 calls, 120 s" in line
    assert plan(backend="pytrio", normalization_probe=False) == []
    assert plan(backend="local") == []


def test_a_service_whose_steps_change_nothing_is_a_probe_error(tmp_path, monkeypatch):
    from pytrio.types import OptimStepResponse

    from grpo.backends.local import LocalTrainingClient

    monkeypatch.setattr(
        LocalTrainingClient,
        "optim_step",
        lambda self, _adam: APIFuture.completed(OptimStepResponse(metrics={})),
    )
    with LocalServiceClient(root=tmp_path, seed=0) as service:
        with pytest.raises(ProbeError, match="no step size moved the log-probs by 0.02..0.5"):
            probe_normalization(service, MODEL)
