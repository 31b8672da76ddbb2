"""--log-to: every tracker gets every step's metrics exactly once, offline, across a kill -9
and a resume; a tracker that fails is one line and never stops training; no API key is
written anywhere. The trackers are read back with their own readers: W&B's offline
transaction log (decoded with W&B's own protobuf records), TensorBoard's EventAccumulator,
Trackio's local SQLite store."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest

from grpo.training.run import run_files
from grpo.training.run.faults import FAULT_ENV
from grpo.training.trackers.fanout import chartable
from tests.runs import quiet_train, tiny_config
from tests.warm_grpo import Finished, WarmGrpo


def needs(*packages: str) -> None:
    """Skip, saying how to install them, unless the trackers' packages are installed."""
    for package in packages:
        pytest.importorskip(package, reason="pip install -e '.[trackers]' runs this test")


FLAGS = [
    *("--steps", "4", "--batch-size", "2", "--group-size", "4", "--max-tokens", "16"),
    *("--eval-every", "2", "--eval-limit", "4", "--save-every", "2", "--concurrency", "4"),
    *("--num-substeps", "1", "--seed", "0", "--swanlab-project", "grpo-tests"),
    *("--log-to", "wandb", "--log-to", "tensorboard", "--log-to", "trackio"),
]
SECRET = "sk-test-0123456789abcdef-never-written"
TIMEOUT_S = 240


def _env(tmp_path: Path, fault: str | None = None) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "offline"}
    env.update(TRACKIO_DIR=str(tmp_path / "trackio"), WANDB_API_KEY=SECRET)
    env.pop(FAULT_ENV, None)
    if fault:
        env[FAULT_ENV] = fault
    return env


def _grpo(warm: WarmGrpo, tmp_path: Path, *argv: str, fault: str | None = None) -> Finished:
    """`grpo train ARGV` as a process of its own, forked from the warm interpreter."""
    output = tmp_path / f"train-{len(list(tmp_path.glob('train-*.err')))}"
    return warm.run(["train", *argv], output, _env(tmp_path, fault), timeout=TIMEOUT_S)


# --- the trackers' own readers -----------------------------------------------------------


