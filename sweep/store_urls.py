"""Where the stores are, and whether they can be used: the tracking store's URI, SQLite URLs
of local files, the checks that a store exists and answers, and the error that says it does not
(:class:`TrackingError`, with any password hidden by :mod:`sweep.passwords`).
"""

from __future__ import annotations

import os
from pathlib import Path

from sweep.passwords import hide_password

#: The Optuna storage URL a worker reads (``--storage`` wins): how the driver hands its workers a
#: URL that may hold a password without writing it into a command line every user can read in ``ps``.
STORAGE_ENV = "GATED_ATTN_STORAGE"


class TrackingError(RuntimeError):
    """The tracking store (or the Optuna storage) cannot be reached or written; its message has
    the password of any URL in it hidden (:func:`hide_password`)."""

    def __init__(self, message: str) -> None:
        super().__init__(hide_password(message))


#: Characters a database URL reads as syntax (query, fragment, escape), whatever the quoting:
#: SQLAlchemy would decode a quoted path but MLflow makes the folder from the raw text.
URL_SPECIAL = "?#%"


def check_url_safe(path: Path) -> None:
    """Refuse a local path that cannot be written into a ``sqlite:///`` URL unchanged.

    Raises:
        ValueError: the path holds one of :data:`URL_SPECIAL`; the message names the path.
    """
    found = sorted(set(str(path.resolve())) & set(URL_SPECIAL))
    if found:
        raise ValueError(
            f"{path}: a folder whose path holds {' '.join(repr(c) for c in found)} cannot hold a SQLite "
            "store (a database URL reads them as syntax); choose another results folder"
        )


def missing_sqlite_store(uri: str) -> tuple[Path, str] | None:
    """For a ``sqlite:///`` tracking URI whose file is missing or empty: (the file, ``"missing"``
    or ``"empty"``); None for any other URI or a file that holds something. Opening such a store
    would create an empty one."""
    if not uri.startswith("sqlite:///"):
        return None
    db = Path(uri.removeprefix("sqlite:///"))
    if db.is_file() and db.stat().st_size > 0:
        return None
    return db, "empty" if db.exists() else "missing"


def sqlite_url(path: Path) -> str:
    """``sqlite:///<absolute path>`` of a local database file.

    Raises:
        ValueError: the path cannot be written into a URL unchanged (:func:`check_url_safe`).
    """
    check_url_safe(path)
    return f"sqlite:///{path.resolve()}"


def tracking_uri(results_dir: Path) -> str:
    """``MLFLOW_TRACKING_URI`` if set, else ``sqlite:///<results_dir>/mlflow.db`` (absolute).

    Raises:
        TrackingError: the default store's path cannot be written into a URL (:func:`sqlite_url`).
    """
    env = os.environ.get("MLFLOW_TRACKING_URI")
    if env:
        return env
    try:
        return sqlite_url(results_dir / "mlflow.db")
    except ValueError as err:
        raise TrackingError(str(err)) from None


def check_reachable(uri: str, timeout_s: float = 10.0) -> None:
    """Fail fast on a tracking server that does not answer (MLflow's own client retries for
    minutes) or a SQLite store whose folder does not exist.

    Raises:
        TrackingError: with the URI and the reason, one line.
    """
    if uri.startswith(("http://", "https://")):
        import requests

        try:
            requests.get(f"{uri.rstrip('/')}/health", timeout=timeout_s)
        except requests.RequestException as err:
            raise TrackingError(f"tracking store {uri} is not reachable: {type(err).__name__}") from None
    elif uri.startswith("sqlite:///"):
        folder = Path(uri.removeprefix("sqlite:///")).parent
        if not folder.is_dir():
            raise TrackingError(f"tracking store {uri} is not usable: folder {folder} does not exist")
