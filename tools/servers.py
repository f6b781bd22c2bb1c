"""Throwaway servers on localhost for the multi-machine check: a PostgreSQL cluster (Debian's
``postgresql`` package) and an MLflow tracking server backed by it.

:func:`postgres` initialises a cluster in a temporary folder (as the ``postgres`` user when run as
root: the server refuses to run as root), starts it on a free port of 127.0.0.1 with trust
authentication, creates the databases asked for and yields their SQLAlchemy URLs
(``postgresql+psycopg://...``, the driver of the ``postgres`` extra). :func:`mlflow_server` starts
``mlflow server`` on such a database with proxied artifacts (clients upload through the server).
Both stop their server and remove its files on leaving.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

from sweep.run.ranks import free_port

#: The database user the throwaway cluster is created with (trust authentication on 127.0.0.1).
DB_USER = "gated"
#: The SQLAlchemy driver of the ``postgres`` extra (psycopg 3).
DRIVER = "postgresql+psycopg"


class ServerError(RuntimeError):
    """A server did not start; the message says which and why (the end of its log)."""


def postgres_bin() -> Path | None:
    """The folder of PostgreSQL's server programs (``initdb``, ``pg_ctl``): Debian's
    ``/usr/lib/postgresql/<newest>/bin``, else the one of ``pg_ctl`` on the PATH; None without."""
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_ctl"), key=lambda p: int(p.parts[-3]))
    if versions:
        return versions[-1].parent
    found = shutil.which("pg_ctl")
    return Path(found).resolve().parent if found else None


def missing() -> str | None:
    """Why the servers cannot start here (no PostgreSQL, no psycopg), or None when they can."""
    if postgres_bin() is None:
        return "no PostgreSQL server programs (apt-get install postgresql)"
    try:
        import psycopg  # noqa: F401
    except ImportError:
        return 'no psycopg (pip install -e ".[postgres]")'
    return None


def _as_server_user() -> list[str]:
    """The command prefix that runs PostgreSQL's programs: none for a normal user; as root,
    ``runuser -u postgres`` (the user Debian's package creates)."""
    if os.geteuid() != 0:
        return []
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise ServerError("running as root and there is no 'postgres' user to run PostgreSQL") from None
    return ["runuser", "-u", "postgres", "--"]


def _run(command: list[str], what: str) -> None:
    done = subprocess.run(command, capture_output=True, text=True)
    if done.returncode != 0:
        tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
        raise ServerError(f"{what} failed (exit {done.returncode}): {' | '.join(tail)}")


@contextlib.contextmanager
def postgres(databases: list[str], port: int | None = None) -> Iterator[dict[str, str]]:
    """A PostgreSQL server on 127.0.0.1 for the duration of the block.

    Args:
        databases: the databases to create.
        port: the port (default: a free one).

    Yields:
        Each database's SQLAlchemy URL, e.g. ``postgresql+psycopg://gated@127.0.0.1:5433/optuna``.

    Raises:
        ServerError: no server programs, or one of them failed (its last lines in the message).
    """
    bin_dir = postgres_bin()
    if bin_dir is None:
        raise ServerError(missing() or "no PostgreSQL")
    port = port or free_port()
    prefix = _as_server_user()
    # as root, in /tmp: the server's user must reach its folder ($TMPDIR may be private to root)
    root = Path(tempfile.mkdtemp(prefix="gated-pg-", dir="/tmp" if prefix else None))
    data = root / "data"
    data.mkdir()
    if prefix:  # the server's user owns its folder
        entry = pwd.getpwnam("postgres")
        root.chmod(0o755)
        os.chown(data, entry.pw_uid, entry.pw_gid)
    pg_ctl = [*prefix, str(bin_dir / "pg_ctl"), "-D", str(data)]
    started = False
    try:
        _run([*prefix, str(bin_dir / "initdb"), "-D", str(data), "-U", DB_USER, "--auth=trust", "-E", "UTF8"],
             "initdb")  # fmt: skip
        options = f"-p {port} -c listen_addresses=127.0.0.1 -k {data} -c max_connections=200"
        _run(
            [*pg_ctl, "-o", options, "-l", str(data / "server.log"), "-w", "-t", "60", "start"],
            "pg_ctl start",
        )
        started = True
        for name in databases:
            createdb = bin_dir / "createdb"
            program = str(createdb) if createdb.exists() else "createdb"
            _run([program, "-h", "127.0.0.1", "-p", str(port), "-U", DB_USER, name], f"createdb {name}")
        yield {name: f"{DRIVER}://{DB_USER}@127.0.0.1:{port}/{name}" for name in databases}
    finally:
        if started:
            subprocess.run([*pg_ctl, "-m", "fast", "-w", "stop"], capture_output=True)
        shutil.rmtree(root, ignore_errors=True)


@contextlib.contextmanager
def mlflow_server(backend_url: str, artifacts: Path, log: Path, port: int | None = None) -> Iterator[str]:
    """``mlflow server`` on 127.0.0.1 with ``backend_url`` as its store and ``artifacts`` as the
    destination of proxied artifacts, for the duration of the block; its output goes to ``log``.

    Yields:
        The tracking URI, ``http://127.0.0.1:<port>``.

    Raises:
        ServerError: the server did not answer ``/health`` within two minutes (or exited).
    """
    import requests

    port = port or free_port()
    command = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", backend_url,
        "--artifacts-destination", str(artifacts), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    uri = f"http://127.0.0.1:{port}"
    with open(log, "w") as sink:
        proc = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while True:
            if proc.poll() is not None:
                tail = " | ".join(log.read_text().strip().splitlines()[-3:])
                raise ServerError(f"mlflow server exited with status {proc.returncode}: {tail}")
            with contextlib.suppress(requests.RequestException):
                if requests.get(f"{uri}/health", timeout=2).ok:
                    break
            if time.monotonic() > deadline:
                raise ServerError(f"mlflow server did not answer on {uri} within 120 s (log: {log})")
            time.sleep(0.5)
        yield uri
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGTERM)  # the server and its uvicorn or gunicorn workers
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
