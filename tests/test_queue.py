"""Many workers on one grid through the Optuna queue: each cell trained once, a dead worker's
cell taken over and resumed."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import optuna
import pytest
from mlflow import MlflowClient

from sweep.cli import main
from sweep.grid import Grid, load_grid
from sweep.run.driver import run_queued_sweep
from sweep.run.queue import CLAIM_ATTR, Queue, enqueue_cells, held_elsewhere, open_queue, pop_cell, record
from sweep.run.resume import worker_name
from sweep.run.runner import SweepContext, prepare_sweep
from sweep.run.summary import queue_outcomes
from sweep.run.worker import drain, run_worker
from sweep.signals import StopRequest
from sweep.studies import storage_url
from tests.support import (
    LONG_MICRO,
    LONG_STEPS,
    MICRO,
    ROOT,
    all_cell_runs,
    queue_trials,
    start_slow_cli,
    wait_for_checkpoint,
)

pytestmark = pytest.mark.slow  # make test-all: processes, signals, faults


def test_three_workers_train_every_cell_exactly_once(
    repo_cache: None, micro: dict, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    grid = tmp_path / "micro.yaml"
    grid.write_text(MICRO)
    results = tmp_path / "results"
    args = ["sweep", "--grid", str(grid), "--results", str(results), "--seeds", "3", "--workers", "3"]
    assert main(args) == 0
    out = capsys.readouterr().out
    assert "9 cells, 9 to train, 0 finished earlier" in out and "for 3 workers" in out
    assert "finished 9, resumed 0, skipped 0, diverged 0, failed 0" in out

    runs = all_cell_runs(results)
    cells = load_grid(grid).cells("tiny", seeds=[0, 1, 2])
    keys = {c.run_key for c in cells}
    assert Counter(r.data.tags["run_key"] for r in runs) == Counter(keys)  # one run per cell, no more
    assert all(r.data.tags["status"] == "finished" and "resumed" not in r.data.tags for r in runs)
    trials = queue_trials(results)
    assert sorted(t.user_attrs["run_key"] for t in trials) == sorted(keys)
    assert {t.user_attrs["outcome"] for t in trials} == {"finished"}
    assert all(t.state == optuna.trial.TrialState.COMPLETE for t in trials)
    for t in trials:  # the trial's value is its run's Avg PPL
        (run,) = [r for r in runs if r.data.tags["run_key"] == t.user_attrs["run_key"]]
        assert t.value == pytest.approx(run.data.metrics["val/ppl/avg"])

    # Seed 0's cells against the one-process sweep's: every cell computes with one thread, so
    # how many workers ran changes no number.
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    single = MlflowClient(tracking_uri=f"sqlite:///{micro['results'] / 'mlflow.db'}")
    by_key = {
        r.data.tags["run_key"]: r
        for r in all_cell_runs(micro["results"])
        if r.data.tags["status"] == "finished"
    }

    def losses(c: MlflowClient, run_id: str) -> list[float]:
        return [m.value for m in sorted(c.get_metric_history(run_id, "train/loss"), key=lambda m: m.step)]

    compared = 0
    for run in runs:
        one = by_key.get(run.data.tags["run_key"])
        if one is not None:
            assert losses(client, run.info.run_id) == losses(single, one.info.run_id)
            assert run.data.tags["threads"] == one.data.tags["threads"] == "1"
            compared += 1
    assert compared == 3

    assert main(args) == 0  # nothing left: no worker starts, no trial is added
    assert "finished 0, resumed 0, skipped 9" in capsys.readouterr().out
    assert len(queue_trials(results)) == 9 and len(all_cell_runs(results)) == 9


@dataclass
class Queued:
    """A grid prepared as a driver would, with its queue open (heartbeat 1 s)."""

    grid_path: Path
    results: Path
    grid: Grid
    cells: list
    ctx: SweepContext
    url: str
    queue: Queue


def queued(tmp_path: Path, grid_text: str, row: str | None = None) -> Queued:
    """Write the grid, create the store and corpus (``prepare_sweep``) and open the queue; the
    cells are the grid's (``row``'s only, if given). Nothing is enqueued yet."""
    grid_path = tmp_path / "micro.yaml"
    grid_path.write_text(grid_text)
    results = tmp_path / "results"
    results.mkdir()
    grid = load_grid(grid_path)
    cells = [c for c in grid.cells("tiny") if row is None or c.row.id == row]
    ctx = prepare_sweep(grid, cells, results, ROOT / ".cache", out=lambda _line: None)
    url = storage_url(results, None)
    return Queued(grid_path, results, grid, cells, ctx, url, open_queue("tiny", url, heartbeat_s=1))


def test_a_dead_workers_cell_is_taken_over_and_resumed(repo_cache: None, tmp_path: Path) -> None:
    q = queued(tmp_path, LONG_MICRO)
    grid_path, results, url = q.grid_path, q.results, q.url
    enqueue_cells(q.queue, q.cells, q.ctx, force=False)

    worker = [
        "worker",
        "--grid",
        str(grid_path),
        "--results",
        str(results),
        "--storage",
        url,
        "--heartbeat",
        "1",
    ]
    procs = [start_slow_cli(worker) for _ in range(2)]
    folder = wait_for_checkpoint(results, 15, procs)
    (victim_run,) = [r for r in all_cell_runs(results) if r.info.run_id == folder.name]
    pid = int(victim_run.data.tags["worker"].rsplit(":", 1)[1])
    (victim,) = [p for p in procs if p.pid == pid]
    victim.send_signal(signal.SIGKILL)
    victim.wait(timeout=60)
    (survivor,) = [p for p in procs if p is not victim]
    out, _ = survivor.communicate(timeout=300)
    victim.stdout.close()
    assert survivor.returncode == 0, out
    assert f"resuming run {folder.name} (running) from step" in out  # taken over after 3 heartbeats

    runs = all_cell_runs(results)
    assert len(runs) == 3 and {r.data.tags["status"] for r in runs} == {"finished"}
    (resumed,) = [r for r in runs if r.info.run_id == folder.name]
    assert resumed.data.tags["resumed"] == "1" and resumed.data.tags["worker"].endswith(f":{survivor.pid}")
    client = MlflowClient(tracking_uri=f"sqlite:///{results / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(resumed.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(LONG_STEPS))  # every step once across the two workers

    trials = {t.number: t for t in queue_trials(results)}
    (dead,) = [t for t in trials.values() if t.state == optuna.trial.TrialState.FAIL]
    (retry,) = [t for t in trials.values() if t.system_attrs.get("failed_trial") == dead.number]
    assert retry.user_attrs["run_key"] == dead.user_attrs["run_key"] == resumed.data.tags["run_key"]
    assert retry.user_attrs["outcome"] == "resumed" and retry.user_attrs["worker"].endswith(
        f":{survivor.pid}"
    )
    assert os.path.isfile(folder / "final.ckpt")


def test_a_cell_enqueued_twice_is_trained_once(repo_cache: None, tmp_path: Path) -> None:
    """Two drivers enqueued one cell at the same moment, and the worker holding the older trial
    (on another machine) died: the younger trial defers to the older one, which is taken over
    once its heartbeat lapses and trained once."""
    q = queued(tmp_path, MICRO, "baseline")
    grid, cells, results, url, queue = q.grid, q.cells, q.results, q.url, q.queue
    enqueue_cells(queue, cells, q.ctx, force=False)
    attrs = {"run_key": cells[0].run_key, "row": "baseline", "seed": 0, "force": False}
    queue.study.enqueue_trial({}, user_attrs=attrs)  # the other driver, which saw no trial yet
    held = pop_cell(queue, {cells[0].run_key})
    # a worker of another machine took trial 0, then died: its heartbeat lapses after 3 s
    claim = {"trial": held.number, "worker": "gpu-node-7:4242", "started": "0"}
    queue.storage.set_trial_user_attr(queue.trial_id(held), CLAIM_ATTR, claim)
    queue.storage.record_heartbeat(queue.trial_id(held))

    quiet = lambda _line: None  # noqa: E731
    outcomes = run_worker(grid, cells, results, url, 1, ROOT / ".cache", StopRequest(), out=quiet)
    assert [o.status for o in outcomes] == ["finished"]
    dead, younger, retry = queue_trials(results)
    assert dead.number == held.number == 0 and dead.state == optuna.trial.TrialState.FAIL
    assert younger.user_attrs["outcome"] == "duplicate"
    assert younger.user_attrs["note"] == "trial 0 has this cell"
    assert retry.system_attrs["failed_trial"] == 0 and retry.user_attrs["outcome"] == "finished"
    assert len(all_cell_runs(results)) == 1


def test_a_cell_another_sweeps_worker_trained_counts_as_skipped_in_this_sweeps_summary(
    repo_cache: None, tmp_path: Path
) -> None:
    """Two sweeps on one queue: each summary counts what its own workers did."""
    q = queued(tmp_path, MICRO, "baseline")
    wanted = enqueue_cells(q.queue, q.cells, q.ctx, force=False)
    quiet = lambda _line: None  # noqa: E731
    run_worker(q.grid, q.cells, q.results, q.url, 1, ROOT / ".cache", StopRequest(), out=quiet)
    (mine,) = queue_outcomes(q.queue, q.cells, wanted, q.ctx, sweep=worker_name())
    (theirs,) = queue_outcomes(q.queue, q.cells, wanted, q.ctx, sweep="elsewhere:1")
    assert mine.status == "finished"
    assert theirs.status == "skipped" and theirs.note == f"finished by another sweep's worker {worker_name()}"


def test_a_younger_twin_that_found_the_result_does_not_hide_who_trained_the_cell(
    repo_cache: None, tmp_path: Path
) -> None:
    """Two machines' drivers enqueued one cell; the older trial trained it, then a worker took
    the younger one and found the result (``skipped``): the summary still says ``finished``."""
    q = queued(tmp_path, MICRO, "baseline")
    wanted = enqueue_cells(q.queue, q.cells, q.ctx, force=False)
    attrs = {"run_key": q.cells[0].run_key, "row": "baseline", "seed": 0, "force": False}
    q.queue.study.enqueue_trial({}, user_attrs=attrs)  # the other machine's driver
    assert record(q.queue, pop_cell(q.queue, set(wanted)), "finished", avg_ppl=1.0)
    assert record(q.queue, pop_cell(q.queue, set(wanted)), "skipped", "finished earlier")
    (mine,) = queue_outcomes(q.queue, q.cells, wanted, q.ctx, sweep=worker_name())
    assert mine.status == "finished"


def test_a_cell_whose_worker_died_reads_failed_but_still_in_the_queue(
    repo_cache: None, tmp_path: Path
) -> None:
    """This machine's worker was killed holding the cell: the sweep fails it, saying that the
    queue still has it (another machine's worker, or the same command again, takes it over)."""
    q = queued(tmp_path, MICRO, "baseline")
    wanted = enqueue_cells(q.queue, q.cells, q.ctx, force=False)
    pop_cell(q.queue, set(wanted))  # taken, never recorded: its worker got SIGKILL
    (cell,) = queue_outcomes(q.queue, q.cells, wanted, q.ctx, sweep=worker_name())  # the popper: ours
    assert cell.status == "failed" and cell.note.startswith("still in the queue")


@contextlib.contextmanager
def stopped_worker() -> Iterator[tuple[str, float]]:
    """A process of this machine stopped with SIGSTOP (Ctrl-Z, a closed laptop lid), as another
    sweep's worker would be: its ``host:pid`` and start time, for a queue claim."""
    import subprocess
    import sys

    import psutil

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        os.kill(proc.pid, signal.SIGSTOP)
        yield f"{socket.gethostname()}:{proc.pid}", psutil.Process(proc.pid).create_time()
    finally:
        proc.kill()
        proc.wait()


def test_a_sweep_beside_another_sweeps_stopped_worker_trains_the_rest_ends_and_counts_its_cell_busy(
    repo_cache: None, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """Another sweep's worker holds baseline s0 and is stopped (SIGSTOP): alive, never taken over.
    A second sweep of the grid trains the other cell, ends, and says once which cell another
    sweep's worker holds, and which worker; ``busy``, also when it is stopped by hand."""
    import threading

    q = queued(tmp_path, MICRO, "baseline")
    (baseline,) = q.cells
    wanted = enqueue_cells(q.queue, q.cells, q.ctx, force=False)
    with stopped_worker() as (worker, started):
        held = pop_cell(q.queue, set(wanted), sweep=worker)
        claim = {"trial": held.number, "worker": worker, "started": started, "sweep": worker}
        for attr, value in ((CLAIM_ATTR, claim), ("worker", worker)):  # as that worker wrote them
            q.queue.storage.set_trial_user_attr(q.queue.trial_id(held), attr, value)

        args = ["sweep", "--grid", str(q.grid_path), "--results", str(q.results), "--workers", "1"]
        assert main([*args, "--rows", "baseline,sdpa_elementwise"]) == 0
        out = capsys.readouterr().out
        assert "2 cells, 2 to train, 0 finished earlier" in out
        assert "finished 1, resumed 0, skipped 0, busy 1, diverged 0, failed 0" in out
        busy = [line for line in out.splitlines() if line.startswith("  busy:")]
        want = f"  busy: baseline seed 0: another sweep's worker {worker} trains it"
        assert busy == [f"{want} (alive, or stopped: a stopped process counts)"]
        runs = all_cell_runs(q.results)
        assert [r.data.tags["row"] for r in runs] == ["sdpa_elementwise"]

        # The same from the worker loop and the summary: the loop leaves at once, and a sweep
        # stopped by hand (a signal) still says busy, not "not started".
        drained: list = []
        loop = threading.Thread(target=lambda: drained.append(drain(q.queue, q.cells, q.ctx, 1, poll_s=0.1)))
        loop.start()
        loop.join(timeout=60)
        assert not loop.is_alive(), "the worker waited for another sweep's live cell"
        assert drained == [[]]
        q.ctx.stop.signum = signal.SIGINT
        (cell,) = queue_outcomes(q.queue, q.cells, wanted, q.ctx, sweep=worker_name())
        assert (cell.cell, cell.status) == (baseline, "busy") and worker in cell.note
        (held_now,) = [t for t in queue_trials(q.results) if t.number == held.number]
        assert held_now.state == optuna.trial.TrialState.RUNNING  # never taken over: it is alive


def test_a_later_stage_whose_parent_another_sweep_holds_here_is_left_to_it_and_one_of_this_sweeps_is_not(
    tmp_path: Path,
) -> None:
    queue = open_queue("tiny", f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_s=1)
    for key in ("parent", "child", "grandchild", "mine", "mine_child"):
        queue.study.enqueue_trial({}, user_attrs={"run_key": key, "row": key, "seed": 0, "force": False})
    queue.study.enqueue_trial({}, user_attrs={"run_key": "far", "row": "far", "seed": 0, "force": False})
    parents = {"child": "parent", "grandchild": "child", "mine_child": "mine"}
    pop_cell(queue, {"parent"}, sweep="other:1")
    pop_cell(queue, {"mine"}, sweep="this:1")
    far = pop_cell(queue, {"far"}, sweep="other:1")  # another machine's worker: waited for
    claim = {"trial": far.number, "worker": "gpu-node-7:4242", "started": "0", "sweep": "other:1"}
    queue.storage.set_trial_user_attr(queue.trial_id(far), CLAIM_ATTR, claim)
    keys = {"parent", "child", "grandchild", "mine", "mine_child", "far"}
    held = held_elsewhere(queue, keys, parents, "this:1")
    assert {k: t.user_attrs["run_key"] for k, t in held.items()} == {
        "parent": "parent",
        "child": "parent",
        "grandchild": "parent",
    }
    assert set(held_elsewhere(queue, keys, parents, "other:1")) == {"mine", "mine_child"}


def test_a_killed_cell_goes_back_into_the_queue_and_a_lapsed_trial_is_not_overwritten(
    repo_cache: None, tmp_path: Path
) -> None:
    q = queued(tmp_path, MICRO, "baseline")
    cells, ctx, results, queue = q.cells, q.ctx, q.results, q.queue
    assert enqueue_cells(queue, cells, ctx, force=False) == {cells[0].run_key: 0}
    assert enqueue_cells(queue, cells, ctx, force=False) == {cells[0].run_key: 0}  # in flight: once

    taken = pop_cell(queue, {cells[0].run_key})
    assert pop_cell(queue, {cells[0].run_key}) is None  # one trial, one worker
    assert record(queue, taken, "killed", "SIGTERM at step 12")
    killed, back = queue_trials(results)
    assert killed.state == optuna.trial.TrialState.FAIL and killed.user_attrs["outcome"] == "killed"
    assert back.state == optuna.trial.TrialState.WAITING
    assert back.user_attrs == {"run_key": cells[0].run_key, "row": "baseline", "seed": 0, "force": False}

    again = pop_cell(queue, {cells[0].run_key})
    queue.storage.set_trial_state_values(queue.trial_id(again), state=optuna.trial.TrialState.FAIL)
    assert not record(queue, again, "finished", avg_ppl=1.0)  # failed by a stale check meanwhile


def test_this_machines_workers_are_judged_by_their_process_not_their_heartbeat(tmp_path: Path) -> None:
    """A live worker of this machine whose heartbeat lapsed (a laptop that slept) keeps its cell;
    a dead one's cell goes back at once; a retry's copy, which inherits its failed trial's
    claim, is not taken for a popped trial."""
    import subprocess
    import sys
    import time

    import psutil

    from sweep.run.queue import settle_this_machine

    queue = open_queue("tiny", f"sqlite:///{tmp_path / 'optuna.db'}", heartbeat_s=1)
    for key in ("live", "dead"):
        queue.study.enqueue_trial({}, user_attrs={"run_key": key, "row": key, "seed": 0, "force": False})
    live, dead = (pop_cell(queue, {key}) for key in ("live", "dead"))
    sleeper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    try:
        for trial, proc, started in (
            (live, sleeper, psutil.Process(sleeper.pid).create_time()),
            (dead, gone, time.time()),
        ):
            claim = {
                "trial": trial.number,
                "worker": f"{socket.gethostname()}:{proc.pid}",
                "started": started,
            }
            queue.storage.set_trial_user_attr(queue.trial_id(trial), CLAIM_ATTR, claim)
        time.sleep(3.5)  # both heartbeats are stale now (three 1 s beats)
        settle_this_machine(queue)
        optuna.storages.fail_stale_trials(queue.study)
    finally:
        sleeper.kill()
        sleeper.wait()
    trials = {t.number: t for t in queue.study.get_trials()}
    assert trials[live.number].state == optuna.trial.TrialState.RUNNING  # renewed: its worker lives
    assert trials[dead.number].state == optuna.trial.TrialState.FAIL
    (copy,) = [t for t in trials.values() if t.system_attrs.get("failed_trial") == dead.number]
    assert copy.state == optuna.trial.TrialState.WAITING
    assert copy.user_attrs[CLAIM_ATTR]["trial"] == dead.number  # inherited: not a claim of the copy
    # A worker pops the copy; before it writes its own claim, the inherited one names the dead
    # process: the copy is not failed for it.
    copy_id = queue.trial_id(copy)
    assert queue.storage.set_trial_state_values(copy_id, state=optuna.trial.TrialState.RUNNING)
    queue.storage.record_heartbeat(copy_id)
    settle_this_machine(queue)
    assert queue.study.get_trials()[copy.number].state == optuna.trial.TrialState.RUNNING


def test_the_fence_stops_a_worker_whose_heartbeats_fail_or_hang_and_spares_one_whose_beats_land() -> None:
    """No heartbeat recorded for two intervals (1 s here): the worker's stop request gets SIGTERM,
    once, with a line; so at once when the claim's own beat is already that old (the database hung
    between the pop and the cell); beats that land never trip it."""
    import threading
    import time

    from sweep.run.resume import Heartbeat

    lines: list[str] = []
    hung = threading.Event()

    def failing() -> None:
        raise ConnectionError("server closed the connection unexpectedly")

    for what, beat in (("failing", failing), ("hanging", lambda: hung.wait(30))):
        stop, started = StopRequest(), time.monotonic()
        with pytest.warns(UserWarning) if what == "failing" else contextlib.nullcontext():
            with Heartbeat(beat, 0.5, what, stop, lines.append) as heart:
                while stop.signum is None and time.monotonic() - started < 20:
                    time.sleep(0.02)
                tripped_after = time.monotonic() - started
        assert heart.lapsed and stop.signum == signal.SIGTERM, what
        assert 1.0 <= tripped_after < 10.0, (what, tripped_after)
    hung.set()
    stop, popped = StopRequest(), time.monotonic() - 1.2  # popped 1.2 s ago, beats land from now on
    with Heartbeat(lambda: None, 0.5, "late", stop, lines.append, since=popped) as heart:
        time.sleep(0.3)
    assert heart.lapsed and stop.signum == signal.SIGTERM
    beats: list[float] = []
    stop = StopRequest()
    with Heartbeat(lambda: beats.append(time.monotonic()), 0.5, "landing", stop, lines.append) as heart:
        time.sleep(2.2)
    assert not heart.lapsed and stop.signum is None and len(beats) >= 3
    assert [line.split(":")[0] for line in lines] == ["failing", "hanging", "late"]
    assert "no heartbeat recorded for" in lines[0] and "before another worker takes it over" in lines[0]


@pytest.mark.parametrize("back_for_the_summary", [False, True])
def test_a_worker_cut_off_from_the_queue_stops_its_cell_saved_and_the_next_resumes_it(
    repo_cache: None, tmp_path: Path, back_for_the_summary: bool
) -> None:
    """The queue's database (one other machines reach) stops answering while a cell of a
    ``WORKERS=1`` sweep trains (the tracking store still does): the fence stops the cell at a
    step's start with a checkpoint, the run reads killed, the outcome cannot be recorded, and the
    summary says killed (from what the worker saw), the database still away or answering again,
    with no traceback. Once it answers the trial is put back and the next worker resumes the run:
    every step once."""
    import dataclasses
    import time

    q = queued(tmp_path, LONG_MICRO, "baseline")
    assert not q.queue.shared  # a SQLite queue is this machine's: its live workers are never taken over
    q.queue.shared = True  # as on a PostgreSQL queue other machines reach: the fence is on
    storage, cut = q.queue.storage, {"off": False}

    def unreachable(real):
        def call(*args, **kwargs):
            if cut["off"]:
                raise ConnectionError("could not connect to server: Connection timed out")
            return real(*args, **kwargs)

        return call

    for name in ("record_heartbeat", "set_trial_user_attr", "set_trial_state_values"):
        setattr(storage, name, unreachable(getattr(storage, name)))
    if not back_for_the_summary:
        q.queue.study.get_trials = unreachable(q.queue.study.get_trials)
    from sweep.run.cell import StopOnRequest

    real_hook = StopOnRequest.on_train_batch_start

    def slow_steps(self, trainer, *args) -> None:  # 0.25 s a step; cut off after step 5's checkpoint
        time.sleep(0.25)
        cut["off"] = cut["off"] or trainer.global_step == 6
        real_hook(self, trainer, *args)

    lines: list[str] = []
    stop = StopRequest()
    with pytest.MonkeyPatch.context() as mp, pytest.warns(UserWarning, match="heartbeat of"):
        mp.setattr(StopOnRequest, "on_train_batch_start", slow_steps)
        mp.setattr("sweep.run.driver.open_queue", lambda *args: q.queue)
        (cut_off,) = run_queued_sweep(
            q.grid, q.cells, q.results, 1, q.url, [], 1, False, ROOT / ".cache", stop, lines.append
        )
    assert cut_off.status == "killed" and stop.signum == signal.SIGTERM
    assert any("no heartbeat recorded for" in line for line in lines), lines
    assert any(line.endswith("killed, not recorded in the queue (ConnectionError)") for line in lines), lines
    (run,) = all_cell_runs(q.results)
    stopped_at = int(Path(run.data.tags["checkpoint"]).stem.removeprefix("step"))
    assert run.data.tags["status"] == "killed" and 8 <= stopped_at < LONG_STEPS
    (held,) = queue_trials(q.results)
    assert held.state == optuna.trial.TrialState.RUNNING  # nothing was recorded

    cut["off"] = False  # the database answers again; the dead worker's claim names this process
    q.queue.study.get_trials = type(q.queue.study).get_trials.__get__(q.queue.study)
    q.queue.shared = False  # from here the ordinary takeover: no fence to trip on a loaded machine
    later = dataclasses.replace(q.ctx, stop=StopRequest(), out=lines.append)
    (resumed,) = drain(q.queue, q.cells, later, heartbeat_s=1)
    assert resumed.status == "resumed"
    (run,) = all_cell_runs(q.results)
    assert run.data.tags["status"] == "finished"
    client = MlflowClient(tracking_uri=f"sqlite:///{q.results / 'mlflow.db'}")
    steps = [m.step for m in client.get_metric_history(run.info.run_id, "train/loss")]
    assert sorted(steps) == list(range(LONG_STEPS))
    failed, retry = queue_trials(q.results)
    assert failed.state == optuna.trial.TrialState.FAIL and retry.user_attrs["outcome"] == "resumed"
