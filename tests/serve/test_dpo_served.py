"""`grpo dpo --backend pytrio` through `grpo serve`: the DPO loss runs through pytrio's own
``forward_backward_custom`` (a forward, then a forward_backward with the gradient as
weights) and gives the local backend's numbers."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from grpo.training.run import run_files
from tests.invariance import assert_same_rows
from tests.runs import comparable
from tests.serve.test_serve import without_forward_usage
from tests.training.test_dpo import _config, _quiet


def test_dpo_through_the_server_equals_the_local_backend(served: Any, tmp_path: Path) -> None:
    options = dict(steps=2, eval_every=2, save_every=0)
    remote = _quiet(_config(tmp_path, "remote", backend="pytrio", **options))
    local = _quiet(_config(tmp_path, "local", backend="local", **options))
    remote_rows = comparable(run_files.read_metrics(remote.run_dir))
    local_rows = comparable(run_files.read_metrics(local.run_dir))
    # pytrio's SDK runs the custom loss as a forward, then a forward_backward: one more
    # forward of the trained positions each step, counted as forward tokens.
    extra = [
        r["usage/forward_tokens"] - lo["usage/forward_tokens"]
        for r, lo in zip(remote_rows, local_rows)
    ]
    assert extra == [row.get("usage/trained_tokens", 0) for row in remote_rows]
    assert_same_rows(without_forward_usage(remote_rows), without_forward_usage(local_rows))
    assert remote_rows[-1]["dpo/margin"] != 0.0
