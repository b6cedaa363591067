"""Build sparsejax/data/prose.txt, the English prose of the long-context tasks' haystacks.

    python scripts/build_prose.py OUT.txt BOOK.txt[=SOURCE[=TITLE]] ...

Each BOOK is a Project Gutenberg plain-text file (UTF-8). SOURCE and TITLE (optional) are what
the header names as the book's origin and title (default: the file's name; the "Title:" and
"Author:" lines of its Gutenberg header). The script strips Project Gutenberg's header and footer (everything
up to the "*** START OF ..." line and from the "*** END OF ..." line, where present), drops
illustration captions and the underscores that mark italics, keeps paragraphs that hold a
lower-case letter (chapter headings and contents entries go), normalizes whitespace (one
paragraph a line, single spaces), and writes the books one after another behind a '#' header
that states where they came from and their license. The shipped file was built with

    python scripts/build_prose.py sparsejax/data/prose.txt \
        "1342-0.txt=https://github.com/gutenbergbooks/1342=Pride and Prejudice, by Jane Austen" \
        "1661-0.txt=https://github.com/gutenbergbooks/1661=The Adventures of Sherlock Holmes, \
by Arthur Conan Doyle" \
        "84-0.txt=https://github.com/gutenbergbooks/84=Frankenstein, by Mary Wollstonecraft \
Shelley"
"""
from __future__ import annotations

import re
import sys
from pathlib import Path

START = re.compile(r"^\*\*\* ?START OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
END = re.compile(r"^\*\*\* ?END OF (THE|THIS) PROJECT GUTENBERG.*$", re.M)
ILLUSTRATION = re.compile(r"\[Illustration[^\]]*\]", re.S)

HEADER = """\
# English prose for sparsejax's long-context tasks (sparsejax.tasks): their haystacks.
# Source: Project Gutenberg (https://www.gutenberg.org) plain-text eBooks, in this order:
{books}
# License: each book is in the public domain in the United States, as Project Gutenberg
# states for it; Project Gutenberg's header, footer and license text are removed (with
# them its trademark), as its license allows for public-domain works.
# Built by scripts/build_prose.py: headers and footers stripped, illustrations and italics
# marks dropped, headings dropped, whitespace normalized to one paragraph a line.
# Lines starting with '#' are this header; the prose follows the first blank line.
"""


def clean(text: str) -> list[str]:
    """The paragraphs of one Gutenberg book, one string each, whitespace normalized."""
    text = text.replace("\r\n", "\n").lstrip("\ufeff")
    start, end = START.search(text), END.search(text)
    if start:
        text = text[start.end():]
        end = END.search(text)
    if end:
        text = text[:end.start()]
    text = ILLUSTRATION.sub(" ", text).replace("_", "")
    paragraphs = (" ".join(p.split()) for p in re.split(r"\n\s*\n", text))
    return [p for p in paragraphs if re.search(r"[a-z]", p)]


def title(text: str) -> str:
    """The book's title and author, from the Gutenberg header or its first paragraph."""
    found = re.search(r"^Title: *(.+)$", text, re.M)
    author = re.search(r"^Author: *(.+)$", text, re.M)
    if found:
        return found.group(1).strip() + (f", by {author.group(1).strip()}" if author else "")
    first = clean(text)[0]
    return first if len(first) <= 80 else first[:77] + "..."


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print(__doc__, file=sys.stderr)
        return 2
    out, books = Path(argv[0]), argv[1:]
    body, names = [], []
    for spec in books:
        path, source, name = (spec.split("=", 2) + ["", ""])[:3]
        text = Path(path).read_text(encoding="utf-8")
        paragraphs = clean(text)
        if not paragraphs:
            raise SystemExit(f"{path}: no prose left after cleaning")
        body += paragraphs
        names.append(f"#   {name or title(text)} ({source or Path(path).name}), "
                     f"{sum(len(p) + 1 for p in paragraphs)} characters")
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(HEADER.format(books="\n".join(names)) + "\n" + "\n".join(body) + "\n",
                   encoding="utf-8")
    print(f"wrote {out}: {out.stat().st_size} bytes, {len(body)} paragraphs")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
