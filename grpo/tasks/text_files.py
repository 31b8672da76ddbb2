"""A text data file's bytes checked: compressed or not UTF-8, named."""

from __future__ import annotations

from pathlib import Path

_COMPRESSED = {
    b"\x1f\x8b": ("gzip", "gunzip"),
    b"PK": ("zip", "unzip"),
    b"BZh": ("bzip2", "bunzip2"),
}
_COMPRESSED[b"\x28\xb5\x2f\xfd"] = ("zstd", "unzstd")


def text_problem(file: Path, data: bytes) -> str | None:
    """Why the bytes of a text data file (.jsonl, .json, .csv) are not UTF-8 text, else None:
    compressed (naming the tool to decompress it) or the first undecodable byte's place."""
    for magic, (kind, tool) in _COMPRESSED.items():
        if data.startswith(magic):
            return f"data file {file} is {kind}-compressed; decompress it first ({tool} {file})"
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as error:
        line = data.count(b"\n", 0, error.start) + 1
        column = error.start - (data.rfind(b"\n", 0, error.start) + 1) + 1
        return (
            f"data file {file} is not UTF-8 text: byte 0x{data[error.start]:02x} at line "
            f"{line}, column {column}; save it as UTF-8 (e.g. iconv -f latin1 -t utf-8)"
        )
    return None
