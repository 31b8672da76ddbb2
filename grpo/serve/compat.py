"""Older pytrio clients on `grpo serve`: their wire forms upgraded to pytrio 0.2.9's, and the
hub-cache copies of the served tokenizers that their ``get_tokenizer`` finds offline.

The server speaks pytrio 0.2.9's protocol. Clients 0.2.0 to 0.2.3 (read from their wheels)
differ in two request bodies, told apart by shape (0.2.9's models forbid unknown fields, so
a body is one form or the other, never both):

- a trainer forward/forward_backward event carries ``batch`` (``input_ids`` and
  ``attention_mask``, ``[B, L]`` padded with 0) and ``loss_inputs`` (``target_tokens``,
  ``weights``, ``logprobs``, ``advantages`` as ``[B, L]`` tensors) where 0.2.9 sends one
  ``data`` entry per datum and a ``gradient_accumulation`` spec; the upgrade cuts each row
  at its attention-mask length and computes the spec as 0.2.9's planner does
  (`gradient_accumulation`), so an old client's batch trains exactly as a 0.2.9 one;
- a sample request carries ``input_token_ids`` where 0.2.9 sends ``prompt`` (chunks).

and their ``RestClient`` asks ``checkpoints/{id}/archive`` where 0.2.9 asks
``checkpoints/{id}/download-url``: one route more (`grpo.serve.routes`), the same answer.

Everything else (paths, the API key headers, the control bodies, the event envelope, every
response: their models ignore unknown fields) is common to the four versions. What the
server cannot change: clients 0.2.0-0.2.3 call ``get_tokenizer(base_model)`` with the name
the program asked for, not the ``model_id`` the server answers, and look it up on the
ModelScope hub (or Hugging Face's, without modelscope). `write_hub_caches` copies each
served tokenizer under every served name into both hubs' offline cache layouts; the user
points the client at them (``MODELSCOPE_CACHE``, ``HF_HUB_CACHE``), as ``grpo serve``
prints.
"""

from __future__ import annotations

import shutil
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from pytrio.protocol.actor.events.tensor import WireTensorData

from grpo.backends.datums import IGNORE_INDEX

LEGACY_CLIENTS = ("0.2.0", "0.2.1", "0.2.3")
"""The older pytrio client versions tested against `grpo serve` (tests/serve/)."""

HUB_CACHE_DIRECTORY = "hub-cache"
_SNAPSHOT = "grpo-serve"  # the Hugging Face cache's revision name for a served tokenizer
_LOSS_INPUT_FIELDS = (
    ("target_tokens", "target_ids"),
    ("weights", "weights"),
    ("logprobs", "logprobs"),
    ("advantages", "advantages"),
)


def _tensor(raw: Any, field: str) -> np.ndarray:
    try:
        return WireTensorData.model_validate(raw).to_numpy()
    except ValueError as error:
        raise ValueError(f"{field}: not a wire tensor ({error})") from None


def gradient_accumulation(data: list[dict[str, Any]], loss_fn: str, auto_shift: bool) -> dict:
    """pytrio 0.2.9's totals of a logical batch (``plan_training_batch``): its samples, its
    active tokens (targets not IGNORE_INDEX past the auto-shift label, with a non-zero weight
    for cross entropy), and those of them with a non-zero advantage."""
    active = advantage = 0
    start = 1 if auto_shift else 0
    for item in data:
        targets = np.asarray(item["target_ids"][start:])
        live = targets != IGNORE_INDEX
        if loss_fn == "cross_entropy":
            weights = item.get("weights")
            if weights is not None:
                live &= np.asarray(weights[start:]) != 0.0
        elif item.get("advantages") is not None:
            advantage += int((live & (np.asarray(item["advantages"][start:]) != 0.0)).sum())
        active += int(live.sum())
    return {
        "total_samples": len(data),
        "total_active_tokens": active,
        "total_advantage_tokens": advantage,
    }


