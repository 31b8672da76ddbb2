"""Supervised fine-tuning data: rows from JSONL / Parquet / CSV, encoded with the chat template.

A file holds rows of one of three kinds, told by its columns:

- ``messages``: a chat, a list of ``{"role", "content"}`` (a JSON string in a CSV cell);
  every assistant message is trained on;
- ``prompt`` and ``completion``: the prompt (a string, one user message, or a list of
  messages) and the completion (a string, one assistant message); the completion is
  trained on;
- ``text``: plain text, every token trained on (no chat template).

Chats are rendered with the tokenizer's chat template (``enable_thinking=False``, as the
prompts of `grpo train`). When the template marks assistant text with ``{% generation %}``
the mask is the template's own (``return_assistant_tokens_mask``); otherwise it comes from
rendering each prefix (`grpo.core.sft.extension_mask`), and a row whose rendering does not
grow by extension is refused. Every error names the file, the row (1-based) and the column.
"""

from __future__ import annotations

import json
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from grpo.core.messages import check_messages
from grpo.core.sft import SftExample, extension_mask
from grpo.tasks.text_files import text_problem

SUFFIXES = (".jsonl", ".parquet", ".csv")
ROW_KINDS = {
    "messages": ("messages",),
    "prompt_completion": ("prompt", "completion"),
    "text": ("text",),
}


class SftDataError(ValueError):
    """A data file or row that cannot be trained on; the message names the file, row and fix."""


def read_rows(path: str | Path) -> list[dict[str, Any]]:
    """The rows of a .jsonl, .parquet or .csv file, as dicts (SftDataError naming the line)."""
    file = Path(path)
    if file.is_dir():
        raise SftDataError(
            f"data {file} is a directory; give a .jsonl, .parquet or .csv file to --data / "
            "--eval-data"
        )
    if not file.is_file():
        raise SftDataError(f"data file {file} not found; check --data / --eval-data")
    if file.suffix not in SUFFIXES:
        raise SftDataError(
            f"data file {file} has suffix {file.suffix!r}; supported: {', '.join(SUFFIXES)}"
        )
    if file.suffix != ".parquet":
        problem = text_problem(file, file.read_bytes())
        if problem is not None:
            raise SftDataError(problem)
    if file.suffix == ".jsonl":
        rows = list(_jsonl_rows(file))
    else:
        import datasets

        try:
            reader = (
                datasets.Dataset.from_parquet
                if file.suffix == ".parquet"
                else (datasets.Dataset.from_csv)
            )
            rows = list(reader(str(file), keep_in_memory=True))
        except Exception as error:  # noqa: BLE001 - pyarrow and csv raise many kinds
            raise SftDataError(
                f"data file {file} cannot be read as {file.suffix[1:]}: {error}"
            ) from None
    if not rows:
        raise SftDataError(f"data file {file} holds no rows")
    return rows


def _jsonl_rows(file: Path) -> Iterator[dict[str, Any]]:
    with file.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as error:
                raise SftDataError(
                    f"{file} line {number} is not valid JSON ({error.msg}); a .jsonl file "
                    'holds one JSON object per line, e.g. {"prompt": "...", "completion": "..."}'
                ) from None
            if not isinstance(row, dict):
                raise SftDataError(
                    f"{file} line {number} holds {type(row).__name__}, not an object"
                )
            yield row


def row_kind(file: str | Path, row: Mapping[str, Any], number: int) -> str:
    """Which of ROW_KINDS a row is, by its columns (SftDataError listing what it has)."""
    for kind, columns in ROW_KINDS.items():
        if all(row.get(column) is not None for column in columns):
            return kind
    raise SftDataError(
        f"{file} row {number}: no 'messages', 'prompt' + 'completion' or 'text' column "
        f"(it has {', '.join(sorted(row)) or 'nothing'})"
    )


def _messages(value: Any, where: str, *, default_role: str) -> list[dict[str, str]]:
    if isinstance(value, str) and default_role == "":
        try:
            value = json.loads(value)
        except json.JSONDecodeError as error:
            raise SftDataError(f"{where}: not a JSON list of messages ({error.msg})") from None
    if isinstance(value, str):
        return [{"role": default_role, "content": value}]
    if isinstance(value, Mapping):
        value = [value]
    if not isinstance(value, Sequence) or not value:
        raise SftDataError(f"{where}: expected a non-empty list of {{role, content}} messages")
    return list(check_messages(value, where, SftDataError))


