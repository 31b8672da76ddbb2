"""The config.json of run directories written before the configuration tree still load.

The fixtures under fixtures/ were written by the code as it was before the config tree
(a GRPO run with loss, KL, mismatch, reward and price flags; a distill run; an SFT run; a
DPO run). Each must load through the path `--resume` takes, pass every check, and be written
back by today's code with the same keys and values, so an old run resumes unchanged.
"""

import json
import os
import shutil
import signal
from pathlib import Path

import pytest

from grpo.cli import build_parser
from grpo.training.recipes.dpo.config import DpoConfig, dpo_to_dict
from grpo.training.recipes.grpo.run import RunStopped, train
from grpo.training.recipes.sft.config import SftConfig, recipe_config_from_dict, sft_to_dict
from grpo.training.run import run_files
from grpo.training.settings import flags
from grpo.training.settings.config import config_from_dict, resolve_run, to_dict

FIXTURES = Path(__file__).parent / "fixtures"


def old_run(tmp_path: Path, name: str) -> tuple[Path, dict[str, object]]:
    """A run directory holding fixture `name`'s config.json, and the fixture's values."""
    run_dir = tmp_path / name
    run_dir.mkdir()
    shutil.copy(FIXTURES / f"{name}_config.json", run_dir / run_files.CONFIG_FILE)
    return run_dir, json.loads((FIXTURES / f"{name}_config.json").read_text())


@pytest.mark.parametrize("name", ["train", "distill"])
def test_old_train_config_json_resumes_with_the_same_values(tmp_path: Path, name: str) -> None:
    run_dir, saved = old_run(tmp_path, name)
    command = "distill" if name == "distill" else "train"
    args = build_parser([command]).parse_args([command, "--resume", str(run_dir)])
    config, resume = flags.config_from_args(args)
    assert resume
    assert to_dict(resolve_run(config)) == {**saved, "run_dir": str(run_dir)}


def test_old_train_config_json_keeps_its_settings(tmp_path: Path) -> None:
    run_dir, _ = old_run(tmp_path, "train")
    args = build_parser(["train"]).parse_args(["train", "--resume", str(run_dir), "--steps", "5"])
    config, _ = flags.config_from_args(args)
    assert (config.steps, config.loss_fn, config.kl_coef, config.kl_estimator) == (
        5,
        "cispo",
        0.05,
        "k3",
    )
    assert config.loss_spec.config["clip_high_threshold"] == 3.5
    assert config.mismatch.cap == 3.0
    assert config.reward == ("grpo.rewards:boxed_match=1.0",)


@pytest.mark.parametrize(
    ("name", "config_class", "writer"),
    [("sft", SftConfig, sft_to_dict), ("dpo", DpoConfig, dpo_to_dict)],
)
def test_old_data_recipe_config_json_loads_with_the_same_values(
    tmp_path: Path, name: str, config_class: type, writer: object
) -> None:
    run_dir, saved = old_run(tmp_path, name)
    values = run_files.read_config(run_dir)
    assert values.pop("recipe") == name
    config = recipe_config_from_dict(config_class, name, values, where=str(run_dir))
    assert json.loads(json.dumps(writer(config))) == saved  # type: ignore[operator]


def test_an_old_run_stopped_after_its_first_step_resumes_to_the_end(tmp_path: Path) -> None:
    saved = json.loads((FIXTURES / "train_config.json").read_text())
    run_dir = tmp_path / "old-grpo"
    config = config_from_dict({**saved, "run_dir": str(run_dir)})

    def stop_after_first_step(line: str) -> None:
        if line.startswith("step 1/"):
            os.kill(os.getpid(), signal.SIGINT)

    with pytest.raises(RunStopped):
        train(config, echo=stop_after_first_step, progress=False)
    # The directory now holds the config.json the old code wrote, byte for byte.
    shutil.copy(FIXTURES / "train_config.json", run_dir / run_files.CONFIG_FILE)
    args = build_parser(["train"]).parse_args(["train", "--resume", str(run_dir)])
    resumed, resume = flags.config_from_args(args)
    train(resolve_run(resumed), resume=resume, echo=lambda _line: None, progress=False)
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [row["step"] for row in rows if "step" in row] == [1, 2, 3]
    assert run_files.read_config(run_dir) == {**saved, "run_dir": str(run_dir)}
