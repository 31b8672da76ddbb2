"""The local backend's thread policy: its decisions, and what the worker and caller get."""

from __future__ import annotations

import threading
from pathlib import Path

import pytest
import torch

from grpo.backends.local import LocalServiceClient
from grpo.backends.local import threads as thread_policy
from grpo.backends.local.threads import MANY_PARAMETERS, ThreadPlan, choose_threads
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.training.settings.config import TrainConfig
from grpo.training.settings.fields import ConfigError

TINY_PARAMETERS = 1_000_000


def plan(threads: int = 0, **overrides: object) -> ThreadPlan:
    arguments: dict[str, object] = {
        "parameter_count": TINY_PARAMETERS,
        "cores": 2,
        "env": {},
        "current": 2,
        "default": 2,
    }
    arguments.update(overrides)
    return choose_threads(threads, **arguments)  # type: ignore[arg-type]


def test_auto_gives_a_small_model_one_thread_and_the_caller_the_other_core() -> None:
    assert (plan().worker, plan().caller) == (1, 1)


def test_auto_gives_a_large_model_every_core_and_the_caller_one() -> None:
    large = plan(parameter_count=MANY_PARAMETERS, cores=8)
    assert (large.worker, large.caller) == (8, 1)


@pytest.mark.parametrize("name", ["OMP_NUM_THREADS", "MKL_NUM_THREADS"])
def test_auto_leaves_a_thread_env_var_alone(name: str) -> None:
    chosen = plan(env={name: "2"})
    assert (chosen.worker, chosen.caller) == (None, None)
    assert name in chosen.reason


def test_auto_leaves_an_explicit_torch_set_num_threads_alone() -> None:
    chosen = plan(current=3, default=2)
    assert (chosen.worker, chosen.caller) == (None, None)
    assert "torch.set_num_threads(3)" in chosen.reason


def test_explicit_threads_win_over_the_env_var() -> None:
    chosen = plan(3, env={"OMP_NUM_THREADS": "1"}, cores=4)
    assert (chosen.worker, chosen.caller) == (3, 1)


@pytest.mark.parametrize("threads", [-1, 1.5, True, "2"])
def test_threads_must_be_a_whole_number_at_least_zero(threads: object) -> None:
    with pytest.raises(ValueError, match="threads must be a whole number >= 0"):
        plan(threads)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="threads must be a whole number >= 0"):
        LocalServiceClient(threads=threads)  # type: ignore[arg-type]


def test_train_config_validates_threads() -> None:
    assert TrainConfig(threads=2).threads == 2
    with pytest.raises(ConfigError, match="--threads must be >= 0"):
        TrainConfig(threads=-1)


def test_auto_after_a_policy_count_is_still_auto(monkeypatch: pytest.MonkeyPatch) -> None:
    """A count this module set (a previous service's) is not mistaken for the user's."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    monkeypatch.setattr(thread_policy, "_last_applied", torch.get_num_threads())
    assert thread_policy.plan_here(0, TINY_PARAMETERS).worker == 1


def _worker_threads(service: LocalServiceClient) -> int:
    return service._engine.run(torch.get_num_threads)


@pytest.mark.parametrize("threads", [1, 2])
def test_worker_and_caller_together_stay_within_the_cores(tmp_path: object, threads: int) -> None:
    previous = torch.get_num_threads()
    cores = thread_policy.available_cores()
    try:
        with LocalServiceClient(root=str(tmp_path), threads=threads) as service:
            service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=0)
            worker, caller = _worker_threads(service), torch.get_num_threads()
    finally:
        torch.set_num_threads(previous)
    assert worker == threads
    assert caller == max(1, cores - threads)
    assert worker + caller <= max(cores, threads + 1)


def test_a_user_setting_reaches_the_worker_unchanged(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """conftest pins 1 thread: with threads=0 the service keeps it on every thread."""
    monkeypatch.setattr(thread_policy, "_last_applied", None)
    assert torch.get_num_threads() == 1
    with LocalServiceClient(root=str(tmp_path)) as service:
        service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=0)
        assert service._engine.thread_plan is not None
        assert service._engine.thread_plan.worker is None
        assert _worker_threads(service) == 1
    assert torch.get_num_threads() == 1


def test_auto_on_a_fresh_thread_gives_the_tiny_model_one_worker_thread(
    tmp_path: object, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `grpo train` runs it: nothing set, torch at its default, threads=0."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.delenv("MKL_NUM_THREADS", raising=False)
    default = thread_policy.torch_default_threads()
    seen: dict[str, int] = {}

    def run() -> None:
        torch.set_num_threads(default)  # a thread at torch's default, as in a fresh process
        monkeypatch.setattr(thread_policy, "_last_applied", None)
        with LocalServiceClient(root=str(tmp_path)) as service:
            service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=0)
            seen["worker"], seen["caller"] = _worker_threads(service), torch.get_num_threads()

    previous = torch.get_num_threads()
    try:
        caller = threading.Thread(target=run)
        caller.start()
        caller.join()
    finally:
        torch.set_num_threads(previous)
    assert seen == {"worker": 1, "caller": max(1, thread_policy.available_cores() - 1)}


def test_grpo_serve_threads_reach_the_backend_worker(tmp_path: Path) -> None:
    """`grpo serve --threads N` sizes the served backend's worker as --threads does for train."""
    import argparse

    from grpo.serve.command import add_serve_arguments, run_serve
    from grpo.serve.server import start_server

    previous = torch.get_num_threads()
    server, service = start_server(root=tmp_path / "served", threads=2)
    try:
        service.create_lora_training_client(base_model=TINY_MODEL_NAME, rank=4, seed=0)
        assert _worker_threads(service) == 2
    finally:
        server.server_close()
        service.close()
        torch.set_num_threads(previous)
    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    lines: list[str] = []
    args = parser.parse_args(["--threads", "-1", "--port", "0", "--root", str(tmp_path)])
    assert run_serve(args, echo=lines.append) == 2
    assert lines == ["grpo serve: --threads must be >= 0 (0 = auto), got -1"]