def upgrade_forward_payload(payload: dict[str, Any]) -> dict[str, Any]:
    """A forward payload in 0.2.9's form: 0.2.0-0.2.3's padded ``batch``/``loss_inputs``
    cut into one ``data`` entry per row, plus its ``gradient_accumulation``; a 0.2.9 payload
    as it is. ValueError naming the field when the old form is malformed."""
    if not isinstance(payload, dict) or "batch" not in payload:
        return payload
    old = dict(payload)
    batch, loss_inputs = old.pop("batch"), old.pop("loss_inputs", {})
    if not isinstance(batch, dict) or not isinstance(loss_inputs, dict):
        raise ValueError("batch and loss_inputs must be maps of wire tensors")
    input_ids = _tensor(batch.get("input_ids"), "batch.input_ids")
    if input_ids.ndim != 2:
        raise ValueError(f"batch.input_ids must be [B, L], got shape {list(input_ids.shape)}")
    if "attention_mask" in batch:
        mask = _tensor(batch["attention_mask"], "batch.attention_mask")
        if mask.shape != input_ids.shape:
            raise ValueError("batch.attention_mask must have batch.input_ids's shape")
        lengths = mask.astype(bool).sum(axis=1)
    else:
        lengths = np.full(input_ids.shape[0], input_ids.shape[1])
    columns = {}
    for key, wire_key in _LOSS_INPUT_FIELDS:
        if key in loss_inputs:
            values = _tensor(loss_inputs[key], f"loss_inputs.{key}")
            if values.shape != input_ids.shape:
                raise ValueError(f"loss_inputs.{key} must have batch.input_ids's shape")
            columns[wire_key] = values
    if "target_ids" not in columns:
        raise ValueError("loss_inputs.target_tokens is required")
    data = []
    for row, length in enumerate(lengths.tolist()):
        item: dict[str, Any] = {
            "model_input": {
                "chunks": [{"type": "encoded_text", "tokens": input_ids[row, :length].tolist()}]
            }
        }
        for wire_key, values in columns.items():
            item[wire_key] = values[row, :length].tolist()
        data.append(item)
    loss = old.get("loss") or {}
    loss_fn = str(loss.get("type", "cross_entropy")) if isinstance(loss, dict) else ""
    old["data"] = data
    old["gradient_accumulation"] = gradient_accumulation(
        data, loss_fn, bool(old.get("auto_shift", False))
    )
    return old


def upgrade_sample_request(body: dict[str, Any]) -> dict[str, Any]:
    """A sample request in 0.2.9's form: 0.2.0-0.2.3's ``input_token_ids`` become ``prompt``."""
    if not isinstance(body, dict) or "input_token_ids" not in body or "prompt" in body:
        return body
    upgraded = dict(body)
    tokens = upgraded.pop("input_token_ids")
    upgraded["prompt"] = {"chunks": [{"type": "encoded_text", "tokens": tokens}]}
    return upgraded


def write_hub_caches(root: Path, tokenizer_directory: Path, names: Iterable[str]) -> Path:
    """Copy the tokenizer files under each of `names` into ``<root>/hub-cache``'s two
    offline layouts; returns that directory.

    - ModelScope (``MODELSCOPE_CACHE=<root>/hub-cache/modelscope``):
      ``models/<owner>/<name with . as ___>``, the layout modelscope before 1.38 writes and
      1.38+ still reads;
    - Hugging Face (``HF_HUB_CACHE=<root>/hub-cache/huggingface``):
      ``models--<owner>--<name>/snapshots/grpo-serve/`` with ``refs/main`` naming it (and a
      missing ``config.json`` recorded under ``.no_exist/``).
    """
    base = root / HUB_CACHE_DIRECTORY
    files = [path for path in tokenizer_directory.iterdir() if path.is_file()]
    for name in names:
        owner, separator, model = name.partition("/")
        if not separator or "/" in model or not owner or not model or ".." in name:
            continue  # not a hub id (a local path): the client loads that path itself
        targets = [
            base / "modelscope" / "models" / owner / model.replace(".", "___"),
            base / "huggingface" / f"models--{owner}--{model}" / "snapshots" / _SNAPSHOT,
        ]
        for target in targets:
            target.mkdir(parents=True, exist_ok=True)
            for file in files:
                shutil.copyfile(file, target / file.name)
        repo = base / "huggingface" / f"models--{owner}--{model}"
        (repo / "refs").mkdir(parents=True, exist_ok=True)
        (repo / "refs" / "main").write_text(_SNAPSHOT)
        if not (tokenizer_directory / "config.json").is_file():
            # Recorded as absent on the hub, so that transformers' AutoTokenizer (which
            # asks for the model config first) goes on offline instead of failing.
            (repo / ".no_exist" / _SNAPSHOT).mkdir(parents=True, exist_ok=True)
            (repo / ".no_exist" / _SNAPSHOT / "config.json").touch()
    return base


def hub_cache_exports(base: Path) -> list[str]:
    """The shell lines that point a 0.2.0-0.2.3 client's ``get_tokenizer`` at `base`."""
    return [
        f"export MODELSCOPE_CACHE={base / 'modelscope'}",
        f"export HF_HUB_CACHE={base / 'huggingface'}",
    ]
