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

from grpo.train import run_files
from grpo.train.config import ConfigError

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
LOCAL_METADATA = "grpo_local.json"
LOCAL_SCHEME = "local://"


def _adapter_directory(root: Path, what: str) -> Path:
    """The directory under `root` holding a PEFT adapter; ConfigError listing what is there."""
    found = [path.parent for path in sorted(root.rglob(ADAPTER_CONFIG))]
    found = [directory for directory in found if (directory / ADAPTER_WEIGHTS).is_file()]
    if len(found) == 1:
        return found[0]
    held = sorted(str(path.relative_to(root)) for path in root.rglob("*") if path.is_file())
    raise ConfigError(
        f"{what}: {'no' if not found else len(found)} PEFT adapter(s) ({ADAPTER_CONFIG} + "
        f"{ADAPTER_WEIGHTS}) found; it holds {held[:12] or 'nothing'}. Pass a run directory, "
        "a local checkpoint, or an archive of one adapter"
    )


@contextmanager
def adapter_source(source: str) -> Iterator[Path]:
    """The adapter directory `source` names (an archive is unpacked into a temporary one)."""
    path = Path(source[len(LOCAL_SCHEME) :] if source.startswith(LOCAL_SCHEME) else source)
    if path.is_dir() and (path / run_files.CONFIG_FILE).is_file():
        weights = run_files.eval_weights_path(path)
        path = Path(weights[len(LOCAL_SCHEME) :] if weights.startswith(LOCAL_SCHEME) else weights)
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
    """The base model (fp32) and tokenizer: the built-in model by name, else a local HF dir."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo.backends.local import tiny

    if base_model == tiny.TINY_MODEL_NAME:
        return tiny.load_tiny_model()
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


def export(source: str, out: Path, *, merge: bool = False) -> Path:
    """Write `source`'s adapter (with `merge`, the merged model) into the new directory `out`."""
    if out.exists() and any(out.iterdir()):
        raise ConfigError(f"--out {out} exists and is not empty; choose a new directory")
    with adapter_source(source) as adapter:
        out.mkdir(parents=True, exist_ok=True)
        if merge:
            model, tokenizer = merged_model(adapter)
            model.save_pretrained(out)
            tokenizer.save_pretrained(out)
        else:
            for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
                shutil.copyfile(adapter / name, out / name)
    return out
