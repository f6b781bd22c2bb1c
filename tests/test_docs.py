"""The README stays short and true to the committed results, and every link in the docs lands.

Issue 50: the README is at most 130 lines, its quickstart and claims table come before line 60,
and every number it quotes is in a committed table (``results/*.md``) or a page of ``docs/``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
PAGES = sorted([README, ROOT / "CONTRIBUTING.md", *(ROOT / "docs").glob("*.md")])
NUMBER = re.compile(r"(?<![A-Za-z_0-9.])[-+]?\d+(?:[.,]\d+)*")
LINK = re.compile(r"\]\(([^)\s]+)\)")


def _slug(heading: str) -> str:
    """GitHub's anchor for a Markdown heading: lower case, punctuation but ``-`` and ``_`` dropped,
    spaces as ``-``."""
    text = re.sub(r"[^\w\- ]", "", heading.strip().lower())
    return text.replace(" ", "-")


def _anchors(page: Path) -> set[str]:
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    return {_slug(h) for h in re.findall(r"^#+ (.+)$", text, flags=re.M)}


def test_the_readme_is_short_with_quickstart_and_claims_first() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= 130
    quickstart = lines.index("## Quickstart")
    claims = next(i for i, line in enumerate(lines) if line.startswith("| the paper's claim |"))
    table_end = next(i for i in range(claims, len(lines)) if not lines[i].startswith("|"))
    assert quickstart < claims < table_end < 60


def test_every_number_the_readme_quotes_is_in_a_committed_table_or_the_docs() -> None:
    text = re.sub(r"```bibtex.*?```", "", README.read_text(), flags=re.S)  # the citation's own numbers
    text = text.replace("2025", "")  # the paper's year, in its citation
    pool = "\n".join(p.read_text() for p in [*(ROOT / "docs").glob("*.md"), *(ROOT / "results").glob("*.md")])
    missing = [
        n
        for n in dict.fromkeys(NUMBER.findall(text))
        if not re.search(r"(?<![0-9.])" + re.escape(n.lstrip("+-")) + r"(?![0-9])", pool)
    ]
    assert missing == []


@pytest.mark.parametrize("page", PAGES, ids=[str(p.relative_to(ROOT)) for p in PAGES])
def test_every_relative_link_lands_on_a_file_and_heading(page: Path) -> None:
    broken = []
    text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
    for target in LINK.findall(text):
        if re.match(r"[a-z]+:", target):  # http:, https:, mailto:
            continue
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(target)
        elif anchor and file.suffix == ".md" and anchor not in _anchors(file):
            broken.append(target)
    assert broken == []