def wandb_history(wandb_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of every history record in the W&B offline runs under ``wandb_dir``.

    A ``.wandb`` file is W&B's header (7 bytes) then LevelDB log records (32 KiB blocks,
    7-byte headers: CRC, length, type) whose payloads are W&B's ``Record`` protobufs.
    """
    from wandb.proto import wandb_internal_pb2

    history = []
    for path in sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb")):
        data, position, payload = path.read_bytes(), 7, b""
        while position + 7 <= len(data):
            left_in_block = 32768 - position % 32768
            if left_in_block < 7:
                position += left_in_block
                continue
            length, kind = struct.unpack("<HB", data[position + 4 : position + 7])
            if length == 0 and kind == 0:
                position += left_in_block  # zero padding to the block's end
                continue
            payload += data[position + 7 : position + 7 + length]
            position += 7 + length
            if kind in (1, 4):  # FULL or LAST: one record done
                record = wandb_internal_pb2.Record()
                record.ParseFromString(payload)
                payload = b""
                if record.WhichOneof("record_type") == "history":
                    items = {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in record.history.item
                    }
                    step = int(items.pop("_step"))
                    metrics = {k: v for k, v in items.items() if not k.startswith("_")}
                    history.append((step, metrics))
    return history


def tensorboard_scalars(log_dir: Path) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) per scalar event, as TensorBoard shows them (purged steps dropped)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    accumulator = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    accumulator.Reload()
    return [
        (event.step, {tag: event.value})
        for tag in accumulator.Tags()["scalars"]
        for event in accumulator.Scalars(tag)
    ]


def trackio_logs(trackio_dir: Path, project: str, run: str) -> list[tuple[int, dict[str, float]]]:
    """(step, metrics) of every row Trackio's local store in ``trackio_dir`` holds for ``run``
    (read in a child process: Trackio fixes its directory when imported)."""
    reader = (
        "import json, sys; from trackio.sqlite_storage import SQLiteStorage; "
        "print(json.dumps(SQLiteStorage.get_logs(sys.argv[1], sys.argv[2])))"
    )
    result = subprocess.run(
        [sys.executable, "-c", reader, project, run],
        env={**os.environ, "TRACKIO_DIR": str(trackio_dir)},
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    return [
        (row["step"], {k: v for k, v in row.items() if k not in ("step", "timestamp")})
        for row in json.loads(result.stdout.strip().splitlines()[-1])
    ]


def assert_once_each(
    what: str, received: Sequence[tuple[int, Mapping[str, Any]]], rows: Sequence[Mapping[str, Any]]
) -> None:
    """Every metric of every metrics.jsonl row reached the tracker once, at its step."""
    seen: dict[tuple[int, str], list[float]] = {}
    for step, metrics in received:
        for key, value in metrics.items():
            seen.setdefault((step, key), []).append(value)
    expected = {
        (row["step"], key): value
        for row in rows
        for key, value in chartable(row).items()
        if key != "step"
    }
    twice = {key: values for key, values in seen.items() if len(values) > 1}
    assert not twice, f"{what} got these more than once: {sorted(twice)[:5]}"
    missing = sorted(set(expected) - set(seen))
    assert not missing, f"{what} lacks {missing[:5]}"
    extra = sorted(set(seen) - set(expected))
    assert not extra, f"{what} has steps metrics.jsonl has not: {extra[:5]}"
    for (step, key), value in expected.items():
        if not key.startswith("time/"):  # a redone step's timings differ from the killed one's
            assert seen[step, key][0] == pytest.approx(value, rel=1e-5, abs=1e-6), (what, step, key)


# --- the tests -----------------------------------------------------------------------------


@pytest.mark.slow
def test_every_tracker_gets_every_step_once_across_a_kill_and_resume(
    tmp_path: Path, warm_grpo: WarmGrpo
) -> None:
    needs("wandb", "tensorboard", "trackio")
    run_dir = tmp_path / "tracked"
    started = time.monotonic()
    first = _grpo(warm_grpo, tmp_path, *FLAGS, "--run-dir", str(run_dir), fault="log:5:SIGKILL")
    assert first.returncode == -9, first.stderr[-2000:]
    assert run_files.read_checkpoint(run_dir).step == 2
    second = _grpo(warm_grpo, tmp_path, "--resume", str(run_dir))
    assert second.returncode == 0, second.stderr[-2000:]
    elapsed = time.monotonic() - started

    rows = run_files.read_metrics(run_dir)
    assert [row["step"] for row in rows] == [0, 1, 2, 3, 4]
    assert_once_each("W&B", wandb_history(run_dir / "trackers" / "wandb"), rows)
    assert len(list((run_dir / "trackers" / "wandb").glob("wandb/offline-run-*"))) == 2
    run_ids = {p.name.rsplit("-", 1)[1] for p in (run_dir / "trackers/wandb").glob("wandb/off*")}
    assert len(run_ids) == 1, "the resumed launch continues the same W&B run"
    assert_once_each("TensorBoard", tensorboard_scalars(run_dir / "trackers" / "tensorboard"), rows)
    assert_once_each("Trackio", trackio_logs(tmp_path / "trackio", "grpo-tests", "tracked"), rows)
    # The API key in the environment reached no file of the run.
    for path in run_dir.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path
    print(f"two launches with W&B, TensorBoard and Trackio: {elapsed:.1f}s")


# --- the fan-out, with trackers that record, fail or hang ---------------------------------


class Recording:
    """A tracker that records what it gets; ``held`` is what its own store says it holds."""

    def __init__(self, name: str, *, rewinds: bool = False, held: int | None = None) -> None:
        self.name, self.rewinds, self.held = name, rewinds, held
        self.started: list[int | None] = []
        self.steps: list[int] = []
        self.finished = 0

    def start(self, run: Any, config: Mapping[str, Any], resume_step: int | None) -> None:
        self.started.append(resume_step)

    def held_through(self) -> int | None:
        return self.held

    def log(self, step: int, metrics: Mapping[str, float], texts: Any) -> None:
        self.steps.append(step)

    def finish(self) -> None:
        self.finished += 1


def _run_info(tmp_path: Path) -> Any:
    from grpo.training.trackers.base import RunInfo

    return RunInfo(tmp_path, "r", "p", None, ("grpo",), "disabled")


def _feed(tmp_path: Path, trackers: list[Any], resume_step: int, live: range, **kw: Any) -> None:
    from grpo.training.trackers.fanout import TrackerSet

    by_name = {tracker.name: tracker for tracker in trackers}
    rows = [{"step": step, "reward": step / 10} for step in range(resume_step + 1)]
    fanout = TrackerSet(
        list(by_name),
        _run_info(tmp_path),
        {},
        resume_step=resume_step,
        replay_rows=rows,
        note=kw.get("note", print),
        factory=by_name.__getitem__,
    )
    for step in live:
        fanout.log(step, {"reward": step / 10}, [])
        time.sleep(kw.get("step_s", 0))
    fanout.close()


def test_a_resume_sends_each_tracker_exactly_the_steps_it_lacks(tmp_path: Path) -> None:
    # The first launch: steps 0..5 reach both; a checkpoint at 3, then a kill.
    first = [Recording("appends"), Recording("rewinds", rewinds=True)]
    _feed(tmp_path, first, 0, range(0, 6))
    assert [tracker.steps for tracker in first] == [list(range(6))] * 2
    # Resumed at 3: the append-only one keeps 4 and 5 (its store says so) and gets 6 on;
    # the rewinding one (TensorBoard's purge) gets 4 and 5 again, as metrics.jsonl does.
    appends, rewinds = Recording("appends", held=5), Recording("rewinds", rewinds=True)
    _feed(tmp_path, [appends, rewinds], 3, range(4, 8))
    assert appends.steps == [6, 7] and rewinds.steps == [4, 5, 6, 7]
    assert appends.started == rewinds.started == [3]
    # A store that lost the steps a kill caught in flight: the missing ones up to the
    # checkpoint are replayed from metrics.jsonl, the rest redone.
    lost = Recording("appends", held=1)
    _feed(tmp_path, [lost], 3, range(4, 6))
    assert lost.steps == [2, 3, 4, 5]
    # No word from the store: the fan-out's own record (trackers/appends.json) says 5, the
    # last step sent above, so a resume at 7 replays 6 and 7 only.
    unknown = Recording("appends", held=None)
    _feed(tmp_path, [unknown], 7, range(8, 10))
    assert unknown.steps == [6, 7, 8, 9]
    # A run that starts over (no checkpoint) sends everything again, to a new tracker run.
    fresh = Recording("appends", held=None)
    _feed(tmp_path, [fresh], 0, range(0, 3))
    assert fresh.steps == [0, 1, 2] and fresh.started == [None]


class Failing(Recording):
    """Raises in ``start`` (when ``at`` is None) or when logging step ``at``."""

    def __init__(self, name: str, at: int | None) -> None:
        super().__init__(name)
        self.at = at

    def start(self, run: Any, config: Mapping[str, Any], resume_step: int | None) -> None:
        if self.at is None:
            raise RuntimeError("no login")

    def log(self, step: int, metrics: Mapping[str, float], texts: Any) -> None:
        if step == self.at:
            raise ConnectionError("network gone\nfor good")
        super().log(step, metrics, texts)


class Hanging(Recording):
    """Never returns from ``log`` of step 1 (a tracker stuck on a dead network)."""

    def log(self, step: int, metrics: Mapping[str, float], texts: Any) -> None:
        if step == 1:
            time.sleep(3600)
        super().log(step, metrics, texts)


def test_a_failing_or_hanging_tracker_is_one_line_and_never_blocks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.training.trackers import fanout

    monkeypatch.setattr(fanout, "QUEUE_STEPS", 5)
    monkeypatch.setattr(fanout, "FINISH_TIMEOUT_S", 1.0)
    lines: list[str] = []
    good = Recording("good")
    trackers = [Failing("nostart", None), Failing("crashes", 2), Hanging("hangs"), good]
    started = time.monotonic()
    _feed(tmp_path, trackers, 0, range(0, 20), note=lines.append, step_s=0.02)
    assert time.monotonic() - started < 3, "a tracker slowed the run"
    assert good.steps == list(range(20)) and good.finished == 1
    assert trackers[1].steps == [0, 1]
    assert sorted(lines) == [
        "crashes failed (ConnectionError: network gone for good); logging to the other "
        "trackers and metrics.jsonl",
        "hangs is 5 steps behind; logging to the other trackers and metrics.jsonl",
        "nostart failed (RuntimeError: no login); logging to the other trackers and metrics.jsonl",
    ]


def test_a_tracker_that_is_not_installed_is_one_line_and_the_run_goes_on(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from grpo.training.recipes.grpo.run import train

    needs("tensorboard")
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb raises ImportError
    lines: list[str] = []
    config = tiny_config(tmp_path, log_to=("wandb", "tensorboard"))
    result = train(config, echo=lines.append, progress=False)
    rows = run_files.read_metrics(result.run_dir)
    assert [row["step"] for row in rows] == [1, 2]
    (line,) = [line for line in lines if "wandb" in line and "[grpo] done" not in line]
    assert "pip install 'grpo[wandb]'" in line and "other trackers" in line
    assert_once_each(
        "TensorBoard", tensorboard_scalars(result.run_dir / "trackers/tensorboard"), rows
    )


@pytest.mark.parametrize("recipe", ["distill", "sft", "dpo"])
def test_every_recipe_logs_each_row_to_tensorboard_once(tmp_path: Path, recipe: str) -> None:
    needs("tensorboard")
    if recipe == "distill":
        from tests.training.test_distill import distill_config

        result = quiet_train(distill_config(tmp_path, "run", log_to=("tensorboard",)))
    else:
        module = __import__(f"tests.training.test_{recipe}", fromlist=["_config", "_quiet"])
        result = module._quiet(module._config(tmp_path, "run", log_to=("tensorboard",)))
    rows = run_files.read_metrics(result.run_dir)
    assert len(rows) >= 2
    assert_once_each(recipe, tensorboard_scalars(result.run_dir / "trackers/tensorboard"), rows)


# --- the flag --------------------------------------------------------------------------


def test_log_to_round_trips_through_the_command_line_toml_and_config_json(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from grpo.cli import build_parser, main
    from grpo.training.recipes.sft.config import SftConfig
    from grpo.training.settings.config import ConfigError, TrainConfig, config_from_dict, to_dict
    from grpo.training.settings.flags import config_from_args, load_toml, train_argv

    argv = train_argv({"log_to": ("wandb", "tensorboard")})
    assert argv == ["--log-to", "wandb", "--log-to", "tensorboard"]
    parsed, _ = config_from_args(build_parser().parse_args(["train", *argv]))
    assert parsed.log_to == ("wandb", "tensorboard")
    toml = tmp_path / "run.toml"
    toml.write_text('log-to = ["trackio"]\ntracker_group = "ablation"\n')
    assert load_toml(toml) == {"log_to": ("trackio",), "tracker_group": "ablation"}
    saved = json.loads(json.dumps(to_dict(parsed)))
    assert saved["log_to"] == ["wandb", "tensorboard"]
    assert config_from_dict(saved) == parsed
    # A config.json written before --log-to existed loads with the default (SwanLab).
    old = {key: value for key, value in saved.items() if key not in ("log_to", "tracker_group")}
    assert config_from_dict(old).log_to == ("swanlab",) == TrainConfig().log_to
    assert SftConfig(data="rows.jsonl", log_to=("none",)).log_to == ("none",)
    for bad, words in [
        (("tensorbored",), "--log-to 'tensorbored' is not one of swanlab, wandb"),
        (("none", "wandb"), "--log-to none means no tracker"),
        (("wandb", "wandb"), "names a tracker twice"),
        ((), "needs at least one tracker"),
    ]:
        with pytest.raises(ConfigError, match=words):
            TrainConfig(log_to=bad)
    assert main(["train", "--log-to", "mlflow", "--run-dir", str(tmp_path / "no")]) == 2
    assert "--log-to 'mlflow' is not one of" in capsys.readouterr().err
    assert not (tmp_path / "no").exists()


def test_compare_gives_each_run_its_own_tracker_run_grouped_by_the_experiment(
    tmp_path: Path,
) -> None:
    from grpo.tools.experiments.compare import compare_specs
    from grpo.tools.experiments.runner import planned_configs
    from grpo.training.settings.config import resolve_run

    specs = compare_specs(["ppo", "cispo"], [0, 1], {"log_to": ("tensorboard",)}, tmp_path / "exp")
    configs = planned_configs(specs)
    assert {config.tracker_group for config in configs} == {"exp"}
    assert {config.log_to for config in configs} == {("tensorboard",)}
    names = {resolve_run(config).run_name for config in configs}  # one tracker run each
    assert names == {"ppo-seed0", "ppo-seed1", "cispo-seed0", "cispo-seed1"}
    mine = compare_specs(["ppo"], [0], {"tracker_group": "mine"}, tmp_path / "exp")
    assert mine[0].overrides["tracker_group"] == "mine"
    # grpo sweep: log_to in the file's [base]; each launched run carries the flags.
    from grpo.tools.experiments.runner import launch_command
    from grpo.tools.experiments.sweep import load_sweep, sweep_specs
    from grpo.training.run.run_files import NEW

    toml = tmp_path / "sweep.toml"
    toml.write_text(
        'seeds = [0]\n[base]\nlog_to = ["tensorboard", "wandb"]\n'
        "[grid]\nlearning_rate = [1e-4, 2e-4]\n"
    )
    specs = sweep_specs(load_sweep(toml), tmp_path / "lr-sweep")
    argv = launch_command(specs[0], NEW, ["grpo", "train"])
    assert "--log-to tensorboard --log-to wandb" in " ".join(argv)
    assert "--tracker-group lr-sweep" in " ".join(argv)


# --- grpo plot on TensorBoard events ---------------------------------------------------------


def test_grpo_plot_reads_another_trainers_tensorboard_events(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    needs("tensorboard")
    from torch.utils.tensorboard import SummaryWriter

    from grpo.cli import main
    from grpo.tools.plots import read_run_metrics

    logs = tmp_path / "trl" / "runs" / "Dec07_04-00-00"  # where TRL's tensorboard logs go
    first = SummaryWriter(log_dir=str(logs))
    for step in (1, 2, 3, 4):
        first.add_scalar("train/reward", step / 10, global_step=step)
    first.close()
    again = SummaryWriter(log_dir=str(logs), purge_step=3)  # a resume redoing steps 3, 4
    for step in (3, 4):
        again.add_scalar("train/reward", step, global_step=step)
    again.close()
    assert read_run_metrics(tmp_path / "trl") == [
        {"step": 1, "train/reward": pytest.approx(0.1)},
        {"step": 2, "train/reward": pytest.approx(0.2)},
        {"step": 3, "train/reward": 3.0},
        {"step": 4, "train/reward": 4.0},
    ]
    grpo_run = tmp_path / "grpo-run"
    grpo_run.mkdir()
    writer = run_files.MetricsWriter(grpo_run)
    for step in (1, 2):
        writer.append(step, {"reward": step / 4})
    writer.close()
    out = tmp_path / "both.png"
    argv = ["plot", str(grpo_run), str(tmp_path / "trl"), "--metrics", "reward", "train/reward"]
    assert main([*argv, "--out", str(out)]) == 0
    assert out.stat().st_size > 0
    # Several runs' logs under one directory, or none: one line saying what to pass.
    SummaryWriter(log_dir=str(tmp_path / "trl" / "runs" / "other")).close()
    assert main(["plot", str(tmp_path / "trl"), "--out", str(tmp_path / "x.png")]) == 2
    assert "holds TensorBoard event files of 2 runs" in capsys.readouterr().err
    alone = ["plot", str(logs), "--out", str(tmp_path / "alone.png")]
    assert main(alone) == 0  # the default panel "reward" finds train/reward by its suffix
    assert "(1 metrics x 1 runs)" in capsys.readouterr().out
    empty = tmp_path / "empty"
    empty.mkdir()
    assert main(["plot", str(empty)]) == 2
    assert "nor TensorBoard event files" in capsys.readouterr().err
    for name in [name for name in sys.modules if name.split(".")[0] == "tensorboard"]:
        monkeypatch.setitem(sys.modules, name, None)  # as if tensorboard were not installed
    assert main(["plot", str(logs), "--metrics", "train/reward"]) == 2
    assert "pip install 'grpo[tensorboard]'" in capsys.readouterr().err


def test_wandb_goes_offline_without_a_login_and_when_online_fails(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    needs("wandb")
    import wandb

    from grpo.training.trackers import wandb_tracker
    from grpo.training.trackers.base import RunInfo

    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no login
    monkeypatch.setenv("NETRC", str(tmp_path / ".netrc"))
    assert not wandb_tracker.has_login()
    monkeypatch.setenv("WANDB_API_KEY", SECRET)
    assert wandb_tracker.has_login()  # online is tried: here it fails (no network)
    real_init, modes = wandb.init, []

    def no_network(**kwargs: Any) -> Any:
        modes.append(kwargs["mode"])
        if kwargs["mode"] == "online":
            raise ConnectionError("api.wandb.ai unreachable")
        return real_init(**kwargs)

    monkeypatch.setattr(wandb, "init", no_network)
    run = RunInfo(tmp_path / "run", "r", "p", "exp", ("grpo",), "disabled")
    tracker = wandb_tracker.WandbTracker()
    line = tracker.start(run, {"steps": 2}, None)
    assert modes == ["online", "offline"]
    assert line is not None and "W&B online failed (api.wandb.ai unreachable)" in line
    assert tracker.held_through() == -1
    tracker.log(1, {"reward": 0.5}, [])
    tracker.log(2, {"reward": 0.75}, [])
    tracker.finish()
    # W&B's service process may write the .wandb file just after finish() returns.
    deadline = time.monotonic() + 20
    while not wandb_history(tmp_path / "run/trackers/wandb") and time.monotonic() < deadline:
        time.sleep(0.1)
    assert wandb_history(tmp_path / "run" / "trackers" / "wandb") == [
        (1, {"reward": 0.5}),
        (2, {"reward": 0.75}),
    ]
    # A resume of this run continues its W&B run and knows what it already holds.
    again = wandb_tracker.WandbTracker()
    again.start(run, {"steps": 2}, 2)
    assert again.held_through() == 2
    again.finish()
    run_ids = {path.name[-8:] for path in (tmp_path / "run/trackers/wandb/wandb").glob("off*")}
    assert len(run_ids) == 1


def test_tensorboard_purges_after_a_resume_and_starts_over_with_its_run(tmp_path: Path) -> None:
    needs("tensorboard")
    from grpo.training.trackers.tensorboard_tracker import TensorboardTracker

    run, log_dir = _run_info(tmp_path), tmp_path / "trackers" / "tensorboard"

    def launch(resume_step: int | None, steps: range, value: float) -> None:
        tracker = TensorboardTracker()
        tracker.start(run, {"steps": 5}, resume_step)
        for step in steps:
            tracker.log(step, {"reward": value}, [])
        tracker.finish()

    launch(None, range(0, 5), 1.0)
    launch(2, range(3, 5), 2.0)  # resumed at the checkpoint of step 2: 3 and 4 redone

    def by_step() -> list[tuple[int, dict[str, float]]]:
        return sorted(tensorboard_scalars(log_dir), key=lambda item: item[0])

    assert by_step() == [
        (0, {"reward": 1.0}),
        (1, {"reward": 1.0}),
        (2, {"reward": 1.0}),
        (3, {"reward": 2.0}),
        (4, {"reward": 2.0}),
    ]
    launch(None, range(0, 2), 3.0)  # started over (no checkpoint): the old events go
    assert by_step() == [(0, {"reward": 3.0}), (1, {"reward": 3.0})]
