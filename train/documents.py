"""Your own text for the fitting jobs: documents read from files and cut into token windows.

    sparsejax calibrate   --model M --text a.txt b.jsonl ...   (DELTA's probe, Kascade's DP)
    sparsejax train-gates --model M --text a.txt ...           (LycheeDecode's passkeys in it)

Files:
  *.jsonl      one JSON object per line, its "text" field a document (blank lines skipped);
  anything else  plain UTF-8 text, the whole file ONE document. Blank lines do not split it:
               prose keeps paragraphs apart with blank lines, and a paragraph is too short to
               calibrate a long context on. Several documents per file: use .jsonl.

Windows (`token_windows`): each document is tokenized once (no special tokens; the tokenizer's
BOS, when it has one, starts every window), then cut into consecutive windows of `context`
tokens. A document longer than the window gives several windows; its tail, and a document
shorter than the window, gives one shorter window (right-padded, its length kept) when it holds
at least `min_tokens`. The windows are ordered round-robin over the documents (the first window
of each, then the second, ...) and `count` of them are taken evenly spaced along that order, so
one long book does not crowd out the rest, nor its first chapter the rest of the book.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Sequence

import numpy as np

MIN_TOKENS = 64     # a shorter window says little about long-context attention


def read_documents(paths: Sequence[str | Path]) -> list[str]:
    """The documents of `paths` in order (see the module docstring); ValueError for a missing,
    unreadable or empty file, or a .jsonl line without a string "text"."""
    if isinstance(paths, (str, Path)):
        paths = [paths]
    if not paths:
        raise ValueError("--text: expected at least one file")
    documents = []
    for path in map(Path, paths):
        try:
            raw = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ValueError(f"--text {str(path)!r}: no such file") from None
        except IsADirectoryError:
            raise ValueError(f"--text {str(path)!r} is a directory: expected .txt or .jsonl "
                             "files") from None
        except UnicodeDecodeError as e:
            raise ValueError(f"--text {str(path)!r} is not UTF-8 text: {e}") from None
        if path.suffix == ".jsonl":
            found = _jsonl_documents(path, raw)
        else:
            found = [raw] if raw.strip() else []
        if not found:
            raise ValueError(f"--text {str(path)!r} holds no text: expected "
                             + ("lines of {\"text\": ...}" if path.suffix == ".jsonl"
                                else "a non-empty document"))
        documents += found
    return documents


def _jsonl_documents(path: Path, raw: str) -> list[str]:
    documents = []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"--text {path}:{number} is not JSON: {e}") from None
        text = record.get("text") if isinstance(record, dict) else None
        if not isinstance(text, str):
            raise ValueError(f"--text {path}:{number}: expected an object with a string \"text\""
                             f" field, got {line[:80]!r}")
        if text.strip():
            documents.append(text)
    return documents


def tokenize_documents(documents: Sequence[str], tokenizer) -> list[np.ndarray]:
    """Each document's token ids (no special tokens), int32."""
    ids = tokenizer(list(documents), add_special_tokens=False)["input_ids"]
    return [np.asarray(x, np.int32) for x in ids]


def token_windows(documents: Sequence[str], tokenizer, context: int, count: int | None = None,
                  *, min_tokens: int = MIN_TOKENS) -> tuple[np.ndarray, np.ndarray]:
    """Windows of at most `context` tokens cut from `documents` -> (ids [N, T] int32 right-padded
    with the tokenizer's pad id, lengths [N] int32), T the longest window; at most `count`
    windows (None: all). ValueError when no window holds `min_tokens` (capped at `context`)."""
    if not isinstance(context, (int, np.integer)) or context < 2:
        raise ValueError(f"context={context!r}: expected an int >= 2")
    if count is not None and (not isinstance(count, (int, np.integer)) or count < 1):
        raise ValueError(f"count={count!r}: expected an int >= 1 or None")
    bos = getattr(tokenizer, "bos_token_id", None)
    prefix = np.asarray([] if bos is None else [bos], np.int32)
    body = context - prefix.size
    least = min(min_tokens, context)
    per_document = []
    for ids in tokenize_documents(documents, tokenizer):
        pieces = [np.concatenate([prefix, ids[s:s + body]]) for s in range(0, ids.size, body)]
        per_document.append([p for p in pieces if p.size >= least])
    windows = [w for rank in range(max(map(len, per_document), default=0))
               for pieces in per_document if rank < len(pieces) for w in [pieces[rank]]]
    if not windows:
        longest = max((d.size for d in tokenize_documents(documents, tokenizer)), default=0)
        raise ValueError(f"the documents hold no window of {least} tokens or more (the longest "
                         f"has {longest} tokens): give longer text")
    if count is not None and count < len(windows):
        windows = [windows[i] for i in np.linspace(0, len(windows) - 1, count).round().astype(int)]
    lengths = np.asarray([w.size for w in windows], np.int32)
    pad = getattr(tokenizer, "pad_token_id", None)
    ids = np.full((len(windows), int(lengths.max())), 0 if pad is None else pad, np.int32)
    for row, w in enumerate(windows):
        ids[row, :w.size] = w
    return ids, lengths


def describe(paths: Sequence[str | Path]) -> str:
    """The files, for a record of how a fit was made."""
    return "text " + ", ".join(Path(p).name for p in paths)


__all__ = ["MIN_TOKENS", "describe", "read_documents", "token_windows", "tokenize_documents"]
