"""`grpo train --backend tinker`: grpo's loop through the official `tinker` SDK against a
`grpo serve` started here equals `--backend local`, resumes exactly, and refuses a missing SDK
or setting before any work."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("tinker")

from grpo.backends.datums import IGNORE_INDEX  # noqa: E402
from grpo.backends.names import TINY_MODEL_NAME  # noqa: E402
from grpo.backends.pytrio import BackendUnavailableError  # noqa: E402
from grpo.backends.tinker_sdk import make_tinker_service_client  # noqa: E402
from grpo.core.loss_spec import LossSpec  # noqa: E402
from grpo.core.normalization import service_divisor  # noqa: E402
from grpo.serve.server import ServeHandle, serve_in_thread  # noqa: E402
from grpo.training.recipes.grpo.run import train  # noqa: E402
from grpo.training.run.learner import loss_submission  # noqa: E402
from grpo.training.run.run_files import read_checkpoint, read_metrics  # noqa: E402
from grpo.training.settings.config import TrainConfig  # noqa: E402
from tests.invariance import assert_same_rows  # noqa: E402
from tests.runs import TINY, embedded_service  # noqa: E402
from tests.serve.conftest import SERVE_API_KEY  # noqa: E402

TINKER_KEY = f"tml-{SERVE_API_KEY}"


@pytest.fixture
def tinker_served(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[ServeHandle]:
    """A `grpo serve` on a free loopback port that the SDK reaches through its env vars (its
    telemetry off)."""
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY) as handle:
        monkeypatch.setenv("TINKER_BASE_URL", handle.url)
        monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)
        # the SDK's telemetry is tested in test_tinker_sdk; here its batches, flushed by
        # clients that outlive their test's server, would only print tracebacks at exit
        monkeypatch.setenv("TINKER_TELEMETRY", "0")
        yield handle


def rows_of(tmp_path: Path, name: str, resume: bool = False, **overrides: Any) -> list[dict]:
    """The metrics rows (timings dropped) of a quiet run of the loop in tmp_path / name."""
    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / name), **overrides})
    train(config, resume=resume, echo=lambda _line: None, progress=False)
    rows = read_metrics(tmp_path / name)
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


FORWARD_USAGE = ("usage/forward_tokens", "usage/cum_forward_tokens", "usage/cum_tokens")


def without_forward_usage(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Rows without the forward-only token counts (they differ where the calls differ)."""
    return [{k: v for k, v in row.items() if k not in FORWARD_USAGE} for row in rows]


def policy_datums() -> list[Any]:
    """Three pytrio datums shaped as the loop sends them: a prompt whose targets are
    IGNORE_INDEX, then completion tokens with sampling log-probs and unequal advantages."""
    from pytrio.types import Datum, ModelInput, TensorData

    data = []
    for index, advantage in enumerate((1.0, -0.5, 0.25)):
        tokens = [5, 17, 42, 9 + index, 77, 12, 31 + index, 8, 20 + index]
        prompt = 4
        n = len(tokens) - 1
        targets = [IGNORE_INDEX] * (prompt - 1) + tokens[prompt:]
        logprobs = [0.0] * (prompt - 1) + [-2.0 - 0.1 * i for i in range(n - prompt + 1)]
        advantages = [0.0] * (prompt - 1) + [advantage] * (n - prompt + 1)
        data.append(
            Datum(
                model_input=ModelInput.from_ints(tokens[:-1]),
                loss_fn_inputs={
                    "target_tokens": TensorData(data=targets, dtype="int64", shape=[n]),
                    "logprobs": TensorData(data=logprobs, dtype="float32", shape=[n]),
                    "advantages": TensorData(data=advantages, dtype="float32", shape=[n]),
                },
            )
        )
    return data


@pytest.mark.parametrize(
    ("loss_fn", "reduction", "custom"),
    [("ppo", "sum", False), ("importance_sampling", "token_mean", True), ("dro", "sum", True)],
)
def test_the_gradient_applied_through_tinker_is_the_losss_own(
    tinker_served: ServeHandle, tmp_path: Path, loss_fn: str, reduction: str, custom: bool
) -> None:
    """The learner's call through the adaptor (pre-scaled for Tinker's sum, prompt targets
    turned into real tokens with weight 0) applies the gradient the in-process local backend
    applies for the same loss: Adam hides a gradient's scale, the norm does not. A non-sum
    reduction, and dro (not 0 where the advantage is; Tinker has no mask), run as custom
    losses on Tinker."""
    config = TrainConfig(backend="tinker", loss_fn=loss_fn, reduction=reduction)
    assert config.runs_custom_loss is custom
    spec = LossSpec.build(loss_fn, reduction=reduction)
    normalization = service_divisor("tinker", None, None).convention
    norms = []
    for service, convention in (
        (make_tinker_service_client(), normalization),
        (embedded_service(tmp_path / "local"), "sum"),
    ):
        trainer = service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=3)
        submit = loss_submission(
            trainer, spec, policy_datums(), custom=custom, normalization=convention
        )
        submit().result()
        from pytrio.types import AdamParams

        norms.append(trainer.optim_step(AdamParams(learning_rate=1e-3)).result().metrics)
        service.close()
    remote, local = (metrics["grad_norm"] for metrics in norms)
    assert local > 0 and remote == pytest.approx(local, rel=1e-4)


