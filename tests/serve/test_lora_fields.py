"""The LoRA fields have one definition (`LoraSpec.to_wire`/`from_wire`, `lora_wire_fields`):
checkpoint metadata, a training run's records and the by-checkpoint lookup all use it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from grpo.backends.local import LoraSpec, checkpoint_lora_spec, lora_wire_fields
from grpo.backends.local.checkpoint import metadata_for, read_metadata
from grpo.serve.wire import CheckpointRecord, TrainingRun, checkpoint_record, training_run_record

SPEC = LoraSpec(rank=8, seed=3, train_mlp=True, train_attn=False, train_unembed=True)

# The grpo_local.json an earlier version wrote: the LoRA fields under these names.
METADATA_ON_DISK = {
    "base_model": "grpo/tiny",
    "created_unix": 1.5,
    "format": 1,
    "kind": "state",
    "lora_rank": 8,
    "name": "step-2",
    "optimizer_steps": 2,
    "run_id": "run-1",
    "seed": 3,
    "train_attn": False,
    "train_mlp": True,
    "train_unembed": True,
    "ttl_seconds": None,
}


def test_a_metadata_file_written_before_reads_the_same_spec(tmp_path: Path) -> None:
    (tmp_path / "grpo_local.json").write_text(json.dumps(METADATA_ON_DISK, indent=2))
    assert checkpoint_lora_spec(read_metadata(tmp_path)) == SPEC


def test_metadata_for_writes_the_fields_as_before() -> None:
    metadata = metadata_for(
        kind="state",
        base_model="grpo/tiny",
        spec=SPEC,
        run_id="run-1",
        name="step-2",
        ttl_seconds=None,
        optimizer_steps=2,
    )
    assert {**metadata, "created_unix": 1.5} == METADATA_ON_DISK


def test_to_wire_then_from_wire_is_the_identity_and_names_the_rank_lora_rank() -> None:
    wire = SPEC.to_wire()
    assert list(wire) == ["lora_rank", "seed", "train_mlp", "train_attn", "train_unembed"]
    assert LoraSpec.from_wire(wire) == SPEC


def test_lora_wire_fields_converts_without_validating_and_keeps_a_missing_seed_none() -> None:
    request = {"lora_rank": 2, "train_mlp": 0, "train_attn": 0, "train_unembed": 0, "x": 1}
    assert lora_wire_fields(request) == {
        "lora_rank": 2,
        "seed": None,
        "train_mlp": False,
        "train_attn": False,
        "train_unembed": False,
    }
    with pytest.raises(Exception, match="rank must be in"):
        LoraSpec.from_wire({**request, "seed": 0})


def test_a_training_runs_records_carry_the_requested_lora_fields() -> None:
    lora = lora_wire_fields({**SPEC.to_wire(), "seed": None})
    run = TrainingRun(
        cuid="train-1",
        session="session-1",
        base_model="grpo/tiny",
        model_id="/tokenizers/grpo--tiny",
        lora=lora,
        source_checkpoint_uri="",
        restore_optimizer=False,
        created_at="2026-01-01T00:00:00+00:00",
        updated_at="2026-01-01T00:00:00+00:00",
    )
    record = training_run_record(run)
    assert record["training_params"] == {"restore_optimizer": False, **lora}
    assert {key: record[key] for key in lora} == lora
    checkpoint = CheckpointRecord(
        cuid="ckpt-1",
        run="train-1",
        name="step-2",
        checkpoint_type="TRAINING",
        uri="local:///x",
        size_bytes=1,
        created_at="2026-01-01T00:00:00+00:00",
        ttl_seconds=None,
    )
    assert checkpoint_record(checkpoint, run)["lora_rank"] == SPEC.rank
    assert checkpoint_record(checkpoint, None)["lora_rank"] == 0
