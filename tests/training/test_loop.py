"""The training loop end to end on the local backend.

Losses, reductions, determinism, resume, faults.
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import attrs
import numpy as np
import pytest

from grpo.core import losses
from grpo.training.recipes.grpo.run import ConfigError, RunStopped, train
from grpo.training.run import run_files
from grpo.training.run.run_files import read_metrics
from grpo.training.run.seeds import pick_batch
from grpo.training.settings.config import TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import comparable, embedded_service, quiet_train, tiny_config


@pytest.mark.slow
@pytest.mark.parametrize("loss_fn", sorted(losses.LOSSES))
def test_every_loss_runs_with_every_reduction(tmp_path: Path, loss_fn: str) -> None:
    from grpo.backends.local import LocalServiceClient

    service = LocalServiceClient(
        root=tmp_path / "backend", seed=0
    )  # one model load for all reductions
    for reduction in losses.REDUCTIONS:
        config = tiny_config(
            tmp_path,
            f"{loss_fn}-{reduction}",
            loss_fn=loss_fn,
            reduction=reduction,
            steps=2,
            group_size=3,
        )
        result = quiet_train(config, service_client=service)
        rows = read_metrics(result.run_dir)
        assert [row["step"] for row in rows] == [1, 2]
        assert all(np.isfinite(row["reward"]) for row in rows)
        trained = [row for row in rows if row["datums"] > 0]
        assert trained, f"no step of {loss_fn}/{reduction} trained: every group was degenerate"
        for row in trained:
            assert np.isfinite(row["loss"]), (loss_fn, reduction, row)
            assert f"{loss_fn}/train_tokens" in row
        summary = json.loads((result.run_dir / "summary.json").read_text())
        assert summary["finished"] and summary["steps"] == 2 and summary["sampler_path"]


def test_sync_and_concurrent_rollouts_give_identical_results(tmp_path: Path) -> None:
    sync = quiet_train(tiny_config(tmp_path, "sync", concurrency=1, steps=3))
    concurrent = quiet_train(tiny_config(tmp_path, "concurrent", concurrency=8, steps=3))
    assert_same_rows(
        comparable(read_metrics(sync.run_dir)), comparable(read_metrics(concurrent.run_dir))
    )


def test_same_seed_same_run_and_other_seed_differs(tmp_path: Path) -> None:
    first = quiet_train(tiny_config(tmp_path, "a", steps=2, seed=3))
    second = quiet_train(tiny_config(tmp_path, "b", steps=2, seed=3))
    other = quiet_train(tiny_config(tmp_path, "c", steps=2, seed=4))
    rows = [comparable(read_metrics(r.run_dir)) for r in (first, second, other)]
    assert_same_rows(rows[1], rows[0])
    assert rows[0] != rows[2]


class _StopAfterOptimSteps:
    """Wraps a service so that its training client raises SIGINT after n optimizer steps."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not name.startswith("create_lora_training_client"):
            return attribute

        def create(*args: Any, **kwargs: Any) -> Any:
            return _SignalingTrainingClient(attribute(*args, **kwargs), self._n)

        return create


class _SignalingTrainingClient:
    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._remaining = inner, n

    def __getattr__(self, name: str) -> Any:
        return getattr(self._inner, name)

    def optim_step(self, *args: Any, **kwargs: Any) -> Any:
        future = self._inner.optim_step(*args, **kwargs)
        self._remaining -= 1
        if self._remaining == 0:
            os.kill(os.getpid(), signal.SIGINT)
        return future


