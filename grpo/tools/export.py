"""`grpo export`: a run's LoRA as a PEFT adapter directory, or merged into its base model.

Sources: a run directory (its final sampler weights, else its last checkpoint), a local
checkpoint (`local://...` or its directory), or an archive from `grpo checkpoints
download` (a tar of a checkpoint directory). The adapter directory holds
`adapter_config.json` + `adapter_model.safetensors`, so `peft.PeftModel.from_pretrained(base,
DIR)` loads it on the base model; everything about the adapter (rank, alpha, target
modules, base model) comes from the checkpoint's own files, whatever the base model is.

`--merge` writes the base model with W + (alpha / r) B A folded into every target and the
tokenizer: a plain Hugging Face model directory. When the base model ties its input and
output embeddings and the LoRA targets the output projection, the merged model unties them
(the LoRA changes the unembedding only, as in training).

PyTRIO checkpoints: `grpo checkpoints download` writes the archive PyTRIO serves. The SDK
(pytrio 0.2.9) treats it as opaque bytes and documents no layout; an archive that holds a
PEFT adapter (`adapter_config.json` + `adapter_model.safetensors`, as Tinker-style services
write) is exported like a local one, anything else is refused with a list of what it holds.

What is copied is checked first: `adapter_model.safetensors` must open as a safetensors file
holding LoRA pairs (`lora_A` / `lora_B`) and `adapter_config.json` must be a JSON object;
otherwise the error says what the file is instead (a tar archive, say). `--out` is checked by
`grpo.tools.paths.check_out` (new or empty, outside run and checkpoint directories unless
`--force`; never over the source, its weights or a local base model, even with `--force`).
"""

from __future__ import annotations

import json
import shutil
import tarfile
import tempfile
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from safetensors import SafetensorError, safe_open

from grpo.tools.paths import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    LOCAL_METADATA,
    check_out,
    local_path,
)
from grpo.training.run import run_files
from grpo.training.run.inputs import read_paths, refuse_overlap
from grpo.training.settings.config import ConfigError


def _adapter_directory(root: Path, what: str) -> Path:
    """The directory under `root` holding a PEFT adapter; ConfigError listing what is there."""
    found = [path.parent for path in sorted(root.rglob(ADAPTER_CONFIG))]
    found = [directory for directory in found if (directory / ADAPTER_WEIGHTS).is_file()]
    if len(found) == 1:
        return verified_adapter(found[0], what)
    held = sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
    raise ConfigError(
        f"{what}: {'no' if not found else len(found)} PEFT adapter(s) ({ADAPTER_CONFIG} + "
        f"{ADAPTER_WEIGHTS}) found; it holds {held[:12] or 'nothing'}. Pass a run directory, "
        "a local checkpoint, or an archive of one adapter"
    )


def _what_it_is(path: Path) -> str:
    """A few words on what a file that should be safetensors holds instead."""
    if path.stat().st_size == 0:
        return "it is empty"
    if tarfile.is_tarfile(path):
        return "it is a tar archive (`grpo checkpoints download` writes those)"
    if zipfile.is_zipfile(path):
        return "it is a zip archive"
    with path.open("rb") as handle:
        return f"it starts with {handle.read(16)!r}"


