"""Every recipe x flag combination runs and does what it says, or is refused naming both.

The table of docs/training.md ("Recipes and flags") is this test: GRPO and distillation, on single
completions and on an environment's episodes, each with one of --dynamic-sampling,
--max-steps-off-policy, --mismatch-correction, --custom-loss, --kl-coef, --reward,
--init-from and --resume. A combination that runs must leave the metric that proves the
flag took effect; a refused one must be refused before any work, naming both flags. SFT
and DPO refuse every `grpo train` flag they have no use for.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import pytest

from grpo.backends.local import LocalServiceClient
from grpo.backends.local.tiny import TINY_MODEL_NAME
from grpo.cli import main
from grpo.core.normalization import LOCAL_TRAIN_NORMALIZATION
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import ConfigError, TrainConfig
from tests.invariance import assert_same_rows
from tests.runs import comparable, quiet_train, tiny_config
from tests.training.test_episodes import ENV_FILE

FLAGS = (
    "none",
    "dynamic_sampling",
    "max_steps_off_policy",
    "mismatch_correction",
    "custom_loss",
    "kl_coef",
    "reward",
    "init_from",
    "resume",
)
REWARD = "def mine(completion, row):\n    return float(sum(map(ord, completion)) % 2)\n"

# (recipe, rollouts, flag) -> the words of the refusal; every other combination runs.
REFUSED = {
    ("distill", "single", "dynamic_sampling"): ("--dynamic-sampling", "grpo distill"),
    ("distill", "env", "dynamic_sampling"): ("--dynamic-sampling", "grpo distill"),
    ("grpo", "env", "reward"): ("--reward", "--env"),
    ("distill", "env", "reward"): ("--reward", "--env"),
}


class _CallRecorder:
    """A service whose training clients record the names of the calls made on them."""

    def __init__(self, inner: Any, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if not name.startswith("create_") or "training_client" not in name:
            return attribute

        def create(*args: Any, **kwargs: Any) -> Any:
            return _RecordingClient(attribute(*args, **kwargs), self._calls)

        return create


class _RecordingClient:
    def __init__(self, inner: Any, calls: list[str]) -> None:
        self._inner, self._calls = inner, calls

    def __getattr__(self, name: str) -> Any:
        attribute = getattr(self._inner, name)
        if callable(attribute):
            self._calls.append(name)
        return attribute


def base_config(tmp_path: Path, name: str, recipe: str, rollouts: str, **flags: Any) -> TrainConfig:
    """Two steps, a checkpoint after each; distillation from the base model itself. The env
    is two turns whose return is the last answer's length parity, so groups seldom tie."""
    options: dict[str, Any] = dict(steps=2, save_every=1, batch_size=3)
    if rollouts == "env":
        env_file = tmp_path / "two_turns.py"
        env_file.write_text(ENV_FILE)
        options["env"] = f"{env_file}:make"
    if recipe == "distill":
        options.update(recipe="distill", teacher=TINY_MODEL_NAME)
    return tiny_config(tmp_path, name, **{**options, **flags})


def flag_values(flag: str, tmp_path: Path, init_run: Path) -> dict[str, Any]:
    """The config fields one flag sets."""
    if flag == "reward":
        (tmp_path / "mine.py").write_text(REWARD)
        return {"reward": (f"{tmp_path / 'mine.py'}:mine",)}
    return {
        "none": {},
        "resume": {},
        "dynamic_sampling": {"dynamic_sampling": True},
        "max_steps_off_policy": {"max_steps_off_policy": 1},
        "mismatch_correction": {"mismatch_correction": "token_truncate"},
        "custom_loss": {"custom_loss": True},
        "kl_coef": {"kl_coef": 0.1},
        "init_from": {"init_from": str(init_run), "eval_every": 2, "eval_limit": 4},
    }[flag]


