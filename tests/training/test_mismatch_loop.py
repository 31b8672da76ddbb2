"""Mismatch metrics and corrections through the loop, on the local backend and the PyTRIO path."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from grpo.training.recipes.grpo.run import sampler_weights_name, sampling_mismatch_note
from grpo.training.run.run_files import read_metrics
from grpo.training.settings.config import ConfigError, TrainConfig
from tests import runs as tiny_runs

TINY = {**tiny_runs.TINY, "max_tokens": 16}
MISMATCH_KEYS = (
    "kl_k1",
    "kl_k3",
    "max_abs_log_ratio",
    "frac_off_by_2x",
    "seq_ratio_std",
    "seq_ratio_min",
    "seq_ratio_max",
)


def _rows(tmp_path: Path, name: str, service: Any = None, **overrides: Any) -> list[dict]:
    config = TrainConfig(**{**TINY, "run_dir": str(tmp_path / name), **overrides})
    result = tiny_runs.quiet_train(config, service_client=service)
    return [row for row in read_metrics(result.run_dir) if row["datums"] > 0]


def test_float32_sampling_has_no_mismatch_and_bfloat16_has_some(tmp_path: Path) -> None:
    exact = _rows(tmp_path, "f32")
    reduced = _rows(tmp_path, "bf16", sampler_dtype="bfloat16")
    assert exact and reduced, "no step trained: every group was degenerate"
    for row in exact:
        assert all(f"mismatch/{key}" in row for key in MISMATCH_KEYS)
        assert row["mismatch/max_abs_log_ratio"] < 1e-4
    assert all(row["mismatch/kl_k3"] > 1e-7 for row in reduced)
    assert all(row["mismatch/max_abs_log_ratio"] > 1e-3 for row in reduced)


def test_stale_rollouts_are_named_mismatch_and_staleness(tmp_path: Path) -> None:
    rows = _rows(tmp_path, "k1", steps=3, max_steps_off_policy=1, group_size=6)
    for row in rows:
        prefix = "mismatch" if row["off_policy_steps"] == 0 else "mismatch_and_staleness"
        assert f"{prefix}/kl_k3" in row, row
    assert any(row["off_policy_steps"] > 0 for row in rows), "the pipeline never filled: setup"


def test_a_correction_logs_its_fraction_and_agrees_across_call_paths(tmp_path: Path) -> None:
    """token_mask under token_mean: the local built-in loss (datums with a mask entry) and the
    PyTRIO path's custom loss (`--backend pytrio` runs non-sum reductions client-side; here
    against a local service) give the same rows."""
    from grpo.backends.local import LocalServiceClient

    remote_service = LocalServiceClient(root=tmp_path / "remote", seed=0)
    flags = dict(
        mismatch_correction="token_mask",
        mismatch_mask_low=0.999,
        mismatch_mask_high=1.001,
        temperature=1.3,
        reduction="token_mean",
        loss_fn="ppo",
    )
    local = _rows(tmp_path, "local", **flags)
    remote = _rows(tmp_path, "pytrio", remote_service, backend="pytrio", **flags)
    assert local and any(row["mismatch_correction/frac_masked"] > 0 for row in local)
    for local_row, remote_row in zip(local, remote, strict=True):
        assert "time/proximal_forward" in local_row
        for key, value in local_row.items():
            # usage/* differ on purpose: the PyTRIO path's custom loss costs one more forward.
            if not key.startswith(("time/", "usage/")):
                assert remote_row[key] == pytest.approx(value, rel=1e-4, abs=1e-6), key


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"sampler_dtype": "bfloat16", "backend": "pytrio"}, "--sampler-dtype"),
        ({"sampler_dtype": "float16"}, "--sampler-dtype"),
        ({"mismatch_correction": "token_truncate", "loss_fn": "dro"}, "linear in the advantage"),
        ({"mismatch_correction": "token_mask", "mismatch_mask_low": 1.5}, "--mismatch"),
        ({"mismatch_correction": "token_truncate", "mismatch_cap": 0.5}, "--mismatch"),
    ],
)
def test_bad_mismatch_flags_fail_when_the_config_is_built(
    tmp_path: Path, overrides: dict, message: str
) -> None:
    with pytest.raises(ConfigError, match=message):
        TrainConfig(**{**TINY, "run_dir": str(tmp_path / "x"), **overrides})


def test_a_tempered_or_filtered_sampler_is_announced() -> None:
    assert sampling_mismatch_note(TrainConfig()) is None
    assert "temperature 0.7" in str(sampling_mismatch_note(TrainConfig(temperature=0.7)))
    assert "top-p 0.9" in str(sampling_mismatch_note(TrainConfig(top_p=0.9)))


def test_sampler_weights_names_are_valid_checkpoint_names() -> None:
    assert (
        sampler_weights_name("mismatch_correction=none-seed1") == "mismatch_correction_none-seed1"
    )
    assert sampler_weights_name("plain-seed0") == "plain-seed0"
    assert sampler_weights_name("==") == "final"


def test_masked_tokens_keep_their_place_in_the_datums_mask(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A masked token (w = 0, so A = 0) still counts in a mean's denominator at the backend."""
    import numpy as np

    import grpo.training.run.learner
    from grpo.backends.datums import batch_to_datums, read_datums
    from grpo.core.alignment import align, pack

    batch = pack([align([5, 6], [7, 8, 9], [-0.1, -0.2, -0.3], 0.0)])
    with_mask = read_datums(batch_to_datums(batch, with_mask=True))
    assert with_mask.mask_N.tolist() == np.asarray(batch.mask, dtype=bool).tolist()
    assert not read_datums(batch_to_datums(batch)).mask_N.any()

    calls: list[bool] = []

    def recording(batch: Any, *, with_mask: bool = False) -> Any:
        calls.append(with_mask)
        return batch_to_datums(batch, with_mask=with_mask)

    monkeypatch.setattr(grpo.training.run.learner, "batch_to_datums", recording)
    assert _rows(tmp_path, "mean", mismatch_correction="token_mask", reduction="token_mean")
    trained_with_mean = list(calls)
    assert _rows(tmp_path, "sum", mismatch_correction="token_mask")
    assert True in trained_with_mean and calls[-1] is False


def test_run_stats_read_the_logged_mismatch(tmp_path: Path) -> None:
    from grpo.tools.experiments.stats import RunData, run_stats

    rows = [
        {"step": 1, "reward": 0.5, "mismatch/max_abs_log_ratio": 0.2, "mismatch/kl_k3": 0.01},
        {"step": 2, "reward": 0.6, "mismatch/max_abs_log_ratio": 0.1, "mismatch/kl_k3": 0.03},
    ]
    run = RunData(run_dir=tmp_path, config={"loss_fn": "ppo"}, rows=rows, summary=None)
    stats = run_stats(run, label="ppo", seed=0, last_steps=2)
    assert stats.mismatch_max_abs_log == pytest.approx(0.2)
    assert stats.mismatch_kl == pytest.approx(0.02)
