"""Reading the project's JSONL files (workloads, step traces): the lines of a file, each
with its number, so every error can name ``file:line``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path


def numbered_lines(path: str | Path, what: str) -> Iterator[tuple[int, str]]:
    """``(number, line)`` for each non-blank line of ``path``, numbered from 1;
    ``ValueError`` naming the file (as ``what``, e.g. "a step trace") if it is not UTF-8."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise ValueError(f"{path} is not UTF-8 text ({what}): {error}") from None
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            yield number, line
