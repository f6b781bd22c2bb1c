"""``make servers-check``, second part: the fence (docs/resuming.md), on a real PostgreSQL queue.

1. Trains one cell (4,000 steps) in one process on the default SQLite stores: the reference.
2. Starts a PostgreSQL server (:mod:`tools.servers`) and runs the recipe's command with the queue
   there (``--storage postgresql+psycopg://...``, ``--heartbeat 2``) and the tracking store on
   this machine's SQLite file, so that the queue alone goes away.
3. Once the cell has a checkpoint, freezes every PostgreSQL process (SIGSTOP: the worst case, the
   database's calls hang instead of failing). Checks that within 15 s the worker says its
   heartbeat went unrecorded and stops the cell, saved, short of its end.
4. Thaws the database (SIGCONT); the sweep records the killed cell and exits 143. The same command
   again resumes the run from that checkpoint and finishes it; its ``train/loss`` history equals
   the reference's (each step once, relative 1e-5).

Exit status: 0 when every check passes, 1 when one fails (each failure one line), 2 when
PostgreSQL or psycopg is missing.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tools.servers import postgres
from tools.servers_check import (
    GRID,
    ROOT,
    cell_runs,
    environment,
    first_checkpoint,
    loss_history,
    run_in_temp,
    same_losses,
    start,
    sweep_command,
)

STEPS = 4000  # about 15 s at `tiny` on 2 cores: the fence trips (in 4-5 s) long before the end
HEARTBEAT_S = 2
FENCE_WAIT_S = 15.0
KILLED = re.compile(r"KILLED: SIGTERM at step (\d+); saved (\S+step\d+\.ckpt)")


def frozen_grid() -> str:
    """The servers check's grid with longer cells and a checkpoint every 100 steps."""
    return GRID.replace("max_steps: 240", f"max_steps: {STEPS}").replace(
        "checkpoint_every: 10}", "checkpoint_every: 100}"
    )


def postgres_processes(port: str) -> list:
    """The server listening on ``port`` and every process it started (its backends)."""
    import psutil

    for proc in psutil.process_iter(["name", "cmdline"]):
        if proc.info["name"] == "postgres" and f"-p {port}" in " ".join(proc.info["cmdline"] or []):
            return [proc, *proc.children(recursive=True)]
    raise RuntimeError(f"no PostgreSQL server on port {port}")


def wait_for(log: Path, pattern: re.Pattern[str], timeout_s: float) -> re.Match[str] | None:
    """The first match of ``pattern`` in ``log`` within ``timeout_s`` seconds, or None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if found := pattern.search(log.read_text()):
            return found
        time.sleep(0.1)
    return None


def run_check(work: Path, out: Callable[[str], None] = print) -> int:
    """Run the whole check in ``work``; return the exit status (see the module docstring)."""
    from mlflow import MlflowClient

    t0 = time.perf_counter()
    say = lambda line: out(f"[{time.perf_counter() - t0:5.0f} s] {line}")  # noqa: E731
    grid = work / "fence.yaml"
    grid.write_text(frozen_grid())
    rows = ["--rows", "baseline"]
    ref = work / "reference" / "results"
    command = [*sweep_command(grid, ref, None), *rows]
    done = subprocess.run(command, env=environment(None), cwd=ROOT, capture_output=True)
    if done.returncode != 0:
        out(f"FAIL: the one-process reference sweep exited {done.returncode}")
        return 1
    say(f"reference: one cell of {STEPS} steps in one process ({ref})")
    results, log, failures = work / "machine" / "results", work / "sweep.log", []
    with postgres(["optuna"]) as urls:
        command = [*sweep_command(grid, results, urls["optuna"], HEARTBEAT_S), *rows]
        say(f"queue on {urls['optuna']}, tracking on {results / 'mlflow.db'}")
        sweep = start(command, environment(None), log)
        first_checkpoint(results / "checkpoints", [sweep])
        frozen = postgres_processes(urls["optuna"].rsplit(":", 1)[1].split("/")[0])
        for proc in frozen:
            proc.suspend()
        say(f"froze PostgreSQL ({len(frozen)} processes, SIGSTOP) mid-cell")
        fenced = wait_for(log, re.compile(r"no heartbeat recorded for (\d+) s"), FENCE_WAIT_S)
        killed = wait_for(log, KILLED, FENCE_WAIT_S)
        for proc in frozen:
            proc.resume()
        say("thawed PostgreSQL (SIGCONT)")
        code = sweep.wait(timeout=120)
        if fenced is None or killed is None:
            failures.append(f"no fence within {FENCE_WAIT_S:.0f} s of the freeze (log: {log})")
        else:
            say(f"fenced after {fenced.group(1)} s without a heartbeat: stopped at step {killed.group(1)}")
        if code != 143:
            failures.append(f"the fenced sweep exited {code}, not 143 (log: {log})")
        again = subprocess.run(command, env=environment(None), cwd=ROOT, capture_output=True, text=True)
        summary = [line for line in again.stdout.splitlines() if line.startswith("sweep finished")]
        say(f"the same command again: {summary[0] if summary else 'no summary'}")
        if again.returncode != 0 or "resumed 1" not in again.stdout:
            failures.append(f"the rerun did not resume the cell: exit {again.returncode}")
    got, want = (MlflowClient(tracking_uri=f"sqlite:///{r / 'mlflow.db'}") for r in (results, ref))
    (run,), (reference,) = cell_runs(got), cell_runs(want)
    if not same_losses(loss_history(got, run.info.run_id), loss_history(want, reference.info.run_id)):
        failures.append("the resumed run's train/loss is not the reference's, each step once")
    for line in failures:
        out(f"FAIL: {line}")
    if not failures:
        say("fence check passed: the cell stopped saved, then resumed; losses equal the reference's")
    return 1 if failures else 0


def main(argv: list[str] | None = None) -> int:
    """``python -m tools.fence_check [--keep]``; see the module docstring."""
    return run_in_temp(run_check, "fence_check", __doc__, argv)


if __name__ == "__main__":
    sys.exit(main())
