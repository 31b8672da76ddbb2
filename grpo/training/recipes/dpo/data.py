"""Preference data for `grpo dpo`: rows of a prompt, a chosen and a rejected completion.

A .jsonl / .parquet / .csv file (read as `grpo sft` reads one: `grpo.training.recipes.sft.data`)
whose rows hold ``prompt`` (a string, one user message, or a list of messages) and ``chosen`` and
``rejected`` (each a string or one assistant message). Each completion is encoded with its
prompt exactly as a `grpo sft` prompt/completion row: rendered with the model's chat
template, the completion's tokens (and its end-of-turn) masked in. Every error names the
file, the row (1-based) and the column.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from grpo.core.dpo import PreferencePair
from grpo.training.recipes.sft.data import (
    SftDataError,
    chat_example,
    prompt_completion_messages,
    read_rows,
)

COLUMNS = ("prompt", "chosen", "rejected")


def encode_pair(
    tokenizer: Any, file: str | Path, row: Mapping[str, Any], number: int
) -> PreferencePair:
    """One row as a PreferencePair; SftDataError naming the file, row and column."""
    missing = [column for column in COLUMNS if row.get(column) is None]
    if missing:
        raise SftDataError(
            f"{file} row {number}: no {' or '.join(repr(c) for c in missing)} column (a "
            f"preference row has 'prompt', 'chosen' and 'rejected'; it has "
            f"{', '.join(sorted(row)) or 'nothing'})"
        )
    try:
        chosen, rejected = (
            chat_example(tokenizer, *prompt_completion_messages(file, row, number, column))
            for column in ("chosen", "rejected")
        )
    except SftDataError:
        raise
    except ValueError as error:
        raise SftDataError(f"{file} row {number}: {error}") from None
    return PreferencePair(chosen=chosen, rejected=rejected)


def load_pairs(tokenizer: Any, path: str | Path) -> list[PreferencePair]:
    """Every row of a preference file encoded (SftDataError at the first bad row)."""
    return [
        encode_pair(tokenizer, path, row, number)
        for number, row in enumerate(read_rows(path), start=1)
    ]
