"""The run directory: atomic files, relative checkpoint paths, metrics scanning, the lock."""

from __future__ import annotations

import json
import multiprocessing
from pathlib import Path

import pytest

from grpo.training.run import run_files as rd


def test_write_json_atomic_leaves_no_temp_file_and_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "x.json"
    rd.write_json_atomic(path, {"b": 1, "a": [1, 2]})
    assert rd.read_json(path, what="test") == {"a": [1, 2], "b": 1}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["x.json"]


def test_read_json_names_file_and_line_of_damage(tmp_path: Path) -> None:
    path = tmp_path / "checkpoint.json"
    path.write_text('{\n  "step": 3,\n  oops\n}')
    with pytest.raises(rd.RunDirError, match=r"checkpoint.json line 3 column 3 is not valid JSON"):
        rd.read_checkpoint(tmp_path)


def test_checkpoint_inside_the_run_dir_is_stored_relative_and_follows_a_move(
    tmp_path: Path,
) -> None:
    run = tmp_path / "run"
    state = run / "backend" / "states" / "step-000002"
    state.mkdir(parents=True)
    rd.write_checkpoint(run, rd.Checkpoint(step=2, state_path=f"local://{state}"), run_name="r")
    stored = json.loads((run / rd.CHECKPOINT_FILE).read_text())
    assert stored["state_path"] == "backend/states/step-000002"
    moved = tmp_path / "moved"
    run.rename(moved)
    checkpoint = rd.read_checkpoint(moved)
    assert checkpoint == rd.Checkpoint(
        step=2, state_path=f"local://{moved.resolve()}/backend/states/step-000002"
    )


def test_checkpoint_outside_the_run_dir_is_stored_as_given(tmp_path: Path) -> None:
    rd.write_checkpoint(
        tmp_path, rd.Checkpoint(step=1, state_path="pytrio://runs/abc/1"), run_name="r"
    )
    assert rd.read_checkpoint(tmp_path) == rd.Checkpoint(step=1, state_path="pytrio://runs/abc/1")


def _write_lines(path: Path, text: str) -> None:
    path.write_text(text)


def test_scan_metrics_reports_damaged_lines_and_a_cut_off_tail(tmp_path: Path) -> None:
    path = tmp_path / rd.METRICS_FILE
    _write_lines(path, '{"step": 1, "r": 1}\nnot json\n{"step": 2}\n{"step": 3, "r"')
    scanned = rd.scan_metrics(path)
    assert [row["step"] for row in scanned.rows] == [1, 2]
    assert scanned.bad_lines == (2, 4)
    assert scanned.truncated_tail
    with pytest.raises(rd.RunDirError, match="line 2 is not a metrics row"):
        rd.read_metrics(tmp_path)


def test_read_metrics_skips_only_a_cut_off_last_line(tmp_path: Path) -> None:
    _write_lines(tmp_path / rd.METRICS_FILE, '{"step": 1}\n{"step": 2, "x": ')
    assert rd.read_metrics(tmp_path) == [{"step": 1}]


def test_a_complete_but_damaged_last_line_is_reported(tmp_path: Path) -> None:
    _write_lines(tmp_path / rd.METRICS_FILE, '{"step": 1}\n{"step": null}\n')
    with pytest.raises(rd.RunDirError, match="line 2"):
        rd.read_metrics(tmp_path)


def test_merge_rows_keeps_latest_non_null_value_per_step() -> None:
    rows = [{"step": 2, "a": 1.0}, {"step": 1, "a": 0.0}, {"step": 2, "a": None, "b": 3.0}]
    assert rd.merge_rows_by_step(rows) == [{"step": 1, "a": 0.0}, {"step": 2, "a": 1.0, "b": 3.0}]


def test_resume_without_checkpoint_drops_every_row_including_the_baseline(tmp_path: Path) -> None:
    _write_lines(tmp_path / rd.METRICS_FILE, '{"step": 0, "test/reward": 0.2}\n{"step": 1}\n')
    assert rd.prepare_metrics_for_resume(tmp_path, None) == 2
    assert rd.read_metrics(tmp_path) == []


def test_resume_keeps_rows_up_to_the_checkpoint_and_drops_the_rest(tmp_path: Path) -> None:
    rows = "".join(json.dumps({"step": step}) + "\n" for step in range(0, 5))
    _write_lines(tmp_path / rd.METRICS_FILE, rows + '{"step": 5, "x"')
    assert rd.prepare_metrics_for_resume(tmp_path, 2) == 2
    assert [row["step"] for row in rd.read_metrics(tmp_path)] == [0, 1, 2]


def test_resume_refuses_when_a_covered_row_is_damaged(tmp_path: Path) -> None:
    _write_lines(tmp_path / rd.METRICS_FILE, '{"step": 1}\n{"step": 2, "reward": 0.\n{"step": 3}\n')
    with pytest.raises(rd.RunDirError, match="line 2 is damaged.*covers steps up to 2"):
        rd.prepare_metrics_for_resume(tmp_path, 2)
    assert (tmp_path / rd.METRICS_FILE).read_text().count("\n") == 3


def test_resume_refuses_when_the_checkpoint_step_has_no_row(tmp_path: Path) -> None:
    _write_lines(tmp_path / rd.METRICS_FILE, '{"step": 1}\n')
    with pytest.raises(rd.RunDirError, match="step 2 has no row"):
        rd.prepare_metrics_for_resume(tmp_path, 2)


def test_metrics_writer_turns_non_finite_values_into_null(tmp_path: Path) -> None:
    writer = rd.MetricsWriter(tmp_path)
    writer.append(1, {"loss": float("nan"), "reward": 0.5})
    writer.close()
    assert rd.read_metrics(tmp_path) == [{"step": 1, "loss": None, "reward": 0.5}]


def test_run_status(tmp_path: Path) -> None:
    assert rd.run_status(tmp_path) == rd.NEW
    (tmp_path / rd.CONFIG_FILE).write_text("{}")
    assert rd.run_status(tmp_path) == rd.UNFINISHED
    (tmp_path / rd.SUMMARY_FILE).write_text("{}")
    assert rd.run_status(tmp_path) == rd.FINISHED


def _hold(run: str, ready: multiprocessing.Event, release: multiprocessing.Event) -> None:
    with rd.owned(Path(run)):
        ready.set()
        release.wait(20)


def test_a_second_owner_is_refused_with_the_first_ones_pid(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    try:
        assert ready.wait(30)
        with pytest.raises(rd.RunDirError, match=rf"in use by pid {holder.pid} "):
            with rd.owned(tmp_path):
                pass
    finally:
        release.set()
        holder.join(30)
    with rd.owned(tmp_path):
        pass


def test_a_killed_owner_leaves_no_stale_lock(tmp_path: Path) -> None:
    context = multiprocessing.get_context("spawn")
    ready, release = context.Event(), context.Event()
    holder = context.Process(target=_hold, args=(str(tmp_path), ready, release))
    holder.start()
    assert ready.wait(30)
    holder.kill()
    holder.join(30)
    with rd.owned(tmp_path):
        pass


def test_the_same_process_cannot_own_a_directory_twice(tmp_path: Path) -> None:
    with rd.owned(tmp_path):
        with pytest.raises(rd.RunDirError, match="in use"):
            with rd.owned(tmp_path):
                pass
