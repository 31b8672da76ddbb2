"""The models `grpo serve` serves: the local backend's catalogue, its aliases, and model ids.

A training run's ``model_id`` is the directory holding its tokenizer (for the built-in
model, a copy written under ``<root>/tokenizers/``): pytrio's ``get_tokenizer`` loads
``AutoTokenizer.from_pretrained(model_id, local_files_only=True)``, so this finds it
offline; the same files go into ``<root>/hub-cache`` for older clients and harnesses,
which look the tokenizer up by name (`grpo.serve.compat`). Both are written for every served
model when the server starts, before it prints where they are: a harness may load the
tokenizer by name (lm-eval's ``local-completions``) before its first request. The
catalogue and ``get_supported_models`` keep the model's name first, and list the model
under its ``model_id`` too once a run has used it (as the service's catalogue holds every
run's ``model_id``). A program may also name a local Hugging Face model directory, or an
alias (``--model-alias``).
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from grpo.backends.local import LocalServiceClient
from grpo.serve.compat import write_hub_caches
from grpo.serve.wire import ServeError, model_list


class ModelCatalogue:
    """The served models, their aliases and their model ids (all methods thread-safe)."""

    def __init__(
        self,
        local: LocalServiceClient,
        root: Path,
        aliases: dict[str, str] | None = None,
        batch_limits: tuple[int | None, int | None] = (None, None),
    ) -> None:
        self.local = local
        # (max_batch_size, max_tokens_per_request) advertised to trainers: pytrio 0.2.9
        # splits a call above them into micro-batches (--max-batch-size ...).
        self.batch_limits = batch_limits
        self.root = root
        self._lock = threading.Lock()
        self._model_ids: dict[str, str] = {}  # model name -> model_id (tokenizer directory)
        self._capabilities = local.get_server_capabilities()
        names = [model.model_name for model in self._capabilities.supported_models]
        self.aliases = dict(aliases or {})  # a name a program asks for -> a served model's name
        for alias, name in self.aliases.items():
            if name not in names:
                raise ValueError(f"--model-alias {alias}={name}: {name!r} is not one of {names}")
        # Every served tokenizer, under its name and its aliases, before anything asks.
        self._tokenizers = {name: self._write_tokenizer(name) for name in names}

    def models(self, limit: int, offset: int) -> dict[str, Any]:
        """`ModelListResponse`: the served models with their real limits, then each under its
        aliases, then under its run ``model_id`` once a run has used it.

        On the service a run's ``model_id`` is a catalogue ``model_id``, and pytrio 0.2.3's
        ``create_training_client_from_state`` relies on it: it looks the checkpoint's model
        (``find_training_run_by_checkpoint_uri``'s ``base_model``) up in the catalogue, and
        refuses it ("Model ... is not supported by the server") when it is not listed.
        """
        with self._lock:
            by_id = {model_id: name for name, model_id in self._model_ids.items()}
        names = {**self.aliases, **{key: name for key, name in by_id.items() if key != name}}
        return model_list(self._capabilities.supported_models, names, limit, offset)

    def names(self) -> list[str]:
        """The served models' names, then their aliases."""
        return [m.model_name for m in self._capabilities.supported_models] + list(self.aliases)

    def limits(self, base_model: str, *, trainer: bool = True) -> dict[str, Any]:
        """The trainer (or sampler) limits of a run on `base_model`: the sequence length if
        known, and for a trainer the advertised batch limits."""
        batch_size, tokens = self.batch_limits if trainer else (None, None)
        for model in self._capabilities.supported_models:
            if model.model_name == base_model:
                return {
                    "max_batch_size": batch_size,
                    "max_tokens_per_request": tokens,
                    "max_seq_len": model.training.max_seq_len,
                }
        return {"max_batch_size": None, "max_tokens_per_request": None, "max_seq_len": None}

    def resolve(self, base_model: str) -> tuple[str, str]:
        """(the local backend's model name, the model_id handed to pytrio) for `base_model`."""
        names = [model.model_name for model in self._capabilities.supported_models]
        with self._lock:
            by_id = {model_id: name for name, model_id in self._model_ids.items()}
        if base_model in by_id:
            return by_id[base_model], base_model
        base_model = self.aliases.get(base_model, base_model)
        if base_model in names:
            return base_model, self._tokenizer_directory(base_model)
        if _is_model_directory(base_model):
            resolved = str(Path(base_model).expanduser().resolve())
            return resolved, resolved
        raise ServeError(
            404,
            "model_not_found",
            f"base_model {base_model!r:.200} is not served here{path_problem(base_model)}; "
            "use one of "
            f"{names + list(self.aliases)} or the path of a local Hugging Face model directory "
            "(or map the name: grpo serve --model-alias NAME=SERVED_MODEL)",
        )

    def _tokenizer_directory(self, name: str) -> str:
        """The directory with served model `name`'s tokenizer files, for pytrio's
        get_tokenizer; from now on the catalogue lists the model under it too."""
        with self._lock:
            return self._model_ids.setdefault(name, self._tokenizers[name])

    def _write_tokenizer(self, name: str) -> str:
        """Write `name`'s tokenizer files under ``<root>/tokenizers`` and into the hub caches
        under `name` and its aliases; returns the directory. ValueError naming the directory
        when it cannot be written."""
        directory = self.root / "tokenizers" / name.replace("/", "--")
        tokenizer = self.local.create_sampling_client(name).get_tokenizer()
        # pytrio before 0.2.9, and harnesses, look the tokenizer up by the name asked for.
        names = [name, *(alias for alias, served in self.aliases.items() if served == name)]
        try:
            tokenizer.save_pretrained(str(directory))
            write_hub_caches(self.root, directory, names)
        except OSError as error:
            raise ValueError(
                f"cannot write the tokenizer of {name} under {self.root}: {error}; give a "
                "writable --root"
            ) from None
        return str(directory.resolve())


def path_problem(name: str) -> str:
    """Why `name`, when it names an existing path, is not a model directory (`` ('/x' is a
    file, not a model directory)``), else ""."""
    try:
        directory = Path(name).expanduser()
        if directory.is_file():
            return f" ({str(directory)!r:.200} is a file, not a model directory)"
        if directory.is_dir():
            return f" ({str(directory)!r:.200} is a directory without a config.json)"
    except (OSError, ValueError, RuntimeError):  # too long, a NUL byte, ~ of no user
        pass
    return ""


def _is_model_directory(name: str) -> bool:
    """Whether `name` is a directory holding a Hugging Face model; False for a name no path
    can have."""
    try:
        directory = Path(name).expanduser()
        return directory.is_dir() and (directory / "config.json").is_file()
    except (OSError, ValueError, RuntimeError):  # too long, a NUL byte, ~ of no user
        return False
