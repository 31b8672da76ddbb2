"""`--env openenv:MODULE:CLIENT`: a small OpenEnv server of the tests (openenv-core's server
classes, on 127.0.0.1) drives training episodes; an unreachable server is a clear error."""

from __future__ import annotations

import re
import threading
import time
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

pytest.importorskip(
    "openenv.core",
    reason='openenv-core is not installed (the optional extra: pip install -e ".[openenv]")',
)

from grpo.cli import build_parser, main  # noqa: E402 - after the skip
from grpo.envs.base import EnvError, Task, stop_env_calls_on  # noqa: E402
from grpo.envs.openenv import (  # noqa: E402
    Capacity,
    OpenEnvEpisode,
    SessionGate,
    observation_messages,
    parse_env_args,
    text_action,
)
from grpo.training.run import run_files  # noqa: E402
from grpo.training.settings.config import ConfigError, config_from_dict, to_dict  # noqa: E402
from grpo.training.settings.flags import config_from_args, load_toml, train_argv  # noqa: E402
from tests.envs.openenv_echo import SessionCounts, counted_echo_app, echo_app  # noqa: E402
from tests.envs.openenv_sums import (  # noqa: E402
    SumsAction,
    SumsClient,
    SumsObservation,
    free_port,
    serve,
)
from tests.runs import quiet_train, tiny_config  # noqa: E402

CLIENT = "openenv:tests.envs.openenv_sums:SumsClient"
ECHO = "openenv:tests.envs.openenv_echo:EchoEnv"  # the environment `openenv init` scaffolds


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