@pytest.mark.parametrize("max_off_policy", [0, 1, 2])
def test_resume_after_interrupt_equals_an_uninterrupted_run(
    tmp_path: Path, max_off_policy: int
) -> None:

    flags: dict[str, Any] = dict(steps=4, num_substeps=2, max_steps_off_policy=max_off_policy)
    whole = quiet_train(tiny_config(tmp_path, "whole", **flags))
    config = tiny_config(tmp_path, "stopped", **flags)
    service = _StopAfterOptimSteps(
        embedded_service(tmp_path / "stopped" / "backend", seed=config.seed), n=3
    )
    with pytest.raises(RunStopped) as stopped:
        quiet_train(config, service_client=service)
    assert stopped.value.exit_code == 130
    checkpoint = json.loads((tmp_path / "stopped" / "checkpoint.json").read_text())
    # SIGINT arrived during step 2; the loop finished that step, then saved and stopped.
    assert checkpoint["step"] == 2
    assert [row["step"] for row in read_metrics(tmp_path / "stopped")] == [1, 2]
    assert not (tmp_path / "stopped" / "summary.json").exists()
    resumed = quiet_train(config, resume=True)
    # Under --max-steps-off-policy K the rollouts sampled ahead of step 2 were saved with
    # its checkpoint: the resumed run trains on them, as stale as they would have been.
    assert_same_rows(
        comparable(read_metrics(resumed.run_dir)), comparable(read_metrics(whole.run_dir))
    )
    if max_off_policy:
        assert max(row["off_policy_steps"] for row in read_metrics(whole.run_dir)) > 0


@pytest.mark.parametrize("max_off_policy", [1, 2])
def test_off_policy_pipeline_never_exceeds_k(tmp_path: Path, max_off_policy: int) -> None:
    config = tiny_config(
        tmp_path, f"k{max_off_policy}", steps=5, max_steps_off_policy=max_off_policy, group_size=6
    )
    rows = read_metrics(quiet_train(config).run_dir)
    staleness = [row["off_policy_steps"] for row in rows]
    trained = [row["datums"] > 0 for row in rows]
    # Step j's rollouts were sampled when step max(0, j - k) began, so they are as many
    # optimizer steps old as steps in [max(0, j - k), j) trained.
    expected = [
        float(sum(trained[max(0, step - max_off_policy) : step])) for step in range(len(rows))
    ]
    assert staleness == expected, (trained, staleness)
    assert max(staleness) == max_off_policy, "the run never filled the pipeline: test setup"


def test_strictly_on_policy_rollouts_are_fresh(tmp_path: Path) -> None:
    rows = read_metrics(quiet_train(tiny_config(tmp_path, steps=3)).run_dir)
    assert all(row["off_policy_steps"] == 0 for row in rows)


def test_extra_epochs_move_the_ratio_away_from_one(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path, steps=3, epochs=3, num_substeps=2, learning_rate=5e-3, group_size=6, batch_size=4
    )
    rows = read_metrics(quiet_train(config).run_dir)
    assert max(row.get("ratio/max_abs_log", 0.0) for row in rows) > 1e-3


def test_periodic_and_final_checkpoints_and_eval(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=4, save_every=2, eval_every=2, eval_limit=8)
    result = quiet_train(config)
    rows = read_metrics(result.run_dir)
    # Step 0 is the evaluation of the starting weights, before any update.
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert [("test/reward" in row) for row in rows] == [True, False, True, False, True]
    assert all(0.0 <= row["test/reward"] <= 1.0 for row in rows if "test/reward" in row)
    checkpoint = json.loads((result.run_dir / "checkpoint.json").read_text())
    assert checkpoint["step"] == 4
    config_saved = json.loads((result.run_dir / "config.json").read_text())
    assert config_saved["steps"] == 4


class _Flaky:
    """Wraps an object so that chosen methods raise ConnectionError a number of times first."""

    def __init__(self, inner: Any, failures: dict[str, int]) -> None:
        self._inner, self._failures = inner, failures

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name in self._failures:

            def flaky(*args: Any, **kwargs: Any) -> Any:
                if self._failures[name] > 0:
                    self._failures[name] -= 1
                    raise ConnectionError(f"simulated network failure in {name}")
                return attribute(*args, **kwargs)

            return flaky
        if name.startswith("create_") or name.startswith("save_weights_and_get"):

            def wrapped(*args: Any, **kwargs: Any) -> Any:
                return _Flaky(attribute(*args, **kwargs), self._failures)

            return wrapped
        return attribute


def test_transient_failures_are_retried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from grpo.backends import pytrio as backend_module

    monkeypatch.setattr(backend_module.time, "sleep", lambda _s: None)
    reference = quiet_train(tiny_config(tmp_path, "reference"))
    config = tiny_config(tmp_path, "flaky")
    flaky = _Flaky(
        embedded_service(tmp_path / "flaky" / "backend", seed=0),
        {"sample": 2, "forward_backward": 1, "optim_step": 1},
    )
    result = quiet_train(config, service_client=flaky)
    assert_same_rows(
        comparable(read_metrics(result.run_dir)), comparable(read_metrics(reference.run_dir))
    )


