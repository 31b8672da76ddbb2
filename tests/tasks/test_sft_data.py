"""SFT rows: reading JSONL/Parquet/CSV, the trained-token mask on the built-in chat template,
and errors naming the file, the row and the column."""

from __future__ import annotations

import json
from functools import lru_cache
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo.training.recipes.sft.data import (
    SftDataError,
    chat_example,
    encode_row,
    load_examples,
    read_rows,
)


@lru_cache(maxsize=1)
def tokenizer() -> Any:
    from grpo.backends.local.tiny import build_tokenizer

    return build_tokenizer()


TEXT = st.text(alphabet="abc xyz0123456789+=.", min_size=1, max_size=20)


@st.composite
def chats(draw: st.DrawFn) -> list[dict[str, str]]:
    """An optional system message, then 1..3 user/assistant exchanges (content drawn)."""
    messages = [{"role": "system", "content": draw(TEXT)}] if draw(st.booleans()) else []
    for _ in range(draw(st.integers(1, 3))):
        messages.append({"role": "user", "content": draw(TEXT)})
        messages.append({"role": "assistant", "content": draw(TEXT)})
    return messages


@settings(max_examples=40, deadline=None)
@given(chats())
def test_only_assistant_tokens_carry_weight(messages: list[dict[str, str]]) -> None:
    tok = tokenizer()
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    example = chat_example(tok, messages, trained)
    # The masked tokens are exactly each assistant message and its end-of-turn, in order.
    expected = "".join(messages[i]["content"] + "<|im_end|>" for i in trained)
    assert tok.decode(example.tokens_T[example.mask_T].tolist()) == expected
    # Unmasked, the rest is every other part of the rendering.
    full = tok.apply_chat_template(messages, tokenize=False, enable_thinking=False)
    assert example.tokens_T.tolist() == tok.encode(full, add_special_tokens=False)


UNMARKED_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


@settings(max_examples=40, deadline=None)
@given(chats(), st.booleans())
def test_the_generation_marks_render_nothing_and_mask_what_extension_masks(
    messages: list[dict[str, str]], generation_prompt: bool
) -> None:
    """The built-in template's {% generation %} marks: the same text as the template without
    them, and the template's mask (return_assistant_tokens_mask) equals the one rendering
    each prefix gives (grpo.core.sft.extension_mask)."""
    import copy

    from grpo.training.recipes.sft.data import has_generation_marks

    marked = tokenizer()
    unmarked = copy.deepcopy(marked)
    unmarked.chat_template = UNMARKED_TEMPLATE
    assert has_generation_marks(marked) and not has_generation_marks(unmarked)
    for kwargs in ({"add_generation_prompt": generation_prompt}, {}):
        assert marked.apply_chat_template(
            messages, tokenize=False, enable_thinking=False, **kwargs
        ) == unmarked.apply_chat_template(messages, tokenize=False, enable_thinking=False, **kwargs)
    trained = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    by_marks, by_extension = (chat_example(t, messages, trained) for t in (marked, unmarked))
    assert by_marks.tokens_T.tolist() == by_extension.tokens_T.tolist()
    assert by_marks.mask_T.tolist() == by_extension.mask_T.tolist()


def test_prompt_completion_rows_train_only_the_completion() -> None:
    tok = tokenizer()
    row = {"prompt": "What is 2+3?", "completion": "2+3=5. \\boxed{5}"}
    example = encode_row(tok, "f.jsonl", row, 1)
    assert tok.decode(example.tokens_T[example.mask_T].tolist()) == row["completion"] + "<|im_end|>"
    text = encode_row(tok, "f.jsonl", {"text": "abc abc"}, 2)
    assert text.mask_T.tolist() == [False] + [True] * (text.mask_T.size - 1)


def _write(tmp_path: Path, name: str, rows: list[dict[str, Any]]) -> Path:
    path = tmp_path / name
    if name.endswith(".jsonl"):
        path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    else:
        import datasets

        data = datasets.Dataset.from_list(rows)
        data.to_parquet(str(path)) if name.endswith(".parquet") else data.to_csv(str(path))
    return path


