"""Real servers: PostgreSQL (Debian's package) and an MLflow tracking server on it, with the
multi-machine recipe of docs/resuming.md run against them (``make servers-check``). Skipped, with
the reason, where PostgreSQL's server programs or psycopg (the ``postgres`` extra) are missing;
CI installs both (``make servers-setup`` in ``.ci/run``)."""

from __future__ import annotations

import subprocess
import sys
import threading

import pytest

from sweep.sqlite_lock import LockTimeout, creation_lock
from tests.support import ROOT
from tools.servers import missing, postgres

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults

needs_servers = pytest.mark.skipif(missing() is not None, reason=f"servers check: {missing()}")


def test_the_checks_loss_comparison_wants_each_step_once_and_equal_values() -> None:
    from tools.servers_check import same_losses

    want = [(0, 6.0), (1, 5.5), (2, 5.0)]
    assert same_losses([(0, 6.0), (1, 5.5 * (1 + 5e-6)), (2, 5.0)], want)
    assert not same_losses([(0, 6.0), (1, 5.5 * (1 + 5e-5)), (2, 5.0)], want)  # beyond 1e-5
    assert not same_losses([(0, 6.0), (1, 5.5), (1, 5.5), (2, 5.0)], want)  # a step logged twice
    assert not same_losses(want[:2], want)  # a step missing


@needs_servers
def test_schema_creation_on_postgresql_is_one_process_at_a_time() -> None:
    """Two machines' first sweeps on a new Optuna database both created its tables (a unique
    violation on ``alembic_version``); the set-up lock is a PostgreSQL advisory lock there."""
    with postgres(["optuna"]) as urls:
        url = urls["optuna"]
        held, release = threading.Event(), threading.Event()

        def holder() -> None:
            with creation_lock(url):
                held.set()
                release.wait(30)

        thread = threading.Thread(target=holder)
        thread.start()
        try:
            assert held.wait(30)
            with pytest.raises(LockTimeout), creation_lock(url, wait_s=0.5):
                pass
        finally:
            release.set()
            thread.join()
        with creation_lock(url, wait_s=5):  # released: the next process gets it at once
            pass


@needs_servers
def test_the_multi_machine_recipe_survives_a_killed_worker_on_real_servers() -> None:
    """``python -m tools.servers_check``: two machines on one PostgreSQL queue and one MLflow
    server, a worker SIGKILLed mid-cell; each cell one finished run with the one-process losses."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.servers_check"], cwd=ROOT, capture_output=True, text=True, timeout=1200
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "servers check passed" in done.stdout


@needs_servers
def test_a_worker_whose_queue_freezes_stops_its_cell_saved_and_a_rerun_resumes_it() -> None:
    """``python -m tools.fence_check``: the PostgreSQL queue frozen (SIGSTOP) mid-cell; the fence
    stops the cell saved within 15 s, the sweep exits 143, the rerun resumes it to the reference's
    losses."""
    done = subprocess.run(
        [sys.executable, "-m", "tools.fence_check"], cwd=ROOT, capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "fence check passed" in done.stdout