def test_persistent_failure_stops_with_a_checkpoint_and_clear_message(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.backends import pytrio as backend_module
    from grpo.backends.local import LocalServiceClient

    monkeypatch.setattr(backend_module.time, "sleep", lambda _s: None)
    config = tiny_config(tmp_path, "broken", steps=3, max_retries=2)

    calls = {"n": 0}
    inner = LocalServiceClient(root=tmp_path / "broken" / "backend", seed=0)

    class Service:
        def __getattr__(self, name: str) -> Any:
            return getattr(inner, name)

        def create_lora_training_client(self, *args: Any, **kwargs: Any) -> Any:
            training = inner.create_lora_training_client(*args, **kwargs)

            class Training:
                def __getattr__(self, name: str) -> Any:
                    return getattr(training, name)

                def save_weights_and_get_sampling_client(self) -> Any:
                    calls["n"] += 1
                    if calls["n"] >= 2:
                        raise ConnectionError("service unreachable")
                    return training.save_weights_and_get_sampling_client()

            return Training()

    with pytest.raises(RunStopped) as stopped:
        quiet_train(config, service_client=Service())
    message = str(stopped.value)
    assert stopped.value.exit_code == 1
    assert (
        "save_weights_and_get_sampling_client failed 3 times" in message and "--resume" in message
    )
    assert json.loads((tmp_path / "broken" / "checkpoint.json").read_text())["step"] == 1
    assert [row["step"] for row in read_metrics(tmp_path / "broken")] == [1]


def test_swanlab_failure_never_stops_training(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import swanlab

    def broken_init(*_args: Any, **_kwargs: Any) -> None:
        raise RuntimeError("swanlab is down")

    monkeypatch.setattr(swanlab, "init", broken_init)
    lines: list[str] = []
    result = train(tiny_config(tmp_path, swanlab_mode="online"), echo=lines.append, progress=False)
    assert len(read_metrics(result.run_dir)) == 2
    # One line: online and offline both failed, so SwanLab is dropped; training went on.
    (line,) = [line for line in lines if line.startswith("[grpo] swanlab")]
    assert "swanlab is down" in line and "other trackers and metrics.jsonl" in line


def test_kl_penalty_is_logged_and_zero_at_the_start(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, kl_coef=0.1, kl_estimator="k3", steps=2, learning_rate=1e-3)
    rows = read_metrics(quiet_train(config).run_dir)
    assert [row["step"] for row in rows if row["datums"] > 0] == [1, 2], "test setup"
    # k3 = exp(−δ) + δ − 1 is 0 only where lp = lp_ref. Step 1 samples the initial LoRA
    # (B = 0), i.e. the base model itself: float noise only. Step 2 samples the policy after
    # one update, so a reference that is the base model (not the current policy) shows KL > 0.
    assert 0.0 <= rows[0]["kl"] < 1e-9
    assert rows[1]["kl"] > 1e-7


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"loss_fn": "reinforce"}, "--loss-fn"),
        ({"loss_config": ("clip_low_threshold=-1",)}, "clip_low_threshold"),
        ({"loss_config": ("clip_low_threshold=1.5",)}, "clip_low_threshold"),
        ({"loss_config": ("typo_key=1",)}, "typo_key"),
        ({"loss_config": ("clip_high_threshold",)}, "KEY=VALUE"),
        ({"reduction": "mean"}, "--reduction"),
        ({"group_size": 1}, "--group-size"),
        ({"num_substeps": 9}, "--num-substeps"),
        ({"top_p": 0.0}, "--top-p"),
    ],
)
def test_bad_flags_fail_when_the_config_is_built(
    tmp_path: Path, overrides: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        tiny_config(tmp_path, **overrides)


def test_missing_dataset_file_and_column_fail_before_any_compute(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match="nope.jsonl"):
        quiet_train(tiny_config(tmp_path, dataset=str(tmp_path / "nope.jsonl")))
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"question": "1+1?", "solution": "#### 2"}) + "\n")
    with pytest.raises(ValueError, match="answer"):
        quiet_train(tiny_config(tmp_path, dataset=str(bad)))
    assert run_files.run_status(tmp_path / "run") == run_files.NEW