@pytest.mark.parametrize("name", ["rows.jsonl", "rows.parquet", "rows.csv"])
def test_every_format_reads_the_same_rows(tmp_path: Path, name: str) -> None:
    rows = [{"prompt": f"q{i}", "completion": f"a{i}"} for i in range(3)]
    path = _write(tmp_path, name, rows)
    assert [dict(row) for row in read_rows(path)] == rows
    assert len(load_examples(tokenizer(), path)) == 3


def test_messages_in_a_csv_cell_are_json(tmp_path: Path) -> None:
    chat = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    path = _write(tmp_path, "chat.csv", [{"messages": json.dumps(chat)}])
    (example,) = load_examples(tokenizer(), path)
    assert tokenizer().decode(example.tokens_T[example.mask_T].tolist()) == "yo<|im_end|>"


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"question": "x"}, "row 2: no 'messages', 'prompt' \\+ 'completion' or 'text' column"),
        (
            {"messages": [{"role": "user", "content": "x"}]},
            "row 2, column 'messages': no assistant",
        ),
        ({"messages": [{"role": "bot", "content": "x"}]}, "row 2, column 'messages', message 0"),
        ({"prompt": "x", "completion": 3}, "row 2, column 'completion'"),
        ({"messages": [{"role": "assistant", "content": "x"}]}, "row 2: the chat starts with"),
        ({"text": ""}, "row 2"),
    ],
)
def test_bad_rows_name_the_file_row_and_column(
    tmp_path: Path, row: dict[str, Any], message: str
) -> None:
    path = _write(tmp_path, "bad.jsonl", [{"text": "fine text"}, row])
    with pytest.raises(SftDataError, match=message) as error:
        load_examples(tokenizer(), path)
    assert str(path) in str(error.value)


def test_bad_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(SftDataError, match="not found"):
        read_rows(tmp_path / "missing.jsonl")
    (tmp_path / "x.txt").write_text("hi")
    with pytest.raises(SftDataError, match="suffix '.txt'"):
        read_rows(tmp_path / "x.txt")
    (tmp_path / "broken.jsonl").write_text('{"text": "a"}\n{nope\n')
    with pytest.raises(SftDataError, match="broken.jsonl line 2 is not valid JSON"):
        read_rows(tmp_path / "broken.jsonl")
    (tmp_path / "empty.jsonl").write_text("\n")
    with pytest.raises(SftDataError, match="holds no rows"):
        read_rows(tmp_path / "empty.jsonl")


def test_a_template_that_rewrites_earlier_turns_is_refused() -> None:
    class Rewriting:
        """A template that drops earlier assistant turns (as reasoning templates do)."""

        eos_token_id = tokenizer().eos_token_id
        chat_template = ""

        def apply_chat_template(self, messages: list[dict[str, str]], **kwargs: Any) -> str:
            keep = [
                m
                for i, m in enumerate(messages)
                if m["role"] != "assistant" or i == len(messages) - 1
            ]
            return tokenizer().apply_chat_template(keep, **kwargs)

        def encode(self, text: str, **kwargs: Any) -> list[int]:
            return tokenizer().encode(text, **kwargs)

    chat = [
        {"role": "user", "content": "a"},
        {"role": "assistant", "content": "b"},
        {"role": "user", "content": "c"},
        {"role": "assistant", "content": "d"},
    ]
    with pytest.raises(SftDataError, match="row 4: assistant turn 0: the rendering of the whole"):
        encode_row(Rewriting(), "f.jsonl", {"messages": chat}, 4)
    assert np.any(chat_example(tokenizer(), chat, [1, 3]).mask_T)


def test_a_directory_or_undecodable_bytes_are_errors_naming_the_path(tmp_path: Path) -> None:
    with pytest.raises(SftDataError, match=f"data {tmp_path} is a directory; give a .jsonl"):
        read_rows(tmp_path)
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "caf\xe9"}\n')
    with pytest.raises(SftDataError, match="latin1.jsonl is not UTF-8 text: byte 0xe9 at line 1"):
        read_rows(path)
