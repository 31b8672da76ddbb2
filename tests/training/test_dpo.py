"""`grpo dpo` end to end on the local backend: it learns the preference, resumes like an
uninterrupted run without paying for the reference again, plans what it uses, refuses bad
pairs by row, and `grpo train --init-from` / `grpo eval --run-dir` take its weights."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from grpo.cli import main
from grpo.training.recipes.dpo.config import DpoConfig
from grpo.training.recipes.dpo.recipe import dpo, dry_run_dpo, planned_usage, preflight_dpo
from grpo.training.recipes.dpo.reference_cache import CACHE_FILE
from grpo.training.recipes.grpo.run import RunStopped
from grpo.training.run import run_files
from grpo.training.settings.config import ConfigError, TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import comparable
from tests.training.test_sft import _SigintAfter

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "dpo_arithmetic.jsonl"


def _data(tmp_path: Path, rows: int = 48) -> Path:
    """The first ``rows`` pairs of the built-in example (a correct answer over a wrong one)."""
    path = tmp_path / "pairs.jsonl"
    path.write_text("".join(EXAMPLE.read_text().splitlines(keepends=True)[:rows]))
    return path


def _config(tmp_path: Path, name: str, **overrides: Any) -> DpoConfig:
    values: dict[str, Any] = {
        "data": str(_data(tmp_path)),
        "run_dir": str(tmp_path / name),
        "steps": 6,
        "batch_size": 8,
        "learning_rate": 2e-3,
        "eval_every": 3,
        "eval_fraction": 0.25,
        "save_every": 2,
        **overrides,
    }
    return DpoConfig(**values)


def _quiet(config: DpoConfig, **kwargs: Any) -> Any:
    return dpo(config, echo=lambda _line: None, progress=False, **kwargs)


class _CountingService:
    """A service whose samplers count their compute_logprobs calls into ``calls``."""

    def __init__(self, inner: Any, calls: list[int]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if name != "create_sampling_client":
            return attribute

        def create(*args: Any, **kwargs: Any) -> Any:
            sampler, calls = attribute(*args, **kwargs), self._calls
            compute = sampler.compute_logprobs

            def counted(*a: Any, **k: Any) -> Any:
                calls.append(1)
                return compute(*a, **k)

            sampler.compute_logprobs = counted
            return sampler

        return create


def test_dpo_raises_held_out_accuracy_and_margin_and_logs_every_metric(tmp_path: Path) -> None:
    result = _quiet(_config(tmp_path, "run"))
    rows = run_files.read_metrics(result.run_dir)
    evals = [row for row in rows if "eval/dpo/accuracy" in row]
    assert [row["step"] for row in evals] == [0, 3, 6]
    first, last = evals[0], evals[-1]
    assert abs(first["eval/dpo/margin"]) < 1e-3 and first["eval/dpo/loss"] == pytest.approx(
        np.log(2), abs=1e-3
    )  # the policy starts at the reference (up to the sampler-trainer mismatch)
    # At step 0 every margin is rounding (|h| < 1e-4), so accuracy there is a coin toss:
    # the margin and the loss carry the claim, accuracy must not fall.
    assert last["eval/dpo/margin"] > 0.02 and last["eval/dpo/loss"] < first["eval/dpo/loss"] - 0.01
    assert last["eval/dpo/accuracy"] >= first["eval/dpo/accuracy"]
    names = ("loss", "accuracy", "margin", "chosen_reward", "rejected_reward")
    for row in rows[1:]:
        assert {f"dpo/{n}" for n in (*names, "chosen_logprob", "rejected_logprob")} <= set(row)
        assert row["dpo/margin"] == pytest.approx(
            row["dpo/chosen_reward"] - row["dpo/rejected_reward"], abs=1e-9
        )
        assert row["pairs"] == 8
    summary = run_files.read_summary(result.run_dir)
    assert summary["recipe"] == "dpo" and summary["reference"] == "base:grpo/tiny-qwen3-bpe"
    # The plan a dry run prints is what the run used, token for token.
    plan = preflight_dpo(_config(tmp_path, "run2"), lambda: _local(tmp_path / "plan"))
    planned = planned_usage(plan)
    assert {
        k: summary["usage"][k] for k in ("prompt_tokens", "trained_tokens", "forward_tokens")
    } == {
        "prompt_tokens": planned.prompt_tokens,
        "trained_tokens": planned.trained_tokens,
        "forward_tokens": planned.forward_tokens,
    }


def _local(root: Path) -> Any:
    from grpo.backends.local import LocalServiceClient

    return LocalServiceClient(root=root, seed=0)


def test_resume_equals_an_uninterrupted_run_and_reads_the_reference_cache(tmp_path: Path) -> None:
    whole = _quiet(_config(tmp_path, "whole"))
    config = _config(tmp_path, "stopped")
    first_calls: list[int] = []
    service = _SigintAfter(_local(tmp_path / "stopped" / "backend"), n=3)
    with pytest.raises(RunStopped) as stopped:
        _quiet(config, service_client=_CountingService(service, first_calls))
    assert stopped.value.exit_code == 130
    assert run_files.read_checkpoint(tmp_path / "stopped").step == 3
    pairs = sum(1 for _ in _data(tmp_path).open())
    assert len(first_calls) == 2 * pairs  # once per sequence, train and held-out
    assert (tmp_path / "stopped" / CACHE_FILE).is_file()
    resumed_calls: list[int] = []
    service = _CountingService(_local(tmp_path / "stopped" / "backend"), resumed_calls)
    _quiet(config, resume=True, service_client=service)
    assert resumed_calls == []  # the resume read every reference log-prob from the cache
    assert_same_rows(
        comparable(run_files.read_metrics(tmp_path / "stopped")),
        comparable(run_files.read_metrics(whole.run_dir)),
    )


def _write(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def test_bad_pairs_are_refused_naming_the_row_before_any_work(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = {"prompt": "1+1?", "chosen": "2", "rejected": "3"}
    cases = [
        ({"prompt": "1+1?", "chosen": "2"}, r"bad.jsonl row 2: no 'rejected' column"),
        ({**good, "chosen": 7}, r"bad.jsonl row 2, column 'chosen': expected a non-empty list"),
        (
            {**good, "rejected": [{"role": "user", "content": "x"}]},
            r"row 2, column 'rejected': expected one assistant message",
        ),
        (
            {**good, "rejected": "1 " * 3000},
            r"bad.jsonl row 2: the prompt with its 'rejected' completion has \d+ tokens, more "
            r"than the model's context of 2048",
        ),
    ]
    for bad, message in cases:
        data = _write(tmp_path / "bad.jsonl", [good, bad])
        with pytest.raises(ConfigError, match=message):
            dry_run_dpo(_config(tmp_path, "bad", data=str(data)))
    assert not (tmp_path / "bad").exists()
    # On the command line: exit 2, one line naming the row, no traceback (transformers may
    # warn of the long sequence on its own line before it).
    assert main(["dpo", "--data", str(data), "--run-dir", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    assert err.splitlines()[-1].startswith("grpo dpo: error: ") and "row 2: the prompt" in err
    assert not (tmp_path / "bad").exists()
    with pytest.raises(ConfigError, match="--ref .*nope: .* is neither sampler weights nor"):
        dry_run_dpo(_config(tmp_path, "bad", ref=str(tmp_path / "nope")))
    with pytest.raises(ConfigError, match="--data is required"):
        DpoConfig()
    with pytest.raises(ConfigError, match="label smoothing applies to the sigmoid loss only"):
        DpoConfig(data="x.jsonl", dpo_loss="ipo", label_smoothing=0.1)
    # A `grpo train` flag DPO has no use for: refused, naming it, before anything is made.
    code = main(["dpo", "--data", str(data), "--run-dir", str(tmp_path / "c"), "--group-size", "4"])
    assert code == 2 and not (tmp_path / "c").exists()


def test_dry_run_writes_nothing(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _data(tmp_path)
    run_dir = tmp_path / "dry"
    assert main(["dpo", "--data", str(data), "--run-dir", str(run_dir), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "every check passed" in out and "43 train / 5 held-out pairs" in out
    held = _write(tmp_path / "held.jsonl", [{"prompt": "1+1?", "chosen": "2", "rejected": "3"}])
    argv = ["dpo", "--data", str(data), "--eval-data", str(held), "--run-dir", str(run_dir)]
    assert main([*argv, "--dry-run", "--steps", "4"]) == 0
    out = capsys.readouterr().out
    assert "48 train / 1 held-out pairs" in out and "steps 0..4 of 16 pairs" in out
    assert not run_dir.exists()


def test_init_from_and_eval_take_the_dpo_weights(tmp_path: Path) -> None:
    from grpo.tools.evaluate import evaluate
    from grpo.training.recipes.grpo.run import train

    data = _data(tmp_path)
    source = tmp_path / "source"
    argv = ["dpo", "--data", str(data), "--run-dir", str(source), "--steps", "2"]
    assert main([*argv, "--eval-every", "0", "--dpo-loss", "ipo", "--sft-weight", "0.5"]) == 0
    assert "dpo/sft_loss" in run_files.read_metrics(source)[-1]
    config = TrainConfig(
        init_from=str(source),
        run_dir=str(tmp_path / "rl"),
        steps=1,
        batch_size=2,
        group_size=4,
        eval_every=0,
    )
    result = train(config, echo=lambda _line: None, progress=False)
    assert run_files.read_summary(result.run_dir)["finished"]
    metrics = evaluate(source, limit=4, echo=lambda _line: None)
    assert 0.0 <= metrics["test/reward"] <= 1.0
    # A DPO run started from another's weights takes them as its reference by default.
    follow = _quiet(_config(tmp_path, "follow", init_from=str(source), steps=1, eval_every=0))
    reference = run_files.read_summary(follow.run_dir)["reference"]
    assert reference == run_files.read_summary(source)["sampler_path"]