def test_over_long_prompt_fails_before_sampling(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="positions"):
        quiet_train(tiny_config(tmp_path, max_tokens=2040))
    assert run_files.run_status(tmp_path / "run") == run_files.NEW


def test_pick_batch_is_a_pure_function_covering_each_pass() -> None:
    indices = np.concatenate([pick_batch(10, 4, step, seed=1) for step in range(5)])
    assert sorted(indices[:10].tolist()) == list(range(10))
    assert sorted(indices[10:20].tolist()) == list(range(10))
    assert np.array_equal(pick_batch(10, 4, 3, seed=1), pick_batch(10, 4, 3, seed=1))
    assert not np.array_equal(indices[:10], indices[10:20])


def test_config_is_saved_without_secrets(tmp_path: Path) -> None:
    from grpo.training.run.run_log import scrub_secrets

    assert scrub_secrets(
        {"api_key": "sk-123", "PYTRIO_API_KEY": "x", "auth_token": "t", "steps": 3, "max_tokens": 8}
    ) == {"steps": 3, "max_tokens": 8}
    # A variable's name is where the key is, not the key: kept, so a resume finds it again;
    # a value that is no variable name (the key itself, given by mistake) is dropped.
    assert scrub_secrets({"judge_api_key_env": "JUDGE_KEY", "steps": 3}) == {
        "judge_api_key_env": "JUDGE_KEY",
        "steps": 3,
    }
    assert scrub_secrets({"judge_api_key_env": "sk-live-123", "api_key_env": "a b"}) == {}

    @attrs.frozen
    class WithSecrets(TrainConfig):
        """A config that carries credentials, so they reach the code that saves config.json."""

        api_key: str = "sk-123"
        auth_token: str = "t"

    config = WithSecrets(**attrs.asdict(tiny_config(tmp_path, steps=1), recurse=False))
    result = quiet_train(config)
    saved = (result.run_dir / "config.json").read_text()
    assert "sk-123" not in saved and not {"api_key", "auth_token"} & json.loads(saved).keys()
    assert attrs.fields_dict(TrainConfig).keys() == json.loads(saved).keys()


def test_a_fresh_run_refuses_a_directory_that_holds_a_run(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=1)
    quiet_train(config)
    before = (tmp_path / "run" / "metrics.jsonl").read_bytes()
    with pytest.raises(
        ConfigError,
        match=r"already holds a finished run \(1 steps, complete\): evaluate it with `grpo "
        r"eval --run-dir .*`, continue it with `grpo train --resume .* --steps N` \(N above 1\)",
    ):
        quiet_train(config)
    assert (tmp_path / "run" / "metrics.jsonl").read_bytes() == before


def test_a_run_whose_stderr_is_not_a_terminal_prints_whole_lines_only(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    lines: list[str] = []
    train(tiny_config(tmp_path, steps=2), echo=lines.append, progress=True)
    captured = capsys.readouterr()
    assert "\r" not in captured.err + captured.out  # no progress bar redrawn into a log file
    assert [line.split()[:2] for line in lines if line.startswith("step ")] == [
        ["step", "1/2"],
        ["step", "2/2"],
    ]


def test_resuming_a_finished_run_changes_nothing(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=1)
    quiet_train(config)
    files = {
        path.name: path.read_bytes() for path in (tmp_path / "run").iterdir() if path.is_file()
    }
    lines: list[str] = []
    result = train(config, resume=True, echo=lines.append, progress=False)
    assert any(
        "is complete: all 1 steps are done; nothing to resume (to continue it, resume with a "
        "larger --steps)" in line
        for line in lines
    )
    assert result.steps == 1 and result.final_metrics
    after = {
        path.name: path.read_bytes() for path in (tmp_path / "run").iterdir() if path.is_file()
    }
    assert after == files


def test_resuming_a_finished_run_with_more_steps_continues_it(tmp_path: Path) -> None:
    quiet_train(tiny_config(tmp_path, "short", steps=1))
    quiet_train(tiny_config(tmp_path, "short", steps=2), resume=True)
    whole = quiet_train(tiny_config(tmp_path, "whole", steps=2))
    # The short run's final checkpoint (at step 1) ran one real forward more: counted.
    forward = ("usage/forward_tokens", "usage/cum_forward_tokens", "usage/cum_tokens")

    def without_forward(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if k not in forward} for row in comparable(rows)]

    short_rows = read_metrics(tmp_path / "short")
    assert_same_rows(without_forward(short_rows), without_forward(read_metrics(whole.run_dir)))
    assert short_rows[0]["usage/forward_tokens"] > 0
    assert json.loads((tmp_path / "short" / "summary.json").read_text())["steps"] == 2


