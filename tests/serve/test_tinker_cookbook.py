"""tinker-cookbook 0.6.1's recipes, unchanged, against `grpo serve`'s Tinker route.

Each recipe runs as its own process (``python -m tinker_cookbook.recipes...``) through its own
CLI flags, with only the variables `grpo serve` prints (``TINKER_BASE_URL``,
``TINKER_API_KEY``, ``HF_HUB_CACHE``), the model name it asks for mapped onto the built-in tiny
model with a model alias, and the smallest batches and step counts its flags accept. The
cookbook is installed without its dependencies (it asks for ``tml-renderers``, which the
package index lacks and which only two model families import); see the README's set-up.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

tinker = pytest.importorskip("tinker")
pytest.importorskip("tinker_cookbook")

from grpo.backends.names import TINY_MODEL_NAME  # noqa: E402
from grpo.serve.server import ServeHandle, serve_in_thread  # noqa: E402
from grpo.serve.tinker_routes import tinker_exports  # noqa: E402
from tests.serve.conftest import SERVE_API_KEY  # noqa: E402
from tests.serve.test_tinker_sdk import TINKER_KEY  # noqa: E402

ASKED_MODEL = "Qwen/Qwen3-8B"  # a name the cookbook knows a renderer for (qwen3)
RECIPE_TIMEOUT_S = 180
SMALL_RL = ("env=arithmetic", "lora_rank=8", "group_size=2", "groups_per_batch=2")
SMALL_SL = ("lora_rank=8", "batch_size=2", "max_length=256")


@pytest.fixture
def server(tmp_path: Path) -> Iterator[ServeHandle]:
    """`grpo serve` with an API key, serving the tiny model under the name the recipes ask."""
    aliases = {ASKED_MODEL: TINY_MODEL_NAME}
    with serve_in_thread(root=tmp_path / "served", api_key=SERVE_API_KEY, aliases=aliases) as h:
        yield h


def recipe(server: ServeHandle, module: str, *flags: str) -> subprocess.CompletedProcess[str]:
    """Run a cookbook recipe with the exports `grpo serve` prints (the key: the one set)."""
    root = Path(server.state.registry.root)
    exports = tinker_exports(server.url, root / "hub-cache", keyed=True)
    env = {**os.environ, "TINKER_API_KEY": TINKER_KEY}
    for line in exports:
        name, value = line.removeprefix("export ").split("=", 1)
        env.setdefault(name, value) if name == "TINKER_API_KEY" else env.update({name: value})
    command = [sys.executable, "-m", f"tinker_cookbook.recipes.{module}.train"]
    command += [f"model_name={ASKED_MODEL}", *flags]
    return subprocess.run(
        command, env=env, capture_output=True, text=True, timeout=RECIPE_TIMEOUT_S, check=False
    )


def lines(path: Path) -> list[dict]:
    """The JSON lines of a file."""
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def ok(run: subprocess.CompletedProcess[str]) -> str:
    """The recipe's output, once it finished well."""
    output = run.stdout + run.stderr
    assert run.returncode == 0, output[-4000:]
    assert "Training completed successfully" in output
    return output


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_math_rl_arithmetic_trains_saves_and_resumes(server: ServeHandle, tmp_path: Path) -> None:
    log = tmp_path / "rl"
    flags = (*SMALL_RL, f"log_path={log}", "save_every=1", "loss_fn=importance_sampling")
    ok(recipe(server, "math_rl", *flags, "max_steps=2", "behavior_if_log_dir_exists=delete"))
    metrics = lines(log / "metrics.jsonl")
    assert [row["progress/batch"] for row in metrics if "env/all/reward/total" in row] == [0, 1]
    saved = lines(log / "checkpoints.jsonl")
    final = saved[-1]
    assert final["name"] == "final" and final["state_path"].startswith("tinker://")
    rest = tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEY).create_rest_client()
    run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    assert run.base_model == ASKED_MODEL and run.lora_rank == 8
    assert run.user_metadata == {"renderer_name": "qwen3"}  # the cookbook reads it back
    stored = {
        c.tinker_path for c in rest.list_checkpoints(run.training_run_id).result().checkpoints
    }
    assert {final["state_path"], final["sampler_path"]} <= stored

    # The same command, resumed from its log directory, carries on from the last checkpoint.
    resumed = ok(
        recipe(server, "math_rl", *flags, "max_steps=3", "behavior_if_log_dir_exists=resume")
    )
    assert f"Resumed training from {final['state_path']}" in resumed
    assert "has no renderer metadata" not in resumed
    rewarded = [
        row["progress/batch"]
        for row in lines(log / "metrics.jsonl")
        if "env/all/reward/total" in row
    ]
    assert rewarded == [0, 1, 2]


def test_math_rl_default_loss_is_refused_naming_importance_sampling(
    server: ServeHandle, tmp_path: Path
) -> None:
    run = recipe(
        server, "math_rl", *SMALL_RL, "max_steps=1", f"log_path={tmp_path / 'rl'}"
    )  # the cookbook's default loss: stable_reinforce
    output = run.stdout + run.stderr
    assert run.returncode != 0
    assert "record_stability_info is not served" in output
    assert "loss_fn=importance_sampling" in output
    assert "Error code: 5" not in output  # a 4xx, never retried as a 5xx


@pytest.mark.filterwarnings("ignore::FutureWarning")
def test_chat_sl_on_a_local_jsonl_trains_and_rolls_its_checkpoints(
    server: ServeHandle, tmp_path: Path
) -> None:
    data = tmp_path / "conversations.jsonl"
    data.write_text(
        "".join(
            json.dumps(
                {
                    "messages": [
                        {"role": "user", "content": f"What is {n} plus {n}?"},
                        {"role": "assistant", "content": f"{n} plus {n} is {2 * n}."},
                    ]
                }
            )
            + "\n"
            for n in range(8)
        )
    )
    log = tmp_path / "sl"
    output = ok(
        recipe(
            server,
            "chat_sl",
            *SMALL_SL,
            f"dataset={data}",
            f"log_path={log}",
            "max_steps=3",
            "eval_every=2",
            "save_every=10",
            "rolling_save_every=1",
            "behavior_if_log_dir_exists=delete",
        )
    )
    metrics = lines(log / "metrics.jsonl")
    assert [row["step"] for row in metrics if "train_mean_nll" in row] == [0, 1, 2]
    assert all(row["train_mean_nll"] > 0 for row in metrics if "train_mean_nll" in row)
    # Rolling checkpoints: each replaced one is deleted through the RestClient.
    assert output.count("Deleted rolling checkpoint") == 2
    assert "Failed to delete rolling checkpoint" not in output
    final = lines(log / "checkpoints.jsonl")[-1]
    rest = tinker.ServiceClient(base_url=server.url, api_key=TINKER_KEY).create_rest_client()
    run = rest.get_training_run_by_tinker_path(final["state_path"]).result()
    states = [
        c.checkpoint_id
        for c in rest.list_checkpoints(run.training_run_id).result().checkpoints
        if c.checkpoint_type == "training"
    ]
    assert states == ["weights/final"]  # the last rolling one went when the final was saved
