"""`grpo dpo`'s reference cache is tied to its reference and its contents (a checksum): a
cache edited by hand, damaged, or holding values that are no log-probs is said, naming the
file and the entry, and computed again; a cache of an older grpo is used and re-signed.
Pairs whose chosen and rejected encode the same are refused (all) or left out (some), in
the pre-flight of a run and of a dry run."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from grpo.cli import main
from grpo.training.recipes.dpo.recipe import dpo
from grpo.training.recipes.dpo.reference_cache import CACHE_FILE, FORMAT, read_cache
from grpo.training.recipes.grpo.run import RunStopped
from grpo.training.run import run_files
from tests.invariance import LOGPROB_ATOL, assert_same_rows
from tests.runs import comparable
from tests.training.test_dpo import _config, _CountingService, _local, _quiet, _write
from tests.training.test_sft import _SigintAfter


def _stopped_at_step_3(tmp_path: Path, name: str) -> tuple[Path, dict[str, float]]:
    """A `grpo dpo` run stopped by Ctrl-C at step 3, and the reference log-probs it cached."""
    service = _SigintAfter(_local(tmp_path / name / "backend"), n=3)
    with pytest.raises(RunStopped):
        _quiet(_config(tmp_path, name), service_client=service)
    cache = json.loads((tmp_path / name / CACHE_FILE).read_text())
    assert cache["format"] == FORMAT and cache["checksum"]
    return tmp_path / name, cache["logprobs"]


def _assert_recomputed(path: Path, original: dict[str, float]) -> None:
    """The cache holds the reference's own values again, under a checksum that matches."""
    payload = json.loads(path.read_text())
    assert payload["format"] == FORMAT
    checksum = payload.pop("checksum")
    assert checksum == run_files.payload_checksum(payload)
    assert payload["logprobs"].keys() == original.keys()
    for key, value in original.items():
        assert payload["logprobs"][key] == pytest.approx(value, abs=LOGPROB_ATOL)