def test_a_moved_run_directory_still_resumes(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, "first", steps=2, save_every=1)

    def stop_after_first_step(line: str) -> None:
        if line.startswith("step 1/"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(RunStopped):
        train(config, echo=stop_after_first_step, progress=False)
    moved = tmp_path / "moved"
    (tmp_path / "first").rename(moved)
    quiet_train(attrs.evolve(config, run_dir=str(moved)), resume=True)
    whole = quiet_train(tiny_config(tmp_path, "whole", steps=2, save_every=1))
    assert_same_rows(comparable(read_metrics(moved)), comparable(read_metrics(whole.run_dir)))


def test_two_runs_cannot_own_one_directory(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=1)
    with run_files.owned(tmp_path / "run"):
        with pytest.raises(run_files.RunDirError, match=r"in use by pid \d+"):
            quiet_train(config)


def test_diverged_weights_stop_the_run_and_are_never_checkpointed(tmp_path: Path) -> None:
    config = tiny_config(tmp_path, steps=4, learning_rate=1e30, save_every=1)
    with pytest.raises(
        RunStopped, match="NonFiniteUpdate: the weights after step 1 give non-finite"
    ) as stopped:
        quiet_train(config)
    assert stopped.value.exit_code == 1
    assert run_files.read_checkpoint(tmp_path / "run") is None
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1]


def test_resume_after_the_weights_were_deleted_says_what_to_do(tmp_path: Path) -> None:
    import shutil

    config = tiny_config(tmp_path, steps=2, save_every=1)

    def stop_after_first_step(line: str) -> None:
        if line.startswith("step 1/"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(RunStopped):
        train(config, echo=stop_after_first_step, progress=False)
    shutil.rmtree(tmp_path / "run" / "backend")
    with pytest.raises(
        ConfigError, match=r"the checkpoint of step 1 .* cannot be loaded.*Restore it"
    ):
        quiet_train(config, resume=True)
    assert [row["step"] for row in read_metrics(tmp_path / "run")] == [1]


def _counting_closes(service: Any, closes: list[Any]) -> Any:
    """`service` with its close() recorded in `closes` (then done)."""
    close = service.close

    def counted() -> None:
        closes.append(service)
        close()

    service.close = counted
    return service


def test_a_run_closes_the_service_it_opened_and_leaves_a_given_one_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Whatever the backend, a finished run (and a dry run) closes the service client it made
    (a Tinker session ends with its run, not at the process's exit); one passed in is the
    caller's, left open."""
    import grpo.training.recipes.grpo.run as grpo_run
    from grpo.training.recipes.grpo.run import dry_run

    closes: list[Any] = []
    opened: list[Any] = []
    make = grpo_run.run_service

    def counted_service(config: Any, run_dir: Path) -> Any:
        opened.append(_counting_closes(make(config, run_dir), closes))
        return opened[-1]

    monkeypatch.setattr(grpo_run, "run_service", counted_service)
    quiet_train(tiny_config(tmp_path, "own", steps=1, eval_every=0))
    dry_run(tiny_config(tmp_path, "planned", steps=1, eval_every=0))
    assert len(opened) == 2 and closes == opened

    given = _counting_closes(embedded_service(tmp_path / "given"), closes)
    try:
        quiet_train(tiny_config(tmp_path, "given", steps=1, eval_every=0), service_client=given)
        dry_run(tiny_config(tmp_path, "given-plan", steps=1, eval_every=0), service_client=given)
        assert closes == opened  # the given service is not closed by the run
    finally:
        given.close()