def test_the_scaffolded_template_of_one_session_trains_under_default_flags(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = tmp_path / "run"
    with serve(app=echo_app(max_concurrent_envs=1)) as url:
        flags = ["--env", ECHO, "--env-arg", f"base_url={url}", "--run-dir", str(run_dir)]
        # The default --batch-size 8 and --concurrency 32: 16 episodes at once, on one session.
        tiny = ["--steps", "1", "--group-size", "2", "--max-tokens", "8", "--max-turns", "2"]
        code = main(["train", *flags, *tiny, "--eval-every", "0"])
    captured = capsys.readouterr()
    assert code == 0, captured.err
    said = [line for line in (captured.out + captured.err).splitlines() if "OpenEnv" in line]
    assert len(said) == 1 and f"the OpenEnv server at {url} holds 1 session at once" in said[0]
    assert "those beyond 1 wait in a queue" in said[0]
    rows = [row for row in run_files.read_metrics(run_dir) if row.get("step", 0) > 0]
    assert [row["step"] for row in rows] == [1]
    assert rows[0]["env/errors"] == 0.0 and rows[0]["env/turns"] == 2.0  # never done: 2 turns


def test_a_run_never_holds_more_sessions_than_the_capacity_it_learnt(tmp_path: Path) -> None:
    counts = SessionCounts()
    with serve(app=counted_echo_app(2, counts)) as url:
        config = tiny_config(
            tmp_path, env=ECHO, env_arg=(f"base_url={url}",), steps=1, concurrency=8, max_turns=2
        )
        quiet_train(config)
    assert counts.peak == 2  # the probe held both
    assert counts.refused == 1  # the probe's third session; no episode was ever refused
    assert counts.held == 0
    rows = [row for row in run_files.read_metrics(tmp_path / "run") if row.get("step", 0) > 0]
    assert rows[0]["env/errors"] == 0.0


def test_env_capacity_bounds_the_sessions_a_run_holds(tmp_path: Path) -> None:
    counts = SessionCounts()
    with serve(app=counted_echo_app(64, counts)) as url:
        config = tiny_config(
            tmp_path,
            env=ECHO,
            env_arg=(f"base_url={url}",),
            env_capacity=2,
            steps=1,
            concurrency=8,
            max_turns=2,
        )
        quiet_train(config)
    assert 1 <= counts.peak <= 2  # 8 episodes, 8 workers: unbounded, they would hold 8
    assert counts.refused == 0 and counts.held == 0
    rows = [row for row in run_files.read_metrics(tmp_path / "run") if row.get("step", 0) > 0]
    assert rows[0]["env/errors"] == 0.0


def test_env_capacity_round_trips_and_old_configs_load_without_it(tmp_path: Path) -> None:
    config = tiny_config(
        tmp_path, env=ECHO, env_arg=("base_url=http://127.0.0.1:9",), env_capacity=3
    )
    parsed, _resume = config_from_args(
        build_parser().parse_args(["train", *train_argv(to_dict(config))])
    )
    assert parsed == config and parsed.env_capacity == 3
    (tmp_path / "flags.toml").write_text("env_capacity = 2\n")
    assert load_toml(tmp_path / "flags.toml") == {"env_capacity": 2}
    old = {key: value for key, value in to_dict(config).items() if key != "env_capacity"}
    assert config_from_dict(old).env_capacity is None  # a config.json of before the flag
    with pytest.raises(ConfigError, match="--env-capacity must be >= 1, got 0"):
        tiny_config(tmp_path, env=ECHO, env_capacity=0)
    with pytest.raises(ConfigError, match="--env-capacity 2 is read by --env openenv"):
        tiny_config(tmp_path, env="grpo.envs:calculator_wordproblems", env_capacity=2)


def test_a_server_that_goes_down_still_fails_clearly_after_the_retries(tmp_path: Path) -> None:
    with serve() as url:
        factory = tiny_config(
            tmp_path, env=CLIENT, env_arg=(f"base_url={url}",), max_retries=1
        ).env_factory
    episode = factory(Task(question="", gold="", index=0))
    lines: list[str] = []
    episode.wait_for_session(lines.append)  # the server is gone: nothing to learn
    assert len(lines) == 1 and "did not open a first session to count its capacity" in lines[0]
    with pytest.raises(EnvError, match="did not open an episode after 2 tries"):
        episode.initial_observation()
    episode.close()


def test_a_queued_episode_stops_waiting_when_the_run_stops() -> None:
    lines: list[str] = []
    gate = SessionGate(lambda: Capacity(1, "one session"))
    gate.acquire(lines.append)  # the only place
    stop = threading.Event()
    ended: list[BaseException] = []

    def queued() -> None:
        try:
            gate.acquire(lines.append)
        except BaseException as error:  # noqa: BLE001 - the test looks at it
            ended.append(error)

    with stop_env_calls_on(stop):
        waiter = threading.Thread(target=queued, daemon=True)
        waiter.start()
        waiter.join(0.5)
        assert waiter.is_alive()  # queued: the place is taken
        stop.set()
        waiter.join(60)  # the 5 s grace of a stopping run, not forever
    assert not waiter.is_alive() and isinstance(ended[0], KeyboardInterrupt)
    gate.release()
    gate.acquire(lines.append)  # a freed place is taken at once
    assert lines == ["one session"] and gate.open == 1  # learnt once


class _SlowClient:
    """A client whose connect waits for `go`; it records what happens to it."""

    def __init__(self, events: list[str], go: threading.Event) -> None:
        self.events, self.go = events, go

    def sync(self) -> _SlowClient:
        return self

    def connect(self) -> None:
        self.events.append("connecting")
        self.go.wait(30)

    def reset(self, **_kwargs: Any) -> Any:
        self.events.append("reset")
        return SimpleNamespace(observation={"prompt": "hi"})

    def close(self) -> None:
        self.events.append("closed")


def test_a_session_opened_after_its_episode_was_closed_is_closed_and_frees_its_place() -> None:
    events: list[str] = []
    go = threading.Event()
    gate = SessionGate(lambda: Capacity(1, "one session"))
    episode = OpenEnvEpisode(
        Task(question="", gold=""),
        lambda: _SlowClient(events, go),
        to_action=str,
        to_messages=observation_messages,
        reset_args={},
        max_retries=0,
        gate=gate,
    )
    episode.wait_for_session(lambda _line: None)
    errors: list[BaseException] = []

    def opening() -> None:
        try:
            episode.initial_observation()
        except EnvError as error:
            errors.append(error)

    thread = threading.Thread(target=opening)
    thread.start()
    deadline = time.monotonic() + 30
    while "connecting" not in events and time.monotonic() < deadline:
        time.sleep(0.01)
    episode.close()  # as play_episode does when --env-timeout abandons the call
    assert gate.open == 0
    go.set()
    thread.join(30)
    assert events[-2:] == ["reset", "closed"]  # the late session did not stay open
    assert errors and "closed while its session opened" in str(errors[0])


def test_an_env_capacity_above_the_servers_is_named_when_its_sessions_are_refused(
    tmp_path: Path,
) -> None:
    with serve(app=echo_app(max_concurrent_envs=1)) as url:
        flags = dict(env=ECHO, env_arg=(f"base_url={url}",), env_capacity=2, max_retries=1)
        factory = tiny_config(tmp_path, **flags).env_factory
        first, second = (factory(Task(question="", gold="", index=i)) for i in range(2))
        lines: list[str] = []
        for episode in (first, second):
            episode.wait_for_session(lines.append)  # 2 places: neither waits
        assert len(lines) == 1 and "holds 2 sessions at once (--env-capacity)" in lines[0]
        first.initial_observation()
        with pytest.raises(EnvError, match="Does it hold --env-capacity 2 sessions at once"):
            second.initial_observation()
        first.close()
        second.close()