def test_a_reference_cache_edited_by_hand_is_computed_again_and_the_resume_is_exact(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    whole = _quiet(_config(tmp_path, "whole"))
    run_dir, original = _stopped_at_step_3(tmp_path, "stopped")
    path = run_dir / CACHE_FILE
    payload = json.loads(path.read_text())  # every value shifted at random, checksum kept
    rng = np.random.default_rng(0)
    payload["logprobs"] = {key: value + rng.normal(0, 3) for key, value in original.items()}
    path.write_text(json.dumps(payload))
    capsys.readouterr()
    assert main(["dpo", "--resume", str(run_dir)]) == 0
    out = capsys.readouterr().out
    assert f"{path} does not match its checksum (edited by hand or damaged)" in out, out
    _assert_recomputed(path, original)
    rows, expected = run_files.read_metrics(run_dir), run_files.read_metrics(whole.run_dir)
    # The reference's tokens are paid (and counted) again in the first resumed step; every
    # trained number equals the uninterrupted run's.
    first_resumed = next(row for row in rows if row["step"] == 4)
    paid_once = expected[-1]["usage/cum_prompt_tokens"]
    assert first_resumed["usage/prompt_tokens"] == paid_once > 0

    def trained(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
        return [{k: v for k, v in row.items() if not k.startswith("usage/")} for row in rows]

    assert_same_rows(comparable(trained(rows)), comparable(trained(expected)))


def test_cache_values_that_are_no_log_probs_are_named_and_computed_again(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, original = _stopped_at_step_3(tmp_path, "stopped")
    path = run_dir / CACHE_FILE
    text_key, nan_key = sorted(original)[:2]
    # As an older grpo wrote it (no checksum), with a string and a NaN in it.
    legacy = {"format": "grpo-reference-logprobs/1", "reference": "base:grpo/tiny-qwen3-bpe"}
    bad = {**original, text_key: "abc", nan_key: float("nan")}
    path.write_text(json.dumps({**legacy, "logprobs": bad}))
    capsys.readouterr()
    assert main(["dpo", "--resume", str(run_dir)]) == 0
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and "could not convert" not in captured.err
    assert (
        f'{path}: entry {text_key!r} holds "abc" (and 1 more), not a log-prob (a finite '
        "number); those entries are computed again" in captured.out
    ), captured.out
    _assert_recomputed(path, original)
    assert run_files.read_summary(run_dir)["finished"]


def test_an_older_cache_without_a_checksum_is_used_and_signed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir, original = _stopped_at_step_3(tmp_path, "stopped")
    path = run_dir / CACHE_FILE
    legacy = {"format": "grpo-reference-logprobs/1", "reference": "base:grpo/tiny-qwen3-bpe"}
    path.write_text(json.dumps({**legacy, "logprobs": original}))
    calls: list[int] = []
    lines: list[str] = []
    service = _CountingService(_local(run_dir / "backend"), calls)
    config = _config(tmp_path, "stopped")
    dpo(config, resume=True, service_client=service, echo=lines.append, progress=False)
    assert calls == []  # its values are used: an old run resumes without paying again
    assert any("from before reference caches had a checksum" in line for line in lines), lines
    payload = json.loads(path.read_text())
    assert payload["logprobs"] == original  # the same values, now under a checksum
    assert payload.pop("checksum") == run_files.payload_checksum(payload)


def test_read_cache_trusts_only_a_file_that_matches_its_checksum(tmp_path: Path) -> None:
    path = tmp_path / CACHE_FILE
    key = "a" * 64

    def signed(values: dict[str, Any], **fields: Any) -> dict[str, Any]:
        payload = {"format": FORMAT, "reference": "base:m", "logprobs": values, **fields}
        return {**payload, "checksum": run_files.payload_checksum(payload)}

    notes: list[str] = []
    path.write_text(json.dumps(signed({key: -3.5})))
    assert read_cache(tmp_path, notes.append) == ({key: -3.5}, False) and notes == []
    cases = [
        ({**signed({key: -3.5}), "logprobs": {key: -1.0}}, "does not match its checksum"),
        (signed({key: "abc"}), f'entry {key!r} holds "abc", not a log-prob'),
        (signed({key: float("inf")}), f"entry {key!r} holds Infinity, not a log-prob"),
        (signed({key: -1.0}, format="grpo-reference-logprobs/9"), "is of format"),
        ([1, 2], "holds no 'logprobs' object"),
    ]
    for payload, message in cases:
        notes.clear()
        path.write_text(json.dumps(payload))
        assert read_cache(tmp_path, notes.append) == ({}, True)
        assert len(notes) == 1 and notes[0].startswith(str(path)) and message in notes[0]
    path.write_text('{"logprobs": {')
    assert read_cache(tmp_path, notes.append) == ({}, True)
    assert "cannot be read as JSON" in notes[-1]


def _pairs(count: int, same: set[int]) -> list[dict[str, Any]]:
    """``count`` pairs; those of row numbers in ``same`` have chosen equal to rejected once
    encoded (a string against the same text as an assistant message)."""
    return [
        {
            "prompt": f"{n}+1?",
            "chosen": str(n + 1),
            "rejected": {"role": "assistant", "content": str(n + 1)} if n in same else str(n),
        }
        for n in range(1, count + 1)
    ]


def test_pairs_whose_chosen_equals_rejected_are_refused_or_left_out_with_their_count(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = _write(tmp_path / "same.jsonl", _pairs(8, same=set(range(1, 9))))
    run_dir = tmp_path / "run"
    argv = ["dpo", "--data", str(data), "--run-dir", str(run_dir), "--steps", "1"]
    for extra in (["--dry-run"], []):
        assert main([*argv, *extra]) == 2
        err = capsys.readouterr().err
        assert "Traceback" not in err, err
        assert err.splitlines()[-1] == (
            f"grpo dpo: error: {data}: all 8 pairs have the chosen completion identical to the "
            "rejected one once encoded: there is no preference to learn (the loss would stay "
            "at log 2); check that 'chosen' and 'rejected' hold different completions"
        )
        assert not run_dir.exists()
    some = _write(tmp_path / "some.jsonl", _pairs(12, same={3, 7}))
    held = _write(tmp_path / "held.jsonl", _pairs(2, same={1, 2}))  # --eval-data too
    assert main([*argv[:2], str(some), *argv[3:], "--eval-data", str(held), "--dry-run"]) == 2
    assert f"{held}: all 2 pairs" in capsys.readouterr().err
    note = (
        f"{some}: 2 of 12 pairs have the chosen completion identical to the rejected one once "
        "encoded (rows 3, 7): they teach no preference and are left out"
    )
    argv = ["dpo", "--data", str(some), "--run-dir", str(run_dir), "--steps", "1"]
    assert main([*argv, "--eval-fraction", "0.2", "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert f"note: {note}" in out and "8 train / 2 held-out pairs" in out, out
    assert main([*argv, "--eval-fraction", "0.2", "--eval-every", "0"]) == 0
    assert f"[grpo] {note}" in capsys.readouterr().out
    assert run_files.read_summary(run_dir)["finished"]