@pytest.fixture(scope="module")
def init_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A finished one-step GRPO run per kind of rollout, evaluated on 4 problems."""
    root = tmp_path_factory.mktemp("init")
    return {
        rollouts: quiet_train(
            base_config(root, rollouts, "grpo", rollouts, steps=1, eval_every=1, eval_limit=4)
        ).run_dir
        for rollouts in ("single", "env")
    }


@pytest.mark.slow
@pytest.mark.parametrize("flag", FLAGS)
@pytest.mark.parametrize("rollouts", ["single", "env"])
@pytest.mark.parametrize("recipe", ["grpo", "distill"])
def test_each_recipe_and_flag_runs_as_it_says_or_is_refused(
    tmp_path: Path, init_runs: dict[str, Path], recipe: str, rollouts: str, flag: str
) -> None:
    values = flag_values(flag, tmp_path, init_runs[rollouts])
    refused = REFUSED.get((recipe, rollouts, flag))
    if refused is not None:
        with pytest.raises(ConfigError) as error:
            base_config(tmp_path, "refused", recipe, rollouts, **values)
        assert all(word in str(error.value) for word in refused), str(error.value)
        assert not (tmp_path / "refused").exists()
        return
    config = base_config(tmp_path, "run", recipe, rollouts, **values)
    calls: list[str] = []
    # the divisor the run's own embedded backend uses, so "whole" below may be compared bit
    # for bit (another one trains the same gradients only to float rounding)
    with LocalServiceClient(
        root=tmp_path / "service", seed=config.seed, service_normalization=LOCAL_TRAIN_NORMALIZATION
    ) as service:
        if flag == "resume":
            quiet_train(attrs.evolve(config, steps=1), service_client=service)
            result = quiet_train(config, resume=True, service_client=service)
        else:
            result = quiet_train(config, service_client=_CallRecorder(service, calls))
    rows = read_metrics(result.run_dir)
    stepped = [row for row in rows if row["step"] >= 1]
    assert [row["step"] for row in stepped] == [1, 2]
    trained = [row for row in stepped if row["datums"] > 0]
    assert trained, "every group of both steps was degenerate: test setup"
    every = set.intersection(*(set(row) for row in trained))
    if recipe == "distill":  # the teacher scored every step's sampled tokens
        assert {"distill/reverse_kl", "usage/teacher_prompt_tokens"} <= every
    else:
        assert not any(key.startswith("distill/") for key in every)
    if rollouts == "env":
        assert all(row["env/turns"] == 2.0 for row in stepped)
    proof = {
        "none": lambda: True,
        "dynamic_sampling": lambda: "sampling/rounds" in every,
        # step 2 was sampled before step 1's update (if step 1 updated at all)
        "max_steps_off_policy": lambda: (
            [r["off_policy_steps"] for r in stepped] == [0.0, float(stepped[0]["datums"] > 0)]
        ),
        "mismatch_correction": lambda: any(k.startswith("mismatch_correction/") for k in every),
        "custom_loss": lambda: (
            "forward_backward_custom" in calls and "forward_backward" not in calls
        ),
        "kl_coef": lambda: "kl" in every,
        "reward": lambda: "reward/mine" in every,
        "init_from": lambda: (
            rows[0]["test/reward"] == read_metrics(init_runs[rollouts])[-1]["test/reward"]
        ),
        "resume": lambda: True,
    }[flag]
    assert proof(), (flag, sorted(every))
    if flag == "resume":  # a stopped-and-resumed run equals the uninterrupted one
        whole = quiet_train(base_config(tmp_path, "whole", recipe, rollouts))
        assert_same_rows(comparable(rows), comparable(read_metrics(whole.run_dir)))


@pytest.mark.parametrize(
    "flag",
    [
        "--env",
        "--dynamic-sampling",
        "--max-steps-off-policy",
        "--mismatch-correction",
        "--custom-loss",
        "--kl-coef",
        "--reward",
        "--init-from",
        "--teacher",
    ],
)
@pytest.mark.parametrize("command", ["sft", "dpo"])
def test_sft_and_dpo_refuse_the_train_flags_naming_them(
    tmp_path: Path, flag: str, command: str, capsys: pytest.CaptureFixture[str]
) -> None:
    if command == "dpo" and flag == "--init-from":
        return  # DPO starts from a run's weights (tests/training/test_dpo.py)
    data = tmp_path / "rows.jsonl"
    data.write_text('{"prompt": "1+1?", "completion": "2", "chosen": "2", "rejected": "3"}\n')
    value = [] if flag in ("--dynamic-sampling", "--custom-loss") else ["1"]
    argv = [command, "--data", str(data), "--run-dir", str(tmp_path / "run"), flag, *value]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"{flag} is a `grpo train` flag" in err and f"grpo {command}" in err, err
    assert not (tmp_path / "run").exists()
