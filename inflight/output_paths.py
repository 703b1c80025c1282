"""Output folders and files, checked before the work that fills them.

A calibration runs the model for a minute or two and a validation for longer; finding
only then that ``--output`` names a folder, or that ``--output-dir`` is a file or cannot
be created, throws that work away. These helpers create what is missing and prove the
place writable up front, raising ``ValueError`` with one line naming the option.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path


def prepare_output_dir(path: str | Path, flag: str) -> Path:
    """Create the folder ``path`` (and its parents) and check that files can be written
    in it; ``ValueError`` naming ``flag`` otherwise."""
    folder = Path(path)
    problem = _unwritable_folder(folder)
    if problem:
        raise ValueError(f"{flag} {path} {problem}")
    return folder


def prepare_output_file(path: str | Path, flag: str) -> Path:
    """Create the folder of the file ``path`` and check that the file can be written
    there (replacing it if it exists); ``ValueError`` naming ``flag`` otherwise."""
    target = Path(path)
    if target.is_dir():
        raise ValueError(f"{flag} {path} is a folder, not a file")
    folder = target.parent if str(target.parent) else Path(".")
    problem = _unwritable_folder(folder)
    if problem:
        raise ValueError(f"{flag} {path}: its folder {folder} {problem}")
    if target.exists() and not os.access(target, os.W_OK):
        raise ValueError(f"{flag} {path} cannot be written: permission denied")
    return target


def _unwritable_folder(folder: Path) -> str | None:
    """Why no file can be written in ``folder`` (created if missing); None if one can."""
    if folder.exists() and not folder.is_dir():
        return "is a file, not a folder"
    try:
        folder.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        return f"cannot be created: {error.strerror or error}"
    try:
        with tempfile.TemporaryFile(dir=folder):
            pass
    except OSError as error:
        return f"cannot be written: {error.strerror or error}"
    return None
