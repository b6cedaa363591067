"""Output files of the jobs: checked writable before the work, replaced only when complete."""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Callable


def check_writable(path: str | Path, flag: str, *, directory: bool = False) -> Path:
    """ValueError naming `flag` unless `path` (a file, or with `directory` a folder that may
    not exist yet) can be written; run before any model work so no result is lost."""
    path = Path(path)
    if directory:
        existing = next(p for p in (path, *path.parents) if p.exists())
        if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
            raise ValueError(f"{flag} {path}: {existing} is not a writable directory")
        return path
    if path.is_dir():
        raise ValueError(f"{flag} {path}: is a directory, expected a file path")
    if not path.parent.is_dir():
        raise ValueError(f"{flag} {path}: directory {path.parent} does not exist")
    if not os.access(path.parent, os.W_OK | os.X_OK) or (
            path.exists() and not os.access(path, os.W_OK)):
        raise ValueError(f"{flag} {path}: not writable")
    return path


def write_atomic(path: str | Path, write: Callable[[Path], None]) -> Path:
    """`write(tmp)` into a temporary file beside `path`, then rename it onto `path`: an existing
    file is replaced only by a complete new one."""
    path = Path(path)
    tmp = path.with_name(f".{path.stem}.{uuid.uuid4().hex[:8]}.tmp{path.suffix}")
    try:
        write(tmp)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    return path


def write_text_atomic(path: str | Path, text: str) -> Path:
    return write_atomic(path, lambda tmp: tmp.write_text(text))
