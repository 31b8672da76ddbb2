"""`grpo sft` end to end on the local backend, and `grpo train --init-from` its weights."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pytrio.types import ModelInput

from grpo.training.recipes.grpo.run import RunStopped
from grpo.training.recipes.sft.config import SftConfig
from grpo.training.recipes.sft.recipe import check_run_dir, dry_run_sft, example_datum, sft
from grpo.training.run import run_files
from grpo.training.run.init_from import init_state_path, init_training_client
from grpo.training.run.lifecycle import finished_result
from grpo.training.settings.config import ConfigError, TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import comparable, embedded_service


def _data(tmp_path: Path, rows: int = 24) -> Path:
    path = tmp_path / "sft.jsonl"
    with path.open("w") as out:
        for i in range(rows):
            chat = [
                {"role": "user", "content": f"What is {i} plus 1?"},
                {"role": "assistant", "content": f"{i}+1={i + 1}. \\boxed{{{i + 1}}}"},
            ]
            out.write(json.dumps({"messages": chat}) + "\n")
    return path


def _config(tmp_path: Path, name: str, **overrides: Any) -> SftConfig:
    values: dict[str, Any] = {
        "data": str(_data(tmp_path)),
        "run_dir": str(tmp_path / name),
        "batch_tokens": 200,
        "epochs": 2,
        "learning_rate": 1e-3,
        "warmup_steps": 1,
        "lr_schedule": "cosine",
        "eval_every": 2,
        "eval_fraction": 0.25,
        "save_every": 2,
        **overrides,
    }
    return SftConfig(**values)


def _quiet(config: SftConfig, **kwargs: Any) -> Any:
    return sft(config, echo=lambda _line: None, progress=False, **kwargs)


class _SigintAfter:
    """A service whose training client sends SIGINT to this process after n optimizer steps."""

    def __init__(self, inner: Any, n: int) -> None:
        self._inner, self._n = inner, n

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name != "create_lora_training_client":
            return attribute

        def create(*args: Any, **kwargs: Any) -> Any:
            client = attribute(*args, **kwargs)
            step, remaining = client.optim_step, [self._n]

            def optim_step(*a: Any, **k: Any) -> Any:
                remaining[0] -= 1
                if remaining[0] == 0:
                    os.kill(os.getpid(), signal.SIGINT)
                return step(*a, **k)

            client.optim_step = optim_step
            return client

        return create


def test_sft_lowers_the_loss_and_resume_equals_an_uninterrupted_run(tmp_path: Path) -> None:

    whole = _quiet(_config(tmp_path, "whole"))
    rows = run_files.read_metrics(whole.run_dir)
    evals = [row["eval/loss"] for row in rows if "eval/loss" in row]
    assert rows[0]["step"] == 0 and len(evals) >= 3 and evals[-1] < evals[0]
    summary = run_files.read_summary(whole.run_dir)  # summary.json stores it run-relative
    assert summary["finished"] and summary["sampler_path"] == whole.sampler_path
    # Every training row once per epoch, within the token budget.
    trained = [row for row in rows if "loss" in row]
    assert all(row["positions"] <= 200 for row in trained)
    for epoch in (0.0, 1.0):
        assert sum(row["rows"] for row in trained if row["epoch"] == epoch) == 18

    config = _config(tmp_path, "stopped")
    service = _SigintAfter(embedded_service(tmp_path / "stopped" / "backend", seed=0), n=3)
    with pytest.raises(RunStopped) as stopped:
        _quiet(config, service_client=service)
    assert stopped.value.exit_code == 130
    assert run_files.read_checkpoint(tmp_path / "stopped").step == 3
    resumed = _quiet(config, resume=True)
    assert_same_rows(comparable(run_files.read_metrics(resumed.run_dir)), comparable(rows))


def test_eval_loss_is_over_the_held_out_rows_only(tmp_path: Path) -> None:
    from grpo.training.recipes.sft.recipe import SftRecipe

    config = _config(tmp_path, "eval", epochs=1)
    calls: list[int] = []
    original = SftRecipe.evaluate

    def spy(self: SftRecipe, state: object) -> dict[str, float]:
        calls.append(len(self.plan.eval))
        held = {tuple(e.tokens_T.tolist()) for e in self.plan.eval}
        assert held and not held & {tuple(e.tokens_T.tolist()) for e in self.plan.train}
        return original(self, state)

    SftRecipe.evaluate = spy  # type: ignore[method-assign]
    try:
        _quiet(config)
    finally:
        SftRecipe.evaluate = original  # type: ignore[method-assign]
    assert calls and set(calls) == {6}


def test_dry_run_writes_nothing_and_bad_data_is_named(tmp_path: Path) -> None:
    config = _config(tmp_path, "dry")
    lines = dry_run_sft(config)
    assert "every check passed" in lines[0] and not (tmp_path / "dry").exists()
    (tmp_path / "bad.jsonl").write_text('{"question": "x"}\n')
    with pytest.raises(ConfigError, match="bad.jsonl row 1: no 'messages'"):
        dry_run_sft(_config(tmp_path, "bad", data=str(tmp_path / "bad.jsonl")))
    with pytest.raises(ConfigError, match="row .* has .* tokens, more than the batch budget"):
        dry_run_sft(_config(tmp_path, "big", batch_tokens=10))
    with pytest.raises(ConfigError, match="--data is required"):
        SftConfig()
    assert not (tmp_path / "bad").exists() and not (tmp_path / "big").exists()


def test_init_from_starts_from_the_sft_weights(tmp_path: Path) -> None:
    from grpo.backends.local import LocalServiceClient

    source = _quiet(_config(tmp_path, "source", epochs=1))
    config = TrainConfig(
        init_from=str(source.run_dir), run_dir=str(tmp_path / "rl"), steps=1, eval_every=0
    )
    with LocalServiceClient(root=tmp_path / "rl-backend", seed=0) as service:
        client = init_training_client(service, config, init_state_path(config))
        tokens = list(range(5, 30))
        datum = example_datum_for(tokens)
        trained = np.asarray(
            client.forward([datum], loss_fn="cross_entropy")
            .result()
            .loss_fn_outputs[0]["logprobs"]
            .data
        )
        sft_sampler = service.create_sampling_client(
            base_model=config.base_model, model_path=source.sampler_path
        )
        base_sampler = service.create_sampling_client(base_model=config.base_model)
        prompt = ModelInput.from_ints(tokens)
        sft_lp = np.asarray(sft_sampler.compute_logprobs(prompt).result()[1:], dtype=np.float32)
        base_lp = np.asarray(base_sampler.compute_logprobs(prompt).result()[1:], dtype=np.float32)
    np.testing.assert_allclose(trained, sft_lp, atol=1e-5)
    assert np.abs(trained - base_lp).max() > 1e-3  # SFT moved the weights

    from grpo.training.recipes.grpo.run import train

    result = train(config, echo=lambda _line: None, progress=False)
    assert result.sampler_path and run_files.read_summary(result.run_dir)["finished"]


def example_datum_for(tokens: list[int]) -> Any:
    from grpo.core.sft import SftExample

    example = SftExample(tokens_T=tokens, mask_T=np.arange(len(tokens)) > 0)
    return example_datum(example, example.mask_T.astype(np.float32))


def test_init_from_refuses_an_unfinished_run_or_another_base_model(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="not a run directory"):
        init_state_path(TrainConfig(init_from=str(tmp_path / "nothing")))
    unfinished = tmp_path / "unfinished"
    unfinished.mkdir()
    (unfinished / "config.json").write_text(json.dumps({"recipe": "sft"}))
    with pytest.raises(ConfigError, match="has not finished .* `grpo sft --resume"):
        init_state_path(TrainConfig(init_from=str(unfinished)))
    (unfinished / "summary.json").write_text(json.dumps({"finished": True}))
    (unfinished / "config.json").write_text(json.dumps({"base_model": "Qwen/Qwen3-8B"}))
    with pytest.raises(ConfigError, match="that run has base_model 'Qwen/Qwen3-8B'"):
        init_state_path(TrainConfig(init_from=str(unfinished)))


def test_sft_resumes_from_the_newest_intact_checkpoint_when_the_latest_is_damaged(
    tmp_path: Path,
) -> None:
    config = _config(tmp_path, "damaged", save_every=1)

    def stop_at_step_3(line: str) -> None:
        if line.startswith("step 3/"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(RunStopped):
        sft(config, echo=stop_at_step_3, progress=False)
    recorded = run_files.read_checkpoint(tmp_path / "damaged")
    assert recorded is not None and recorded.step == 3
    weights = Path(recorded.state_path.removeprefix("local://"))
    for path in weights.rglob("*.safetensors"):  # damaged: the adapter's bytes cut short
        path.write_bytes(path.read_bytes()[:100])
    notes: list[str] = []
    sft(config, resume=True, echo=notes.append, progress=False)
    assert any("resuming from step 2, the newest intact checkpoint" in n for n in notes), notes
    whole = _quiet(_config(tmp_path, "whole", save_every=1))
    assert_same_rows(
        comparable(run_files.read_metrics(tmp_path / "damaged")),
        comparable(run_files.read_metrics(whole.run_dir)),
    )


def test_a_finished_sft_run_is_called_complete_and_no_resume_is_suggested(tmp_path: Path) -> None:
    run_dir = tmp_path / "done"
    run_dir.mkdir()
    (run_dir / "config.json").write_text(json.dumps({"recipe": "sft"}))
    (run_dir / "summary.json").write_text(json.dumps({"finished": True, "steps": 4}))
    with pytest.raises(ConfigError) as refused:
        check_run_dir(run_dir, resume=False)
    message = str(refused.value)
    assert "finished run (4 steps, complete)" in message
    assert f"`grpo eval --run-dir {run_dir}`" in message and "--resume" not in message
    assert check_run_dir(run_dir, resume=True) is False  # a resume does nothing ...
    said: list[str] = []
    result = finished_result(run_dir, said.append, "")
    assert said == [f"[grpo] {run_dir} is complete: all 4 steps are done; nothing to resume"]
    assert result.steps == 4  # ... and says so


def test_sft_closes_the_service_it_opened_and_leaves_a_given_one_open(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """As `grpo train` does (tests/training/test_loop.py): the data recipes close the service
    client they made when the run or the dry run is done, and leave one passed in open."""
    import grpo.training.recipes.sft.recipe as sft_recipe
    from grpo.backends.local import LocalServiceClient

    closes: list[str] = []
    make = sft_recipe.run_service

    def counted_service(config: Any, run_dir: Path) -> Any:
        service = make(config, run_dir)
        close = service.close
        service.close = lambda: (closes.append(str(run_dir.name)), close())
        return service

    monkeypatch.setattr(sft_recipe, "run_service", counted_service)
    _quiet(_config(tmp_path, "own", epochs=1))
    dry_run_sft(_config(tmp_path, "planned", epochs=1))
    assert closes == ["own", "planned"]

    with LocalServiceClient(root=tmp_path / "given") as given:
        given_close = given.close
        given.close = lambda: closes.append("given")  # type: ignore[method-assign]
        _quiet(_config(tmp_path, "with-given", epochs=1), service_client=given)
        assert closes == ["own", "planned"]
        given.close = given_close  # type: ignore[method-assign]