def verified_adapter(directory: Path, what: str) -> Path:
    """`directory` if it holds a PEFT LoRA adapter; ConfigError saying what it holds instead.

    The weights must open as safetensors with at least one `lora_A` and one `lora_B`
    tensor, the config must be a JSON object.
    """
    weights = directory / ADAPTER_WEIGHTS
    try:
        with safe_open(str(weights), framework="np") as opened:
            keys = list(opened.keys())
    except (SafetensorError, OSError) as error:
        raise ConfigError(
            f"{what}: {weights} is not a safetensors file ({_what_it_is(weights)}; {error}), "
            "so this is no PEFT adapter; restore the checkpoint's weights or export another one"
        ) from None
    if not any("lora_A" in key for key in keys) or not any("lora_B" in key for key in keys):
        raise ConfigError(
            f"{what}: {weights} holds {len(keys)} tensor(s) but no LoRA pair (lora_A and "
            f"lora_B), e.g. {keys[:3]}; it is not a PEFT LoRA adapter"
        )
    try:
        config = json.loads((directory / ADAPTER_CONFIG).read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ConfigError(
            f"{what}: {directory / ADAPTER_CONFIG} is not valid JSON ({error}); the adapter "
            "is damaged: restore the checkpoint or export another one"
        ) from None
    if not isinstance(config, dict):
        raise ConfigError(
            f"{what}: {directory / ADAPTER_CONFIG} holds {type(config).__name__}, not the "
            "JSON object of a PEFT adapter config"
        )
    return directory


@contextmanager
def adapter_source(source: str) -> Iterator[Path]:
    """The adapter directory `source` names (an archive is unpacked into a temporary one)."""
    path = local_path(source)
    if path.is_dir() and (path / run_files.CONFIG_FILE).is_file():
        weights = run_files.eval_weights_path(path)
        path = local_path(weights)
        if not path.is_dir():
            raise ConfigError(
                f"run {source}: its weights {weights} are not on this machine; download them "
                "with `grpo checkpoints download` and export the archive"
            )
    if path.is_dir():
        yield _adapter_directory(path, str(source))
        return
    if not path.is_file():
        raise ConfigError(
            f"{source}: neither a run directory, a checkpoint directory nor an archive file"
        )
    with tempfile.TemporaryDirectory(prefix="grpo-export-") as scratch:
        if tarfile.is_tarfile(path):
            with tarfile.open(path) as archive:
                archive.extractall(scratch, filter="data")
        elif zipfile.is_zipfile(path):
            with zipfile.ZipFile(path) as archive:
                archive.extractall(scratch)
        else:
            raise ConfigError(f"{source}: not a tar or zip archive (its format is unknown)")
        yield _adapter_directory(Path(scratch), str(source))


def base_model_of(adapter: Path) -> str:
    """The base model an adapter was trained on (grpo_local.json, else adapter_config.json)."""
    metadata = adapter / LOCAL_METADATA
    if metadata.is_file():
        return str(json.loads(metadata.read_text())["base_model"])
    return str(json.loads((adapter / ADAPTER_CONFIG).read_text())["base_model_name_or_path"])


def load_base(base_model: str) -> tuple[Any, Any]:
    """The base model (fp32) and tokenizer: a built-in model by name, else a local HF dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.backends.local import tiny

    if base_model in tiny.MODEL_DIRS:
        return tiny.load_tiny_model(base_model)
    directory = Path(base_model).expanduser()
    if not (directory / "config.json").is_file():
        raise ConfigError(
            f"base model {base_model!r} is not a local Hugging Face directory; --merge needs "
            "the base weights on this machine (download them, then point the adapter's "
            f"{ADAPTER_CONFIG} base_model_name_or_path at them)"
        )
    model = AutoModelForCausalLM.from_pretrained(
        directory, local_files_only=True, dtype=torch.float32
    )
    return model.eval(), AutoTokenizer.from_pretrained(directory, local_files_only=True)


def _untie_output_embeddings(model: Any) -> None:
    """Give the output projection its own copy of a tied embedding matrix (merging changes it)."""
    import torch

    if not getattr(model.config, "tie_word_embeddings", False):
        return
    output = model.get_output_embeddings()
    output.weight = torch.nn.Parameter(model.get_input_embeddings().weight.detach().clone())
    model.config.tie_word_embeddings = False


def merged_model(adapter: Path) -> tuple[Any, Any]:
    """The base model with the adapter merged in (W + (alpha/r) B A), and its tokenizer."""
    import warnings

    from peft import PeftModel

    model, tokenizer = load_base(base_model_of(adapter))
    _untie_output_embeddings(model)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*tie_word_embeddings.*")
        peft_model = PeftModel.from_pretrained(model, str(adapter))
    return peft_model.merge_and_unload().eval(), tokenizer


def export(source: str, out: Path, *, merge: bool = False, force: bool = False) -> Path:
    """Write `source`'s adapter (with `merge`, the merged model) into the new directory `out`.

    `out` must be new or empty and outside run and checkpoint directories (`force` lifts
    that), and never be, lie inside or hold `source`, its weights or (`merge`) a local base
    model.
    """
    check_out(out, force=force, reads=read_paths("SOURCE", source), empty_dir_ok=True)
    with adapter_source(source) as adapter:
        if merge:  # a local base model is read too: never written over
            refuse_overlap(out, "--out", read_paths("the base model", base_model_of(adapter)))
        out.mkdir(parents=True, exist_ok=True)
        if merge:
            model, tokenizer = merged_model(adapter)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
        else:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copyfile(adapter / name, out / name)
    return out
