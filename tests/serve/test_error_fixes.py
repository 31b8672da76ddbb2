"""A user-facing error reaches stderr whole: the fix at its end is never cut off.

pytrio's errors print as `message | Hint: ... | Request: ... | Details: ...`; the CLI once cut
every message at its first ` | Hint:`, and so cut off the fix of our own messages that quote
a pytrio error before it (docs/RELIABILITY.md, "Bad input"). These run against `grpo serve`,
whose errors are pytrio's, with its hint.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest

from grpo.cli import describe_error, main
from tests.test_cli import TINY_FLAGS


def _stderr_of(capsys: pytest.CaptureFixture[str], argv: list[str]) -> str:
    """`grpo argv` in-process: exit 2, one error line on stderr (after at most `grpo eval`'s
    stage lines, "[grpo eval] ..."), no traceback."""
    assert main(argv) == 2
    err = capsys.readouterr().err
    said = [line for line in err.strip().splitlines() if not line.startswith("[grpo eval] ")]
    assert "Traceback" not in err and len(said) == 1, err
    return said[0]


def test_our_messages_are_never_cut_and_pytrios_keep_their_hint() -> None:
    from pytrio.errors.base import ValidationError

    quoted = ValueError("--x: cannot load (gone | Hint: retry | Request: GET /a); do this")
    assert describe_error(quoted) == (str(quoted), 2)
    error = ValidationError("no such path", hint="give a saved path", operation="GET /a")
    assert "| Request:" in str(error)
    assert describe_error(error) == ("no such path (hint: give a saved path)", 2)


def test_resume_after_its_checkpoint_was_deleted_prints_the_whole_fix(
    served: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    train = ["train", *TINY_FLAGS, "--backend", "pytrio", "--no-normalization-probe"]
    assert main([*train, "--steps", "1", "--save-every", "1", "--run-dir", str(run)]) == 0
    for checkpoints in Path(served.state.registry.root).glob("run-*"):
        shutil.rmtree(checkpoints)  # every checkpoint of the run, deleted on the service
    capsys.readouterr()
    err = _stderr_of(capsys, ["train", "--resume", str(run), "--steps", "2"])
    assert "cannot be loaded: no local checkpoint at" in err
    assert "no intact earlier checkpoint was found. Restore it (it lives on the service" in err
    assert f"or delete {run / 'checkpoint.json'} and {run / 'metrics.jsonl'} to rerun" in err
    assert "| Hint:" not in err and "| Request:" not in err


def test_eval_of_deleted_weights_through_a_service_prints_the_whole_fix(
    served: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    gone = f"local://{served.state.registry.root}/run-x/weights/final"
    err = _stderr_of(capsys, ["eval", "--backend", "pytrio", "--checkpoint", gone, "--limit", "2"])
    assert f"--checkpoint {gone}: neither sampler weights nor a training state" in err
    assert "give the sampler_path of a run's summary.json" in err and "or use --run-dir" in err
    assert "| Request:" not in err
