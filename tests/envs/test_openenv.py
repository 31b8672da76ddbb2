"""`--env openenv:MODULE:CLIENT`: a small OpenEnv server of the tests (openenv-core's server
classes, on 127.0.0.1) drives training episodes; an unreachable server is a clear error."""

from __future__ import annotations

import re
import threading
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

pytest.importorskip(
    "openenv.core",
    reason='openenv-core is not installed (the optional extra: pip install -e ".[openenv]")',
)

from grpo.cli import main  # noqa: E402 - after the skip
from grpo.envs.base import Task  # noqa: E402
from grpo.envs.openenv import observation_messages, parse_env_args, text_action  # noqa: E402
from grpo.training import run_files  # noqa: E402
from grpo.training.config import ConfigError  # noqa: E402
from tests.envs.openenv_sums import (  # noqa: E402
    SumsAction,
    SumsClient,
    SumsObservation,
    free_port,
    serve,
)
from tests.runs import quiet_train, tiny_config  # noqa: E402

CLIENT = "openenv:tests.envs.openenv_sums:SumsClient"


def test_three_steps_of_episodes_against_an_openenv_server(tmp_path: Path) -> None:
    with serve() as url:
        config = tiny_config(
            tmp_path,
            env=CLIENT,
            env_arg=(f"base_url={url}", "top=3"),
            steps=3,
            max_turns=2,
            max_tokens=16,
        )
        quiet_train(config)
    rows = [row for row in run_files.read_metrics(tmp_path / "run") if row.get("step", 0) > 0]
    assert [row["step"] for row in rows] == [1, 2, 3]
    for row in rows:
        assert row["env/turns"] == 1.0  # the server ends every episode after one answer
        assert row["env/errors"] == 0.0
        assert 0.0 <= row["env/final_reward"] <= 1.0
        assert "env/turn_reward" in row


def test_an_unreachable_server_exits_2_before_training(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    url = f"http://127.0.0.1:{free_port()}"
    run_dir = tmp_path / "run"
    argv = ["train", "--env", CLIENT, "--env-arg", f"base_url={url}", "--run-dir", str(run_dir)]
    assert main([*argv, "--steps", "1"]) == 2
    error = capsys.readouterr().err
    assert f"--env-arg base_url={url}: no OpenEnv server answers" in error
    assert "Traceback" not in error and not run_dir.exists()


def test_the_env_flags_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="needs --env-arg base_url=URL"):
        _ = tiny_config(tmp_path, env=CLIENT).env_factory
    with pytest.raises(ConfigError, match="is read by --env openenv"):
        tiny_config(tmp_path, env="grpo.envs:calculator_wordproblems", env_arg=("a=1",))
    with pytest.raises(ValueError, match="KEY=VALUE"):
        parse_env_args(["novalue"])
    with pytest.raises(ConfigError, match="not an OpenEnv EnvClient"):
        _ = tiny_config(
            tmp_path, env="openenv:tests.envs.openenv_sums:SumsAction", env_arg=("base_url=x",)
        ).env_factory


def test_the_default_mappings() -> None:
    action = text_action(SumsClient, CLIENT)("\\boxed{4}")
    assert isinstance(action, SumsAction) and action.message == "\\boxed{4}"
    observation = SumsObservation(prompt="What is 1 + 3?", reward=0.5, done=False)
    assert observation_messages(observation) == [{"role": "user", "content": "What is 1 + 3?"}]
    chat = {"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]}
    assert observation_messages(chat) == chat["messages"]
    assert observation_messages({"board": [1, 2], "turn": "x"}) == [
        {"role": "user", "content": '{"board": [1, 2], "turn": "x"}'}
    ]


def test_hooks_map_the_action_and_the_observation_and_the_server_scores(tmp_path: Path) -> None:
    hooks = (
        "action=tests.envs.openenv_sums:answer_action",
        "observation=tests.envs.openenv_sums:quiz_messages",
    )
    with serve() as url:
        config = tiny_config(tmp_path, env=CLIENT, env_arg=(f"base_url={url}", *hooks, "top=20"))
        episode = config.env_factory(Task(question="", gold="", index=7))
        messages = episode.initial_observation()
        assert messages[0] == {"role": "system", "content": "Answer briefly."}
        a, b = map(int, re.findall(r"\d+", messages[1]["content"]))
        assert max(a, b) <= 20  # the reset argument reached the server
        result = episode.step(f"  \\boxed{{{a + b}}}  ")
        assert (result.reward, result.done, result.observation) == (1.0, True, ())
        again = config.env_factory(Task(question="", gold="", index=7))
        assert again.initial_observation() == messages  # one seed, one problem (a group's)
        assert again.step("\\boxed{-1}").reward == 0.0


def test_a_server_that_is_not_openenv_is_named(tmp_path: Path) -> None:
    server = ThreadingHTTPServer(("127.0.0.1", 0), SimpleHTTPRequestHandler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        with pytest.raises(ConfigError, match="HTTP 404, so this is not an OpenEnv server"):
            _ = tiny_config(tmp_path, env=CLIENT, env_arg=(f"base_url={url}",)).env_factory
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=10)