def row_messages(
    file: str | Path, row: Mapping[str, Any], number: int
) -> tuple[list[dict[str, str]], list[int]] | None:
    """(messages, indices of the trained assistant messages) of a chat row; None for text."""
    kind = row_kind(file, row, number)
    where = f"{file} row {number}"
    if kind == "text":
        return None
    if kind == "messages":
        messages = _messages(row["messages"], f"{where}, column 'messages'", default_role="")
        trained = [i for i, message in enumerate(messages) if message["role"] == "assistant"]
    else:
        messages, trained = prompt_completion_messages(file, row, number, "completion")
    if not trained:
        raise SftDataError(f"{where}, column 'messages': no assistant message to train on")
    if trained[0] == 0:
        raise SftDataError(f"{where}: the chat starts with an assistant message (no prompt)")
    return messages, trained


def prompt_completion_messages(
    file: str | Path, row: Mapping[str, Any], number: int, column: str
) -> tuple[list[dict[str, str]], list[int]]:
    """(the prompt's messages + the completion in ``column``, [index of the completion]):
    the prompt a string (one user message) or messages, the completion a string or one
    assistant message (SftDataError naming the file, row and column otherwise)."""
    where = f"{file} row {number}"
    prompt = _messages(row["prompt"], f"{where}, column 'prompt'", default_role="user")
    completion = _messages(row[column], f"{where}, column '{column}'", default_role="assistant")
    if [message["role"] for message in completion] != ["assistant"]:
        raise SftDataError(f"{where}, column '{column}': expected one assistant message")
    return [*prompt, *completion], [len(prompt)]


def _render(tokenizer: Any, messages: list[dict[str, str]], *, generation: bool) -> list[int]:
    text = tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=generation, enable_thinking=False
    )
    return list(tokenizer.encode(text, add_special_tokens=False))


def has_generation_marks(tokenizer: Any) -> bool:
    """Whether the chat template marks assistant text with {% generation %}."""
    template = getattr(tokenizer, "chat_template", None)
    return isinstance(template, str) and "{% generation %}" in template.replace("{%-", "{%")


def chat_example(
    tokenizer: Any, messages: list[dict[str, str]], trained: Sequence[int]
) -> SftExample:
    """A chat as tokens with its trained-token mask (ValueError when the template won't say)."""
    full = _render(tokenizer, messages, generation=False)
    if has_generation_marks(tokenizer) and list(trained) == [
        i for i, message in enumerate(messages) if message["role"] == "assistant"
    ]:
        encoded = tokenizer.apply_chat_template(
            messages,
            tokenize=True,
            return_dict=True,
            return_assistant_tokens_mask=True,
            enable_thinking=False,
        )
        mask = np.asarray(encoded["assistant_masks"], dtype=bool)
        return SftExample(tokens_T=encoded["input_ids"], mask_T=mask & (np.arange(mask.size) > 0))
    turns = [
        (
            _render(tokenizer, messages[:index], generation=True),
            _render(tokenizer, messages[: index + 1], generation=False),
        )
        for index in trained
    ]
    return SftExample(tokens_T=full, mask_T=extension_mask(full, turns, tokenizer.eos_token_id))


def encode_row(tokenizer: Any, file: str | Path, row: Mapping[str, Any], number: int) -> SftExample:
    """One row as an SftExample; SftDataError naming the file, row and column on bad input."""
    try:
        chat = row_messages(file, row, number)
        if chat is None:
            text = row["text"]
            if not isinstance(text, str) or not text:
                raise SftDataError(f"{file} row {number}, column 'text': expected non-empty text")
            tokens = list(tokenizer.encode(text, add_special_tokens=False))
            return SftExample(tokens_T=tokens, mask_T=np.arange(len(tokens)) > 0)
        return chat_example(tokenizer, *chat)
    except SftDataError:
        raise
    except ValueError as error:
        raise SftDataError(f"{file} row {number}: {error}") from None


def load_examples(tokenizer: Any, path: str | Path) -> list[SftExample]:
    """Every row of a data file encoded (SftDataError at the first bad row)."""
    return [
        encode_row(tokenizer, path, row, number)
        for number, row in enumerate(read_rows(path), start=1)
    ]
