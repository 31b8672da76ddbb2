"""Local checkpoints: PEFT-format adapter directories, written atomically.

Layout under the service root::

    <root>/<run_id>/weights/<name>/          save_state (adapter + optimizer)
    <root>/<run_id>/sampler_weights/<name>/  save_weights_for_sampler (adapter only)

Each directory holds ``adapter_model.safetensors`` and ``adapter_config.json`` (so
``peft.PeftModel.from_pretrained(base, path)`` loads it), ``optimizer.pt`` for a state
checkpoint, and ``grpo_local.json`` (the LoRA run's configuration). The path handed back
is ``local://<absolute directory>``; loaders accept that or the plain directory.

A checkpoint is written into a hidden temporary directory next to its destination and
renamed into place, so a crash mid-save leaves the previous checkpoint of that name
intact. Replacing one (``overwrite=True``) renames the old directory aside first, then
the new one in, then deletes the old.
"""

from __future__ import annotations

import json
import os
import shutil
import time
import uuid
from pathlib import Path
from typing import Literal

import torch
from pytrio.errors.base import ValidationError
from safetensors.torch import load_file, save_file

from grpo.backends.files import fsync_path
from grpo.backends.local.model import AdapterWeights, LoraSpec, ModelHost

URI_SCHEME = "local://"
FORMAT_VERSION = 1
METADATA_FILE = "grpo_local.json"
ADAPTER_FILE = "adapter_model.safetensors"
OPTIMIZER_FILE = "optimizer.pt"

CheckpointKind = Literal["state", "sampler"]
_SUBDIRECTORY: dict[CheckpointKind, str] = {"state": "weights", "sampler": "sampler_weights"}


def checkpoint_directory(root: Path, run_id: str, kind: CheckpointKind, name: str) -> Path:
    """Where checkpoint `name` of run `run_id` lives."""
    return root / run_id / _SUBDIRECTORY[kind] / name


def to_uri(directory: Path) -> str:
    """The `local://` path handed back to users."""
    return URI_SCHEME + str(directory.resolve())


def resolve(path: str) -> Path:
    """The directory of a `local://` URI or plain path; ValidationError when it is no checkpoint."""
    if not isinstance(path, str) or not path:
        raise ValidationError(
            f"checkpoint path must be a non-empty string, got {path!r}",
            code="validation.checkpoint_not_found",
        )
    try:
        directory = Path(path.removeprefix(URI_SCHEME)).expanduser()
    except RuntimeError:  # "~name/..." where no user is called name
        raise ValidationError(
            f"no local checkpoint at {path!r}: its ~ names no user of this machine",
            code="validation.checkpoint_not_found",
        ) from None
    if not (directory / METADATA_FILE).is_file():
        raise ValidationError(
            f"no local checkpoint at {path!r}: pass a path returned by save_state or "
            "save_weights_for_sampler (local://...)",
            code="validation.checkpoint_not_found",
        )
    return directory


def write(
    directory: Path,
    *,
    host: ModelHost,
    weights: AdapterWeights,
    metadata: dict[str, object],
    optimizer_state: dict[str, object] | None,
    overwrite: bool,
) -> int:
    """Write a checkpoint atomically; returns its size in bytes."""
    if directory.exists() and not overwrite:
        raise ValidationError(
            f"checkpoint {directory.name!r} already exists at {to_uri(directory)}; pass "
            "overwrite=True to replace it or choose another name",
            code="validation.checkpoint_exists",
        )
    directory.parent.mkdir(parents=True, exist_ok=True)
    staging = directory.parent / f".tmp-{directory.name}-{uuid.uuid4().hex}"
    staging.mkdir()
    try:
        save_file(
            {key: tensor.contiguous() for key, tensor in weights.tensors.items()},
            staging / ADAPTER_FILE,
        )
        config = host.lora_config(weights.spec)
        config.base_model_name_or_path = (
            host.model_id
        )  # so PeftModel.from_pretrained knows the base
        config.save_pretrained(str(staging))
        if optimizer_state is not None:
            torch.save(optimizer_state, staging / OPTIMIZER_FILE)
        (staging / METADATA_FILE).write_text(json.dumps(metadata, indent=2, sort_keys=True))
        for file in staging.iterdir():
            fsync_path(file)
        size = sum(file.stat().st_size for file in staging.iterdir())
        _publish(staging, directory)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return size


def _publish(staging: Path, directory: Path) -> None:
    """Rename the finished staging directory to `directory`, replacing an old one."""
    retired = None
    if directory.exists():
        retired = directory.parent / f".old-{directory.name}-{uuid.uuid4().hex}"
        os.replace(directory, retired)
    os.replace(staging, directory)
    fsync_path(directory.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def metadata_for(
    *,
    kind: CheckpointKind,
    base_model: str,
    spec: LoraSpec,
    run_id: str,
    name: str,
    ttl_seconds: int | None,
    optimizer_steps: int,
) -> dict[str, object]:
    """The `grpo_local.json` record: what `create_training_client_from_state` needs."""
    return {
        "format": FORMAT_VERSION,
        "kind": kind,
        "base_model": base_model,
        **spec.to_wire(),
        "run_id": run_id,
        "name": name,
        "ttl_seconds": ttl_seconds,  # recorded only: local checkpoints never expire
        "optimizer_steps": optimizer_steps,
        "created_unix": time.time(),
    }


def read_metadata(directory: Path) -> dict[str, object]:
    """The checkpoint's `grpo_local.json`."""
    path = directory / METADATA_FILE
    try:
        metadata = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, ValueError, RecursionError) as error:
        raise ValidationError(
            f"{path} is damaged ({type(error).__name__}: {error}); restore it from a backup, "
            "or delete the checkpoint",
            code="validation.checkpoint_metadata",
        ) from None
    if not isinstance(metadata, dict):
        raise ValidationError(
            f"{path} holds {type(metadata).__name__}, not the checkpoint's record; restore it "
            "from a backup, or delete the checkpoint",
            code="validation.checkpoint_metadata",
        )
    if metadata.get("format") != FORMAT_VERSION:
        raise ValidationError(
            f"checkpoint {to_uri(directory)} has format {metadata.get('format')!r}; this version "
            f"reads format {FORMAT_VERSION}",
            code="validation.checkpoint_format",
        )
    return metadata


def spec_from(metadata: dict[str, object]) -> LoraSpec:
    """The LoRA spec a checkpoint was trained with (its metadata holds `LoraSpec.to_wire`)."""
    return LoraSpec.from_wire(metadata)


def read_weights(directory: Path, spec: LoraSpec) -> AdapterWeights:
    """The adapter tensors of a checkpoint."""
    return AdapterWeights(spec=spec, tensors=load_file(directory / ADAPTER_FILE))


def read_optimizer(directory: Path) -> dict[str, object]:
    """The optimizer state of a `save_state` checkpoint."""
    file = directory / OPTIMIZER_FILE
    if not file.is_file():
        raise ValidationError(
            f"checkpoint {to_uri(directory)} holds no optimizer state (it was saved by "
            "save_weights_for_sampler); load it with load_state, or save with save_state",
            code="validation.checkpoint_without_optimizer",
        )
    return torch.load(file, weights_only=True)
