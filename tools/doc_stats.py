"""How a Markdown text reads, in figures: lines, mean and longest sentence in words, and numbers per
100 words (issue 50's measures). Every file is split the same way, so files compare:

- fenced code blocks, HTML tags and table rows are left out (a table row is data, not a sentence);
  a link or an image counts as its text;
- the rest is one stream, cut into sentences after ``.``, ``!`` or ``?`` followed by white space
  (headings and list items run into the next sentence unless they end with a stop);
- a word is a token with a letter; a number is a run of digits (``0.14``, ``2,400`` and ``-87.9``
  count once each) not glued to a letter (``G1`` and ``q48`` are names, not numbers).

``python -m tools.doc_stats README.md docs/`` prints one line per file and one per folder (its
files pooled). ``--tables`` also prints numbers per 100 words with the table rows kept.
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_CODE = re.compile(r"```.*?```", re.S)
_TAG = re.compile(r"<[^>]+>")
_LINK = re.compile(r"!?\[([^\]]*)\]\([^)]*\)")
_STOP = re.compile(r"(?<=[.!?])\s+")
_NUMBER = re.compile(r"(?<![A-Za-z_])\d+(?:[.,]\d+)*")
_LETTER = re.compile(r"[A-Za-z]")


@dataclass
class Figures:
    """What one text (or several, pooled) holds."""

    lines: int = 0
    sentences: int = 0
    words: int = 0
    numbers: int = 0
    longest: int = 0
    table_words: int = 0
    table_numbers: int = 0

    def add(self, other: Figures) -> None:
        for name in self.__dataclass_fields__:
            if name == "longest":
                self.longest = max(self.longest, other.longest)
            else:
                setattr(self, name, getattr(self, name) + getattr(other, name))


def measure(markdown: str) -> Figures:
    """The figures of one Markdown text (see the module docstring for the rules)."""
    text = _LINK.sub(r"\1", _TAG.sub(" ", _CODE.sub(" ", markdown)))
    prose, table = [], []
    for line in text.splitlines():
        if line.strip().startswith("|"):
            if not re.fullmatch(r"[-:| ]+", line.strip()):
                table.append(line.replace("|", " "))
        else:
            prose.append(line)
    sentences = [s for s in _STOP.split("\n".join(prose)) if _LETTER.search(s)]
    counts = [sum(1 for w in s.split() if _LETTER.search(w)) for s in sentences]
    table_text = " ".join(table)
    return Figures(
        lines=len(markdown.splitlines()),
        sentences=len(sentences),
        words=sum(counts),
        numbers=sum(len(_NUMBER.findall(s)) for s in sentences),
        longest=max(counts, default=0),
        table_words=sum(1 for w in table_text.split() if _LETTER.search(w)),
        table_numbers=len(_NUMBER.findall(table_text)),
    )


def row(name: str, f: Figures, tables: bool) -> str:
    """One Markdown table row: name, lines, sentences, mean and longest words per sentence,
    numbers per 100 words (and, with ``tables``, the same counting the table rows)."""
    mean = f.words / f.sentences if f.sentences else 0.0
    per_100 = 100 * f.numbers / f.words if f.words else 0.0
    cells = [name, f"{f.lines:,}", f"{f.sentences:,}", f"{mean:.1f}", str(f.longest), f"{per_100:.1f}"]
    if tables:
        words = f.words + f.table_words
        cells.append(f"{100 * (f.numbers + f.table_numbers) / words:.1f}" if words else "0.0")
    return "| " + " | ".join(cells) + " |"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.doc_stats", description=__doc__.splitlines()[0])
    parser.add_argument("paths", nargs="+", help="Markdown files, or folders (their *.md files, pooled)")
    parser.add_argument("--tables", action="store_true", help="also count numbers with the table rows kept")
    args = parser.parse_args(argv)
    head = ["text", "lines", "sentences", "words per sentence, mean", "longest", "numbers per 100 words"]
    if args.tables:
        head.append("numbers per 100 words, tables kept")
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for name in args.paths:
        path = Path(name)
        files = sorted(path.glob("*.md")) if path.is_dir() else [path]
        if not files or not all(f.is_file() for f in files):
            print(f"error: {name}: no Markdown file there", file=sys.stderr)
            return 2
        pooled = Figures()
        for file in files:
            figures = measure(file.read_text())
            pooled.add(figures)
            if path.is_dir():
                print(row(str(file), figures, args.tables))
        print(row(f"{name} ({len(files)} files)" if path.is_dir() else name, pooled, args.tables))
    return 0


if __name__ == "__main__":
    sys.exit(main())
