"""One process at a time sets up a database (MLflow's and Optuna's schema creation are not safe
to race).

Two ``make sweep`` started at once on a new results folder both find no tables and both create
them; the slower one fails ("table spans already exists", "duplicate column name", Alembic's
"expected to match one row"). :func:`creation_lock` holds an operating-system lock on
``<database>.lock`` beside the file while a store is opened for the first time, so the second
process waits, then finds the schema complete. On a PostgreSQL database (many machines)
:func:`creation_lock` is a session advisory lock instead: two machines' first ``make sweep`` on a
new Optuna database would otherwise both create its tables ("duplicate key value violates unique
constraint", found by ``make servers-check``). MySQL stores get neither. Cells need no lock: the
work queue hands each cell to one worker (``sweep.run.queue``).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from filelock import FileLock, Timeout

#: How long a process waits for another one to finish creating the schema (it takes seconds).
WAIT_S = 300.0
#: The PostgreSQL advisory lock key of schema creation (any 64-bit number this harness alone uses).
ADVISORY_KEY = 0x6761746564  # "gated"


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
    """Hold ``<database>.lock`` (an OS file lock) while inside, for a SQLite ``url``; a session
    advisory lock of the database for a PostgreSQL one; do nothing for any other URL. Held while
    a store is opened for the first time in a process.

    Raises:
        LockTimeout: the lock stayed held for ``wait_s`` seconds.
    """
    with _file_lock(url, ".lock", wait_s), _advisory_lock(url, wait_s):
        yield


@contextlib.contextmanager
def _advisory_lock(url: str, wait_s: float) -> Iterator[None]:
    """``pg_advisory_lock`` on its own connection while inside, for a PostgreSQL ``url``."""
    from sqlalchemy import create_engine, text
    from sqlalchemy.engine import make_url
    from sqlalchemy.pool import NullPool

    try:
        postgres = make_url(url).get_backend_name() == "postgresql"
    except Exception:  # not an SQLAlchemy URL (an http tracking server, say)
        postgres = False
    if not postgres:
        yield
        return
    engine = create_engine(url, poolclass=NullPool)
    try:
        with engine.connect() as conn:
            deadline = time.monotonic() + wait_s
            while not conn.execute(text(f"SELECT pg_try_advisory_lock({ADVISORY_KEY})")).scalar():
                if time.monotonic() > deadline:
                    raise LockTimeout(
                        f"{make_url(url)!r}: another process held the set-up lock for {wait_s:.0f} s"
                    )
                time.sleep(0.2)
            try:
                yield
            finally:
                conn.execute(text(f"SELECT pg_advisory_unlock({ADVISORY_KEY})"))
    finally:
        engine.dispose()


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
