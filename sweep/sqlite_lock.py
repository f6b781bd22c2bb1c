"""One process at a time sets up a SQLite database (MLflow's and Optuna's schema creation are not
safe to race), and one sweep at a time claims a cell of a SQLite store.

Two ``make sweep`` started at once on a new results folder both find no tables and both create
them; the slower one fails ("table spans already exists", "duplicate column name", Alembic's
"expected to match one row"). :func:`creation_lock` holds an operating-system lock on
``<database>.lock`` beside the file while a store is opened for the first time, so the second
process waits, then finds the schema complete; :func:`claim_lock` does the same for the moment a
sweep looks at a cell's runs and makes one its own. PostgreSQL and MySQL stores (many machines)
are used without them: the first ``make sweep`` creates their schema before the others start, and
the work queue hands each cell to one worker (docs/resuming.md, "Many workers").
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

#: How long a process waits for another one to finish creating the schema (it takes seconds).
WAIT_S = 300.0


class LockTimeout(RuntimeError):
    """Another process held the set-up lock of a database for longer than :data:`WAIT_S`."""


def sqlite_file(url: str) -> Path | None:
    """The database file of a SQLite URL (``sqlite:///path`` or the URI form
    ``sqlite:///file:path?uri=true``); None for another database or an in-memory one."""
    from sqlalchemy.engine import make_url

    try:
        parsed = make_url(url)
    except Exception:  # not an SQLAlchemy URL (an http tracking server, say)
        return None
    database = parsed.database
    if parsed.get_backend_name() != "sqlite" or not database or database == ":memory:":
        return None
    if parsed.query.get("uri") == "true" and database.startswith("file:"):
        database = database.removeprefix("file:")
        database = "/" + database.lstrip("/") if database.startswith("//") else database
    return Path(database)


@contextlib.contextmanager
def creation_lock(url: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold ``<database>.lock`` (an OS file lock) while inside, for a SQLite ``url``; do nothing
    for any other URL. Held while a store is opened for the first time in a process.

    Raises:
        LockTimeout: the lock stayed held for ``wait_s`` seconds.
    """
    with _file_lock(url, ".lock", wait_s):
        yield


@contextlib.contextmanager
def claim_lock(url: str, wait_s: float = WAIT_S) -> Iterator[None]:
    """Hold ``<database>.claim.lock`` while inside, for a SQLite ``url``; do nothing for any other
    URL. A sweep holds it while it decides what a cell needs and makes its run its own, so two
    sweeps on one machine never both claim a cell (the second then sees the first's live run).

    Raises:
        LockTimeout: the lock stayed held for ``wait_s`` seconds.
    """
    with _file_lock(url, ".claim.lock", wait_s):
        yield


@contextlib.contextmanager
def _file_lock(url: str, suffix: str, wait_s: float) -> Iterator[None]:
    path = sqlite_file(url)
    if path is None:
        yield
        return
    lock = FileLock(f"{path}{suffix}")
    try:
        lock.acquire(timeout=wait_s)
    except Timeout:
        raise LockTimeout(f"{path}: another process held {lock.lock_file} for {wait_s:.0f} s") from None
    try:
        yield
    finally:
        lock.release()