@pytest.mark.parametrize(
    "options",
    [dict(loss_fn="ppo"), dict(loss_fn="importance_sampling", reduction="token_mean")],
    ids=["ppo-builtin", "token-mean-custom"],
)
def test_the_loop_through_the_tinker_sdk_equals_the_local_backend(
    tinker_served: ServeHandle, tmp_path: Path, options: dict[str, Any]
) -> None:
    remote = rows_of(tmp_path, "tinker", backend="tinker", **options)
    local = rows_of(tmp_path, "local", backend="local", **options)
    assert [row["step"] for row in remote] == [row["step"] for row in local] == [1, 2]
    # Same seed: the same completions and rewards, exactly.
    for key in ("reward", "tokens", "usage/completion_tokens", "usage/trained_tokens"):
        assert [row[key] for row in remote] == [row[key] for row in local], key
    # Losses and every other float to tests/invariance.py's METRIC_RTOL/ATOL (1e-4): the
    # server runs the same local-backend code on the same datums.
    assert_same_rows(without_forward_usage(remote), without_forward_usage(local))
    record = (tmp_path / "tinker" / "config.json").read_text()
    assert TINKER_KEY not in record and SERVE_API_KEY not in record
    checkpoint = read_checkpoint(tmp_path / "tinker")
    assert checkpoint is not None and checkpoint.state_path.startswith("tinker://")


def final_logprobs(run_dir: Path) -> np.ndarray:
    """The log-probs that a run's last checkpoint (a ``tinker://`` path) gives `policy_datums`."""
    checkpoint = read_checkpoint(run_dir)
    assert checkpoint is not None and checkpoint.state_path.startswith("tinker://")
    service = make_tinker_service_client()
    trainer = service.create_training_client_from_state(checkpoint.state_path)
    output = trainer.forward(policy_datums(), "importance_sampling").result()
    service.close()
    return np.concatenate([np.asarray(o["logprobs"].data) for o in output.loss_fn_outputs])


def test_a_stopped_tinker_run_resumes_like_an_uninterrupted_one(
    tinker_served: ServeHandle, tmp_path: Path
) -> None:
    whole = rows_of(tmp_path, "whole", backend="tinker", steps=4)
    rows_of(tmp_path, "resumed", backend="tinker", steps=2)
    resumed = rows_of(tmp_path, "resumed", resume=True, backend="tinker", steps=4)
    # The 2-step run's final checkpoint check is one forward the whole run did not do.
    assert_same_rows(without_forward_usage(resumed), without_forward_usage(whole))
    # The final weights too (Adam's moments restored: a fresh optimizer moves them ~1e-3).
    np.testing.assert_allclose(
        final_logprobs(tmp_path / "resumed"), final_logprobs(tmp_path / "whole"), atol=1e-6
    )
    for path in (tmp_path / "resumed").rglob("*"):
        if path.is_file():
            assert TINKER_KEY not in path.read_text(errors="replace"), path


