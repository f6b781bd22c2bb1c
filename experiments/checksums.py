"""The content check of a folder the harness builds once and reuses (the corpus, the benchmark
suite): the size and sha256 of every file, recorded when it is built (``checksums.json``) and
verified when it is opened, so a token file cut short, grown or overwritten, or a hand-edited
manifest, is never used as the artefact it was.

A folder built before the check existed gets its ``checksums.json`` on first open (the state as
found; nothing older can be known). Verifying reads every byte once per process (about 10 ms for
the `tiny` corpus); a file whose size, mtime and inode are unchanged since it was verified is not
read again.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

CHECKSUMS = "checksums.json"
_CHUNK = 1 << 22  # 4 MiB reads keep memory flat on a corpus of any size

#: (file path) -> (size, mtime_ns, inode) of the last content this process verified
_verified: dict[str, tuple[int, int, int]] = {}


class Damaged(RuntimeError):
    """A file of a built folder differs from what was built: the machine's state, not the input."""


def hash_file(digest: Any, path: Path) -> Any:
    """``digest`` (a ``hashlib`` object) updated with the bytes of ``path``, read in chunks; returned."""
    with open(path, "rb") as fh:
        while chunk := fh.read(_CHUNK):
            digest.update(chunk)
    return digest


def file_sha256(path: Path) -> str:
    """Hex sha256 of a file's bytes, read in chunks."""
    return hash_file(hashlib.sha256(), path).hexdigest()


def _files(root: Path) -> list[str]:
    """Every file of the folder but the checksums themselves, relative, sorted."""
    return sorted(
        p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file() and p.name != CHECKSUMS
    )


def write_checksums(root: Path) -> dict[str, dict[str, int | str]]:
    """Record ``{relative path: {"bytes": size, "sha256": hex}}`` of every file under ``root`` in
    ``root/checksums.json`` (written last of a build, the manifest included) and return it."""
    table = {
        rel: {"bytes": (root / rel).stat().st_size, "sha256": file_sha256(root / rel)} for rel in _files(root)
    }
    tmp = root / f".{CHECKSUMS}.tmp-{os.getpid()}"
    tmp.write_text(json.dumps(table, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, root / CHECKSUMS)
    return table


def _damaged(error: type[Exception], what: str, root: Path, rel: str, problem: str) -> Exception:
    return error(f"{what} {root}: {rel} {problem}; delete the folder to rebuild it (rm -r {root})")


def require_recorded(
    root: Path,
    table: dict | None,
    needed: Sequence[str],
    what: str = "corpus",
    error: type[Exception] = Damaged,
) -> None:
    """Check that each of ``needed`` (relative paths) is in ``table`` (what :func:`verify`
    returned; None: nothing recorded, nothing to check).

    Raises:
        error: a file not recorded (the folder was edited), one line as :func:`verify`'s.
    """
    for rel in dict.fromkeys(needed):
        if table is not None and rel not in table:
            raise _damaged(error, what, root, rel, "has no recorded checksum (the folder was edited)")


def verify(
    root: Path, needed: Sequence[str] = (), what: str = "corpus", error: type[Exception] = Damaged
) -> dict | None:
    """Check that every file recorded in ``checksums.json`` has the size and sha256 it was built
    with, and that each of ``needed`` (relative paths) is recorded.

    Returns:
        The recorded table, or None for a read-only folder built before the check (nothing
        recorded, nothing checked).

    Raises:
        error: (``Damaged`` by default) a file missing, of another size or content, or not
            recorded; one line naming the ``what``, the file and how to rebuild the folder.
    """
    root = Path(root)
    try:
        table = json.loads((root / CHECKSUMS).read_text())
    except FileNotFoundError:
        try:
            table = write_checksums(root)  # built before the check existed: record it as found
        except OSError:  # a read-only shared cache we cannot stamp: nothing recorded to check against
            return None
    except (OSError, ValueError) as err:
        raise _damaged(error, what, root, CHECKSUMS, f"cannot be read ({err})") from err
    require_recorded(root, table, needed, what, error)
    for rel, entry in table.items():
        path = root / rel
        try:
            st = path.stat()
        except FileNotFoundError:
            raise _damaged(error, what, root, rel, "is missing") from None
        if st.st_size != entry["bytes"]:
            raise _damaged(error, what, root, rel, f"is {st.st_size:,} bytes, {entry['bytes']:,} when built")
        stamp = (st.st_size, st.st_mtime_ns, st.st_ino)
        if _verified.get(str(path)) == stamp:
            continue
        if file_sha256(path) != entry["sha256"]:
            raise _damaged(error, what, root, rel, "changed since it was built (another sha256)")
        _verified[str(path)] = stamp
    return table