@pytest.mark.parametrize("missing", ["TINKER_BASE_URL", "TINKER_API_KEY"])
def test_a_missing_tinker_setting_is_named_before_any_work(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, missing: str
) -> None:
    monkeypatch.setenv("TINKER_BASE_URL", "http://127.0.0.1:9")
    monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)
    monkeypatch.delenv(missing)
    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / "run"), "backend": "tinker"})
    with pytest.raises(BackendUnavailableError, match=missing) as refused:
        train(config, echo=lambda _line: None, progress=False)
    assert TINKER_KEY not in str(refused.value)
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_the_cli_names_a_missing_setting_in_one_line_without_the_key(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpo.cli import main

    monkeypatch.delenv("TINKER_BASE_URL", raising=False)
    monkeypatch.setenv("TINKER_API_KEY", TINKER_KEY)
    code = main(["train", "--backend", "tinker", "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code != 0 and "TINKER_BASE_URL" in err and "Traceback" not in err
    assert TINKER_KEY not in err


def test_only_connection_failures_429_and_5xx_from_the_sdk_are_retried() -> None:
    import httpx
    import tinker

    from grpo.backends.pytrio import is_transient

    request = httpx.Request("POST", "http://127.0.0.1:9/api/v1/forward_backward")

    def status(code: int, kind: type) -> Exception:
        response = httpx.Response(code, request=request)
        return kind(f"status {code}", response=response, body=None)

    assert is_transient(tinker.APIConnectionError(request=request))
    assert is_transient(status(503, tinker.InternalServerError))
    assert is_transient(status(429, tinker.RateLimitError))
    assert not is_transient(status(400, tinker.BadRequestError))
    assert not is_transient(status(401, tinker.AuthenticationError))


def test_a_missing_sdk_names_the_extra(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import sys

    monkeypatch.setitem(sys.modules, "tinker", None)  # `import tinker` now fails
    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / "run"), "backend": "tinker"})
    with pytest.raises(BackendUnavailableError, match=r'pip install -e "\.\[tinker\]"'):
        train(config, echo=lambda _line: None, progress=False)


def test_grpo_eval_through_tinker_equals_the_local_backend(
    tinker_served: ServeHandle, tmp_path: Path
) -> None:
    """`grpo eval` of a tinker run (its `tinker://` sampler weights, the run's backend) scores
    what the same evaluation of the local run scores; a base-model eval too."""
    from grpo.tools.evaluate import evaluate_report

    reports = {}
    for backend in ("tinker", "local"):
        rows_of(tmp_path, backend, backend=backend, steps=1, learning_rate=0.05)
        quiet = dict(limit=4, temperature=1.0, echo=lambda _line: None)
        trained = evaluate_report(tmp_path / backend, **quiet)
        base = evaluate_report(backend=backend, base_model=TINY_MODEL_NAME, **quiet)
        reports[backend] = (trained, base)
    (trained, base), (local_trained, local_base) = reports["tinker"], reports["local"]
    assert trained.provenance["weights"]["path"].startswith("tinker://")
    assert trained.metrics == local_trained.metrics and base.metrics == local_base.metrics
    # The trained weights sample otherwise than the base model's: the eval read the run's.
    trained_tokens = trained.results[0].samples.tokens_PG
    assert not np.array_equal(trained_tokens, base.results[0].samples.tokens_PG)
    for report, local in ((trained, local_trained), (base, local_base)):
        samples, local_samples = report.results[0].samples, local.results[0].samples
        assert samples.answers_PG == local_samples.answers_PG
        np.testing.assert_array_equal(samples.tokens_PG, local_samples.tokens_PG)


def test_sft_dpo_and_distill_through_tinker_equal_the_local_backend(
    tinker_served: ServeHandle, tmp_path: Path
) -> None:
    """The other recipes through the same adaptor: `grpo sft`, `grpo dpo` (its loss runs as
    the SDK's client-side custom loss: one more forward per step) and `grpo distill` (the
    SFT run as teacher) give the local backend's rows."""
    from tests.runs import comparable
    from tests.training import test_dpo, test_sft
    from tests.training.test_distill import distill_config

    for name, make, run, options in (
        ("sft", test_sft._config, test_sft._quiet, dict(epochs=1)),
        ("dpo", test_dpo._config, test_dpo._quiet, dict(steps=2, eval_every=2, save_every=0)),
    ):
        remote = run(make(tmp_path, f"{name}-tinker", backend="tinker", **options))
        local = run(make(tmp_path, f"{name}-local", backend="local", **options))
        remote_rows = comparable(read_metrics(remote.run_dir))
        local_rows = comparable(read_metrics(local.run_dir))
        assert_same_rows(without_forward_usage(remote_rows), without_forward_usage(local_rows))
        assert read_checkpoint(remote.run_dir).state_path.startswith("tinker://")
    for backend in ("tinker", "local"):
        # The teacher: the SFT run on the same backend (with the base model as teacher the
        # advantages are float noise, ~1e-8, that the route's float32 log-probs round away).
        teacher = str(tmp_path / f"sft-{backend}")
        config = distill_config(
            tmp_path, f"distill-{backend}", backend=backend, teacher=teacher, steps=2
        )
        train(config, echo=lambda _line: None, progress=False)
    distilled = [
        comparable(read_metrics(tmp_path / f"distill-{backend}")) for backend in ("tinker", "local")
    ]
    assert_same_rows(*(without_forward_usage(rows) for rows in distilled))
    assert "distill/reverse_kl" in distilled[0][-1]
